"""Layouts of a DCP target: FSDP2's ``Shard(0)`` chunks (or a spec's boxes), the entries carried
verbatim or synthesized (Adam's ``step``, ``param_groups``), and which chunk goes into which file."""

from __future__ import annotations

import io
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import NamedTuple

from reshard.core.chunks import place_items
from reshard.core.geometry import Box, row_major_strides
from reshard.core.layout import (
    PARAM,
    Fragment,
    Item,
    ItemInfo,
    Layout,
    LogicalTensor,
    box_fragments,
    dims_of,
    held_tensors,
    new_fragment,
    new_item,
)
from reshard.core.resolve import resolve
from reshard.core.spec import parse_spec
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import (
    Source,
    Target,
    require_sizes,
)
from reshard.formats.dcp.reading import _ADAM_GROUP, SECTION, ParamGroup, _Naming, _plain, _rank_file, _Verbatim
from reshard.formats.derived import logical_lines, recorded_of
from reshard.formats.specs import BUFFERS, TIED, TIED_HEAD, family_of, source_family, spec_text, tied_embedding
from reshard.io.dcp_metadata import (
    DcpChunk,
    DcpTensor,
)
from reshard.io.torch_types import TensorSpec
from reshard.io.torch_write import TorchFileWriter


def _torch_chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk``'s split of ``n`` rows into ``parts``: ``ceil(n/parts)`` each, the rest short or empty."""
    step = -(-n // parts)
    return [(min(r * step, n), max(0, min(step, n - r * step))) for r in range(parts)]

def _dtype_of(source: Source) -> str:
    for f in source.layout.fragments:
        if f.state == PARAM and f.item in source.where:
            return source.where[f.item].dtype
    return "float32"

def _tensor_order(source: Source) -> list[str]:
    """The source's stored, non-blob tensors in its own order (embedding, layers, ...)."""
    held = held_tensors(source.layout)
    return [n for n, t in source.layout.tensors.items() if not t.blob and n in held]

def _synthesized(source: Source, names: list[str], naming: _Naming, opt_states: list[str],
                 optimized: Collection[str] | None = None) -> list[_Verbatim]:
    """Adam's per-parameter ``step`` and the ``param_groups`` entries, for a source that is not DCP: the source
    optimizer's groups (hyperparameters, params, step) when it tells them (``_carried_groups``), else one group
    of torch's Adam defaults, ``lr`` from the source when known, and the source's step count. ``optimized``: which
    of ``names`` have optimizer state (by default, those the source holds it of)."""
    out: list[_Verbatim] = []
    if not opt_states:  # weights only: no torch to import (a second or more of a small conversion)
        return out
    import torch

    def saved(obj: object) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    if optimized is None:
        optimized = {f.tensor for f in source.layout.fragments if f.state in opt_states}
    names = [n for n in names if n in optimized]  # the optimizer's parameters: never a buffer
    step = source.progress.step_count
    scalar = DcpTensor("float32", (), (DcpChunk((), ()),))
    default = _Verbatim("", scalar, saved(torch.tensor(step, dtype=torch.float32)))
    groups = _carried_groups(source, names)
    if groups:
        per_name = {}
        for g in groups:
            s = g.step
            per_name.update(dict.fromkeys(g.params, default if s is None else _Verbatim(
                "", DcpTensor(s.dtype, (), (DcpChunk((), ()),)), saved(s.to_torch()))))
        for name in names:
            out.append(_Verbatim(naming.key(name, "step"), per_name[name].tensor, per_name[name].data))
        for g, group in enumerate(groups):
            for k, v in {**group.hyper, "params": list(group.params)}.items():
                out.append(_Verbatim(f"{naming.optim}param_groups.{g}.{k}", None, saved(v)))
        return out
    for name in names:
        out.append(_Verbatim(naming.key(name, "step"), default.tensor, default.data))
    group = dict(_ADAM_GROUP)
    lr = source.progress.lr
    if isinstance(lr, int | float):
        group["lr"] = float(lr)
    group["params"] = list(names)
    for k, v in group.items():
        out.append(_Verbatim(f"{naming.optim}param_groups.0.{k}", None, saved(v)))
    return out


def _carried_groups(source: Source, names: list[str]) -> tuple[ParamGroup, ...]:
    """The source optimizer's param groups (a DeepSpeed checkpoint's, its params by name), when they hold
    exactly the tensors that have optimizer state here; empty otherwise."""
    if source.format != "deepspeed":
        return ()
    from reshard.formats.deepspeed import optimizer_groups

    groups = optimizer_groups(source)
    listed = [p for g in groups for p in g.params]
    return groups if sorted(listed) == sorted(names) else ()


def _module_facts(source: Source, names: list[str]) -> tuple[dict[str, str], frozenset[str]]:
    """What a source records of its module beyond its tensors: the module keys that hold another tensor of
    ``names`` (a tied weight: DeepSpeed's ``shared_params``, or a tied model's ``lm_head.weight``, its family's
    embedding), which FSDP2's state dict holds under both names, and DeepSpeed's persistent buffers
    (``buffer_names``), which FSDP2 does not shard."""
    from reshard.formats.deepspeed import DsModel

    ds_model = source.extra.get("ds_model") if source.format == "deepspeed" else None
    if isinstance(ds_model, DsModel):
        return {key: name for key, name in ds_model.shared.items() if name in names}, frozenset(ds_model.buffers)
    family = source_family(source)
    embed = tied_embedding(family, family.tied_in(source.layout.tensors)) if family is not None else None
    if embed is None or embed.name not in names or TIED_HEAD in source.layout.tensors:
        return {}, frozenset()
    return {TIED_HEAD: embed.name}, frozenset()


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
    fqn: str = ""
    """The module's name of the tensor (the key without its state dict's prefixes)."""

def _new_chunk(key: str, chunk: DcpChunk, size: tuple[int, ...], rank: int, writer: Item, fqn: str) -> _Chunk:
    """``_Chunk(key, chunk, size, rank, writer, fqn)`` at twice the speed, for FSDP2's one per chunk (200,000 for
    100,000 small tensors at dp 2): a frozen dataclass's ``__init__`` looks ``object.__setattr__`` up per field."""
    c = _new(_Chunk)
    _set(c, "key", key)
    _set(c, "chunk", chunk)
    _set(c, "size", size)
    _set(c, "rank", rank)
    _set(c, "writer", writer)
    _set(c, "fqn", fqn)
    return c


_new = object.__new__
_set = object.__setattr__


def _fsdp_layout(source: Source, topology: Topology, names: list[str], states: tuple[str, ...], model_state: str,
                 naming: _Naming, copies: Mapping[str, str] | None = None,
                 buffers: Collection[str] = ()) -> tuple[Layout, dict[Item, _Chunk]]:
    """FSDP2's chunks of each of ``names``: its model state (the fp32 master where the source has one, else its
    weights: a frozen param, a buffer) under ``model.<fqn>``, also under each tied copy's key (``copies``: key
    -> the tensor it holds), and its optimizer states. The ``buffers`` the source names as such are whole, one
    chunk in rank 0's file, as FSDP2 leaves a module's buffers unsharded and DCP saves a replica once."""
    tensors: dict[str, LogicalTensor] = {}
    items: dict[Item, ItemInfo] = {}
    fragments: list[Fragment] = []
    chunks: dict[Item, _Chunk] = {}
    held = {(f.tensor, f.state) for f in source.layout.fragments}
    held |= {(i.tensor, it.state) for it, i in source.layout.items.items() if i.tensor is not None}
    tied: dict[str, list[str]] = {}
    for key, name in (copies or {}).items():
        tied.setdefault(name, []).append(key)
    # Tensors of one shape are chunked alike: each shape's chunks are worked out once (a model has few shapes
    # and may have 100,000 tensors).
    pieces: dict[tuple[tuple[int, ...], bool], list[tuple[int, ItemInfo, DcpChunk, Box | None, tuple[int, ...]]]] = {}
    units = [(("dp", rank),) for rank in range(topology.dp)]
    of_source = source.layout.tensors
    for name in names:
        shape = of_source[name].shape
        plain = tensors[name] = _plain(name, shape)
        # A 0-d tensor or a buffer (FSDP2 leaves them unsharded) is one chunk, rank 0's, as DCP deduplicates it.
        whole = not shape or name in buffers
        shaped = pieces.get((shape, whole))
        if shaped is None:
            shaped = pieces[(shape, whole)] = _shape_chunks(plain, topology.dp, whole)
        for state in states:
            stored = state
            if (name, state) not in held:
                if state != model_state or (name, PARAM) not in held:
                    continue
                stored = PARAM  # no master (a frozen param, a buffer): its weights are what FSDP2 holds
            keys = (naming.key(name, PARAM if state == model_state else state),)
            if state == model_state and name in tied:
                keys += tuple(naming.key(k, PARAM) for k in tied[name])
            for key in keys:
                for rank, info, dcp_chunk, box, strides in shaped:
                    item = new_item(SECTION, units[rank], 0, stored, key)
                    items[item] = info if box is not None else replace(info, tensor=name)
                    chunks[item] = _new_chunk(key, dcp_chunk, shape, rank, item, name)
                    if box is not None:
                        fragments.append(new_fragment(name, stored, box, item, 0, strides))
    layout = Layout(topology=topology, tensors=MappingProxyType(tensors), items=MappingProxyType(items),
                    fragments=tuple(fragments))
    return layout, chunks

def _shape_chunks(plain: LogicalTensor, dp: int,
                  whole: bool) -> list[tuple[int, ItemInfo, DcpChunk, Box | None, tuple[int, ...]]]:
    """FSDP2's ``Shard(0)`` chunks of a tensor of ``plain``'s shape over ``dp`` ranks (one, rank 0's, when
    ``whole``): per rank that holds rows, its item's info, DCP chunk, box and strides. A tensor with no
    elements is one chunk of none, rank 0's, as ``dcp.save`` records it; no box (its item names it)."""
    shape = plain.shape
    if 0 in shape:
        return [(0, ItemInfo(shape=shape, mapped=0, rule="FSDP2 Shard(0)"), DcpChunk((0,) * len(shape), shape),
                 None, ())]
    out = []
    for rank, (lo, n) in enumerate([(0, shape[0] if shape else 1)] if whole else _torch_chunks(shape[0], dp)):
        if n == 0:
            continue
        offs, sizes = ((lo,) + (0,) * (len(shape) - 1), (n, *shape[1:])) if shape else ((), ())
        info = ItemInfo(shape=sizes, mapped=math.prod(sizes), rule="FSDP2 Shard(0)")
        [(box, _, strides)] = box_fragments(plain, offs, sizes, row_major_strides(sizes), 0)
        out.append((rank, info, DcpChunk(offs, sizes), box, strides))
    return out


def _spec_layout(source: Source, topology: Topology, spec_ast, spec_name: str, states: tuple[str, ...],
                 model_state: str, naming: _Naming) -> tuple[Layout, dict[Item, _Chunk]]:
    """The spec's layout at ``topology``, each stored item one DCP chunk: a box of the whole stored tensor it is a
    piece of (the spec at the trivial topology), keyed by that tensor's name without the spec's ``model.``."""
    family = family_of(spec_name)
    if family is not None:
        require_sizes(source, family.sizes, f"dcp with spec {spec_name}")
    # A buffer has its weights only; a tied output projection the model's state (the optimizer's is the embedding's).
    wanted = {s: (PARAM,) if s == BUFFERS else (model_state,) if s == TIED else states for s in _sections(spec_ast)}
    layout = resolve(spec_ast, topology, source.sizes, states=wanted)
    whole = resolve(spec_ast, Topology(), source.sizes, states=wanted)
    places = place_items(whole, layout)
    shapes = {it.key: info.shape for it, info in whole.items.items()}
    chunks: dict[Item, _Chunk] = {}
    first: dict[tuple[str, tuple[int, ...]], Item] = {}
    for it in sorted(layout.items, key=lambda i: (topology.rank(**dict(i.unit)), i.key, i.state)):
        if it not in places:
            if layout.items[it].numel:
                raise CheckpointFormatError(f"spec {spec_name}: {it} ({layout.items[it].rule}) holds no tensor's "
                                            "data; a DCP chunk is a piece of one")
            continue  # a rank past the rows of a chunked tensor: no chunk (dcp.save records none)
        stored, offs = places[it]
        fqn = stored.removeprefix(_MODEL_KEY)
        key = naming.key(fqn, PARAM if it.state == model_state else it.state)
        writer = first.setdefault((key, offs), it)
        rank = topology.rank(**dict(writer.unit))
        chunks[it] = _Chunk(key, DcpChunk(offs, layout.items[it].shape), shapes[stored], rank, writer, fqn)
    if len(chunks) < len(layout.items):
        layout = Layout(topology=layout.topology, tensors=layout.tensors,
                        items=MappingProxyType({it: i for it, i in layout.items.items() if it in chunks}),
                        fragments=layout.fragments, order=layout.order)
    return layout, chunks

def family_spec(source: Source, spec_name: str, topology: Topology):
    """The family's DCP layout ``spec_name``, plus at tp = 1 the source's tensors it does not name (a value head, an
    MTP layer's embedding copy), each chunked over dp under its own name as ``fully_shard`` shards any parameter."""
    text = spec_text(spec_name)
    family = family_of(spec_name)
    logical = [p for t in family.tensors for p in t.parts or (t,)] if family is not None else []
    extras = [t for t in recorded_of(source.layout) if family is not None and not family.names(t.name, logical)]
    if not extras or topology.tp > 1:
        return parse_spec(text, spec_name)
    rules = [f"{_MODEL_KEY}{t.name} -> {t.name} = " + (" ".join((t.axes[0] + "/dp:chunk", *t.axes[1:])) if t.shape
                                                       else t.dims) for t in extras]
    extra = "\n".join([*logical_lines(extras, source.path), "section extras per dp tp", *rules])
    return parse_spec(text + "\n" + extra + "\n", f"<{spec_name} with {len(extras)} tensors of {source.path}>")


_MODEL_KEY = "model."
"""How a DCP spec names a stored tensor: ``model.`` and its fqn, as ``get_state_dict``'s model dict is saved."""

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

class _Entry(NamedTuple):
    """One entry of a rank file: a chunk (``item``), a verbatim tensor (``tensor``) or bytes, at ``base``.
    (A named tuple: a writer makes one per chunk, 200,000 for 100,000 small tensors, at a third of a frozen
    dataclass's cost.)"""

    key: str
    base: int
    length: int
    item: Item | None = None
    chunk: DcpChunk | None = None
    global_size: tuple[int, ...] = ()
    dtype: str = ""
    """The chunk's dtype (the target's), looked up once here rather than by each reader of the entry."""
    tensor: DcpTensor | None = None
    data: bytes = b""

def _file_plan(target: Target) -> dict[str, list[_Entry]]:
    """Every entry of every rank file with its byte offset, computed without writing."""
    chunks, dtypes = target.extra["dcp"].chunks, target.dtypes
    per_rank: dict[int, list[_Chunk]] = {}
    for it, c in chunks.items():
        if c.writer is it:
            per_rank.setdefault(c.rank, []).append(c)
    files: dict[str, list[_Entry]] = {}
    lengths: dict[tuple[str, tuple[int, ...]], int] = {}  # archive sizes by dtype and shape: many chunks, few shapes
    for rank in range(target.topology.world_size):
        base, entries = 0, []
        for c in per_rank.get(rank, []):
            it = c.writer
            dtype = dtypes[it]
            length = lengths.get((dtype, c.chunk.sizes))
            if length is None:
                length = lengths[(dtype, c.chunk.sizes)] = TorchFileWriter.measure(
                    TensorSpec(dtype, c.chunk.sizes, key=0), archive_name="archive")
            entries.append(_Entry(c.key, base, length, it, c.chunk, c.size, dtype))
            base += length
        if rank == 0:
            for v in target.extra["dcp"].verbatim:
                entries.append(_Entry(v.key, base, len(v.data), tensor=v.tensor, data=v.data))
                base += len(v.data)
        if entries:  # a rank with nothing to write (a dp replica, a rank past a short tensor) gets no file
            files[_rank_file(rank)] = entries
    return files
