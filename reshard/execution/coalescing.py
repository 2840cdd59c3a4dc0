"""Which reads a fill makes: runs of source bytes merged into spans, within a slack of gap bytes.

Pure arithmetic on byte ranges (no file is opened): ``reshard.execution.executor``
reads the spans. Every offset and length here is in bytes, within one file.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reshard.errors import ReshardError

__all__ = ["FREE_GAP", "RANK_LOAD", "Coalescing", "GapBudget", "coalesce", "conversion", "gap_sizes", "runs_in_place",
           "segments"]

# Runs at least this long, contiguous in the destination, are read in place by a vectored read;
# shorter ones (a transposed store's single elements) go through the span buffer, where one
# vectorized copy beats a buffer descriptor per run.
IN_PLACE_RUN = 512

FREE_GAP = 16 << 10
"""The gaps a conversion or a rank's load reads through whatever its slack: one more read call costs more than
copying 16 KiB from the page cache, and a disk reads that far ahead anyway."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Coalescing:
    """How fills merge reads of nearby bytes of a source file into one read.

    Runs that overlap or touch always merge. A gap between runs is read through
    (one read instead of two, the gap's bytes discarded) when it is at most
    ``max_gap`` bytes and the gaps taken so far, smallest first, stay within
    ``slack`` times the bytes needed: per fill of a ``SourceReader``, over the
    whole plan for a ``PlanFill``. Reading through the other ranks' halves of
    row-split weights (gaps of a few KiB) replaces thousands of reads by one
    (``RANK_LOAD``, what ``reshard.load`` reads with).
    """

    slack: float = 0.0
    """Bytes that may be read beyond those needed, as a fraction of them; 0 (a conversion's): every byte
    read is needed, and only runs that touch merge."""
    max_gap: int = 1 << 20
    """The largest gap, in bytes, read through."""
    in_place_run: int = IN_PLACE_RUN
    """Runs at least this many bytes long, contiguous in the destination, are read in place by one vectored read
    (a buffer per run, and per gap read through); shorter ones are read into the span buffer and copied out of it
    by one vectorized copy per piece."""
    free_gap: int = 0
    """Gaps of at most this many bytes are read through whatever the slack, without counting against it: one
    more read call costs more than copying that many bytes from the page cache, and a disk reads them ahead
    anyway. 0 (a conversion's): none."""
    max_span: int = 64 << 20
    """The largest merged read, in bytes (a single needed run longer than that is read alone, whole). With
    no slack, a span holds only needed bytes, so the span buffer is at most the window filled."""

    def __post_init__(self) -> None:
        if not self.slack >= 0 or self.max_gap < 0 or self.max_span < 1 or not 0 <= self.free_gap <= self.max_gap \
                or self.in_place_run < 1:
            raise ReshardError(f"coalescing needs slack >= 0, max_gap >= 0, 0 <= free_gap <= max_gap, max_span >= 1 and "
                               f"in_place_run >= 1, got slack={self.slack}, max_gap={self.max_gap}, "
                               f"free_gap={self.free_gap}, max_span={self.max_span}, in_place_run={self.in_place_run}")


RANK_LOAD = Coalescing(slack=0.25, free_gap=FREE_GAP, in_place_run=16 << 10)
"""How a rank's load reads: gaps of up to 16 KiB read through (the other ranks' parts of the rows of a row-split
weight), and larger ones of up to 1 MiB, smallest first, while they add at most a quarter to its bytes; runs
shorter than 16 KiB (the row pieces between such gaps) copied from the span buffer, not given a buffer each in a
vectored read: a 0.5 GiB rank load on 2 threads went from 0.101 s to 0.086 s."""


def conversion(window: int) -> Coalescing:
    """How a conversion reads: no slack, but gaps of up to ``FREE_GAP`` read through, and no merged read longer than
    the ``window`` it fills (in bytes), so that the span buffer stays within the window, as without gaps.

    The gaps are the other ranks' parts of each row of a row-split weight, and the other ranks' chunks of small
    tensors: a 2 GiB Hugging Face Llama to Megatron tp=2,pp=2 made 164,126 read calls (1.4 s of CPU in Python and
    1.6 s in the kernel) and now makes 606 (0.6 s and 1.9 s), reading 1.30 times the bytes it needs."""
    return Coalescing(free_gap=FREE_GAP, max_span=max(1, window))


class GapBudget:
    """Gap bytes that several fills (every window of a conversion or of a rank's load, on any thread) may
    read through between them, so that windows with many small gaps (row-split weights) use what windows
    without gaps leave."""

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes
        self._lock = threading.Lock()

    def take(self, ascending: np.ndarray) -> int:
        """How many of the gaps ``ascending`` (sizes in bytes, smallest first) fit; those are taken."""
        cums = np.cumsum(ascending)
        with self._lock:
            n = int(np.searchsorted(cums, self.left, side="right"))
            if n:
                self.left -= int(cums[n - 1])
        return n


def runs_in_place(first: int, strides: tuple[int, ...], lengths: tuple[int, ...], dst_first: int,
                   dst_strides: tuple[int, ...], size: int,
                   min_run: int = IN_PLACE_RUN) -> tuple[np.ndarray, np.ndarray, int] | None:
    """A region's runs that are contiguous in the source and the destination alike: their first bytes in
    the file and in the destination, and their length in bytes; None if shorter than ``min_run`` bytes."""
    axes = sorted((s, k) for k, (s, n) in enumerate(zip(strides, lengths)) if n > 1)
    run, inner = 1, 0
    while inner < len(axes) and axes[inner][0] == run and dst_strides[axes[inner][1]] == run:
        run *= lengths[axes[inner][1]]
        inner += 1
    if run * size < min_run:
        return None
    src = np.array([first], dtype=np.int64)
    dst = np.array([dst_first], dtype=np.int64)
    for s, k in axes[inner:]:
        steps = np.arange(lengths[k], dtype=np.int64)
        src = (src[:, None] + steps * (s * size)).ravel()
        dst = (dst[:, None] + steps * (dst_strides[k] * size)).ravel()
    return src, dst, run * size


def coalesce(runs: Mapping[Path, list[tuple[np.ndarray, int]]], needed: int, how: Coalescing,
              budget: GapBudget | None) -> dict[Path, tuple[list[int], list[int], list[int]]]:
    """The spans to read per file, ``(starts, ends, gap bytes)`` in bytes, sorted: the runs (each ``(first bytes, length)``)
    merged where they overlap or touch, across every gap of at most ``how.free_gap``, and across gaps of at most
    ``how.max_gap``, smallest gap first, while their bytes stay within ``how.slack * needed`` (or, given a shared
    ``budget``, within what is left of it), into spans of at most ``how.max_span`` bytes."""
    merged = {path: segments(runs[path]) for path in sorted(runs)}
    sizes = gap_sizes(merged)
    taken = sizes <= how.free_gap
    if len(sizes) and (how.slack > 0 if budget is None else budget.left > 0):
        order = np.argsort(sizes, kind="stable")
        order = order[(sizes[order] <= how.max_gap) & ~taken[order]]
        # Smallest first: the gaps that fit the allowance are a prefix of the sorted ones.
        n = budget.take(sizes[order]) if budget is not None else \
            int(np.searchsorted(np.cumsum(sizes[order]), how.slack * needed, side="right"))
        taken[order[:n]] = True
    out: dict[Path, tuple[list[int], list[int], list[int]]] = {}
    at = 0
    for path, (seg_starts, seg_ends) in merged.items():
        joined = taken[at:at + len(seg_starts) - 1]
        at += len(seg_starts) - 1
        out[path] = _spans(seg_starts.tolist(), seg_ends.tolist(), joined.tolist(), how.max_span)
    return out


def segments(runs: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Runs of one file (each ``(first bytes, length)``) merged where they overlap or touch: sorted
    ``(starts, ends)`` in bytes."""
    starts = np.concatenate([s for s, _ in runs])
    ends = np.concatenate([s + n for s, n in runs])
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    first = np.flatnonzero(np.concatenate(([True], starts[1:] > reach[:-1])))
    return starts[first], reach[np.append(first[1:] - 1, len(starts) - 1)]


def gap_sizes(segments: Mapping[Path, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The gaps between consecutive segments of each file, in bytes, file after file."""
    gaps = [starts[1:] - ends[:-1] for starts, ends in segments.values()]
    return np.concatenate(gaps) if gaps else np.empty(0, dtype=np.int64)


def _spans(starts: list[int], ends: list[int], joined: list[bool],
           max_span: int) -> tuple[list[int], list[int], list[int]]:
    """Segments merged across the gaps ``joined`` marks, each merged read at most ``max_span`` bytes: ``(starts,
    ends, gap bytes)`` of the spans."""
    if not any(joined):
        return starts, ends, [0] * len(starts)
    out_starts, out_ends, gaps = [starts[0]], [ends[0]], [0]
    for k in range(1, len(starts)):
        if joined[k - 1] and ends[k] - out_starts[-1] <= max_span:
            gaps[-1] += starts[k] - out_ends[-1]
            out_ends[-1] = ends[k]
        else:
            out_starts.append(starts[k])
            out_ends.append(ends[k])
            gaps.append(0)
    return out_starts, out_ends, gaps
