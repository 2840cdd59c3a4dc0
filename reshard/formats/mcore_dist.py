"""Megatron-core ``torch_dist`` checkpoints (``dist_checkpointing.save``): read as a source.

A directory holds ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``),
``common.pt`` (the non-sharded state: ``args``, ``iteration``, ...) and a
PyTorch DCP checkpoint (``.metadata``, ``__{rank}_{n}.distcp``). Unlike the
torch format, every stored key is the *global* tensor: layers stacked on a
leading dim (``decoder.layers.self_attention.linear_qkv.weight`` is
``[layers, g·(qpg+2)·hd, h]``), QKV group-interleaved, SwiGLU fc1 stored as
``[gate; up]`` of the whole ffn, the vocabulary padded. DCP's chunks say which
box of it each rank wrote. The spec ``mcore-dist-llama`` describes the global
tensors; ``chunk_fragments`` cuts its fragments down to each chunk, so a
conversion reads just the rows each target needs, in place inside the chunks'
``torch.save`` archives.

Model sizes come from ``common.pt``'s ``args`` (as Megatron's training loop
saves them) or from ``sizes``; ``vpad`` is the stored embedding's row count.
Per-layer ``_extra_state`` entries and the RNG state are bytes entries; they
hold nothing the logical model needs and are not carried to other formats.
Not yet read: optimizer state (``optimizer.*`` keys) and MoE layers; writing
this format is not supported yet.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reshard.catalog import load_spec
from reshard.dcp_metadata import read_metadata
from reshard.errors import CheckpointFormatError
from reshard.formats.base import DTYPE_SIZES, Fill, Located, Source, Target
from reshard.formats.dcp import _chunk_ref
from reshard.layout import Fragment, Item, ItemInfo, Layout, chunk_fragments, resolve
from reshard.topology import Topology
from reshard.torch_read import read_torch_file

__all__ = ["FORMAT", "McoreDistFormat"]

SPEC = "mcore-dist-llama"
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
_EMBEDDING = "embedding.word_embeddings.weight"
_SIZE_KEYS = ("h", "heads", "g", "hd", "f", "vocab", "layers")


class McoreDistFormat:
    """The ``mcore-dist`` format adapter (see ``reshard.formats.base.Format``); reading only."""

    name = "mcore-dist"

    def detect(self, path: Path) -> bool:
        meta = Path(path) / METADATA_JSON
        if not meta.is_file():
            return False
        try:
            return json.loads(meta.read_text()).get("sharded_backend") == "torch_dist"
        except (OSError, ValueError, AttributeError):
            return False

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read ``metadata.json``, ``common.pt`` and DCP's ``.metadata``; match every stored key to the spec.

        Raises:
          CheckpointFormatError: another backend, missing model sizes, a stored
            key the spec does not know (or the reverse), a global shape that
            differs from the spec's, or optimizer state (not read yet).
        """
        path = Path(path)
        backend = _read_json(path / METADATA_JSON).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointFormatError(f"{path / METADATA_JSON}: sharded_backend is {backend!r}; reshard reads "
                                        "'torch_dist' (zarr and others are not supported)")
        common = _common(path)
        md = read_metadata(path)
        spec_name = spec or SPEC
        spec_ast = load_spec(spec_name)
        model_sizes, topology = _sizes(path, common, md, sizes or {})
        whole = resolve(spec_ast, Topology(), model_sizes)
        by_key = {it.key: it for it in whole.items}
        frags_of: dict[Item, list[Fragment]] = {}
        for f in whole.fragments:
            frags_of.setdefault(f.item, []).append(f)
        items: dict[Item, ItemInfo] = {}
        fragments: list[Fragment] = []
        where: dict[Item, Located] = {}
        problems: list[str] = []
        optim = sorted(k for k in [*md.tensors, *md.byte_entries] if k.startswith("optimizer."))
        if optim:
            problems.append(f"optimizer state ({len(optim)} keys, e.g. '{optim[0]}') is not read from torch_dist yet; "
                            "convert the model weights from a checkpoint saved without it, or use the torch format")
        archives: dict[str, Any] = {}
        for key, t in md.tensors.items():
            if key.startswith("optimizer."):
                continue
            whole_item = by_key.get(key)
            if whole_item is None:
                problems.append(f"'{key}' ({t.dtype} {list(t.size)}) matches no tensor of spec '{spec_name}'")
                continue
            if t.size != whole.items[whole_item].shape:
                problems.append(f"'{key}' is {list(t.size)}, spec '{spec_name}' expects "
                                f"{list(whole.items[whole_item].shape)} for sizes {model_sizes}")
                continue
            if t.dtype not in DTYPE_SIZES:
                problems.append(f"'{key}' has dtype {t.dtype}, which reshard cannot copy")
                continue
            for c in t.chunks:
                if 0 in c.sizes:
                    continue
                ref = _chunk_ref(path, md, key, c, t, archives, problems)
                if ref is None:
                    continue
                item = Item("model", (), 0, "param", f"{key}@{','.join(map(str, c.offsets))}")
                mine = chunk_fragments(frags_of.get(whole_item, []), t.size, c.offsets, c.sizes, item)
                items[item] = ItemInfo(shape=c.sizes, mapped=sum(math.prod(f.box.lengths) for f in mine),
                                       rule=whole.items[whole_item].rule)
                fragments.extend(mine)
                where[item] = Located(ref.path, ref.data_offset, ref.dtype)
        stored = set(md.tensors)
        for key in by_key:
            if key not in stored:
                problems.append(f"'{key}' is missing (spec '{spec_name}' has it)")
        if problems:
            raise CheckpointFormatError(f"{path}: the torch_dist checkpoint does not match spec '{spec_name}':\n  "
                                        + "\n  ".join(problems[:20]))
        used = {f.tensor for f in fragments}
        layout = Layout(topology=topology, tensors=MappingProxyType({n: t for n, t in whole.tensors.items() if n in used}),
                        items=MappingProxyType(items), fragments=tuple(fragments))
        extra: dict[str, Any] = {"iteration": common.get("iteration")} if isinstance(common.get("iteration"), int) else {}
        return Source(format=self.name, path=path, spec_name=spec_name, spec=spec_ast, topology=topology,
                      sizes=model_sizes, layout=layout, where=where, extra=extra)

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        raise CheckpointFormatError("writing Megatron torch_dist checkpoints is not supported yet; "
                                    "write --format megatron (torch format), hf or dcp")

    def write(self, target: Target, out: Path, fill: Fill, *, progress: Callable[[int], None] | None = None,
              only: Collection[Path] | None = None, window_bytes: int | None = None) -> list[Path]:
        raise CheckpointFormatError("writing Megatron torch_dist checkpoints is not supported yet")

    def files_of(self, target: Target) -> dict[Item, Path]:
        raise CheckpointFormatError("writing Megatron torch_dist checkpoints is not supported yet")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read: {e.strerror or e}") from e
    except ValueError as e:
        raise CheckpointFormatError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object")
    return data


def _common(path: Path) -> dict[str, Any]:
    file = path / COMMON
    if not file.is_file():
        return {}
    obj = read_torch_file(file)
    return obj if isinstance(obj, dict) else {}


def _sizes(path: Path, common: Mapping[str, Any], md, given: Mapping[str, int]) -> tuple[dict[str, int], Topology]:
    from reshard.formats.megatron import _sizes_from_args

    embedding = md.tensors.get(_EMBEDDING)
    if embedding is None:
        raise CheckpointFormatError(f"{path}: no '{_EMBEDDING}' in .metadata, so not a GPT checkpoint reshard reads")
    tp = len({c.offsets[0] for c in embedding.chunks}) or 1
    args = common.get("args")
    if isinstance(args, argparse.Namespace):
        args = vars(args)
    if isinstance(args, Mapping):
        tp = int(args.get("tensor_model_parallel_size") or tp)
        pp = int(args.get("pipeline_model_parallel_size") or 1)
        topology = Topology(tp=tp, pp=pp)
        sizes = _sizes_from_args(args, {k: int(v) for k, v in given.items()}, topology, f"{path / COMMON} args")
        sizes.pop("vocab_div", None)
    else:
        topology = Topology(tp=tp)
        sizes = {k: int(v) for k, v in given.items()}
        qkv = md.tensors.get("decoder.layers.self_attention.linear_qkv.weight")
        fc1 = md.tensors.get("decoder.layers.mlp.linear_fc1.weight")
        sizes.setdefault("h", embedding.size[1])
        if qkv is not None:
            sizes.setdefault("layers", qkv.size[0])
        if fc1 is not None:
            sizes.setdefault("f", fc1.size[1] // 2)
        missing = [k for k in _SIZE_KEYS if k not in sizes]
        if missing:
            raise CheckpointFormatError(f"{path}: {COMMON} holds no args, so the model sizes {', '.join(missing)} "
                                        "are unknown; give them as sizes")
    sizes["vpad"] = embedding.size[0]
    return sizes, topology


FORMAT = McoreDistFormat()
