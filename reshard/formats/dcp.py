"""PyTorch Distributed Checkpoint (DCP) directories: ``.metadata`` plus ``__{rank}_0.distcp`` files.

What is read. ``.metadata`` (see ``reshard.io.dcp_metadata``) lists every
flattened state-dict key: tensors with their global size and chunks (boxes),
and bytes entries. Keys follow ``get_state_dict``'s flattening:
``model.<fqn>`` (or bare ``<fqn>``, as torchtitan saves), then
``optim.state.<fqn>.<state>`` (``optimizer.`` also accepted) and
``optim.param_groups.<i>.<key>``. Each model parameter becomes a logical
tensor named by its fqn (``model.layers.0.self_attn.q_proj.weight`` for a
Hugging Face model), state ``param``; each optimizer state with the
parameter's shape becomes that tensor's state of the same name
(``exp_avg``, ``exp_avg_sq``, any other optimizer's). Every chunk is an item
whose bytes are located inside its ``torch.save`` archive in the ``.distcp``
file (the archive's zip index is read, never the tensor data), so a target
reads just the rows it needs instead of deserializing whole chunks.
0-d tensors (Adam's per-parameter ``step``) and bytes entries
(``param_groups``) are carried verbatim to a DCP target.

Model sizes (for targets that need them: hf, megatron, deepspeed) come from a
Hugging Face Llama ``config.json`` in the checkpoint directory or its parent
(where Accelerate keeps it), or from ``sizes``. reshard writes one beside the
``.metadata`` it writes when the sizes are known; ``dcp.load`` ignores it.

What is written. The layout ``get_state_dict`` + ``dcp.save`` produce for a
model sharded with FSDP2 (``fully_shard``) over ``dp`` ranks: every tensor
``Shard(0)`` with ``torch.chunk`` semantics (64 rows at 3 ranks: 22, 22, 20;
ranks past the end hold nothing), rank ``r``'s chunks in ``__{r}_0.distcp``,
each a ``torch.save`` archive, then ``.metadata`` as DCP pickles it. Real
``dcp.load`` loads it at any mesh (DCP reshards boxes at load time); with the
same mesh, each rank reads only its own file. A source's fp32 master weights
(state ``master``), when it has them, are what ``model.<fqn>`` holds, since
FSDP2 keeps fp32 sharded parameters; optimizer states go to
``optim.state.<fqn>.<state>``. A non-DCP source gets Adam's per-parameter
``step`` (0-d float32, from the source's step or iteration count) and one
Adam ``param_groups`` entry (``lr`` from the source when known, torch's
defaults otherwise).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reshard.io.dcp_metadata import METADATA_NAME, DcpChunk, DcpMetadata, DcpStorage, DcpTensor, read_metadata, write_metadata
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.core.dtypes import SUPPORTED
from reshard.formats.base import (
    LLAMA_SIZES,
    Fill,
    Located,
    Source,
    Target,
    expect_step,
    given_sizes,
    require_sizes,
    scalar_value,
    stream_item,
)

from reshard.core.geometry import row_major_strides
from reshard.core.catalog import load_spec
from reshard.core.layout import Fragment, Item, ItemInfo, Layout, LogicalTensor, box_fragments, dims_of
from reshard.core.resolve import resolve
from reshard.core.spec import parse_spec
from reshard.core.topology import Topology
from reshard.io.safetensors_io import read_header
from reshard.io.torch_read import read_torch_file
from reshard.io.torch_types import TensorRef, TensorSpec
from reshard.io.storage import OutputFile
from reshard.io.torch_write import TorchFileWriter

__all__ = ["FORMAT", "DcpFormat"]

SECTION = "dcp"
SPEC = "dcp-llama"
CONFIG_NAME = "config.json"
WINDOW_BYTES = 8 << 20
_DATA_FILE = re.compile(r"__([0-9]{1,9})_([0-9]{1,9})\.distcp")
_OPTIM_PREFIXES = ("optim.", "optimizer.")
_ADAM_GROUP = {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": False}
"""torch.optim.Adam's param_groups entry with its defaults (torch 2.13)."""


@dataclass(frozen=True, slots=True)
class _Verbatim:
    """A whole entry copied as stored: a 0-d tensor chunk or a bytes entry (a torch.save archive)."""

    key: str
    tensor: DcpTensor | None
    """None for a bytes entry."""
    data: bytes


def _rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _plain(name: str, shape: tuple[int, ...]) -> LogicalTensor:
    return LogicalTensor(name=name, shape=shape, axes=tuple(f"d{k}" for k in range(len(shape))), view=shape,
                         dim_axes=(1,) * len(shape))


class DcpFormat:
    """The ``dcp`` format adapter (see ``reshard.formats.base.Format``)."""

    name = "dcp"

    def detect(self, path: Path) -> bool:
        path = Path(path)
        return (path / METADATA_NAME).is_file()

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read ``.metadata`` and each chunk's archive index; match optimizer states to parameters.

        Raises:
          CheckpointFormatError: a malformed or hostile ``.metadata``, a missing
            or truncated ``.distcp``, a chunk whose archive disagrees with the
            metadata, an optimizer state for no parameter, or a transformed
            (compressed) entry; each naming the key and file.
        """
        path = Path(path)
        if spec is not None:
            raise CheckpointFormatError(f"{path}: a DCP checkpoint describes its own layout; --spec does not apply to it")
        md = read_metadata(path)
        naming = _naming(md, path)
        tensors: dict[str, LogicalTensor] = {}
        items: dict[Item, ItemInfo] = {}
        fragments: list[Fragment] = []
        where: dict[Item, Located] = {}
        verbatim: list[_Verbatim] = []
        step: float | None = None
        problems: list[str] = []
        archives: dict[str, Any] = {}
        for key, t in md.tensors.items():
            role = naming.role(key)
            if t.size == () or role is None:
                if t.size != ():
                    problems.append(f"'{key}' is neither a parameter ('{naming.model}<fqn>') nor an optimizer state")
                    continue
                data, ref = _entry_bytes(path, md, key, ())
                verbatim.append(_Verbatim(key, t, data))
                if step is None and key.endswith(".step"):
                    value = _step_value(data, ref, md.storage[(key, ())].offset)
                    step = None if value is None else expect_step(value, f"'{key}'", path / METADATA_NAME)
                continue
            fqn, state = role
            if t.dtype not in SUPPORTED:
                problems.append(f"'{key}' has dtype {t.dtype}, which reshard cannot copy")
                continue
            known = tensors.setdefault(fqn, _plain(fqn, t.size))
            if known.shape != t.size:
                problems.append(f"'{key}' has size {list(t.size)} but parameter '{fqn}' has {list(known.shape)}")
                continue
            if problem := _chunk_cover(key, t):
                problems.append(problem)
                continue
            for c in t.chunks:
                if 0 in c.sizes:
                    continue
                item = Item(SECTION, (), 0, state, f"{key}@{','.join(map(str, c.offsets))}")
                ref = _chunk_ref(path, md, key, c, t, archives, problems)
                if ref is None:
                    continue
                items[item] = ItemInfo(shape=c.sizes, mapped=math.prod(c.sizes), rule="dcp chunk")
                where[item] = Located(ref.path, ref.data_offset, ref.dtype)
                strides = row_major_strides(c.sizes)
                for box, off, st in box_fragments(known, c.offsets, c.sizes, strides, 0):
                    fragments.append(Fragment(tensor=fqn, state=state, box=box, item=item, offset=off, strides=st))
        for key in md.byte_entries:
            verbatim.append(_Verbatim(key, None, _entry_bytes(path, md, key, None)[0]))
        if problems:
            raise CheckpointFormatError(f"{path}: cannot read this DCP checkpoint:\n  " + "\n  ".join(problems[:20]))
        ranks = {int(m.group(1)) for s in md.storage.values() if (m := _DATA_FILE.fullmatch(s.relative_path))}
        topology = Topology(dp=max(len(ranks), 1))
        layout = Layout(topology=topology, tensors=MappingProxyType(tensors), items=MappingProxyType(items),
                        fragments=tuple(fragments))
        from reshard.formats.hf import llama_config_near

        model_sizes, config = llama_config_near(path, path.parent, tensors=len(md.tensors))
        model_sizes.update(given_sizes(sizes))
        extra: dict[str, Any] = {"dcp": {"naming": naming, "verbatim": verbatim, "planner_data": md.planner_data}}
        if config is not None:
            extra["config"] = config
        if step is not None:
            extra["step"] = step
        return Source(format=self.name, path=path, spec_name="dcp", spec=parse_spec("", "<dcp>"), topology=topology,
                      sizes=model_sizes, layout=layout, where=where, extra=extra)

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        """The layout FSDP2 (and DTensor tensor parallelism) give ``source``'s tensors at ``topology``.

        ``dp`` alone: every tensor ``Shard(0)`` over dp with torch.chunk sizes, for
        any model. With ``tp`` (or a ``spec``): the spec's layout, by default
        ``dcp-llama`` (a Hugging Face Llama under ``parallelize_module`` with the
        usual colwise/rowwise plan, then ``fully_shard``); each stored item must be
        one box of its tensor, which DCP records as a chunk. A chunk several ranks
        hold (a replicated norm) is written once, by the lowest rank.
        """
        others = [f"{a}({topology.degree(a)})" for a in ("pp", "cp", "ep", "vpp") if topology.degree(a) > 1]
        if others:
            raise TopologyError(f"the dcp target shards over dp (FSDP2) and tp (DTensor) only; cannot write "
                                f"{', '.join(others)}")
        topology = Topology(dp=topology.dp, tp=topology.tp)
        states = set(source.layout.states)
        model_state = "master" if "master" in states else "param"
        opt_states = sorted(states - {"param", "master"})
        src_dcp = source.extra.get("dcp") if source.format == self.name else None
        naming = src_dcp["naming"] if src_dcp else _Naming("model.", "optim.", frozenset())
        names = _tensor_order(source)
        wanted = (model_state, *opt_states)
        if spec is None and topology.tp == 1:
            layout, chunks = _fsdp_layout(source, topology, names, wanted, model_state, naming)
            spec_name, spec_ast = "dcp", parse_spec("", "<dcp>")
        else:
            spec_name = spec or SPEC
            spec_ast = load_spec(spec_name)
            layout, chunks = _spec_layout(source, topology, spec_ast, spec_name, wanted, model_state, naming)
        verbatim = list(src_dcp["verbatim"]) if src_dcp else _synthesized(source, names, naming, opt_states)
        planner = dict(src_dcp["planner_data"]) if src_dcp else {}
        extra = {"chunks": chunks, "verbatim": verbatim, "planner_data": planner, "naming": naming}
        config = source.extra.get("config")
        if config is None and all(k in source.sizes for k in LLAMA_SIZES) and "transformer.wte.weight" not in names:
            from reshard.formats.hf import llama_config

            config = llama_config(source.sizes, [_dtype_of(source)])
        if config is not None:
            extra["config"] = config
        return Target(format=self.name, spec_name=spec_name, spec=spec_ast, topology=topology,
                      sizes=dict(source.sizes), layout=layout, dtypes=dict.fromkeys(layout.items, "float32"),
                      extra=extra)

    def files_of(self, target: Target) -> dict[Item, Path]:
        """Each item's rank file; a chunk several ranks hold is in the file of the rank that writes it."""
        chunks = target.extra["chunks"]
        return {it: Path(_rank_file(chunks[it].rank)) for it in target.layout.items}

    def write(self, target: Target, out: Path, fill: Fill, *, progress: Callable[[int], None] | None = None,
              only: Collection[Path] | None = None, window_bytes: int | None = None) -> list[Path]:
        """Write each rank's ``.distcp`` (one torch.save archive per chunk), then ``.metadata``.

        Rank 0's file also holds the verbatim entries (steps, param_groups).
        With ``only``, just those rank files; ``.metadata`` is written by the
        call without ``only`` or with ``only=()``. Offsets are computed before
        any byte is written, so workers need not report back.
        """
        out = Path(out)
        files = _file_plan(target)
        window = window_bytes or WINDOW_BYTES
        written: list[Path] = []
        for rel, entries in files.items():
            if only is not None and Path(rel) not in set(only):
                continue
            f = OutputFile(out / rel)
            try:
                for e in entries:
                    if e.item is None:
                        f.pwrite(e.data, e.base)
                        continue
                    dtype = target.dtypes[e.item]
                    w = TorchFileWriter(out / rel, TensorSpec(dtype, e.chunk.sizes, key=0), archive_name="archive",
                                        file=f, base=e.base)
                    if w.size != e.length:
                        raise AssertionError(f"{e.key}: archive is {w.size} bytes, planned {e.length}")
                    stream_item(fill, e.item, math.prod(e.chunk.sizes), dtype, lambda data, w=w: w.write(0, data),
                                progress, window)
                    w.close()
                f.close()
            except BaseException:
                f.abort()
                raise
            written.append(Path(rel))
        if only:
            return written
        md = DcpMetadata(version="1.0.0")
        naming: _Naming = target.extra["naming"]
        for rel, entries in files.items():
            for e in entries:
                if e.item is not None:
                    t = md.tensors.get(e.key)
                    chunk_list = (t.chunks if t else ()) + (e.chunk,)
                    md.tensors[e.key] = DcpTensor(target.dtypes[e.item], e.global_size, chunk_list)
                    md.storage[(e.key, e.chunk.offsets)] = DcpStorage(rel, e.base, e.length)
                elif e.tensor is not None:
                    md.tensors[e.key] = e.tensor
                    md.storage[(e.key, (0,) * len(e.tensor.size))] = DcpStorage(rel, e.base, e.length)
                else:
                    md.byte_entries.append(e.key)
                    md.storage[(e.key, None)] = DcpStorage(rel, e.base, e.length)
        planner = dict(target.extra.get("planner_data") or {})
        for key in [*md.tensors, *md.byte_entries]:
            planner.setdefault(key, naming.path(key))
        md.planner_data = {k: planner[k] for k in [*md.tensors, *md.byte_entries]}
        if "config" in target.extra:  # not DCP's: the model's sizes, for targets that need them (hf, megatron)
            (out / CONFIG_NAME).write_text(json.dumps(target.extra["config"], indent=2, sort_keys=True) + "\n")
            written.append(Path(CONFIG_NAME))
        write_metadata(out, md)  # last: DCP's own commit marker
        written.append(Path(METADATA_NAME))
        return written


# -- naming ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Naming:
    """How flat keys are spelled: the model prefix (``model.`` or none) and the optimizer's (``optim.``)."""

    model: str
    optim: str
    fqns: frozenset[str]

    def role(self, key: str) -> tuple[str, str] | None:
        """``(fqn, state)`` of a tensor key, None for a tensor that is not a parameter or its state."""
        state_prefix = f"{self.optim}state."
        if self.optim and key.startswith(state_prefix):
            fqn, _, state = key[len(state_prefix):].rpartition(".")
            return (fqn, state) if fqn in self.fqns else None
        if key.startswith(self.model) and key[len(self.model):] in self.fqns:
            return key[len(self.model):], "param"
        return None

    def key(self, fqn: str, state: str) -> str:
        return f"{self.model}{fqn}" if state == "param" else f"{self.optim}state.{fqn}.{state}"

    def path(self, key: str) -> tuple:
        """``planner_data``: where ``key`` sits in the nested state dict ``dcp.save`` was given."""
        for p in (f"{self.optim}state.", f"{self.optim}param_groups."):
            if self.optim and key.startswith(p):
                rest = key[len(p):]
                if p.endswith("state."):
                    fqn, _, state = rest.rpartition(".")
                    return (self.optim[:-1], "state", fqn, state)
                group, _, name = rest.partition(".")
                return (self.optim[:-1], "param_groups", int(group) if re.fullmatch(r"[0-9]{1,9}", group) else group,
                        name)
        if self.model and key.startswith(self.model):
            return (self.model[:-1], key[len(self.model):])
        return (key,)


def _naming(md: DcpMetadata, path: Path) -> _Naming:
    optim = next((p for p in _OPTIM_PREFIXES if any(k.startswith(p) for k in [*md.tensors, *md.byte_entries])), "")
    model_keys = [k for k, t in md.tensors.items() if not (optim and k.startswith(optim)) and t.size != ()]
    prefix = "model." if model_keys and all(k.startswith("model.") for k in model_keys) else ""
    for k in model_keys:
        if prefix == "" and k.startswith(("model.", optim or "\0")):
            raise CheckpointFormatError(f"{path}: key '{k}' mixes prefixed and bare parameter names")
    return _Naming(prefix, optim, frozenset(k[len(prefix):] for k in model_keys))


# -- reading --------------------------------------------------------------------------------------------


def _storage(path: Path, md: DcpMetadata, key: str, offsets: tuple[int, ...] | None) -> DcpStorage:
    s = md.storage.get((key, offsets))
    if s is None:
        where = "" if offsets is None else f" at {list(offsets)}"
        raise CheckpointFormatError(f"{path}/{METADATA_NAME}: '{key}'{where} has no storage entry")
    if s.transforms:
        raise CheckpointFormatError(f"{path}/{s.relative_path}: '{key}' is stored with transforms {list(s.transforms)} "
                                    "(compression/extensions), which reshard does not read")
    return s


def _entry_bytes(path: Path, md: DcpMetadata, key: str, offsets: tuple[int, ...] | None) -> tuple[bytes, TensorRef | None]:
    s = _storage(path, md, key, offsets)
    file = path / s.relative_path
    if not file.is_file():  # never open a FIFO or a device: reading it could block or never end
        raise CheckpointFormatError(f"{file}: missing or not a regular file (the metadata puts '{key}' there)")
    try:
        with open(file, "rb") as f:
            data = os.pread(f.fileno(), s.length, s.offset)
    except OSError as e:
        raise CheckpointFormatError(f"{file}: cannot read '{key}': {e.strerror or e}") from e
    if len(data) != s.length:
        raise CheckpointFormatError(f"{file}: '{key}' needs bytes {s.offset}..{s.offset + s.length}, "
                                    f"the file ends at {s.offset + len(data)} (truncated?)")
    if offsets is not None:  # a 0-d tensor: check it is what the metadata says before carrying it
        ref = read_torch_file(file, offset=s.offset, length=s.length)
        if not isinstance(ref, TensorRef) or ref.shape != ():
            raise CheckpointFormatError(f"{file}: '{key}' should be a 0-d tensor, the archive holds {_what(ref)}")
        return data, ref
    return data, None


def _chunk_ref(path: Path, md: DcpMetadata, key: str, c: DcpChunk, t: DcpTensor, cache: dict,
               problems: list[str]) -> TensorRef | None:
    s = _storage(path, md, key, c.offsets)
    file = path / s.relative_path
    if not file.is_file():
        raise CheckpointFormatError(f"{file}: missing (the metadata puts '{key}' there)")
    with open(file, "rb") as f:
        magic = os.pread(f.fileno(), 4, s.offset)
    if magic == b"PK\x03\x04":
        ref = read_torch_file(file, offset=s.offset, length=s.length)
    else:
        ref = _safetensors_ref(file, s, key, cache)
    if not isinstance(ref, TensorRef):
        problems.append(f"{file}: '{key}' chunk at {list(c.offsets)} holds {_what(ref)}, not a tensor")
    elif ref.shape != c.sizes or ref.dtype != t.dtype:
        problems.append(f"{file}: '{key}' chunk at {list(c.offsets)} is {ref.dtype} {list(ref.shape)}, "
                        f"the metadata says {t.dtype} {list(c.sizes)}")
    elif not ref.is_contiguous:
        problems.append(f"{file}: '{key}' chunk at {list(c.offsets)} is stored non-contiguous (stride {list(ref.stride)})")
    else:
        return ref
    return None


def _safetensors_ref(file: Path, s: DcpStorage, key: str, cache: dict) -> TensorRef:
    """A chunk of DCP's safetensors serialization (``FileSystemWriter(serialization_format=SAFETENSORS)``).

    Each rank file then ends with one safetensors blob of all its tensors keyed
    by flat key, and every tensor's storage offset points at the blob's start
    (torch 2.13's own ``dcp.load`` cannot read these); the blob's header says
    where each tensor's bytes are.
    """
    header = cache.get((file, s.offset))
    if header is None:
        header = cache[(file, s.offset)] = read_header(file, offset=s.offset)
    info = header.tensors.get(key)
    if info is None:
        raise CheckpointFormatError(f"{file}: '{key}' is neither a torch.save archive at byte {s.offset} nor a "
                                    "tensor of a safetensors blob there")
    return TensorRef(dtype=info.dtype, shape=info.shape, stride=row_major_strides(info.shape), storage=key,
                     storage_offset=0, path=file, data_offset=info.data_offset, storage_nbytes=info.nbytes)


def _chunk_cover(key: str, t: DcpTensor) -> str | None:
    """What is wrong with a tensor's chunks, if anything: DCP saves each element once (replicas deduplicated),
    so the chunks' element counts add up to the tensor's exactly; more means two chunks overlap (whose bytes
    could disagree), fewer that part of the tensor is stored nowhere."""
    stored, numel = sum(math.prod(c.sizes) for c in t.chunks), math.prod(t.size)
    if stored == numel:
        return None
    return (f"'{key}' of size {list(t.size)} ({numel} elements) has chunks holding {stored} elements "
            f"({'overlapping chunks' if stored > numel else 'part of it is stored nowhere'})")


def _what(obj: object) -> str:
    return f"a tensor of shape {list(obj.shape)}" if isinstance(obj, TensorRef) else type(obj).__name__


def _step_value(data: bytes, ref: TensorRef, base: int) -> float | None:
    """The value of a 0-d tensor whose archive (``data``) was read from byte ``base`` of its file."""
    at = ref.data_offset - base
    return scalar_value(data[at:at + ref.itemsize], ref.dtype)


# -- writing --------------------------------------------------------------------------------------------


def _torch_chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk``'s split of ``n`` rows into ``parts``: ``ceil(n/parts)`` each, the rest short or empty."""
    step = -(-n // parts)
    return [(min(r * step, n), max(0, min(step, n - r * step))) for r in range(parts)]


def _dtype_of(source: Source) -> str:
    for f in source.layout.fragments:
        if f.state == "param" and f.item in source.where:
            return source.where[f.item].dtype
    return "float32"


def _tensor_order(source: Source) -> list[str]:
    """The source's stored, non-blob, non-scalar tensors in its own order (embedding, layers, ...)."""
    held = {f.tensor for f in source.layout.fragments}
    return [n for n, t in source.layout.tensors.items() if not t.blob and t.shape and n in held]


def _synthesized(source: Source, names: list[str], naming: _Naming, opt_states: list[str]) -> list[_Verbatim]:
    """Adam's per-parameter ``step`` and one ``param_groups`` entry, for a source that is not DCP."""
    import torch

    def saved(obj: object) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    out: list[_Verbatim] = []
    if not opt_states:
        return out
    step = float(source.extra.get("step") or source.extra.get("iteration") or 0)
    step_bytes = saved(torch.tensor(step, dtype=torch.float32))
    for name in names:
        out.append(_Verbatim(naming.key(name, "step"), DcpTensor("float32", (), (DcpChunk((), ()),)), step_bytes))
    group = dict(_ADAM_GROUP)
    lr = source.extra.get("lr")
    if isinstance(lr, int | float):
        group["lr"] = float(lr)
    group["params"] = list(names)
    for k, v in group.items():
        out.append(_Verbatim(f"{naming.optim}param_groups.0.{k}", None, saved(v)))
    return out


@dataclass(frozen=True, slots=True)
class _Chunk:
    """Where a target item goes in DCP terms: its flat key, its box of the global tensor, who writes it."""

    key: str
    chunk: DcpChunk
    size: tuple[int, ...]
    rank: int
    """The rank whose file holds it."""
    writer: Item
    """The item written for this (key, box): the lowest rank's; the others are replicas of it."""


def _fsdp_layout(source: Source, topology: Topology, names: list[str], states: tuple[str, ...], model_state: str,
                 naming: _Naming) -> tuple[Layout, dict[Item, _Chunk]]:
    tensors: dict[str, LogicalTensor] = {}
    items: dict[Item, ItemInfo] = {}
    fragments: list[Fragment] = []
    chunks: dict[Item, _Chunk] = {}
    held = {(f.tensor, f.state) for f in source.layout.fragments}
    for name in names:
        t = source.layout.tensors[name]
        plain = tensors[name] = _plain(name, t.shape)
        for state in states:
            if (name, state) not in held:
                continue
            key = naming.key(name, "param" if state == model_state else state)
            for rank, (lo, n) in enumerate(_torch_chunks(t.shape[0], topology.dp)):
                if n == 0:
                    continue
                offs, sizes = (lo,) + (0,) * (len(t.shape) - 1), (n, *t.shape[1:])
                item = Item(SECTION, (("dp", rank),), 0, state, key)
                items[item] = ItemInfo(shape=sizes, mapped=math.prod(sizes), rule="FSDP2 Shard(0)")
                chunks[item] = _Chunk(key, DcpChunk(offs, sizes), t.shape, rank, item)
                for box, off, st in box_fragments(plain, offs, sizes, row_major_strides(sizes), 0):
                    fragments.append(Fragment(tensor=name, state=state, box=box, item=item, offset=off, strides=st))
    layout = Layout(topology=topology, tensors=MappingProxyType(tensors), items=MappingProxyType(items),
                    fragments=tuple(fragments))
    return layout, chunks


def _spec_layout(source: Source, topology: Topology, spec_ast, spec_name: str, states: tuple[str, ...],
                 model_state: str, naming: _Naming) -> tuple[Layout, dict[Item, _Chunk]]:
    require_sizes(source, LLAMA_SIZES, f"dcp with spec {spec_name}")
    layout = resolve(spec_ast, topology, source.sizes, states={s: states for s in _sections(spec_ast)})
    by_item: dict[Item, list[Fragment]] = {}
    for f in layout.fragments:
        by_item.setdefault(f.item, []).append(f)
    chunks: dict[Item, _Chunk] = {}
    first: dict[tuple[str, tuple[int, ...]], Item] = {}
    for it in sorted(layout.items, key=lambda i: (topology.rank(**dict(i.unit)), i.key, i.state)):
        frags = by_item.get(it, [])
        names = {f.tensor for f in frags}
        if len(names) != 1:
            raise CheckpointFormatError(f"spec {spec_name}: {it} holds {len(names)} tensors; a DCP chunk is one box of "
                                        "one tensor")
        t = layout.tensors[frags[0].tensor]
        offs, sizes = _plain_box(t, frags)
        if sizes != layout.items[it].shape:
            raise CheckpointFormatError(f"spec {spec_name}: {it} stores shape {list(layout.items[it].shape)}, which "
                                        f"is not one box of '{t.name}' (it spans {list(sizes)} at {list(offs)})")
        key = naming.key(t.name, "param" if it.state == model_state else it.state)
        writer = first.setdefault((key, offs), it)
        rank = topology.rank(**dict(writer.unit))
        chunks[it] = _Chunk(key, DcpChunk(offs, sizes), t.shape, rank, writer)
    return layout, chunks


def _sections(spec_ast) -> list[str]:
    from reshard.core.spec import Section

    return [st.name for st in spec_ast.statements if isinstance(st, Section)]


def _plain_box(t: LogicalTensor, frags: list[Fragment]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of ``t``'s own dims that ``frags`` (boxes of its axis view) cover together."""
    lo, hi = [], []
    for group in dims_of(t):
        sizes = [t.view[k] for k in group]
        strides = row_major_strides(tuple(sizes))
        starts = [sum(f.box.offsets[k] * s for k, s in zip(group, strides)) for f in frags]
        ends = [sum((f.box.offsets[k] + f.box.lengths[k] - 1) * s for k, s in zip(group, strides)) + 1 for f in frags]
        lo.append(min(starts))
        hi.append(max(ends))
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


@dataclass(frozen=True, slots=True)
class _Entry:
    key: str
    base: int
    length: int
    item: Item | None = None
    chunk: DcpChunk | None = None
    global_size: tuple[int, ...] = ()
    tensor: DcpTensor | None = None
    data: bytes = b""


def _file_plan(target: Target) -> dict[str, list[_Entry]]:
    """Every entry of every rank file with its byte offset, computed without writing."""
    per_rank: dict[int, list[Item]] = {}
    for it, c in target.extra["chunks"].items():
        if c.writer is it:
            per_rank.setdefault(c.rank, []).append(it)
    files: dict[str, list[_Entry]] = {}
    for rank in range(target.topology.world_size):
        base, entries = 0, []
        for it in per_rank.get(rank, []):
            c = target.extra["chunks"][it]
            length = TorchFileWriter.measure(TensorSpec(target.dtypes[it], c.chunk.sizes, key=0), archive_name="archive")
            entries.append(_Entry(c.key, base, length, item=it, chunk=c.chunk, global_size=c.size))
            base += length
        if rank == 0:
            for v in target.extra["verbatim"]:
                entries.append(_Entry(v.key, base, len(v.data), tensor=v.tensor, data=v.data))
                base += len(v.data)
        if entries:  # a rank with nothing to write (a dp replica, a rank past a short tensor) gets no file
            files[_rank_file(rank)] = entries
    return files


FORMAT = DcpFormat()
