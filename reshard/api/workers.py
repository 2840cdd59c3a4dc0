"""Spreading a conversion over worker processes: byte-balanced shares of the destination files, how many
workers help, what each holds in memory, and the shares they are sent (``reshard.execution.workers``).

Shares are balanced by destination bytes, whatever the connectivity of the source-file <->
destination-file graph: most conversions are one connected component (Hugging Face shards cut across
layers, ZeRO flat partitions span every parameter), and workers reading the same source file at
once need no coordination. Between torchrun ranks, which may sit on different hosts, components only break
ties, keeping a component's files together when balance does not care. Workers on one host share its disk and
page cache, and skip the graph: making it imports networkx, some 0.1 s of a conversion of a few seconds.

Whole files go to workers while that keeps every share within ``BALANCE`` of the mean. Otherwise (fewer
files than workers, or one file much larger than the rest) the files that do not fit whole are split at
their stored tensors, each worker writing its own tensors of such a file (``reshard.execution.workers``),
and where a tensor is larger than the slack, inside tensors too (each worker writing a piece of one), so
that no share exceeds the mean by more than a tenth.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.api.sinks import usable_cores
from reshard.core.dtypes import itemsize
from reshard.core.layout import Item
from reshard.errors import ReshardError
from reshard.execution.manifest import logical_sources, segments_of
from reshard.execution.workers import Share
from reshard.formats import get_format

if TYPE_CHECKING:
    from reshard.api.planning import PlanReport

__all__ = ["BALANCE", "MIN_COPY_BYTES", "MIN_SHARE_BYTES", "Portion", "copies_per_share", "file_bytes", "share_table",
           "shares", "split_items", "usable_cores", "worker_count", "worker_shares"]

BALANCE = 1.1
"""The largest share over the mean that whole files may give before files are split between workers."""

MIN_SHARE_BYTES = 512 << 20
"""Destination bytes per worker below which more workers stopped paying: ``auto`` starts one worker per this many
bytes at most. Shares of about 480 MiB were as fast as any, shares half that size slower on 16 cores as on 2:
1.92 GiB of Hugging Face shards to Megatron tp=2,pp=2 took 2.4 s with 4 workers and 3.7 s with 8 on 16 cores
(1.7 and 2.9 s on 2), and 2.62 GiB of Megatron tp=2,pp=2 to tp=1,pp=4 2.0 s with 4 and 3.3 s with 8 on 2 cores
(``bench/convert_memory.py``)."""


MIN_COPY_BYTES = 256 << 10
"""The average bytes per copy below which ``auto`` starts no worker: Python per tensor, not bytes, is the cost
then. A worker started as a fresh interpreter is sent its slice of the plan and the whole target and unpickles
them, at some 60 microseconds per copy; a forked one is sent nothing, and still did not pay on 2 busy cores:
100,000 tensors of 10 KiB (``bench/small_tensors.py``'s checkpoint) took 18.7 s with two forked workers and
18.8 s with one, 46.7 s with two fresh interpreters (medians of 2, load average 7 to 13)."""


def file_bytes(report: PlanReport) -> dict[str, int]:
    """Each item-holding destination file's bytes: its items' elements (padding included) at their dtypes."""
    return {f: sum(n for _, n in items) for f, items in _item_bytes(report).items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class Portion:
    """One worker's share of the destination."""

    files: tuple[str, ...]
    """Its destination files, sorted, those it writes in part included."""
    split: tuple[tuple[str, tuple[Item, ...]], ...] = ()
    """The files of ``files`` split between workers, each with the stored tensors of it this worker writes."""
    pieces: tuple[tuple[str, Item, int, int], ...] = ()
    """The tensors of ``split`` this worker writes a piece of: file, tensor, first and end element."""
    bytes: int = 0
    """The destination bytes it writes (its tensors' elements, padding included, at their dtypes)."""


def _item_bytes(report: PlanReport) -> dict[str, list[tuple[Item, int]]]:
    """Each item-holding destination file's stored tensors with their bytes, in the plan's order."""
    out: dict[str, list[tuple[Item, int]]] = defaultdict(list)
    for item, path in report.dst_files.items():
        info = report.target.layout.items.get(item)
        if info is not None:
            out[str(path)].append((item, info.numel * itemsize(report.target.dtypes.get(item, "uint8"))))
    return dict(out)


def shares(report: PlanReport, workers: int, files: Collection[str] | None = None, *,
           split: bool = True, locality: bool = False) -> list[Portion]:
    """``files`` (default: every item-holding destination file) in at most ``workers`` shares of balanced bytes.

    Whole files first: largest first, each to the least loaded worker (ties: with ``locality``, for ranks that
    may be on other hosts, one already holding a file of the same connected component; then the lowest number).
    Where that leaves a share over ``BALANCE`` times the mean, or a worker idle, and ``split`` allows, files are
    split instead (``_split``), if that brings the largest share within ``BALANCE`` of the mean, or down by more
    than a tenth. Empty shares are dropped.
    """
    weight = file_bytes(report)
    todo = sorted(weight if files is None else files)
    whole = _whole_files(report, weight, todo, workers, locality)
    loads = [sum(weight.get(f, 0) for f in s) for s in whole]
    total = sum(loads)
    balanced = len(whole) == workers and max(loads) <= BALANCE * total / workers
    kept = [Portion(files=tuple(s), bytes=n) for s, n in zip(whole, loads, strict=True)]
    if workers <= 1 or not todo or not split or balanced or total == 0:
        return kept
    dtypes = report.target.dtypes
    cut = _split(_item_bytes(report), weight, todo, workers,
                 {it: itemsize(dtypes.get(it, "uint8")) for it in report.dst_files})
    # a split file costs the parent a read back: worth it where shares come within BALANCE of the mean, or else
    # where the largest shrinks by more than that slack
    most = max(p.bytes for p in cut)
    return cut if most < max(loads) and (most <= BALANCE * total / workers or BALANCE * most < max(loads)) else kept


def _whole_files(report: PlanReport, weight: Mapping[str, int], todo: list[str], workers: int,
                 locality: bool) -> list[list[str]]:
    if workers <= 1 or len(todo) <= 1:
        return [todo] if todo else []
    component = {f: k for k, (_, dsts) in enumerate(report.work_units()) for f in dsts} if locality else {}
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


def _split(items: Mapping[str, list[tuple[Item, int]]], weight: Mapping[str, int], todo: list[str],
           workers: int, sizes: Mapping[Item, int]) -> list[Portion]:
    """Shares that split as few files as balance needs.

    Largest first, a file goes whole to the least loaded worker if that keeps it within ``BALANCE`` of the
    mean; the files left over are split: their stored tensors, in order, fill what each worker lacks of the
    bound, the emptiest worker first (each file split between neighbours, as in McNaughton's wrap-around rule): the
    least bound on any share that cuts at tensors allow (found by bisection; a check packs worker by worker,
    jumping over the tensors' prefix sums). Where that bound passes ``BALANCE`` of the mean (a tensor larger
    than the slack), tensors are cut too, at elements (``_cut_inside``).
    """
    mean = sum(weight[f] for f in todo) / workers
    loads, mine = [0] * workers, [defaultdict(list) for _ in range(workers)]
    rest = []
    for f in sorted(todo, key=lambda f: (-weight[f], f)):
        k = min(range(workers), key=lambda k: (loads[k], k))
        if loads[k] + weight[f] <= BALANCE * mean:
            loads[k] += weight[f]
            mine[k][f] = [it for it, _ in items[f]]
        else:
            rest.append(f)
    seq = [(f, item, n) for f in sorted(rest) for item, n in items[f]]
    ends = list(itertools.accumulate(n for _, _, n in seq))

    order = sorted(range(workers), key=lambda k: (loads[k], k))  # the emptiest first: large tensors fit there

    def cuts(most: int) -> list[int]:  # where each worker's run ends (exclusive), or [] if ``most`` is too little
        out, at = [], 0
        for k in order:
            start = ends[at - 1] if at else 0
            out.append(at := bisect.bisect_right(ends, start + max(0, most - loads[k]), lo=at))
        return out if at == len(seq) else []

    lo, hi = math.ceil(mean), max(loads) + (ends[-1] if ends else 0)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cuts(mid) else (mid + 1, hi)
    pieces: list[list[tuple[str, Item, int, int]]] = [[] for _ in range(workers)]
    if lo <= BALANCE * mean or not seq:
        at = 0
        for k, stop in zip(order, cuts(lo), strict=True):
            for f, item, n in seq[at:stop]:
                mine[k][f].append(item)
                loads[k] += n
            at = stop
    else:  # a tensor larger than the slack: cut inside tensors too
        _cut_inside(seq, ends, [(k, max(0.0, mean - loads[k])) for k in order], mean, sizes, mine, loads, pieces)
    return [Portion(files=tuple(sorted(m)), bytes=loads[k], pieces=tuple(pieces[k]),
                    split=tuple((f, tuple(its)) for f, its in sorted(m.items())
                                if len(its) != len(items[f]) or any(p[0] == f for p in pieces[k])))
            for k, m in enumerate(mine) if m]


def _cut_inside(seq: list[tuple[str, Item, int]], ends: list[int], rooms: list[tuple[int, float]], mean: float,
                sizes: Mapping[Item, int], mine: list[dict[str, list[Item]]], loads: list[int],
                pieces: list[list[tuple[str, Item, int, int]]]) -> None:
    """The tensors of ``seq``, in order, cut into a run per worker (``rooms``: each worker and what it lacks of
    the mean, scaled to what ``seq`` holds) at the cut's own element where no tensor boundary lies within half
    the slack of it: such a tensor is written in pieces (``pieces``: file, tensor, first and end element)."""
    total = ends[-1]
    scale = total / (sum(r for _, r in rooms) or 1)
    cuts = [0]
    for bound in itertools.accumulate(r * scale for _, r in rooms[:-1]):
        j = min(bisect.bisect_left(ends, bound), len(seq) - 1)  # the tensor the cut falls in
        start = ends[j] - seq[j][2]
        near = min((start, ends[j]), key=lambda b: abs(b - bound))
        size = sizes[seq[j][1]]
        cut = near if abs(near - bound) <= (BALANCE - 1) / 2 * mean else start + int(bound - start) // size * size
        cuts.append(max(cuts[-1], min(total, cut)))
    cuts.append(total)
    for (k, _), a, b in zip(rooms, cuts[:-1], cuts[1:], strict=True):
        for j in range(bisect.bisect_left(ends, a), len(seq)):
            f, item, n = seq[j]
            start = ends[j] - n
            if start >= b and not (n == 0 and start == b == total):
                break
            lo, hi = max(a, start), min(b, ends[j])
            if hi <= lo and n:
                continue
            mine[k][f].append(item)
            loads[k] += hi - lo
            if hi - lo != n:
                pieces[k].append((f, item, (lo - start) // sizes[item], (hi - start) // sizes[item]))


def share_table(report: PlanReport, workers: int) -> dict[str, object]:
    """The shares ``workers`` workers would get, for ``reshard plan``: per worker its files (those it writes in
    part, with their bytes and tensors, whole or in pieces) and bytes, and the largest share over the mean."""
    weight = _item_bytes(report)
    sizes = {it: itemsize(report.target.dtypes.get(it, "uint8")) for it in report.dst_files}
    parts = shares(report, workers)
    rows = [{"files": list(p.files), "bytes": p.bytes,
             "parts": [{"file": f, "bytes": _part_bytes(weight[f], its, p, sizes), "tensors": len(its)}
                       for f, its in p.split]} for p in parts]
    mean = sum(r["bytes"] for r in rows) / len(rows) if rows else 0
    return {"workers": len(rows), "shares": rows,
            "largest_over_mean": round(max(r["bytes"] for r in rows) / mean, 3) if mean else 1.0}


def _part_bytes(weight: list[tuple[Item, int]], its: tuple[Item, ...], p: Portion, sizes: Mapping[Item, int]) -> int:
    piece = {it: (hi - lo) * sizes[it] for _, it, lo, hi in p.pieces}
    mine = set(its)
    return sum(piece.get(it, n) for it, n in weight if it in mine)


def worker_count(report: PlanReport, workers: int | str, files: Collection[str]) -> int:
    """How many workers to start: ``workers`` itself (never more than there are stored tensors to write), or
    for ``auto`` as many as help: at most one per core and per ``MIN_SHARE_BYTES`` of destination bytes, and
    one alone where the copies average under ``MIN_COPY_BYTES``."""
    if isinstance(workers, bool) or (workers != "auto" and (not isinstance(workers, int) or workers < 1)):
        raise ReshardError(f"workers must be 'auto' or an integer of at least 1, got {workers!r}")
    if workers == 1:  # nothing to weigh (100,000 stored tensors take some 0.3 s)
        return 1
    items = _item_bytes(report)
    tensors = sum(len(items.get(f, ())) for f in files)
    if workers == "auto":
        total = sum(n for f in files for _, n in items.get(f, ()))
        if total < MIN_COPY_BYTES * len(report.plan.copies):
            return 1
        return max(1, min(usable_cores(), tensors, total // MIN_SHARE_BYTES))
    return max(1, min(workers, tensors))


def worker_shares(report: PlanReport, parts: list[Portion], out: Path, window: int,
                  segments: Mapping[Item, object] | None = None, *, direct_io: bool = True) -> list[Share]:
    """What each worker is sent: its files, the plan's copies into the tensors it writes and where those read,
    the target, and for the files it writes in part, the tensors the other workers write. ``segments``: the
    conversion's (``segments_of``), when the caller has them; ``direct_io``: as ``convert``'s."""
    owners = _owners(parts)
    copies: list[list] = [[] for _ in parts]
    for c in report.plan.copies:
        for k in owners(report.dst_file(c.dst), c.dst):
            copies[k].append(c)
    if segments is None:
        segments = segments_of(logical_sources(report.target.layout, report.target.dtypes))
    write = get_format(report.target.format).write
    items = _item_bytes(report)
    result = []
    for k, p in enumerate(parts):
        split = dict(p.split)
        skipped: list[Item] = []  # the split files' tensors the other workers write
        for f, its in p.split:
            mine = set(its)
            skipped += [it for it, _ in items[f] if it not in mine]
        skip = frozenset(skipped)
        where: dict[Item, object] = {c.src: report.source.where[c.src] for c in copies[k]}
        result.append(Share(write=write, target=report.target, out=out, files=p.files, copies=tuple(copies[k]),
                            where=where, window_bytes=window, split=tuple(split), skip=skip, direct_io=direct_io,
                            pieces={it: (lo, hi) for _, it, lo, hi in p.pieces},
                            segments={it: v for it, v in segments.items() if k in owners(_file_of(report, it), it)}))
    return result


def _file_of(report: PlanReport, item: Item) -> str | None:
    path = report.dst_files.get(item)
    return None if path is None else str(path)


def copies_per_share(report: PlanReport, parts: list[Portion]) -> list[int]:
    """How many of the plan's copies each share holds (what a worker's slice of the plan weighs)."""
    counts = [0] * len(parts)
    owners = _owners(parts)
    for c in report.plan.copies:
        for k in owners(report.dst_file(c.dst), c.dst):
            counts[k] += 1
    return counts


def _owners(parts: list[Portion]) -> Callable[[str | None, Item], list[int]]:
    """``owners(file, item)``: the numbers of the shares that write that stored tensor (several for one written
    in pieces)."""
    files: dict[str, int] = {}
    tensors: dict[tuple[str, Item], list[int]] = defaultdict(list)
    for k, p in enumerate(parts):
        files.update({f: k for f in p.files if f not in dict(p.split)})
        for f, its in p.split:
            for it in its:
                tensors[(f, it)].append(k)
    return lambda f, item: [] if f is None else [files[f]] if f in files else tensors.get((f, item), [])


def split_items(report: PlanReport, parts: list[Portion]) -> dict[str, list[Item]]:
    """The stored tensors of each file split between workers."""
    items = _item_bytes(report)
    return {f: [it for it, _ in items[f]] for f in sorted({f for p in parts for f, _ in p.split})}
