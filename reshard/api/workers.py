"""Writing a conversion's destination files in worker processes, each its own share of the files."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from reshard.api.planning import PlanReport, plan
from reshard.errors import ReshardError
from reshard.execution.executor import ByteReader, PlanFill
from reshard.execution.manifest import logical_sources, segments_of, tensor_digests
from reshard.execution.session import WriteSession
from reshard.formats import get_format

__all__ = ["run_workers", "shares"]


def shares(report: PlanReport, workers: int, files: Collection[str]) -> list[list[str]]:
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

def run_workers(shares: list[list[str]], src, tmp: Path, to, format, spec, sizes, window: int,
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
    try:
        report = plan(src, to=to, format=format, spec=spec, sizes=sizes or None, **options)
        segments = segments_of(logical_sources(report.target.layout, report.target.dtypes))
        with WriteSession(journal=tmp, segments=segments, window_bytes=window) as session, ByteReader() as reader:
            fill = PlanFill(report.plan, report.source.where, reader)
            written = get_format(report.target.format).write(report.target, Path(tmp), fill, session,
                                                             only=[Path(f) for f in files])
            return ({str(w): session.digest(Path(tmp) / w) for w in written}, None, reader.bytes_read,
                    (tensor_digests(session.item_digests(), report.dst_files), session.segment_digests()))
    except ReshardError as e:
        return {}, f"{e} (while writing {', '.join(files[:3])}{' ...' if len(files) > 3 else ''})", 0, ({}, {})
