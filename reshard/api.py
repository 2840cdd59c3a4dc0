"""The library's entry points: open, plan, convert, load, verify, inspect.

Each is one call a user or the CLI makes; everything below them is pure
(spec, layout, planner) or behind a format adapter (files).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from reshard import __version__
from reshard.io.bounds import brief
from reshard.core.units import parse_size
from reshard.errors import CheckpointFormatError, ReshardError
from reshard.execution.executor import ByteReader, PlanFill, destination_dtypes, uint_dtype
from reshard.formats import detect_format, get_format
from reshard.formats.base import Source, Target, expect_int, itemsize, read_json
from reshard.core.layout import Item, common_views, with_state_alias
from reshard.core.planner import Plan, plan as make_plan
from reshard.execution.partial import Partial, partial_path
from reshard.io.storage import (HASH, file_digest, hash_segments, journal_into, take_digest, take_item_digests,
                             take_segment_digests)
from reshard.core.topology import Topology, parse_topology

__all__ = [
    "ConvertResult",
    "RankState",
    "VerifyResult",
    "convert",
    "inspect",
    "load",
    "open_checkpoint",
    "plan",
    "verify",
]

MANIFEST = "reshard.json"
DEFAULT_MEMORY_BUDGET = 1 << 30
Progress = Callable[[int], None]


def open_checkpoint(path: str | Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
    """Detect a checkpoint's format and read its metadata (no tensor data)."""
    path = Path(path)
    return detect_format(path).open(path, spec=spec, sizes=sizes)


def _topology(to: str | Topology | None, default: Topology) -> Topology:
    if to is None:
        return default
    return parse_topology(to) if isinstance(to, str) else to


def _target(source: Source, to: str | Topology | None, format: str | None, spec: str | None,
            max_shard_size: int | str | None = None, vocab_pad: str | None = None) -> Target:
    fmt = get_format(format or source.format)
    same = fmt.name == source.format
    topology = _topology(to, source.topology if same else Topology())
    if same and isinstance(to, str) and "zero" not in _keys(to):
        # A new layout keeps the source's optimizer sharding unless the user names another.
        topology = dataclasses.replace(topology, zero=source.topology.zero)
    if vocab_pad is not None and fmt.name != "megatron":
        raise ReshardError(f"vocab_pad applies to the megatron format (its padded vocabulary), not {fmt.name}")
    target = fmt.target(source, topology, spec=spec, **({"vocab_pad": vocab_pad} if vocab_pad else {}))
    if max_shard_size is not None:
        if target.format != "hf":
            raise ReshardError(f"max_shard_size applies to the hf format (safetensors shards), not {target.format}")
        parse_size(max_shard_size, "max_shard_size")  # a bad size fails before anything is read
        target.extra["max_shard_size"] = max_shard_size
    return target


def _keys(text: str) -> set[str]:
    return {part.split("=", 1)[0].strip() for part in text.split(",") if "=" in part}


@dataclass(frozen=True, slots=True)
class PlanReport:
    """A plan and what it means: per destination file, bytes and sources; independent work units."""

    source: Source
    target: Target
    plan: Plan
    dropped_states: tuple[str, ...]
    """Source states the destination format does not hold (e.g. optimizer state going to hf)."""
    dst_files: Mapping[Item, Path]
    """The destination file (relative to the destination directory) of each destination item."""

    def src_file(self, item: Item) -> str:
        path = self.source.where[item].path
        return str(path.relative_to(self.source.path)) if path.is_relative_to(self.source.path) else str(path)

    def dst_file(self, item: Item) -> str:
        return str(self.dst_files[item])

    def needed_bytes(self, files: Collection[str] | None = None) -> int:
        """Bytes the copies move (what a conversion reads at least), into just ``files`` if given."""
        keep = None if files is None else set(files)
        return sum(c.numel * itemsize(self.source.where[c.src].dtype) for c in self.plan.copies
                   if keep is None or self.dst_file(c.dst) in keep)

    def files(self) -> list[dict[str, Any]]:
        per: dict[str, dict[str, Any]] = defaultdict(lambda: {"bytes": 0, "copies": 0, "sources": set()})
        for c in self.plan.copies:
            row = per[self.dst_file(c.dst)]
            row["bytes"] += c.numel * itemsize(self.source.where[c.src].dtype)
            row["copies"] += 1
            row["sources"].add(self.src_file(c.src))
        return [{"destination": k, "bytes": v["bytes"], "copies": v["copies"], "sources": sorted(v["sources"])}
                for k, v in sorted(per.items())]

    def work_units(self) -> list[tuple[list[str], list[str]]]:
        return self.plan.work_units(self.src_file, self.dst_file)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": {"path": str(self.source.path), "format": self.source.format, "topology": str(self.source.topology),
                       "spec": self.source.spec_name},
            "destination": {"format": self.target.format, "topology": str(self.target.topology), "spec": self.target.spec_name},
            "summary": self.plan.summary(),
            "dropped_states": list(self.dropped_states),
            "files": self.files(),
            "work_units": [{"sources": s, "destinations": d} for s, d in self.work_units()],
        }


def plan(src: str | Path, *, to: str | Topology | None = None, format: str | None = None, spec: str | None = None,
         sizes: Mapping[str, int] | None = None, max_shard_size: int | str | None = None,
         vocab_pad: str | None = None) -> PlanReport:
    """What converting ``src`` to topology ``to`` (in ``format``) moves where, without reading tensor data.

    >>> report = plan("ckpt/", to="tp=1,pp=4")   # doctest: +SKIP
    >>> report.plan.summary()["copies"]          # doctest: +SKIP
    """
    source = open_checkpoint(src, sizes=sizes)
    target = _target(source, to, format, spec, max_shard_size, vocab_pad)
    held = set(source.layout.states)
    source.layout, target.layout = common_views(source.layout, target.layout)
    if "master" in target.layout.states and "master" not in source.layout.states and all(
            loc.dtype == "float32" for it, loc in source.where.items() if it.state == "param"):
        # fp32 weights with no separate master copy (FSDP2, fp32 runs) are the master copy.
        source.layout = with_state_alias(source.layout, "param", "master")
    elif "param" in target.layout.states and "param" not in source.layout.states and "master" in source.layout.states:
        # Only fp32 master weights stored (DeepSpeed ZeRO-3): they are the weights, as zero_to_fp32 reads them.
        source.layout = with_state_alias(source.layout, "master", "param")
    p = make_plan(source.layout, target.layout)
    p.validate()
    target.dtypes = destination_dtypes(p, source.where)
    dropped = tuple(sorted(held - set(target.layout.states)))
    files = get_format(target.format).files_of(target)
    return PlanReport(source=source, target=target, plan=p, dropped_states=dropped, dst_files=files)


@dataclass(frozen=True, slots=True)
class ConvertResult:
    path: Path
    report: PlanReport
    files: dict[str, dict[str, Any]]
    bytes_read: int
    bytes_written: int
    seconds: float
    reused: int = 0
    """Files an interrupted conversion had written that ``resume`` kept (verified by checksum)."""


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    to: str | Topology | None = None,
    format: str | None = None,
    spec: str | None = None,
    sizes: Mapping[str, int] | None = None,
    workers: int = 1,
    memory_budget: int | str = DEFAULT_MEMORY_BUDGET,
    max_shard_size: int | str | None = None,
    vocab_pad: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    resume: bool = False,
) -> ConvertResult:
    """Rewrite the checkpoint ``src`` for topology ``to`` (and ``format``) at ``dst``.

    Streams: each destination file is written window by window from just the
    source bytes it needs. The output is built in a hidden sibling directory
    (``.{name}.reshard-partial``) and renamed to ``dst`` only when complete, with the
    manifest ``reshard.json`` written last: sources, topologies, and per file
    its size and the xxh3-128 of its bytes and of each stored tensor, taken
    while writing. A failed run leaves no ``dst``; one that was killed or
    interrupted leaves the hidden directory, which ``resume`` continues.

    Args:
      src: a checkpoint directory in any supported format.
      dst: the directory to create; must not exist, or be empty.
      to: the destination topology (``"tp=2,pp=2,dp=4"``); default: the source's
        for the same format, unsharded for hf.
      format: destination format; default: the source's.
      spec: destination spec name or path; default: the format's spec for the model.
      sizes: model sizes the source's metadata lacks.
      workers: processes writing the plan's independent work units (sets of
        destination files no two of which share a source file) side by side.
      memory_budget: bytes (or ``"512MiB"``, ``"1GiB"``) the conversion may hold,
        shared by the workers; it sets the window each writer asks for at a time.
        Too small a budget for the plan is an error before anything is written.
      max_shard_size: hf only: the largest safetensors shard (bytes, or ``"5GB"``;
        default 5GB as transformers), with ``model.safetensors.index.json``.
      vocab_pad: megatron only: ``zero`` or ``last``, what fills the rows that pad the
        vocabulary for the target tp (``last``: copies of the last real row, as Megatron's
        own converter pads); default: the spec's own policy (zeros in the shipped specs).
      progress: ``progress(done_bytes, total_bytes)`` while writing (one worker).
      resume: continue an interrupted conversion with the same source and options,
        keeping the files it finished whose checksums still verify; if it had
        finished, check ``dst`` against its manifest instead.

    Raises:
      ReshardError: anything about the inputs, named with file, tensor and reason.
    """
    started = time.perf_counter()
    dst = Path(dst)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ReshardError(f"workers must be an integer of at least 1, got {workers!r}")
    report = plan(src, to=to, format=format, spec=spec, sizes=sizes, max_shard_size=max_shard_size,
                  vocab_pad=vocab_pad)
    if resume and dst.exists() and not partial_path(dst).exists() and (dst / MANIFEST).exists():
        files = _finished(dst, report)  # done before: killed after its rename, or run twice
        return ConvertResult(path=dst, report=report, files=files, bytes_read=0, bytes_written=0, reused=len(files),
                             seconds=time.perf_counter() - started)
    _check_destination(Path(src), dst)
    window = _window_bytes(report, parse_size(memory_budget, "memory budget"), workers)
    target = report.target
    fmt = get_format(target.format)
    options = {"max_shard_size": max_shard_size, "vocab_pad": vocab_pad}
    partial = Partial(dst, _resume_header(report, options), resume=resume, manifest=MANIFEST)
    tmp = partial.path
    try:
        if partial.complete:  # killed after its manifest, before its rename
            files = _finished(tmp, report)
            partial.commit(None)
            return ConvertResult(path=dst, report=report, files=files, bytes_read=0, bytes_written=0,
                                 reused=len(files), seconds=time.perf_counter() - started)
        kept = partial.kept
        todo = sorted({str(f) for f in report.dst_files.values()} - kept.keys())
        total = report.needed_bytes(todo) if kept else report.needed_bytes()
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if progress:
                progress(done[0], total)

        journal_into(tmp)
        take_item_digests()  # nothing left over from an earlier conversion in this process
        take_segment_digests()
        sources = _logical_sources(report)
        hash_segments(_segments(sources))
        written: dict[Path, str | None] = {Path(rel): e[HASH] for rel, e in kept.items()}
        shares = _shares(report, workers, todo)
        if len(shares) <= 1:
            with ByteReader() as reader:
                fill = PlanFill(report.plan, report.source.where, reader)
                if not kept:
                    paths = fmt.write(target, tmp, fill, progress=tick, window_bytes=window)
                else:
                    paths = fmt.write(target, tmp, fill, progress=tick, only=[Path(f) for f in todo],
                                      window_bytes=window) if todo else []
                    paths += fmt.write(target, tmp, fill, only=())
                written.update({p: take_digest(tmp / p) for p in paths})
                bytes_read = reader.bytes_read
            tensors, segments = _tensor_digests(report)
        else:
            new, bytes_read, tensors, segments = _run_workers(shares, src, tmp, to, format, spec, sizes, window,
                                                              options)
            written.update(new)
            with ByteReader() as reader:  # the files that hold no items: trackers, configs, indexes
                paths = fmt.write(target, tmp, PlanFill(report.plan, report.source.where, reader), only=())
                written.update({p: take_digest(tmp / p) for p in paths})
        labels = {str(item): report.dst_file(item) for item in report.dst_files}
        for label, digest in partial.tensors.items():
            if labels.get(label) in kept:
                tensors.setdefault(labels[label], {})[label] = digest
        for (label, lo, hi), digest in partial.segments.items():
            if labels.get(label) in kept:
                segments[(label, lo, hi)] = digest
        files = {}
        for rel in sorted(written, key=str):
            files[str(rel)] = _file_record(tmp / rel, written[rel])
            if str(rel) in tensors:
                files[str(rel)]["tensors"] = dict(sorted(tensors[str(rel)].items()))
        manifest = {
            "reshard": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **report.to_json(),
            "files": files,
            "logical": _logical_digests(report, sources, tensors, segments),
        }
        manifest.pop("work_units", None)
        partial.commit(json.dumps(manifest, indent=1) + "\n")
    except (KeyboardInterrupt, SystemExit):
        raise  # interrupted: the partial directory stays for --resume
    except BaseException:
        partial.abandon()
        raise
    finally:
        journal_into(None)
        hash_segments(None)
        take_segment_digests()
        partial.release()
    size = sum(f["bytes"] for rel, f in files.items() if rel not in kept)
    return ConvertResult(path=dst, report=report, files=files, bytes_read=bytes_read, bytes_written=size,
                         reused=len(kept), seconds=time.perf_counter() - started)




# Resident memory of a process with numpy, networkx, reshard and torch (some formats regenerate
# RNG state with it) loaded, and per planned copy and fragment (dataclasses, boxes, tuples,
# dict entries): measured on CPython 3.11 with torch 2.13.
_BASE_BYTES = 224 << 20
_BYTES_PER_COPY = 700
_BYTES_PER_FRAGMENT = 500


def _window_bytes(report: PlanReport, budget: int, workers: int) -> int:
    """The window each writer asks of fill, from the memory budget; an error if the budget cannot hold the plan.

    Each process holds the runtime and the plan (estimated from its counts);
    each writing process also a destination window, the source spans feeding
    it (at most the window again) and the writer's own buffer: four windows in
    all. With workers, the main process waits holding its plan, so the budget
    is split ``workers + 1`` ways.
    """
    share = budget // (workers + 1 if workers > 1 else 1)
    fragments = len(report.source.layout.fragments) + len(report.target.layout.fragments)
    plan_bytes = _BASE_BYTES + _BYTES_PER_COPY * len(report.plan.copies) + _BYTES_PER_FRAGMENT * fragments
    window = min(64 << 20, max(1 << 20, (share - plan_bytes) // 4))
    if plan_bytes + 4 * window > share:
        mib = 1 << 20
        raise ReshardError(
            f"memory budget {budget / mib:.0f} MiB{f' over {workers} workers' if workers > 1 else ''} is below the "
            f"{(plan_bytes + 4 * window) * (budget // share) / mib:.0f} MiB this conversion needs: per process, "
            f"{_BASE_BYTES / mib:.0f} MiB runtime + {(plan_bytes - _BASE_BYTES) / mib:.0f} MiB plan "
            f"({len(report.plan.copies):,} copies, {fragments:,} fragments) + 4 windows of {window / mib:.0f} MiB")
    return window


def _shares(report: PlanReport, workers: int, files: Collection[str]) -> list[list[str]]:
    """Destination ``files`` per worker: whole work units, largest first, each to the least loaded worker."""
    if workers == 1 or len(files) <= 1:
        return [sorted(files)] if files else []
    weight: dict[str, int] = defaultdict(int)
    for c in report.plan.copies:
        weight[report.dst_file(c.dst)] += c.numel
    todo = set(files)
    units = [(s, [f for f in d if f in todo]) for s, d in report.work_units()]
    units = sorted([u for u in units if u[1]], key=lambda u: -sum(weight[f] for f in u[1]))
    bins: list[tuple[int, list[str]]] = [(0, []) for _ in range(min(workers, len(units)))]
    for _, dsts in units:
        k = min(range(len(bins)), key=lambda b: bins[b][0])
        bins[k] = (bins[k][0] + sum(weight[f] for f in dsts), bins[k][1] + dsts)
    return [files for _, files in bins if files]


def _run_workers(shares: list[list[str]], src, tmp: Path, to, format, spec, sizes, window: int,
                 options: Mapping[str, Any] | None = None) -> tuple[dict[Path, str | None], int, dict[str, dict[str, str]],
                                                                     dict[tuple[str, int, int], str]]:
    """Write each share of destination files in its own process; returns the files written (with the
    checksums their writers took), bytes read, the per-tensor checksums by file and those of the
    tensors held inside items."""
    import multiprocessing

    # spawn, not fork: a child forked from a large parent starts with the parent's memory.
    ctx = multiprocessing.get_context("spawn")
    jobs = [(str(src), str(tmp), to, format, spec, dict(sizes or {}), files, window, dict(options or {}))
            for files in shares]
    with ctx.Pool(len(jobs), initializer=_init_worker, initargs=(os.getpid(),)) as pool:
        results = pool.map(_worker, jobs)
    written: dict[Path, str | None] = {}
    tensors: dict[str, dict[str, str]] = {}
    segments: dict[tuple[str, int, int], str] = {}
    read = 0
    for files, error, nbytes, (digests, parts) in results:
        if error:
            raise ReshardError(error)
        written.update({Path(f): d for f, d in files.items()})
        tensors.update(digests)
        segments.update(parts)
        read += nbytes
    return written, read, tensors, segments


def _init_worker(parent: int) -> None:
    """A worker dies with the conversion: a killed parent must not leave it writing into the
    directory a resumed conversion takes over."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def _worker(job) -> tuple[dict[str, str | None], str | None, int, tuple[dict, dict]]:
    """One worker: re-plan (deterministic), write its share of files. Errors come back as text."""
    src, tmp, to, format, spec, sizes, files, window, options = job
    journal_into(tmp)
    try:
        report = plan(src, to=to, format=format, spec=spec, sizes=sizes or None, **options)
        hash_segments(_segments(_logical_sources(report)))
        with ByteReader() as reader:
            fill = PlanFill(report.plan, report.source.where, reader)
            written = get_format(report.target.format).write(report.target, Path(tmp), fill,
                                                             only=[Path(f) for f in files], window_bytes=window)
            return ({str(w): take_digest(Path(tmp) / w) for w in written}, None, reader.bytes_read,
                    _tensor_digests(report))
    except ReshardError as e:
        return {}, f"{e} (while writing {', '.join(files[:3])}{' ...' if len(files) > 3 else ''})", 0, ({}, {})


def _resume_header(report: PlanReport, options: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies a conversion for ``resume``: source, destination, options, the plan, and the
    size and mtime of each source file it reads."""
    plan_json = json.dumps({"files": report.files(), "summary": report.plan.summary()}, sort_keys=True, default=str)
    src_files = {}
    for path in sorted({loc.path for loc in report.source.where.values()}):
        st = path.stat()
        src_files[str(path)] = [st.st_size, st.st_mtime_ns]
    return {
        "reshard": __version__,
        "source": str(report.source.path.resolve()),
        "destination": {"format": report.target.format, "topology": str(report.target.topology),
                        "spec": report.target.spec_name},
        "options": {k: v for k, v in options.items() if v is not None},
        "plan": xxhash.xxh3_128(plan_json.encode()).hexdigest(),
        "source_files": src_files,
    }


def _finished(path: Path, report: PlanReport) -> dict[str, dict[str, Any]]:
    """The files of a finished conversion at ``path`` that ``resume`` is asked to redo: its manifest must
    describe this conversion and verify."""
    manifest = _read_manifest(path)
    want = report.to_json()
    for key in ("source", "destination"):
        if manifest.get(key) != want[key]:
            raise CheckpointFormatError(f"{path}: holds a finished conversion of another {key} "
                                        f"({json.dumps(manifest.get(key))}, not {json.dumps(want[key])})")
    missing = sorted({row["destination"] for row in want["files"]} - set(manifest.get("files", {})))
    if missing:
        raise CheckpointFormatError(f"{path}: its manifest lacks {', '.join(missing[:3])} of this conversion")
    result = _verify_manifest(path)
    if not result:
        raise CheckpointFormatError(f"{path}: holds a finished conversion that fails its manifest: "
                                    f"{'; '.join(result.differences[:5])}; remove it to convert again")
    return manifest["files"]


def _check_destination(src: Path, dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointFormatError(f"{dst}: destination exists and is not empty")
    try:
        s, d = src.resolve(), dst.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop, before Python 3.13
        raise CheckpointFormatError(f"{dst}: cannot be resolved ({e})") from None
    if d == s or s in d.parents:
        raise CheckpointFormatError(f"{dst}: destination is inside the source {src}")


def _tensor_digests(report: PlanReport) -> tuple[dict[str, dict[str, str]], dict[tuple[str, int, int], str]]:
    """The per-tensor checksums the writers took in this process, by destination file, and those of
    the tensors held inside items (``hash_segments``)."""
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for item, digest in take_item_digests().items():
        if item in report.dst_files:
            out[report.dst_file(item)][str(item)] = digest
    return dict(out), take_segment_digests()


def _logical_sources(report: PlanReport) -> dict[tuple[str, str], list[tuple[Item, int, int | None]]]:
    """Where the destination holds each logical tensor row-major in one piece, by (tensor, state): per
    copy, the item and the byte range of it (``None`` for the end: the whole item is the tensor). Tensors
    stored in pieces (split over ranks, or interleaved like a fused qkv) are left out."""
    layout, dtypes = report.target.layout, report.target.dtypes
    frags: dict[tuple[str, str], list] = defaultdict(list)
    for f in layout.fragments:
        frags[(f.tensor, f.state)].append(f)
    out = {}
    for key, fs in frags.items():
        t = layout.tensors[key[0]]
        if t.blob or any(f.fill or not _row_major_whole(f, t.view) for f in fs):
            continue
        numel = math.prod(t.view)
        places = []
        for f in fs:
            size = itemsize(dtypes[f.item])
            whole = f.offset == 0 and layout.items[f.item].numel == numel
            places.append((f.item, f.offset * size, None if whole else (f.offset + numel) * size))
        out[key] = places
    return out


def _row_major_whole(f, view: tuple[int, ...]) -> bool:
    """The fragment is the whole tensor, laid out row-major from ``f.offset`` on."""
    if any(f.box.offsets) or f.box.lengths != view:
        return False
    step = 1
    for n, stride in zip(reversed(f.box.lengths), reversed(f.strides)):
        if n > 1 and stride != step:
            return False
        step *= n
    return True


def _segments(sources: Mapping[tuple[str, str], list[tuple[Item, int, int | None]]]) -> dict[Item, list[tuple[int, int]]]:
    """The byte ranges inside items the writers checksum on their own: tensors held in part of an item."""
    out: dict[Item, list[tuple[int, int]]] = defaultdict(list)
    for places in sources.values():
        for item, lo, hi in places:
            if hi is not None:
                out[item].append((lo, hi))
    return dict(out)


def _logical_digests(report: PlanReport, sources, tensors: Mapping[str, Mapping[str, str]],
                     segments: Mapping[tuple[str, int, int], str]) -> dict[str, dict[str, Any]]:
    """Checksums of logical tensors, by state and tensor: the xxh3-128 of the tensor's bytes in row-major
    order (what hashing ``tensor.contiguous()`` gives), with its dtype.

    For a tensor the destination holds row-major in one piece (every copy of it, when replicated): the
    checksum of its item, or of its byte range inside the item, both taken while writing. Tensors stored
    in pieces are left out; ``verify`` compares those by value.
    """
    digests = {label: d for per_file in tensors.values() for label, d in per_file.items()}
    out: dict[str, dict[str, Any]] = defaultdict(dict)
    for (name, state), places in sorted(sources.items()):
        found = {(report.target.dtypes[item],
                  digests.get(str(item)) if hi is None else segments.get((str(item), lo, hi)))
                 for item, lo, hi in places}
        if len(found) == 1 and None not in next(iter(found)):
            dtype, digest = found.pop()
            out[state][name] = {"dtype": dtype, HASH: digest}
    return dict(out)


def _file_record(path: Path, digest: str | None = None) -> dict[str, Any]:
    """A manifest entry: size and xxh3-128, the one taken while writing if given, else read from the file."""
    return {"bytes": path.stat().st_size, HASH: digest or file_digest(path)}


@dataclass(slots=True)
class RankState:
    """What one rank holds under a new topology: its stored items, as torch tensors."""

    topology: Topology
    rank: int
    tensors: dict[Item, Any]
    bytes_read: int

    def state_dict(self, state: str = "param", *, section: str | None = None, chunk: int = 0) -> dict[str, Any]:
        """The items of one state (and section, chunk) by key, e.g. the model's state dict."""
        return {it.key: t for it, t in self.tensors.items()
                if it.state == state and it.chunk == chunk and (section is None or it.section == section)}


def load(src: str | Path, *, to: str | Topology, rank: int, format: str | None = None, spec: str | None = None,
         sizes: Mapping[str, int] | None = None) -> RankState:
    """Load what ``rank`` holds when ``src`` is resharded to topology ``to``, reading only its bytes.

    Called inside each rank of a job whose topology differs from the
    checkpoint's. Tensors come back as torch tensors in the destination
    format's stored shapes and dtypes (model weights under state ``param``,
    optimizer states under their own names).

    >>> mine = load("ckpt/", to="tp=4,pp=1", rank=3)      # doctest: +SKIP
    >>> mine.state_dict("param")["embedding.word_embeddings.weight"].shape  # doctest: +SKIP
    """
    import torch

    report = plan(src, to=to, format=format, spec=spec, sizes=sizes)
    topo = report.target.topology
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < topo.world_size:
        raise ReshardError(f"rank {rank} is outside world_size {topo.world_size} of {topo}")
    coords = topo.coords(rank)
    mine = [it for it in report.target.layout.items if all(coords.get(a) == c for a, c in it.unit)]
    out: dict[Item, Any] = {}
    with ByteReader() as reader:
        fill = PlanFill(report.plan, report.source.where, reader)
        dtypes = fill.dtypes
        for it in mine:
            info = report.target.layout.items[it]
            dtype = dtypes[it]
            buf = bytearray(fill(it, 0, info.numel)) if info.numel else bytearray()
            t = torch.frombuffer(buf, dtype=getattr(torch, dtype)) if buf else torch.empty(0, dtype=getattr(torch, dtype))
            out[it] = t.reshape(info.shape)
        read = reader.bytes_read
    return RankState(topology=topo, rank=rank, tensors=out, bytes_read=read)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    identical: bool
    compared: int
    """Logical tensors (per state) compared."""
    differences: tuple[str, ...] = field(default=())
    by_checksum: int = 0
    """Of those, the ones compared by the logical checksums both manifests carry, without reading them."""

    def __bool__(self) -> bool:
        return self.identical


def verify(a: str | Path, b: str | Path | None = None, *, states: tuple[str, ...] | None = None, limit: int = 10,
           sizes: Mapping[str, int] | None = None) -> VerifyResult:
    """Compare the logical tensors of two checkpoints in any layouts and formats, bit for bit.

    With one checkpoint, check it against the manifest (``reshard.json``) its
    conversion wrote: every listed file present with its size and checksum,
    and no other checkpoint file beside them (``compared`` counts files). A
    file whose checksum differs is opened again to name the stored tensors
    that differ from their own checksums.

    Every logical tensor and state the two hold in common is compared. When
    both checkpoints carry a manifest that they still match (each file's
    checksum is checked) and both manifests record the tensor's logical
    checksum, those are compared. Otherwise the tensor is rebuilt from each
    side (one tensor in memory at a time) and compared by value; replicas
    inside one checkpoint must agree too. A tensor or state only one side
    holds is a difference, unless ``states`` restricts the comparison.

    Returns a ``VerifyResult``; ``differences`` name the first differing
    tensors and the first differing position in each.
    """
    if b is None:
        return _verify_manifest(Path(a))
    sa, sb = open_checkpoint(a, sizes=sizes), open_checkpoint(b, sizes=sizes)
    diffs: list[str] = []
    keys_a, keys_b = _logical_keys(sa, states), _logical_keys(sb, states)
    only: dict[tuple[str, str], list[str]] = defaultdict(list)
    for key in sorted(keys_a.keys() ^ keys_b.keys()):
        only[("first" if key in keys_a else "second", key[1])].append(key[0])
    for (side, state), names in sorted(only.items()):
        what = names[0] if len(names) == 1 else f"{len(names)} logical tensors, e.g. {names[0]}"
        diffs.append(f"{what} [{state}]: only in the {side} checkpoint")
    compared = by_checksum = 0
    common = keys_a.keys() & keys_b.keys()
    sums_a, sums_b = (_manifest_logical(Path(a)), _manifest_logical(Path(b))) if common else ({}, {})
    with ByteReader() as reader:
        for key in sorted(common):
            ta, tb = sa.layout.tensors[key[0]], sb.layout.tensors[key[0]]
            if ta.shape != tb.shape:
                diffs.append(f"{key[0]} [{key[1]}]: shape {ta.shape} != {tb.shape}")
                continue
            if key in sums_a and sums_a.get(key) == sums_b.get(key):
                compared += 1
                by_checksum += 1
                continue
            va = _logical(sa, keys_a[key], reader, diffs)
            vb = _logical(sb, keys_b[key], reader, diffs)
            compared += 1
            if va is None or vb is None:
                continue
            va, vb = va.reshape(ta.shape), vb.reshape(tb.shape)  # the layouts may view the tensor through other axes
            if va.dtype.itemsize != vb.dtype.itemsize:
                diffs.append(f"{key[0]} [{key[1]}]: dtype {_dtype(sa, keys_a[key])} != {_dtype(sb, keys_b[key])}")
                continue
            if not np.array_equal(va, vb):
                pos = tuple(int(i) for i in np.argwhere(va != vb)[0])
                diffs.append(f"{key[0]} [{key[1]}]: first difference at {pos} ({int(np.sum(va != vb))} elements differ)")
            if len(diffs) >= limit + len(only):
                break
    return VerifyResult(identical=not diffs, compared=compared, differences=tuple(diffs[: limit + len(only)]),
                        by_checksum=by_checksum)


def _manifest_logical(path: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """The logical checksums (dtype, digest) by (tensor, state) of the manifest at ``path``, if there is one
    and the checkpoint still matches it file by file; else none."""
    try:
        logical = _read_manifest(path).get("logical") if (path / MANIFEST).is_file() else None
        if not logical or not _verify_manifest(path):
            return {}
    except CheckpointFormatError:  # a broken manifest: compare by value
        return {}
    return {(name, state): (v["dtype"], v[HASH]) for state, per in logical.items() for name, v in per.items()}


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, every field of the types a conversion writes: ``files``
    (relative path -> ``bytes``, checksum, optional per-tensor checksums) and optional ``logical`` (state ->
    tensor -> dtype and checksum). CheckpointFormatError naming the field otherwise."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointFormatError(f"{manifest_path}: no manifest; give a second checkpoint to compare with")
    manifest = read_json(manifest_path)

    def bad(field: str, value: Any, expected: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{manifest_path}: not a reshard manifest: {field} is {brief(value, 60)}, "
                                     f"expected {expected}")

    def strings(value: Any, field: str) -> dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise bad(field, value, "an object of strings")
        return value

    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise bad("'files'", manifest.get("files") if isinstance(manifest, dict) else manifest, "an object")
    for rel, want in manifest["files"].items():
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts or "\0" in rel:
            raise bad("a file name", rel, "a path inside the checkpoint")
        if not isinstance(want, dict) or not isinstance(want.get(HASH, ""), str):
            raise bad(f"files['{rel}']", want, f"an object with 'bytes' and a '{HASH}' string")
        expect_int(want.get("bytes"), f"files['{rel}'].bytes", manifest_path)
        strings(want.get("tensors") or {}, f"files['{rel}'].tensors")
    logical = manifest.get("logical")
    if logical is not None and not (isinstance(logical, dict) and all(
            isinstance(per, dict) and all(isinstance(v, dict) and isinstance(v.get("dtype"), str)
                                          and isinstance(v.get(HASH), str) for v in per.values())
            for per in logical.values())):
        raise bad("'logical'", logical, f"state -> tensor -> {{'dtype', '{HASH}'}} strings")
    return manifest


def _verify_manifest(path: Path) -> VerifyResult:
    files = _read_manifest(path)["files"]
    diffs = []
    for rel, want in sorted(files.items()):
        file = path / rel
        if not file.is_file():
            diffs.append(f"{rel}: missing")
            continue
        size = file.stat().st_size
        if size != want["bytes"]:
            diffs.append(f"{rel}: {size} bytes, the manifest says {want['bytes']}")
            continue
        if HASH not in want:
            diffs.append(f"{rel}: the manifest has no {HASH} checksum")
            continue
        got = file_digest(file)
        if got != want[HASH]:
            diffs.append(f"{rel}: {HASH} {got} differs from the manifest's {want[HASH]}")
            diffs += _tensor_differences(path, rel, want.get("tensors") or {})
    listed = set(files) | {MANIFEST}
    extra = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and str(p.relative_to(path)) not in listed)
    diffs += [f"{rel}: not in the manifest" for rel in extra]
    return VerifyResult(identical=not diffs, compared=len(files), differences=tuple(diffs))


def _tensor_differences(path: Path, rel: str, want: Mapping[str, str]) -> list[str]:
    """Which stored tensors of a file that fails its checksum differ from the manifest's, when the
    checkpoint still opens; else nothing more than the file-level difference."""
    if not want:
        return []
    try:
        src = open_checkpoint(path)
    except ReshardError:
        return ["  (the checkpoint does not open, so its tensors cannot be checked one by one)"]
    out = []
    with ByteReader() as reader:
        for item, loc in src.where.items():
            label = str(item)
            if label not in want or Path(loc.path).resolve() != (path / rel).resolve():
                continue
            h = xxhash.xxh3_128()
            nbytes = src.layout.items[item].numel * itemsize(loc.dtype)
            for lo in range(0, nbytes, 8 << 20):
                buf = bytearray(min(8 << 20, nbytes - lo))
                reader.read_into(Path(loc.path), loc.offset + lo, memoryview(buf))
                h.update(buf)
            if h.hexdigest() != want[label]:
                out.append(f"  tensor {label}: {HASH} {h.hexdigest()} differs from the manifest's {want[label]}")
    return out


def _logical_keys(src: Source, states: tuple[str, ...] | None) -> dict[tuple[str, str], list]:
    out: dict[tuple[str, str], list] = defaultdict(list)
    for f in src.layout.fragments:
        if not f.fill and (states is None or f.state in states) and f.item in src.where:
            out[(f.tensor, f.state)].append(f)
    return out


def _dtype(src: Source, frags: list) -> str:
    return src.where[frags[0].item].dtype


def _logical(src: Source, frags: list, reader: ByteReader, diffs: list[str]) -> np.ndarray | None:
    t = src.layout.tensors[frags[0].tensor]
    dtype = uint_dtype(_dtype(src, frags))
    if sum(math.prod(f.box.lengths) for f in frags) < math.prod(t.view):  # before allocating the tensor
        diffs.append(f"{t.name} [{frags[0].state}]: part of it is stored nowhere in {src.path}")
        return None
    out = np.zeros(t.view, dtype=dtype)
    seen = np.zeros(t.view, dtype=bool)
    fill = PlanFill.__new__(PlanFill)
    fill.where, fill.reader = src.where, reader
    for f in frags:
        region = fill.read_region(f.item, f.offset, f.strides, f.box.lengths, dtype)
        sl = tuple(slice(o, o + n) for o, n in zip(f.box.offsets, f.box.lengths))
        already = seen[sl]
        if already.any() and not np.array_equal(out[sl][already], region[already]):
            diffs.append(f"{t.name} [{f.state}]: replicas disagree ({f.item} differs from an earlier copy)")
        out[sl] = region
        seen[sl] = True
    if not seen.all():
        diffs.append(f"{t.name} [{frags[0].state}]: {int((~seen).sum())} elements are stored nowhere in {src.path}")
        return None
    return out


def inspect(src: str | Path, *, sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Format, topology, model sizes, and every logical tensor with its dtype and size."""
    s = open_checkpoint(src, sizes=sizes)
    tensors: dict[str, dict[str, Any]] = {}
    for f in s.layout.fragments:
        if f.fill or f.item not in s.where:
            continue
        t = s.layout.tensors[f.tensor]
        row = tensors.setdefault(f.tensor, {"shape": list(t.shape), "states": {}})
        dtype = s.where[f.item].dtype
        row["states"][f.state] = {"dtype": dtype, "bytes": math.prod(t.shape) * itemsize(dtype)}
    files = sorted({str(loc.path.relative_to(s.path)) if loc.path.is_relative_to(s.path) else str(loc.path)
                    for loc in s.where.values()})
    return {
        "path": str(s.path),
        "format": s.format,
        "spec": s.spec_name,
        "topology": str(s.topology),
        "sizes": dict(s.sizes),
        "states": list(s.layout.states),
        "files": files,
        "tensors": dict(sorted(tensors.items())),
        "bytes": sum(st["bytes"] for r in tensors.values() for st in r["states"].values()),
    }

