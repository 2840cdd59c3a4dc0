"""DeepSpeed universal checkpoints (UCP, what ``ds_to_universal`` writes), read as a source.

A universal folder holds, per parameter, ``zero/<name>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt`` (each ``{"param": full tensor, "cat_dim":
...}``; any other optimizer state likewise) and ``step.pt`` (a 0-d tensor),
plus ``zero/optimizer_state.pt`` (param groups, loss scaler). Tensors are
whole and unsharded, so every file is one item whose bytes are read in place;
``fp32`` is state ``master``. The path may be the universal folder itself or a
save dir whose ``latest_universal`` names it.

Model sizes come from a Hugging Face ``config.json`` in the folder or the two
above it, or from ``sizes``, and the rest from the tensors' shapes (given the
head count, which shapes cannot tell from the head size). Refused with a message: sub-parameter and vocab
padding entries (Megatron-DeepSpeed's tp-fused layouts) and tensors that are
not contiguous.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any


from reshard.errors import CheckpointFormatError
from reshard.formats.base import Located, Source, Target, scalar_value
from reshard.geometry import row_major_strides
from reshard.layout import Fragment, Item, ItemInfo, Layout, LogicalTensor, box_fragments
from reshard.spec import parse_spec
from reshard.topology import Topology
from reshard.torch_read import read_torch_file
from reshard.torch_types import TensorRef

__all__ = ["FORMAT", "UcpFormat"]

ZERO = "zero"
_KNOWN_KEYS = {"param", "cat_dim"}


class UcpFormat:
    """The ``ucp`` format adapter (see ``reshard.formats.base.Format``); reading only."""

    name = "ucp"

    def detect(self, path: Path) -> bool:
        try:
            return _folder(Path(path)) is not None
        except CheckpointFormatError:
            return False

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        path = Path(path)
        folder = _folder(path)
        if folder is None:
            raise CheckpointFormatError(f"{path}: not a universal checkpoint (no zero/<param>/fp32.pt)")
        tensors: dict[str, LogicalTensor] = {}
        items: dict[Item, ItemInfo] = {}
        fragments: list[Fragment] = []
        where: dict[Item, Located] = {}
        step = None
        problems: list[str] = []
        for pdir in sorted(p for p in (folder / ZERO).iterdir() if p.is_dir()):
            name = pdir.name
            for file in sorted(pdir.glob("*.pt")):
                obj = read_torch_file(file)
                if file.stem == "step":
                    if isinstance(obj, TensorRef) and obj.shape == () and step is None:
                        step = _scalar(file, obj)
                    continue
                if not isinstance(obj, dict) or not isinstance(obj.get("param"), TensorRef):
                    problems.append(f"{file}: expected {{'param': tensor, ...}}, found {type(obj).__name__}")
                    continue
                extra_keys = sorted(set(obj) - _KNOWN_KEYS)
                if extra_keys:
                    problems.append(f"{file}: entries {extra_keys} (sub-parameters or vocab padding) are not supported")
                    continue
                ref: TensorRef = obj["param"]
                if not ref.is_contiguous:
                    problems.append(f"{file}: '{name}' is stored non-contiguous (stride {list(ref.stride)})")
                    continue
                state = "master" if file.stem == "fp32" else file.stem
                t = tensors.setdefault(name, LogicalTensor(name=name, shape=ref.shape,
                                                           axes=tuple(f"d{k}" for k in range(len(ref.shape))),
                                                           view=ref.shape, dim_axes=(1,) * len(ref.shape)))
                if t.shape != ref.shape:
                    problems.append(f"{file}: '{name}' is {list(ref.shape)} here but {list(t.shape)} in its fp32.pt")
                    continue
                item = Item(ZERO, (), 0, state, name)
                items[item] = ItemInfo(shape=ref.shape, mapped=ref.numel, rule="ucp")
                where[item] = Located(ref.path, ref.data_offset, ref.dtype)
                zeros = (0,) * len(ref.shape)
                for box, off, st in box_fragments(t, zeros, ref.shape, row_major_strides(ref.shape), 0):
                    fragments.append(Fragment(tensor=name, state=state, box=box, item=item, offset=off, strides=st))
        if not tensors:
            problems.append(f"{folder / ZERO}: no parameter folders")
        if problems:
            raise CheckpointFormatError(f"{folder}: cannot read this universal checkpoint:\n  " + "\n  ".join(problems[:20]))
        missing = sorted(n for n in tensors if Item(ZERO, (), 0, "master", n) not in items)
        if missing:
            raise CheckpointFormatError(f"{folder / ZERO}: no fp32.pt for {', '.join(missing[:5])}")
        layout = Layout(topology=Topology(), tensors=MappingProxyType(tensors), items=MappingProxyType(items),
                        fragments=tuple(fragments))
        from reshard.formats.hf import llama_config_near

        model_sizes, config = llama_config_near(folder, folder.parent, folder.parent.parent)
        model_sizes.update({k: int(v) for k, v in (sizes or {}).items()})
        _shape_sizes(model_sizes, {n: t.shape for n, t in tensors.items()})
        extra: dict[str, Any] = {}
        if step is not None:
            extra["step"] = int(step)
        lr = _lr(folder)
        if lr is not None:
            extra["lr"] = lr
        if config is not None:
            extra["config"] = config
        return Source(format=self.name, path=folder, spec_name="ucp", spec=parse_spec("", "<ucp>"),
                      topology=Topology(), sizes=model_sizes, layout=layout, where=where, extra=extra)

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        raise CheckpointFormatError("writing universal checkpoints is not supported yet; write --format deepspeed "
                                    "at the new dp (DeepSpeed loads it without load_universal)")

    def write(self, *args, **kwargs):
        raise CheckpointFormatError("writing universal checkpoints is not supported yet")

    def files_of(self, target: Target):
        raise CheckpointFormatError("writing universal checkpoints is not supported yet")


def _folder(path: Path) -> Path | None:
    marker = path / "latest_universal"
    if marker.is_file():
        tag = marker.read_text(encoding="utf-8").strip()
        if not tag or "/" in tag or tag in (".", ".."):
            raise CheckpointFormatError(f"{marker}: not a checkpoint tag: {tag!r}")
        path = path / tag
    zero = path / ZERO
    if zero.is_dir() and any((p / "fp32.pt").is_file() for p in zero.iterdir() if p.is_dir()):
        return path
    return None


def _scalar(file: Path, ref: TensorRef) -> float | None:
    with open(file, "rb") as f:
        f.seek(ref.data_offset)
        return scalar_value(f.read(ref.itemsize), ref.dtype)


def _lr(folder: Path) -> float | None:
    file = folder / ZERO / "optimizer_state.pt"
    if not file.is_file():
        return None
    state = read_torch_file(file)
    groups = state.get("param_groups") if isinstance(state, dict) else None
    lr = groups[0].get("lr") if isinstance(groups, list) and groups and isinstance(groups[0], dict) else None
    return float(lr) if isinstance(lr, int | float) else None


def _shape_sizes(sizes: dict[str, int], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Fill in the Llama sizes the tensor shapes tell (given ``heads`` or ``hd``, for the attention layout)."""
    if len(embed := shapes.get("model.embed_tokens.weight", ())) == 2:
        sizes.setdefault("vocab", embed[0])
        sizes.setdefault("h", embed[1])
    layers = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if layers:
        sizes.setdefault("layers", max(layers) + 1)
    if gate := shapes.get("model.layers.0.mlp.gate_proj.weight"):
        sizes.setdefault("f", gate[0])
    q, k = shapes.get("model.layers.0.self_attn.q_proj.weight"), shapes.get("model.layers.0.self_attn.k_proj.weight")
    if q and k and ("heads" in sizes or "hd" in sizes):
        sizes.setdefault("hd", q[0] // sizes["heads"] if "heads" in sizes else sizes["hd"])
        sizes.setdefault("heads", q[0] // sizes["hd"])
        sizes.setdefault("g", k[0] // sizes["hd"])


FORMAT = UcpFormat()
