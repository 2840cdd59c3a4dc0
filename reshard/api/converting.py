"""``convert``: open -> resolve -> plan -> execute -> manifest, into a directory renamed into place when complete."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from reshard import __version__
from reshard.api.distributed import Ranks, join_ranks
from reshard.api.planning import PlanReport, plan
from reshard.api.workers import Portion, copies_per_share, shares, split_items, worker_count, worker_shares
from reshard.core.collector import collector_paused
from reshard.core.topology import Topology
from reshard.core.units import parse_size
from reshard.errors import CheckpointFormatError, ReshardError
from reshard.execution.coalescing import conversion
from reshard.execution.executor import ByteReader, PlanFill
from reshard.execution.manifest import (
    MANIFEST,
    file_record,
    logical_digests,
    logical_sources,
    read_manifest,
    segments_of,
    tensor_digests,
    verify_manifest,
)
from reshard.execution.partial import Partial, partial_path
from reshard.execution.session import WriteSession
from reshard.execution.workers import WorkerLost, finish_split, run_shares
from reshard.formats import get_format
from reshard.io import json_text
from reshard.io.location import UrlPath, as_path, is_url
from reshard.io.upload import check_empty, upload_tree
from reshard.io.checksum import FILE_HASH

__all__ = ["ConvertResult", "convert"]

Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class ConvertResult:
    path: Path | UrlPath
    report: PlanReport | None
    """The plan; None on the ranks other than 0 of a conversion across ranks, which get only their slice."""
    files: dict[str, dict[str, Any]]
    """Every file of the destination with its size and checksum (on a rank other than 0: the files it wrote)."""
    bytes_read: int
    bytes_written: int
    seconds: float
    reused: int = 0
    """Files an interrupted conversion had written that ``resume`` kept (verified by checksum)."""
    ranks: int = 1
    """The torchrun ranks the conversion was split over (1: this process alone, with its workers)."""
    gap_bytes: int = 0
    """Of ``bytes_read``, those read only to skip a gap of at most 16 KiB between needed ones (``conversion`` in
    ``reshard.execution.coalescing``: one read call costs more than copying them): every other byte read is one
    the destination needs, read once."""

def convert(
    src: str | Path,
    dst: str | Path,
    *,
    to: str | Topology | None = None,
    format: str | None = None,
    spec: str | None = None,
    sizes: Mapping[str, int] | None = None,
    workers: int | str = "auto",
    memory_budget: int | str | None = None,
    max_shard_size: int | str | None = None,
    vocab_pad: str | None = None,
    dist_optim: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    resume: bool = False,
    distributed: bool | None = None,
    direct_io: bool = True,
) -> ConvertResult:
    """Rewrite the checkpoint ``src`` for topology ``to`` (and ``format``) at ``dst``.

    Streams: each destination file is written window by window from just the
    source bytes it needs. The output is built in a hidden sibling directory
    (``.{name}.reshard-partial``) and renamed to ``dst`` only when complete, with the
    manifest ``reshard.json`` written last: sources, topologies, and per file
    its size and checksum (``xxh3_128_64k``: ``reshard.io.checksum``) and the
    xxh3-128 of each stored tensor, taken while writing. A failed run leaves no ``dst``; one that was killed or
    interrupted, or whose worker died, leaves the hidden directory, which ``resume``
    continues (with any number of workers).

    Args:
      src: a checkpoint directory in any supported format, or an fsspec URL (``s3://bucket/ckpt``) of one,
        read with range requests.
      dst: the directory to create; must not exist, or be empty (a symbolic link to such a directory is written
        through, the link kept; a link to nothing is refused). An fsspec URL (``s3://bucket/ckpt``) too: the
        checkpoint is assembled in a local temporary directory (``TMPDIR``: it needs the space of the output),
        then each file is uploaded in parts (S3: a multipart upload of 64 MiB parts), the manifest last, and the
        local copy removed; one process (with its workers), no ``resume``.
      to: the destination topology (``"tp=2,pp=2,dp=4"``); default: the source's
        for the same format, unsharded for hf.
      format: destination format; default: the source's.
      spec: destination spec name or path; default: the format's spec for the model.
      sizes: model sizes the source's metadata lacks.
      workers: processes writing byte-balanced shares of the destination files side by
        side, from the plan made once here; ``"auto"`` (the default): as many as help,
        at most one per core, per stored tensor and per 512 MiB of destination bytes
        (``MIN_SHARE_BYTES``), and as many as the memory budget holds.
      memory_budget: bytes (or ``"512MiB"``, ``"1GiB"``) the conversion may hold,
        shared by the main process and the workers; it sets the window each writer asks
        for at a time. Default (None or ``"auto"``): three quarters of the memory
        available (``MemAvailable``). Too small a budget is an error before anything is
        written, naming the smallest budget that works.
      max_shard_size: hf only: the largest safetensors shard (bytes, or ``"5GB"``;
        default 5GB as transformers), with ``model.safetensors.index.json``.
      vocab_pad: megatron only: ``zero`` or ``last``, what fills the rows that pad the
        vocabulary for the target tp (``last``: copies of the last real row, as Megatron's
        own converter pads); default: the spec's own policy (zeros in the shipped specs).
      dist_optim: mcore-dist with ``zero=1`` only: the distributed optimizer's torch_dist format,
        ``dp_reshardable`` or ``fully_reshardable``; default: as the target args ask (``fully_reshardable``
        if the source run used ``--dist-ckpt-optim-fully-reshardable``), else ``dp_reshardable``.
      progress: ``progress(done_bytes, total_bytes)`` while writing (workers included).
      resume: continue an interrupted conversion with the same source and options,
        keeping the files it finished whose checksums still verify; if it had
        finished, check ``dst`` against its manifest instead.
      distributed: split the conversion over the ranks of a torchrun job, called on every
        rank with the same arguments (``reshard.api.distributed``): rank 0 plans, each rank
        writes a byte-balanced share of the destination files into the partial directory
        (one process each: ``workers`` must be ``auto`` or 1), rank 0 writes the manifest
        and reports ``progress`` for all. Default (None): when torchrun started more than
        one rank (``WORLD_SIZE``), or a process group of more than one rank is initialized;
        ``False``: this process alone.
      direct_io: write the output's windows of 1 MiB or more directly to the disk (``O_DIRECT``, where the file
        system allows it), not through the page cache: steady at the disk's speed, and the page cache is left to
        other work; the converted checkpoint is then not in the page cache. False: every write through the page
        cache, which is faster where memory was just freed for a checkpoint smaller than it.

    Raises:
      ReshardError: anything about the inputs, named with file, tensor and reason.
      RankLost: across ranks, a rank died or stopped answering; ``resume`` continues.
    """
    started = time.perf_counter()
    options = dict(to=to, format=format, spec=spec, sizes=sizes, workers=workers, memory_budget=memory_budget,
                   max_shard_size=max_shard_size, vocab_pad=vocab_pad, dist_optim=dist_optim, progress=progress,
                   direct_io=direct_io)
    if is_url(dst):
        return _to_url(src, as_path(dst), options, resume=resume, distributed=distributed, started=started)
    dst = _destination(as_path(dst))
    ranks = join_ranks(distributed)
    if ranks is None:
        return _convert(src, dst, to=to, format=format, spec=spec, sizes=sizes, workers=workers,
                        memory_budget=memory_budget, max_shard_size=max_shard_size, vocab_pad=vocab_pad,
                        dist_optim=dist_optim, direct_io=direct_io,
                        progress=progress, resume=resume, started=started, ranks=None)
    with ranks:
        if ranks.rank != 0:
            mine, files = ranks.follow()
            return ConvertResult(path=dst, report=None, files=files, bytes_read=mine.bytes_read if mine else 0,
                                 gap_bytes=mine.gap_bytes if mine else 0,
                                 bytes_written=sum(f["bytes"] for f in files.values()),
                                 seconds=time.perf_counter() - started, ranks=ranks.size)
        with ranks.leading():
            return _convert(src, dst, to=to, format=format, spec=spec, sizes=sizes, workers=workers,
                            memory_budget=memory_budget, max_shard_size=max_shard_size, vocab_pad=vocab_pad,
                            dist_optim=dist_optim, direct_io=direct_io,
                            progress=progress, resume=resume, started=started, ranks=ranks)


def _to_url(src: str | Path, dst: UrlPath, options: dict[str, Any], *, resume: bool, distributed: bool | None,
            started: float) -> ConvertResult:
    """``convert`` to object storage: assembled in a local temporary directory (``TMPDIR``), then uploaded file
    by file in parts, the manifest last (``reshard.io.upload``); the local copy is removed either way, and a
    failed upload removes what it put in the bucket."""
    if resume:
        raise ReshardError(f"{dst}: resume continues a local conversion; a conversion to object storage is "
                           "assembled afresh: convert to a local directory with resume, then upload it")
    ranks = join_ranks(distributed)
    if ranks is not None:
        with ranks:
            raise ReshardError(f"{dst}: a conversion to object storage runs in one process (with its workers); "
                               f"across {ranks.size} torchrun ranks, convert to a shared directory instead")
    check_empty(dst)
    root = Path(tempfile.mkdtemp(prefix="reshard-upload-"))
    try:
        result = _convert(src, root / "out", **options, resume=False, started=started, ranks=None)
        try:
            upload_tree(root / "out", dst, last=MANIFEST)
        except BaseException:
            if dst.exists():
                dst.fs.rm(dst.path, recursive=True)
            raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return dataclasses.replace(result, path=dst, seconds=time.perf_counter() - started)


def _convert(src: str | Path, dst: Path, *, to, format, spec, sizes, workers, memory_budget, max_shard_size,
             vocab_pad, dist_optim, progress, resume: bool, started: float, ranks: Ranks | None,
             direct_io: bool = True) -> ConvertResult:
    """``convert`` in this process (with its workers), or as rank 0 of ``ranks``."""
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ReshardError(f"workers must be 'auto' or an integer of at least 1, got {workers!r}")
    if ranks is not None and workers not in ("auto", 1):
        raise ReshardError(f"workers={workers} across {ranks.size} torchrun ranks: each rank writes its share in one "
                           f"process; start more ranks per host (--nproc-per-node) instead")
    report = plan(src, to=to, format=format, spec=spec, sizes=sizes, max_shard_size=max_shard_size,
                  vocab_pad=vocab_pad, dist_optim=dist_optim)
    with collector_paused():  # the collector would walk the plan's objects again and again while bytes move
        return _run(report, src, dst, workers=workers, memory_budget=memory_budget, max_shard_size=max_shard_size,
                    vocab_pad=vocab_pad, dist_optim=dist_optim, progress=progress, resume=resume, started=started,
                    ranks=ranks, direct_io=direct_io)


def _run(report: PlanReport, src: str | Path, dst: Path, *, workers, memory_budget, max_shard_size, vocab_pad,
         dist_optim, progress, resume: bool, started: float, ranks: Ranks | None, direct_io: bool) -> ConvertResult:
    """``_convert`` once its plan is made: write the destination (or find it written), then its manifest."""
    if resume and dst.exists() and not partial_path(dst).exists() and (dst / MANIFEST).exists():
        files = _finished(dst, report)  # done before: killed after its rename, or run twice
        return ConvertResult(path=dst, report=report, files=files, bytes_read=0, bytes_written=0, reused=len(files),
                             seconds=time.perf_counter() - started)
    if not is_url(src):
        _check_destination(Path(src), dst)
    every = _dst_names(report)
    # across ranks, this host's ranks share its memory budget as workers would
    count, window, planned = _workers_and_window(report, workers if ranks is None else ranks.local_size, every,
                                                 memory_budget)
    target = report.target
    fmt = get_format(target.format)
    options = {"max_shard_size": max_shard_size, "vocab_pad": vocab_pad}
    options |= {"dist_optim": dist_optim} if dist_optim else {}
    partial = Partial(dst, _resume_header(report, options), resume=resume, manifest=MANIFEST)
    tmp = partial.path
    session: WriteSession | None = None
    try:
        if partial.complete:  # killed after its manifest, before its rename
            files = _finished(tmp, report)
            partial.commit(None)
            return ConvertResult(path=dst, report=report, files=files, bytes_read=0, bytes_written=0,
                                 reused=len(files), seconds=time.perf_counter() - started)
        kept = partial.kept
        todo = sorted(set(every) - kept.keys())
        total = report.needed_bytes(todo) if kept else report.needed_bytes()
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if progress:
                progress(done[0], total)

        sources = logical_sources(target.layout, target.dtypes)
        ranges = segments_of(sources)
        session = WriteSession(journal=tmp, segments=ranges, window_bytes=window, sync_behind=True, direct_io=direct_io)
        written: dict[Path, str | None] = {Path(rel): e[FILE_HASH] for rel, e in kept.items()}
        # across ranks, files are split as between workers: the ranks write into one partial directory on a shared
        # file system, each rank's part of a split file fsynced before rank 0 finishes it
        if ranks is not None:
            parts = shares(report, ranks.size, todo, locality=True)
        else:  # the shares the budget was worked out for, unless resume left fewer files to write
            parts = planned if todo == every else shares(report, count, todo)
        if len(parts) <= 1 and ranks is None:
            with ByteReader() as reader:
                # the destination dtypes planning worked out (destination_dtypes), not worked out again
                fill = PlanFill(report.plan, report.source.where, reader, dtypes=target.dtypes,
                                coalescing=conversion(window), progress=tick)
                if not kept:
                    paths = fmt.write(target, tmp, fill, session)
                else:
                    paths = fmt.write(target, tmp, fill, session, only=[Path(f) for f in todo]) if todo else []
                    paths += fmt.write(target, tmp, fill, session, only=())
                written.update({p: session.digest(tmp / p) for p in paths})
                bytes_read, gap_bytes = reader.bytes_read, reader.gap_bytes
            session.flush()
            tensors, segments = tensor_digests(session.item_digests(), report.dst_files), session.segment_digests()
        else:
            results = (run_shares if ranks is None else ranks.run_shares)(
                worker_shares(report, parts, tmp, window, ranges, direct_io=direct_io), progress=tick)
            items: dict = {}
            segments = {}
            for r in results:
                written.update({Path(f): d for f, d in r.files.items()})
                items.update(r.items)
                segments.update(r.segments)
            bytes_read = sum(r.bytes_read for r in results)
            gap_bytes = sum(r.gap_bytes for r in results)
            if any(p.split for p in parts):  # the files the workers wrote in parts: framing, checksum, journal
                done = finish_split(fmt.write, target, tmp, results, split_items(report, parts), window_bytes=window,
                                    segments=ranges, pieced={it for p in parts for _, it, _, _ in p.pieces})
                written.update({Path(f): d for f, d in done.files.items()})
                items.update(done.items)
                segments.update(done.segments)
            tensors = tensor_digests(items, report.dst_files)
            with ByteReader() as reader:  # the files that hold no items: trackers, configs, indexes
                paths = fmt.write(target, tmp, PlanFill(report.plan, report.source.where, reader, dtypes=target.dtypes),
                                  session, only=())
                written.update({p: session.digest(tmp / p) for p in paths})
            session.flush()
        if partial.tensors or partial.segments:  # resumed: the kept files' checksums, from the journal
            labels = {str(item): report.dst_file(item) for item in report.dst_files}
            for label, digest in partial.tensors.items():
                if labels.get(label) in kept:
                    tensors.setdefault(labels[label], {})[label] = digest
            for (label, lo, hi), digest in partial.segments.items():
                if labels.get(label) in kept:
                    segments[(label, lo, hi)] = digest
        files = {}
        for rel in sorted(written, key=str):
            files[str(rel)] = file_record(tmp / rel, written[rel])
            if str(rel) in tensors:
                files[str(rel)]["tensors"] = dict(sorted(tensors[str(rel)].items()))
        manifest = {
            "reshard": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **report.to_json(units=False),
            "files": files,
            "logical": logical_digests(target.dtypes, sources, tensors, segments),
        }
        partial.commit(json_text.dumps(manifest, indent=1) + "\n")
    except (KeyboardInterrupt, SystemExit, WorkerLost):
        raise  # interrupted, or a worker killed: the partial directory stays for --resume
    except BaseException:
        if session is not None:  # its threads' syncs and journal lines end before the directory goes
            session.close()
        partial.abandon()
        raise
    finally:
        if session is not None:
            session.close()
        partial.release()
    size = sum(f["bytes"] for rel, f in files.items() if rel not in kept)
    return ConvertResult(path=dst, report=report, files=files, bytes_read=bytes_read, gap_bytes=gap_bytes,
                         bytes_written=size,
                         reused=len(kept), seconds=time.perf_counter() - started, ranks=ranks.size if ranks else 1)

def _dst_names(report: PlanReport) -> list[str]:
    """The destination files, sorted: each ``Path`` object named once (a file's items share one, mostly)."""
    paths = list(report.dst_files.values())
    return sorted({str(path) for path in dict(zip(map(id, paths), paths)).values()})

# Resident memory of a process with numpy, networkx, reshard and torch (some formats regenerate
# RNG state with it) loaded, and per planned copy and fragment (dataclasses, boxes, tuples,
# dict entries): measured on CPython 3.11 with torch 2.13.
_BASE_BYTES = 224 << 20

_BYTES_PER_COPY = 700

_BYTES_PER_FRAGMENT = 500

# A worker's own memory besides its slice of the plan and its windows: the interpreter, the execution
# and format modules (no torch) and the share as it arrives; measured at 52-55 MiB peak RSS (35 MiB
# private) for Megatron, DeepSpeed, DCP and torch_dist targets on CPython 3.11.
_WORKER_BYTES = 64 << 20

_MIB = 1 << 20

_WINDOWS = 5
"""The windows a writing process holds at once: the write session's three, reused (the one being filled and two
in flight on its writer thread: ``reshard.execution.session``), the source spans feeding a window (at most the
window again), and the page-aligned buffer a direct write copies through where a window is not aligned as in its
file (``reshard.io.storage``: no larger than a window)."""

_WINDOW_MAX = 16 << 20
"""The largest window: one that stays in the processor's cache (32 MiB of L3 on the bench machine) between being
filled, checksummed and written. A 2.6 GiB Megatron conversion took 1.83 s with 16 MiB windows and 2.05 s with
64 MiB ones (medians of 5, fresh processes); 8 MiB was no faster than 16."""


def _workers_and_window(report: PlanReport, workers: int | str, files: list[str],
                        memory_budget: int | str | None) -> tuple[int, int, list[Portion]]:
    """How many workers, the window each writer asks of fill, and the workers' shares of ``files``, from the
    memory budget: for ``auto`` workers, as many as help and as the budget holds; an error if the budget cannot
    hold the plan."""
    budget = default_memory_budget() if memory_budget in (None, "auto") else parse_size(memory_budget, "memory budget")
    count = worker_count(report, workers, files)
    while True:
        parts = shares(report, count, files)
        fixed, what = _fixed_bytes(report, parts)
        writers = max(1, len(parts))
        if fixed + _WINDOWS * writers * _MIB <= budget or workers != "auto" or count == 1:
            break
        count -= 1
    window = min(_WINDOW_MAX, max(_MIB, (budget - fixed) // (_WINDOWS * writers)))
    if fixed + _WINDOWS * writers * window > budget:
        need = math.ceil((fixed + _WINDOWS * writers * _MIB) / _MIB)
        over = f" over {len(parts)} workers" if len(parts) > 1 else ""
        raise ReshardError(f"memory budget {budget / _MIB:.0f} MiB{over} is below the {need} MiB this conversion needs: "
                           f"{what} + {_WINDOWS} windows of 1 MiB" + (" each" if len(parts) > 1 else "")
                           + (f"; give --memory-budget {need}MiB or more, or fewer workers" if len(parts) > 1 else ""))
    return max(1, len(parts)), window, parts


def _fixed_bytes(report: PlanReport, parts: list[list[str]]) -> tuple[int, str]:
    """What the processes hold besides windows, and how that adds up (for the error naming it).

    The main process holds the runtime and the plan (estimated from its counts). Each writing
    process also holds windows (``_WINDOWS``). Workers hold their own runtime, the
    target and their slice of the plan; the main process waits holding the whole plan.
    """
    fragments = len(report.source.layout.fragments) + len(report.target.layout.fragments)
    plan_bytes = _BYTES_PER_COPY * len(report.plan.copies) + _BYTES_PER_FRAGMENT * fragments
    main = (f"{_BASE_BYTES / _MIB:.0f} MiB runtime + {plan_bytes / _MIB:.0f} MiB plan "
            f"({len(report.plan.copies):,} copies, {fragments:,} fragments)")
    if len(parts) <= 1:
        return _BASE_BYTES + plan_bytes, f"per process, {main}"
    slices = [_WORKER_BYTES + _BYTES_PER_COPY * n + _BYTES_PER_FRAGMENT * len(report.target.layout.fragments)
              for n in copies_per_share(report, parts)]
    return (_BASE_BYTES + plan_bytes + sum(slices),
            f"the main process {main}; per worker, {_WORKER_BYTES / _MIB:.0f} MiB runtime + up to "
            f"{(max(slices) - _WORKER_BYTES) / _MIB:.0f} MiB of the plan")


def default_memory_budget() -> int:
    """Three quarters of the memory available now (``MemAvailable``; where the system does not say, of
    the free pages, else of 4 GiB)."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            available = 4 << 30
    return available * 3 // 4

def _resume_header(report: PlanReport, options: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies a conversion for ``resume``: source, destination, options, the plan, and the
    size and mtime of each source file it reads."""
    plan_json = json.dumps({"files": report.files(), "summary": report.summary()}, sort_keys=True, default=str)
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
    manifest = read_manifest(path)
    want = report.to_json(units=False)
    for key in ("source", "destination"):
        if manifest.get(key) != want[key]:
            raise CheckpointFormatError(f"{path}: holds a finished conversion of another {key} "
                                        f"({json.dumps(manifest.get(key))}, not {json.dumps(want[key])})")
    missing = sorted({row["destination"] for row in want["files"]} - set(manifest.get("files", {})))
    if missing:
        raise CheckpointFormatError(f"{path}: its manifest lacks {', '.join(missing[:3])} of this conversion")
    result = verify_manifest(path)
    if not result:
        raise CheckpointFormatError(f"{path}: holds a finished conversion that fails its manifest: "
                                    f"{'; '.join(result.differences[:5])}; remove it to convert again")
    return manifest["files"]

def _destination(dst: Path) -> Path:
    """Where a conversion to ``dst`` writes: ``dst``, or the directory a symbolic link at ``dst`` stands for (the
    finished output is renamed onto its path, which would replace the link, not fill the directory). Refuses a
    link to nothing and a path through a link loop up front, before any planning or writing."""
    try:
        target = os.stat(dst)  # follows links
    except FileNotFoundError:
        if dst.is_symlink():
            raise CheckpointFormatError(f"{dst}: a symbolic link to nothing ({os.readlink(dst)}); reshard writes "
                                        "through a link only into a directory that exists") from None
        return dst
    except OSError as e:  # ELOOP, EACCES, ...
        raise CheckpointFormatError(f"{dst}: cannot be resolved ({e.strerror})") from None
    return dst.resolve() if stat.S_ISDIR(target.st_mode) and dst.is_symlink() else dst


def _check_destination(src: Path, dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointFormatError(f"{dst}: destination exists and is not empty")
    try:
        s, d = src.resolve(), dst.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop, before Python 3.13
        raise CheckpointFormatError(f"{dst}: cannot be resolved ({e})") from None
    if d == s or s in d.parents:
        raise CheckpointFormatError(f"{dst}: destination is inside the source {src}")
