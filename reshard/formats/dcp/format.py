"""The DCP format's entry points: detect, open (metadata into a layout), target, and write."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reshard.core.dtypes import SUPPORTED
from reshard.core.geometry import row_major_strides
from reshard.core.layout import MASTER, PARAM, Fragment, Item, ItemInfo, Layout, LogicalTensor, box_fragments
from reshard.core.spec import parse_spec
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.execution.session import Slot, WriteSession
from reshard.formats.base import (
    Fill,
    Located,
    Progress,
    Source,
    Target,
    expect_step,
    given_sizes,
)
from reshard.formats.dcp.layouts import (
    family_spec,
    _dtype_of,
    _Entry,
    _file_plan,
    _fsdp_layout,
    _module_facts,
    _spec_layout,
    _synthesized,
    _tensor_order,
)
from reshard.formats.dcp.reading import (
    _DATA_FILE,
    _MODEL_PREFIX,
    _OPTIM_PREFIXES,
    SECTION,
    DcpRead,
    DcpWrite,
    ParamGroup,
    _chunk_cover,
    _chunk_ref,
    _entry_bytes,
    _Naming,
    _naming,
    _param_groups,
    _plain,
    _rank_file,
    _step_value,
    _Verbatim,
)
from reshard.formats.identity import CONFIG_NAME, read_identity, write_identity
from reshard.formats.module_view import module_family
from reshard.formats.specs import layout_spec, require_family, source_config
from reshard.io.dcp_metadata import (
    METADATA_NAME,
    DcpChunk,
    DcpMetadata,
    DcpStorage,
    DcpTensor,
    read_metadata,
    write_metadata,
)
from reshard.io.location import as_path
from reshard.io.storage import FilePart, OutputFile
from reshard.io.torch_types import SmallTensor, TensorSpec
from reshard.io.torch_write import LoneArchive, TorchFileWriter, lone_archive
from reshard.models.config import config_sizes


class DcpFormat:
    """The ``dcp`` format adapter (see ``reshard.formats.base.Format``)."""

    name = "dcp"

    def detect(self, path: Path) -> bool:
        path = as_path(path)
        return (path / METADATA_NAME).is_file()

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read ``.metadata`` and each chunk's archive index; match optimizer states to parameters.

        Raises:
          CheckpointFormatError: a malformed or hostile ``.metadata``, a missing
            or truncated ``.distcp``, a chunk whose archive disagrees with the
            metadata, an optimizer state for no parameter, or a transformed
            (compressed) entry; each naming the key and file.
        """
        path = as_path(path)
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
        steps: dict[str, SmallTensor] = {}
        problems: list[str] = []
        archives: dict[str, Any] = {}
        for key, t in md.tensors.items():
            role = naming.role(key)
            if role is None or (t.size == () and role[1] != PARAM):  # a 0-d model tensor is a tensor
                if t.size != ():
                    problems.append(f"'{key}' is neither a parameter ('{naming.model}<fqn>') nor an optimizer state")
                    continue
                data, ref = _entry_bytes(path, md, key, ())
                verbatim.append(_Verbatim(key, t, data))
                if role is not None and role[1] == "step" and ref is not None:
                    at = ref.data_offset - md.storage[(key, ())].offset
                    steps[role[0]] = SmallTensor(ref.dtype, (), data[at:at + ref.itemsize])
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
                if 0 in c.sizes and 0 not in t.size:
                    continue  # a rank past a sharded tensor's rows
                item = Item(SECTION, (), 0, state, f"{key}@{','.join(map(str, c.offsets))}")
                ref = _chunk_ref(path, md, key, c, t, archives, problems)
                if ref is None:
                    continue
                items[item] = ItemInfo(shape=c.sizes, mapped=math.prod(c.sizes), rule="dcp chunk",
                                       tensor=fqn if 0 in t.size else None)
                where[item] = Located(ref.path, ref.data_offset, ref.dtype)
                strides = row_major_strides(c.sizes)
                for box, off, st in box_fragments(known, c.offsets, c.sizes, strides, 0) if 0 not in t.size else ():
                    fragments.append(Fragment(tensor=fqn, state=state, box=box, item=item, offset=off, strides=st))
        for key in md.byte_entries:
            verbatim.append(_Verbatim(key, None, _entry_bytes(path, md, key, None)[0]))
        if problems:
            raise CheckpointFormatError(f"{path}: cannot read this DCP checkpoint:\n  " + "\n  ".join(problems[:20]))
        ranks = {int(m.group(1)) for s in md.storage.values() if (m := _DATA_FILE.fullmatch(s.relative_path))}
        topology = Topology(dp=max(len(ranks), 1))
        layout = Layout(topology=topology, tensors=MappingProxyType(tensors), items=MappingProxyType(items),
                        fragments=tuple(fragments))
        model = read_identity(path, path.parent)
        model_sizes = config_sizes(model.config, path / CONFIG_NAME, tensors=len(md.tensors))
        model_sizes.update(given_sizes(sizes))
        extra: dict[str, Any] = {"dcp": DcpRead(naming=naming, verbatim=verbatim, planner_data=md.planner_data,
                                                param_groups=_param_groups(path, md, naming, steps))}
        return Source(format=self.name, path=path, spec_name="dcp", spec=parse_spec("", "<dcp>"), topology=topology,
                      sizes=model_sizes, layout=layout, where=where, model=model,
                      progress=Progress(step=step), extra=extra)

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
        model_state = MASTER if MASTER in states else PARAM
        opt_states = sorted(states - {PARAM, MASTER})
        src_dcp = source.extra.get("dcp") if source.format == self.name else None
        naming = src_dcp.naming if src_dcp else _Naming(_MODEL_PREFIX, _OPTIM_PREFIXES[0], frozenset())
        names = _tensor_order(source)
        wanted = (model_state, *opt_states)
        module = module_family(source)
        if spec is None and topology.tp == 1 and module is None:
            copies, buffers = _module_facts(source, names)
            layout, chunks = _fsdp_layout(source, topology, names, wanted, model_state, naming, copies, buffers)
            spec_name, spec_ast = "dcp", parse_spec("", "<dcp>")
            optimized = None
        else:
            family = module or require_family(source, "a tensor-parallel DCP target needs its tensor-parallel plan")
            if family.module and topology.tp > 1 and spec is None:
                raise TopologyError(f"dcp at tp({topology.tp}): transformers packs the fused experts of {family.name} "
                                    "over tp (gate_up_proj's gate and up halves per rank: packed_colwise), which no "
                                    "DCP layout of reshard's holds; convert at tp=1")
            tied = family.can_tie and family.tied_in(source.layout.tensors)
            spec_name = spec or f"dcp-{family.name}{'-tied' if tied else ''}"
            spec_ast = layout_spec(spec_name) if spec else family_spec(source, spec_name, topology)
            layout, chunks = _spec_layout(source, topology, spec_ast, spec_name, wanted, model_state, naming)
            names = list(dict.fromkeys(c.fqn for c in chunks.values() if c.writer.state == model_state))
            optimized = {c.fqn for c in chunks.values() if c.writer.state in opt_states}
        verbatim = list(src_dcp.verbatim) if src_dcp else _synthesized(source, names, naming, opt_states, optimized)
        planner = dict(src_dcp.planner_data) if src_dcp else {}
        extra = {"dcp": DcpWrite(chunks=chunks, verbatim=verbatim, planner_data=planner, naming=naming)}
        # Beside the checkpoint for later conversions (the model's identity and sizes); DCP itself never reads it.
        model = replace(source.model, config=source_config(source, [_dtype_of(source)]))
        return Target(format=self.name, spec_name=spec_name, spec=spec_ast, topology=topology,
                      sizes=dict(source.sizes), layout=layout, dtypes=dict.fromkeys(layout.items, "float32"),
                      model=model, extra=extra)

    def files_of(self, target: Target) -> dict[Item, Path]:
        """Each item's rank file; a chunk several ranks hold is in the file of the rank that writes it."""
        chunks = target.extra["dcp"].chunks
        files = {r: Path(_rank_file(r)) for r in {c.rank for c in chunks.values()}}
        return {it: files[chunks[it].rank] for it in target.layout.items}

    def write(self, target: Target, out: Path, fill: Fill, session: WriteSession | None = None, *,
              only: Collection[Path] | None = None) -> list[Path]:
        """Write each rank's ``.distcp`` (one torch.save archive per chunk), then ``.metadata``.

        Rank 0's file also holds the verbatim entries (steps, param_groups).
        With ``only``, just those rank files; ``.metadata`` is written by the
        call without ``only`` or with ``only=()``. Offsets are computed before
        any byte is written, so workers need not report back.
        """
        out = Path(out)
        session = session or WriteSession()
        files = _file_plan(target)
        written: list[Path] = []
        for rel, entries in files.items():
            if only is not None and Path(rel) not in set(only):
                continue
            f = session.open(out / rel)
            try:
                _write_entries(session, fill, f, entries)
                f.close()
            except BaseException:
                f.abort()
                raise
            written.append(Path(rel))
        if only:
            return written
        md = _metadata(target, files)
        written += write_identity(out, target.model)  # not DCP's: the model's identity, for later conversions
        write_metadata(out, md)  # last: DCP's own commit marker
        written.append(Path(METADATA_NAME))
        return written

FORMAT = DcpFormat()


def _metadata(target: Target, files: Mapping[str, list[_Entry]]) -> DcpMetadata:
    """``.metadata`` of the planned ``files``: each key's tensor with its chunks in file order, where each entry's
    bytes are, and ``planner_data`` (the target's, else each key's path in the state dict)."""
    md = DcpMetadata(version="1.0.0")
    naming: _Naming = target.extra["dcp"].naming
    tensors, storage = md.tensors, md.storage
    # A key's chunks are gathered first and its DcpTensor made once (the dtype and size its last chunk says)
    pending: dict[str, tuple[str, tuple[int, ...], list[DcpChunk]]] = {}
    for rel, entries in files.items():
        for e in entries:
            if e.item is not None:
                key, dtype = e.key, e.dtype
                got = pending.get(key)
                if got is None:
                    t = tensors.get(key)
                    got = pending[key] = (dtype, e.global_size, list(t.chunks) if t else [])
                    tensors[key] = t  # its place in the order; made below
                elif got[0] is not dtype or got[1] is not e.global_size:
                    got = pending[key] = (dtype, e.global_size, got[2])
                got[2].append(e.chunk)
                storage[(key, e.chunk.offsets)] = DcpStorage(rel, e.base, e.length)
            elif e.tensor is not None:
                pending.pop(e.key, None)
                tensors[e.key] = e.tensor
                storage[(e.key, (0,) * len(e.tensor.size))] = DcpStorage(rel, e.base, e.length)
            else:
                md.byte_entries.append(e.key)
                storage[(e.key, None)] = DcpStorage(rel, e.base, e.length)
    for key, (dtype, size, chunk_list) in pending.items():
        tensors[key] = DcpTensor(dtype, size, tuple(chunk_list))
    given = target.extra["dcp"].planner_data
    md.planner_data = {k: given[k] if k in given else naming.path(k) for k in [*md.tensors, *md.byte_entries]}
    return md


def _write_entries(session: WriteSession, fill: Fill, f: OutputFile, entries: list[_Entry]) -> None:
    """One rank file's entries: verbatim bytes as they are, and each chunk as a torch.save archive of its own.
    Runs of small chunks (``session.runs``) are framed in memory and go out with one write each; a larger chunk
    is streamed into its archive."""
    # one per dtype and shape: its spec, archive, elements, and the archive's tensor offset and size
    archives: dict[tuple[str, tuple[int, ...]], tuple[TensorSpec, LoneArchive, int, int, int]] = {}

    def slots(chunks: Iterable[_Entry]) -> Iterator[Slot]:
        for e in chunks:
            dtype = e.dtype
            known = archives.get((dtype, e.chunk.sizes))
            if known is None:
                spec = TensorSpec(dtype, e.chunk.sizes, key=0)
                archive = lone_archive(spec, "archive")
                known = archives[(dtype, e.chunk.sizes)] = (spec, archive, math.prod(e.chunk.sizes),
                                                            archive.data_offset, archive.size)
            if known[4] != e.length:
                raise CheckpointFormatError(f"{f.path}: {e.key}'s archive is {known[4]} bytes, planned "
                                            f"{e.length} (a bug in reshard's DCP writer)")
            base = e.base
            yield Slot(e.item, known[2], dtype, base, base + known[3], base + e.length, known)

    part = f if isinstance(f, FilePart) else None  # a worker's part of a split file: its finisher needs the CRCs

    def framed(run: Sequence[Slot], buf: memoryview) -> None:
        start, k = run[0].start, 0
        while k < len(run):  # each stretch of archives of one dtype and shape framed at once
            archive, j = run[k].key[1], k + 1
            while j < len(run) and run[j].key[1] is archive:
                j += 1
            crcs = archive.frame_many(buf[run[k].start - start:run[j - 1].end - start], j - k)
            if part is not None:
                for s, crc in zip(run[k:j], crcs):
                    part.crcs[s.data] = crc
            k = j
        f.pwrite(buf, start)  # in a part, the framing too: the same bytes its finisher writes over them

    for verbatim, group in itertools.groupby(entries, key=lambda e: e.item is None):
        if verbatim:
            for e in group:
                f.pwrite(e.data, e.base)
            continue
        for run in session.runs(slots(group)):
            if len(run) > 1:
                session.stream_run(fill, run, framed)
                continue
            (s,) = run
            w = TorchFileWriter(f.path, s.key[0], archive_name="archive", file=f, base=s.start)
            session.stream_item(fill, s.item, s.numel, s.dtype, lambda data, w=w: w.write(0, data), at=w.entries[0][0])
            w.close()


def optimizer_groups(source: Source) -> tuple[ParamGroup, ...]:
    """A DCP source's optimizer param groups (hyperparameters, params by fqn, Adam ``step``), for a target of
    another format; empty for another format's source, or a checkpoint whose groups are not plain values."""
    read = source.extra.get("dcp") if source.format == FORMAT.name else None
    return read.param_groups if isinstance(read, DcpRead) else ()
