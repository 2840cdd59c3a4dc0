"""Spreading a conversion over worker processes: byte-balanced shares of the destination files, how many
workers help, what each holds in memory, and the shares they are sent (``reshard.execution.workers``).

Shares are balanced by destination bytes, whatever the connectivity of the source-file <->
destination-file graph: most conversions are one connected component (Hugging Face shards cut across
layers, ZeRO flat partitions span every parameter), and workers reading the same source file at
once need no coordination. Components only break ties, keeping a component's files together when
balance does not care.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.core.dtypes import itemsize
from reshard.core.layout import Item
from reshard.errors import ReshardError
from reshard.execution.manifest import logical_sources, segments_of
from reshard.execution.workers import Share
from reshard.formats import get_format

if TYPE_CHECKING:
    from reshard.api.planning import PlanReport

__all__ = ["MIN_COPY_BYTES", "MIN_SHARE_BYTES", "copies_per_share", "file_bytes", "share_table", "shares",
           "usable_cores", "worker_count", "worker_shares"]

MIN_SHARE_BYTES = 64 << 20
"""Destination bytes below which another worker does not pay for its start (an interpreter and imports,
about 0.3 s): ``auto`` starts one worker per this many bytes at most."""


MIN_COPY_BYTES = 256 << 10
"""The average bytes per copy below which ``auto`` starts no worker: each one is sent its slice of the plan
and the target, and unpickles them, at some 60 microseconds per copy, while a small copy moves in a few. 100,000
tensors of 10 KiB took 14 s with two workers and 7.8 s with one (``bench/small_tensors.py``'s checkpoint)."""


def file_bytes(report: PlanReport) -> dict[str, int]:
    """Each item-holding destination file's bytes: its items' elements (padding included) at their dtypes."""
    out: dict[str, int] = defaultdict(int)
    for item, path in report.dst_files.items():
        info = report.target.layout.items.get(item)
        if info is not None:
            out[str(path)] += info.numel * itemsize(report.target.dtypes.get(item, "uint8"))
    return dict(out)


def shares(report: PlanReport, workers: int, files: Collection[str] | None = None) -> list[list[str]]:
    """``files`` (default: every item-holding destination file) in at most ``workers`` shares of balanced bytes.

    Largest file first, each to the least loaded worker (ties: one already holding a file of the same
    connected component, then the lowest number). Each share is sorted; empty shares are dropped.
    """
    weight = file_bytes(report)
    todo = sorted(weight if files is None else files)
    if workers <= 1 or len(todo) <= 1:
        return [todo] if todo else []
    component = {f: k for k, (_, dsts) in enumerate(report.work_units()) for f in dsts}
    loads = [0] * min(workers, len(todo))
    held: list[set[int]] = [set() for _ in loads]
    out: list[list[str]] = [[] for _ in loads]
    for f in sorted(todo, key=lambda f: (-weight.get(f, 0), component.get(f, -1), f)):
        least = min(loads)
        tied = [k for k, load in enumerate(loads) if load == least]
        k = next((k for k in tied if component.get(f, -1) in held[k]), tied[0])
        loads[k] += weight.get(f, 0)
        held[k].add(component.get(f, -1))
        out[k].append(f)
    return [sorted(s) for s in out if s]


def share_table(report: PlanReport, workers: int) -> dict[str, object]:
    """The shares ``workers`` workers would get, for ``reshard plan``: per worker its files and bytes, and
    the largest share over the mean."""
    weight = file_bytes(report)
    parts = shares(report, workers)
    rows = [{"files": s, "bytes": sum(weight[f] for f in s)} for s in parts]
    mean = sum(r["bytes"] for r in rows) / len(rows) if rows else 0
    return {"workers": len(rows), "shares": rows,
            "largest_over_mean": round(max(r["bytes"] for r in rows) / mean, 3) if mean else 1.0}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_count(report: PlanReport, workers: int | str, files: Collection[str]) -> int:
    """How many workers to start: ``workers`` itself (never more than there are files), or for ``auto``
    as many as help: at most one per core, per file and per ``MIN_SHARE_BYTES`` of destination bytes, and one
    alone where the copies average under ``MIN_COPY_BYTES``."""
    if workers == "auto":
        weight = file_bytes(report)
        total = sum(weight.get(f, 0) for f in files)
        if total < MIN_COPY_BYTES * len(report.plan.copies):
            return 1
        return max(1, min(usable_cores(), len(files), total // MIN_SHARE_BYTES))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ReshardError(f"workers must be 'auto' or an integer of at least 1, got {workers!r}")
    return max(1, min(workers, len(files)))


def worker_shares(report: PlanReport, parts: list[list[str]], out: Path, window: int) -> list[Share]:
    """What each worker is sent: its files, the plan's copies into them and where those read, the target."""
    owner = {f: k for k, part in enumerate(parts) for f in part}
    copies: list[list] = [[] for _ in parts]
    for c in report.plan.copies:
        k = owner.get(report.dst_file(c.dst))
        if k is not None:
            copies[k].append(c)
    segments = segments_of(logical_sources(report.target.layout, report.target.dtypes))
    write = get_format(report.target.format).write
    result = []
    for k, part in enumerate(parts):
        mine = set(part)
        where: dict[Item, object] = {c.src: report.source.where[c.src] for c in copies[k]}
        result.append(Share(write=write, target=report.target, out=out, files=tuple(part), copies=tuple(copies[k]),
                            where=where, window_bytes=window,
                            segments={it: v for it, v in segments.items() if _file_of(report, it) in mine}))
    return result


def _file_of(report: PlanReport, item: Item) -> str | None:
    path = report.dst_files.get(item)
    return None if path is None else str(path)


def copies_per_share(report: PlanReport, parts: list[list[str]]) -> list[int]:
    """How many of the plan's copies each share holds (what a worker's slice of the plan weighs)."""
    owner: Mapping[str, int] = {f: k for k, part in enumerate(parts) for f in part}
    counts = [0] * len(parts)
    for c in report.plan.copies:
        k = owner.get(report.dst_file(c.dst))
        if k is not None:
            counts[k] += 1
    return counts
