"""Carry out a plan against files: read only the spans the plan names, window by window.

Reads go through ``ByteReader`` (``reshard.execution.reader``), the whole read
surface; ``PlanFill`` answers a writer's ``fill(item, lo, hi)`` (or fills a
caller's buffer in place, ``fill_into``, or a run of small items side by side
in one buffer, ``fill_run``) by cutting the plan's copies into that window of
the destination item and reading the source bytes they need in few, large reads:

- a run of source bytes at least ``_DIRECT_RUN`` long that is contiguous in
  the destination too is read straight into the destination;
- the other runs are grouped by file and coalesced (``Coalescing``, in
  ``reshard.execution.coalescing``): runs that
  overlap or touch merge, and runs apart by a gap of at most ``max_gap`` merge
  too, smallest gap first, while the gap bytes read along stay within the
  slack (of the whole plan's bytes, for a ``PlanFill``). A merged span is one
  read: a vectored read that puts each run in its place in the destination
  and the gaps in a small discard buffer, or, where the destination holds the
  runs in another order (a transposed store) or two copies read the same
  bytes, a read into a reused buffer from which the pieces are copied out;
- in a ``fill_run``, every contiguous source run contiguous in the destination
  too is read there, one read call for the runs that touch in their file
  (adjacent tensors of a safetensors file, the one after the other).

Memory is the destination window plus, per thread, the discard buffer and one
buffer of the largest span read through it (at most the window without slack,
at most ``max_span`` with it). Fills of one
``PlanFill`` may run in several threads at once (reads release the GIL): each
thread has its own buffers, and the reader's counts and the gap budget are locked.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from reshard.core.dtypes import itemsize
from reshard.core.geometry import restrict, row_major_strides
from reshard.core.layout import Item
from reshard.core.planner import Copy, Plan
from reshard.errors import CheckpointFormatError, ReshardError
from reshard.execution.arrays import view
from reshard.execution.coalescing import Coalescing, GapBudget, coalesce, gap_sizes, runs_in_place, segments
from reshard.execution.reader import ByteReader
from reshard.io.smallfiles import Located

__all__ = ["ByteReader", "PlanFill", "SourceReader", "destination_dtypes", "uint_dtype"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# A source run of at least this many bytes that is contiguous in the destination too is read
# straight into the destination window, on its own.
_DIRECT_RUN = 256 << 10

_DISCARD = 256 << 10  # the buffer gap bytes are read into (a longer gap takes several descriptors)
_BUFFER_STEP = 1 << 20


def uint_dtype(dtype: str) -> np.dtype:
    """An unsigned integer dtype of the same size: copies move bits, never values."""
    size = itemsize(dtype)
    if size not in _UINT:
        raise CheckpointFormatError(f"dtype '{dtype}' of {size} bytes cannot be copied element-wise")
    return np.dtype(_UINT[size])


def destination_dtypes(plan: Plan, where: Mapping[Item, Located]) -> dict[Item, str]:
    """Each destination item's dtype: that of its sources (copies move bits, so they must agree).

    An item of a tensor with no elements (``ItemInfo.tensor``) gets no copies;
    it takes the dtype of the source's item of the same tensor and state (of
    the tensor in any state, when the source keeps it in another). A shard of
    pure padding (the last tp rank of a padded vocab) gets none either; it
    takes the dtype of the items with the same key and state on other ranks,
    else of its state, else float32.
    """
    dtypes: dict[Item, str] = {}
    last_src = last_dst = last_dt = None
    for c in plan.copies:  # copies come in runs of one item: each looked up once per run
        if c.src is not last_src:
            last_src = c.src
            dt = where[last_src].dtype
        if c.dst is last_dst and dt == last_dt:
            continue
        last_dst, last_dt = c.dst, dt
        if dtypes.setdefault(c.dst, dt) != dt:
            raise CheckpointFormatError(f"{c.dst} would mix source dtypes {sorted({dtypes[c.dst], dt})}")
    by_key: dict[tuple[str, str], str] = {}
    by_state: dict[str, str] = {}
    for it, dt in dtypes.items():
        by_key.setdefault((it.state, it.key), dt)
        by_state.setdefault(it.state, dt)
    empty: dict[tuple[str, str | None], str] = {}
    for it, info in plan.src_items.items():
        if info.tensor is not None and it in where:
            empty.setdefault((info.tensor, it.state), where[it].dtype)
            empty.setdefault((info.tensor, None), where[it].dtype)
    for it, info in plan.dst_items.items():
        if it not in dtypes:
            dtypes[it] = (empty.get((info.tensor, it.state)) or empty.get((info.tensor, None))
                          or by_key.get((it.state, it.key)) or by_state.get(it.state, "float32"))
    return dtypes


class SourceReader:
    """Strided regions of source items, read with as few reads as their runs and the coalescing allow.

    Args:
      where: where each source item's bytes are (``Source.where``).
      reader: the byte reader (shared, so bytes read add up across files).
      coalescing: how runs of one file merge into one read.
      budget: the gap bytes all fills may read through together; None: the coalescing's slack per fill.
    """

    def __init__(self, where: Mapping[Item, Located], reader: ByteReader, coalescing: Coalescing | None = None,
                 budget: GapBudget | None = None) -> None:
        self.where = where
        self.reader = reader
        self.coalescing = coalescing or Coalescing()
        self.budget = budget
        self._local = threading.local()  # each thread's span and discard buffers

    def read_region(self, item: Item, base: int, strides: tuple[int, ...], lengths: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The elements of a strided region of a source item, as an array of shape ``lengths``."""
        out = np.empty(math.prod(lengths), dtype=dtype)
        self._fill([(_Region(item, base, strides, lengths), 0, row_major_strides(lengths))], out)
        return out.reshape(lengths)

    def _fill(self, pieces: list[tuple[_Region, int, tuple[int, ...]]], out: np.ndarray) -> None:
        """Read each piece ``(source region, destination offset, destination strides)`` into ``out``."""
        alone = len(pieces) == 1  # nothing to coalesce it with: a contiguous one is one read, however short
        gathered = [p for p in pieces if not self._read_direct(p[0], out, p[1], p[2], alone)]
        if gathered:
            self._gather(gathered, out)

    def _located(self, item: Item, size: int) -> Located:
        loc = self.where.get(item)
        if loc is None:
            raise CheckpointFormatError(f"source item {item} has no location in the checkpoint")
        if size != itemsize(loc.dtype):
            raise CheckpointFormatError(f"{item}: stored as {loc.dtype}, copied as {size}-byte elements")
        return loc

    def _direct(self, region: _Region, size: int, dst_strides: tuple[int, ...],
                alone: bool = False) -> tuple[list[int], list[int], int] | None:
        """The region's ``split()`` where each contiguous source run of it (of ``size``-byte elements) is contiguous
        in the destination too and long enough to be read there on its own (any length if the region is one run
        and ``alone`` in its window); None where it is not."""
        parts = outer, inner, run = region.split()
        short = run * size < _DIRECT_RUN and (outer or not alone)  # one run alone in its window: read however short
        if short or len(outer) > 1 or not _compact(inner, region.lengths, dst_strides):
            return None
        loc = self.where.get(region.item)
        return parts if loc is not None and size == itemsize(loc.dtype) else None

    def _read_direct(self, region: _Region, out: np.ndarray, at: int, dst_strides: tuple[int, ...],
                     alone: bool = False) -> bool:
        """Read a region straight into the destination window when ``_direct`` allows; False to gather it instead."""
        parts = self._direct(region, out.itemsize, dst_strides, alone)
        if parts is None:
            return False
        outer, _, run = parts
        loc = self.where[region.item]
        size = out.itemsize
        flat = memoryview(out).cast("B")
        if not outer:
            self.reader.read_into(loc.path, loc.offset + region.base * size, flat[at * size:(at + run) * size])
            return True
        k = outer[0]
        for i in range(region.lengths[k]):
            src, dst = region.base + i * region.strides[k], at + i * dst_strides[k]
            self.reader.read_into(loc.path, loc.offset + src * size, flat[dst * size:(dst + run) * size])
        return True

    def _runs(self, pieces: list[tuple[_Region, int, tuple[int, ...]]], size: int) -> tuple[dict, dict, list[int], int]:
        """Per file, the pieces reading it and their runs ``(first bytes, length in bytes)``; each piece's first
        byte in its file; and the bytes the runs hold."""
        pieces_of: dict[Path, list[int]] = defaultdict(list)
        runs: dict[Path, list[tuple[np.ndarray, int]]] = defaultdict(list)
        firsts: list[int] = []
        needed = 0
        for k, (region, _, _) in enumerate(pieces):
            loc = self._located(region.item, size)
            starts, run = region.runs()
            pieces_of[loc.path].append(k)
            runs[loc.path].append((loc.offset + starts * size, run * size))
            firsts.append(loc.offset + region.base * size)
            needed += len(starts) * run * size
        return pieces_of, runs, firsts, needed

    def _gather(self, pieces: list[tuple[_Region, int, tuple[int, ...]]], out: np.ndarray) -> None:
        """Read what ``pieces`` need as coalesced spans per file, and put each piece in place."""
        size = out.itemsize
        pieces_of, runs, firsts, needed = self._runs(pieces, size)
        spans = coalesce(runs, needed, self.coalescing, self.budget)
        for path, (starts, ends, gaps) in spans.items():
            work: list[list[tuple]] = [[] for _ in starts]
            for k in pieces_of[path]:
                region, at, dst_strides = pieces[k]
                _assign(firsts[k], region.strides, region.lengths, at, dst_strides, size, starts, ends, work)
            for start, end, gap, subs in zip(starts, ends, gaps, work):
                if not self._read_in_place(path, start, end, gap, subs, out):
                    self._read_span(path, start, end, gap, subs, out)

    def _read_in_place(self, path: Path, start: int, end: int, gap: int, subs: list[tuple], out: np.ndarray) -> bool:
        """Read bytes ``[start, end)`` of ``path`` (``gap`` of them between the runs) with one vectored read that
        puts each run of ``subs`` in its place in ``out`` and the gaps in the discard buffer; False (nothing read)
        where the runs are short, not laid out the same in the destination, or read twice."""
        size = out.itemsize
        src_parts, dst_parts = [], []
        run = None
        for first, strides, lengths, at, dst_strides in subs:
            got = runs_in_place(first, strides, lengths, at * size, dst_strides, size, self.coalescing.in_place_run)
            if got is None:
                return False
            s, d, n = got
            if run is None:
                run = n
            elif n != run:
                return False
            src_parts.append(s)
            dst_parts.append(d)
        src = np.concatenate(src_parts) if len(src_parts) > 1 else src_parts[0]
        dst = np.concatenate(dst_parts) if len(dst_parts) > 1 else dst_parts[0]
        if len(src) > 1:
            order = np.argsort(src, kind="stable")
            src, dst = src[order], dst[order]
            if (src[1:] < src[:-1] + run).any():  # two pieces read the same bytes
                return False
        flat = memoryview(out).cast("B")
        discard = self._discard()
        buffers: list[memoryview] = []
        pos = start
        for s, d in zip(src.tolist(), dst.tolist()):
            while pos < s:
                n = min(s - pos, _DISCARD)
                buffers.append(discard[:n])
                pos += n
            buffers.append(flat[d:d + run])
            pos = s + run
        if pos != end:
            raise RuntimeError(f"span [{start}, {end}) of {path} ends at byte {pos}")  # a bug, not the data
        self.reader.read_vectored(path, start, buffers, gap)
        return True

    def _read_span(self, path: Path, start: int, end: int, gap: int, subs: list[tuple], out: np.ndarray) -> None:
        """Read bytes ``[start, end)`` of ``path`` (``gap`` of them between the runs) once into the span buffer and
        copy the pieces ``subs`` (each
        ``(first byte, source strides, lengths, destination offset, destination strides)``, strides in
        elements) out of it."""
        size = out.itemsize
        n = end - start
        buf = getattr(self._local, "span", None)
        if buf is None or len(buf) < n:  # grown to the largest span read, never shrunk
            buf = self._local.span = np.empty(-(-n // _BUFFER_STEP) * _BUFFER_STEP, dtype=np.uint8)
        self.reader.read_into(path, start, memoryview(buf)[:n], gap)
        for first, strides, lengths, at, dst_strides in subs:
            src = np.ndarray(lengths, dtype=out.dtype, buffer=buf, offset=first - start,
                             strides=tuple(s * size for s in strides))
            view(out, at, dst_strides, lengths)[...] = src

    def _discard(self) -> memoryview:
        buf = getattr(self._local, "discard", None)
        if buf is None:
            buf = self._local.discard = memoryview(bytearray(_DISCARD))
        return buf


def _compact(inner: list[int], lengths: tuple[int, ...], dst_strides: tuple[int, ...]) -> bool:
    """Whether the inner axes of a source run (``_Region.split``) keep the same compact layout in the destination."""
    step = 1
    for k in reversed(inner):
        if dst_strides[k] != step:
            return False
        step *= lengths[k]
    return True


def _assign(first: int, strides: tuple[int, ...], lengths: tuple[int, ...], at: int, dst_strides: tuple[int, ...],
            size: int, starts: list[int], ends: list[int], work: list[list[tuple]]) -> None:
    """Add a region (its first byte in the file, element strides and lengths; its destination offset and
    strides) to the work of the span that holds it, or, when it straddles spans, its slices along its
    outermost axis, each to its own (every contiguous run lies inside one span)."""
    last = first + (sum((n - 1) * s for n, s in zip(lengths, strides)) + 1) * size
    j = bisect.bisect_right(starts, first) - 1
    if last <= ends[j]:
        work[j].append((first, strides, lengths, at, dst_strides))
        return
    k = max(range(len(lengths)), key=lambda a: (lengths[a] > 1, strides[a]))
    if lengths[k] == 1:
        raise RuntimeError(f"a run of {last - first} bytes at byte {first} lies in no span read")  # a bug, not the data
    one = lengths[:k] + (1,) + lengths[k + 1:]
    for i in range(lengths[k]):
        _assign(first + i * strides[k] * size, strides, one, at + i * dst_strides[k], dst_strides, size, starts, ends, work)


class PlanFill(SourceReader):
    """``fill(item, lo, hi)`` for a format writer, backed by a plan and source files.

    Args:
      plan: the copy plan.
      where: where each source item's bytes are (``Source.where``).
      reader: the byte reader (shared, so bytes read add up across files).
      dtypes: each destination item's dtype, when the caller has them (``destination_dtypes``); a plan
        holding only some destination items' copies (a worker's share) needs them.
      coalescing: how runs of one source file merge into one read; its slack is taken over the whole
        plan (every window of it, filled once, reads at most ``1 + slack`` times the plan's bytes).
      progress: ``progress(nbytes)`` after each window, with the bytes the plan's copies moved into it (its
        padding not counted): over a whole plan they add up to the bytes its copies move.
    """

    def __init__(self, plan: Plan, where: Mapping[Item, Located], reader: ByteReader,
                 dtypes: Mapping[Item, str] | None = None, coalescing: Coalescing | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.progress = progress
        coalescing = coalescing or Coalescing()
        needed = sum(c.numel * itemsize(where[c.src].dtype) for c in plan.copies if c.src in where) \
            if coalescing.slack > 0 else 0  # a conversion's fill reads through no gap: no need to weigh every copy
        super().__init__(where, reader, coalescing, GapBudget(int(coalescing.slack * needed)))
        self._copies: dict[Item, list[Copy]] = defaultdict(list)
        for c in plan.copies:
            self._copies[c.dst].append(c)
        self._extents: dict[Item, tuple[np.ndarray, np.ndarray]] = {}  # of the items with several copies, made on use
        # (source strides, destination strides, lengths) -> the copy's length if it is one run alike on both sides,
        # else -1: a model has few shapes, and a plan of 100,000 small tensors one copy each
        self._whole_runs: dict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], int] = {}
        self.dtypes = destination_dtypes(plan, where) if dtypes is None else dtypes

    def __call__(self, item: Item, lo: int, hi: int) -> memoryview:
        dtype = uint_dtype(self.dtypes.get(item, "uint8"))
        pieces, covered = self._pieces(item, lo, hi)
        out = np.empty(hi - lo, dtype=dtype) if covered == hi - lo else np.zeros(hi - lo, dtype=dtype)
        self._fill(pieces, out)
        if self.progress is not None and covered:
            self.progress(covered * dtype.itemsize)
        return memoryview(out).cast("B")

    def fill_into(self, item: Item, lo: int, hi: int, out: np.ndarray) -> None:
        """Fill ``out`` in place with the item's elements ``[lo, hi)`` (row-major), padding zeroed.

        ``out`` is a writable, contiguous 1-D array of ``hi - lo`` elements of the item's element
        size (any dtype of that size: the bits are copied).
        """
        dtype = uint_dtype(self.dtypes.get(item, "uint8"))
        if out.ndim != 1 or len(out) != hi - lo or out.itemsize != dtype.itemsize or not out.flags.c_contiguous \
                or not out.flags.writeable:
            raise ReshardError(f"{item}: elements [{lo}, {hi}) need a writable contiguous 1-D buffer of {hi - lo} "
                               f"{dtype.itemsize}-byte elements, got shape {out.shape} of {out.dtype}")
        out = out.view(dtype)
        pieces, covered = self._pieces(item, lo, hi)
        if covered != hi - lo:
            out[...] = 0
        self._fill(pieces, out)
        if self.progress is not None and covered:
            self.progress(covered * dtype.itemsize)

    def fill_run(self, requests: Sequence[tuple[Item, int, int, int]], buf: np.ndarray) -> None:
        """Fill several items' windows side by side in one buffer: each request ``(item, lo, hi, at)`` puts the
        item's elements ``[lo, hi)`` (row-major, padding zeroed) at byte ``at`` of ``buf``, a writable uint8 array.

        Source runs contiguous in the destination too are read straight there, the runs that touch in their
        file with one read call (a vectored read where they lie apart in ``buf``): a run of small tensors
        stored side by side is one read, not one per tensor. Other pieces are filled as ``fill_into`` fills
        them. No gap is read through: only the bytes the copies need are read.
        """
        runs: dict[Path, list[tuple[int, int, int]]] = defaultdict(list)  # (first byte in the file, bytes, at)
        moved = 0
        dtypes: dict[str, np.dtype] = {}
        whole = self._whole_runs
        for item, lo, hi, at in requests:
            name = self.dtypes.get(item, "uint8")
            dtype = dtypes.get(name)
            if dtype is None:
                dtype = dtypes[name] = uint_dtype(name)
            size = dtype.itemsize
            copies = self._copies.get(item)
            if copies is not None and len(copies) == 1:  # most small tensors: one copy, one run, all of the window
                c = copies[0]
                run = whole.get((c.src_strides, c.dst_strides, c.lengths), 0)
                if run == 0:
                    run = whole[c.src_strides, c.dst_strides, c.lengths] = _Region(
                        c.src, 0, c.src_strides, c.lengths).run_to(c.dst_strides) or -1
                if run == hi - lo and c.dst_offset == lo:
                    loc = self._located(c.src, size)
                    runs[loc.path].append((loc.offset + c.src_offset * size, run * size, at))
                    moved += run * size
                    continue
            pieces, covered = self._pieces(item, lo, hi)
            if covered != hi - lo:
                buf[at:at + (hi - lo) * size] = 0
            rest = []
            for region, first, dst_strides in pieces:
                run = region.run_to(dst_strides)
                if run is None:
                    rest.append((region, first, dst_strides))
                    continue
                loc = self._located(region.item, size)
                runs[loc.path].append((loc.offset + region.base * size, run * size, at + first * size))
            if rest:
                self._fill(rest, buf[at:at + (hi - lo) * size].view(dtype))
            moved += covered * size
        flat = memoryview(buf)
        free = min(self.coalescing.free_gap, _DISCARD)  # a gap is one discard buffer
        discard = self._discard() if free else None
        for path, found in runs.items():
            found.sort()
            k = 0
            while k < len(found):  # one read per stretch of runs that touch in the file, or lie free_gap apart
                offset = end = found[k][0]
                spans: list[list[int]] = []  # where the stretch goes in buf: [first byte, end byte] each, or
                # [-1, gap bytes] for a gap read into the discard buffer
                while k < len(found) and end <= found[k][0] <= end + free:
                    first, n, at = found[k]
                    if first > end:
                        spans.append([-1, first - end])
                    elif spans and spans[-1][1] == at and spans[-1][0] >= 0:  # next to the last run in buf too
                        spans[-1][1] = at + n
                        end += n
                        k += 1
                        continue
                    spans.append([at, at + n])
                    end = first + n
                    k += 1
                buffers = [flat[a:b] if a >= 0 else discard[:b] for a, b in spans]
                if len(buffers) == 1:
                    self.reader.read_into(path, offset, buffers[0])
                else:
                    self.reader.read_vectored(path, offset, buffers, sum(b for a, b in spans if a < 0))
        if self.progress is not None and moved:
            self.progress(moved)

    def fit_gaps(self, windows: Iterable[tuple[Item, int, int]]) -> int:
        """Make the fills of ``windows`` (each ``(item, lo, hi)``, elements) read through every gap up to the
        largest size whose gaps in all of them, smallest first, fit the slack (those up to ``free_gap`` aside,
        read through whatever the slack); returns that size in bytes.

        Each gap read through saves one read call, so the slack goes to the smallest gaps of all the
        windows (the other ranks' halves of row-split weights), not to whichever window is filled first;
        the result depends only on ``windows``, not on the order or the threads they are filled in.
        """
        gaps = []
        for item, lo, hi in windows:
            size = uint_dtype(self.dtypes.get(item, "uint8")).itemsize
            pieces = self._pieces(item, lo, hi)[0]
            pieces = [p for p in pieces if self._direct(p[0], size, p[2], len(pieces) == 1) is None]
            if pieces:
                runs = self._runs(pieces, size)[1]
                gaps.append(gap_sizes({path: segments(r) for path, r in runs.items()}))
        sizes = np.sort(np.concatenate(gaps)) if gaps else np.empty(0, dtype=np.int64)
        free = self.coalescing.free_gap  # read through whatever the slack
        sizes = sizes[(sizes > free) & (sizes <= self.coalescing.max_gap)]
        allowance = self.budget.left if self.budget is not None else 0
        n = int(np.searchsorted(np.cumsum(sizes), allowance, side="right"))
        # Gaps equal to the n-th are all read through, or none: the last size that fits whole.
        while n and n < len(sizes) and sizes[n] == sizes[n - 1]:
            n -= 1
        largest = int(sizes[n - 1]) if n else free
        self.coalescing = dataclasses.replace(self.coalescing, max_gap=largest)
        return largest

    def _pieces(self, item: Item, lo: int, hi: int) -> tuple[list[tuple[_Region, int, tuple[int, ...]]], int]:
        """The source regions of the copies into the item's elements ``[lo, hi)``, each with its offset in the
        window and its destination strides, and how many of the window's elements they cover."""
        pieces = []
        copies = self._copies.get(item)
        if copies:
            if len(copies) == 1:
                c = copies[0]
                end = _end(c)
                if lo <= c.dst_offset and end <= hi:  # the whole of one copy (a small tensor, whole or a chunk)
                    return [(_Region(c.src, c.src_offset, c.src_strides, c.lengths), c.dst_offset - lo,
                             c.dst_strides)], math.prod(c.lengths)
                hits: Iterable[int] = (0,) if c.dst_offset < hi and end > lo else ()
            else:
                extents = self._extents.get(item)
                if extents is None:  # two threads may both make it: the same arrays
                    extents = self._extents[item] = (np.array([c.dst_offset for c in copies], dtype=np.int64),
                                                      np.array([_end(c) for c in copies], dtype=np.int64))
                starts, ends = extents
                hits = np.nonzero((starts < hi) & (ends > lo))[0].tolist()
            for k in hits:
                c = copies[k]
                if c.dst_offset >= lo and _end(c) <= hi:  # the whole copy in the window: restrict's one box
                    pieces.append((_Region(c.src, c.src_offset, c.src_strides, c.lengths), c.dst_offset - lo,
                                   c.dst_strides))
                    continue
                for offs, lens, base in restrict(c.box.offsets, c.lengths, c.dst_strides, c.dst_offset, lo, hi):
                    src_base = c.src_offset + sum((o - b) * s for o, b, s in zip(offs, c.box.offsets, c.src_strides))
                    pieces.append((_Region(c.src, src_base, c.src_strides, lens), base - lo, c.dst_strides))
        covered = sum(math.prod(r.lengths) for r, _, _ in pieces)  # pieces never overlap in the destination
        return pieces, covered


def _end(c: Copy) -> int:
    """One past the last destination element a copy writes."""
    return c.dst_offset + sum((n - 1) * s for n, s in zip(c.lengths, c.dst_strides)) + 1


class _Region:
    """A strided box of a source item: element ``base + sum(i_k * strides[k])`` for ``i < lengths``."""

    __slots__ = ("base", "item", "lengths", "strides")

    def __init__(self, item: Item, base: int, strides: tuple[int, ...], lengths: tuple[int, ...]) -> None:
        self.item, self.base, self.strides, self.lengths = item, base, strides, lengths

    def split(self) -> tuple[list[int], list[int], int]:
        """(outer axes, inner axes by decreasing stride, run length): inner axes are contiguous runs."""
        axes = sorted(((s, k) for k, (s, n) in enumerate(zip(self.strides, self.lengths)) if n > 1), reverse=True)
        run, inner = 1, []
        while axes and axes[-1][0] == run:
            _, k = axes.pop()
            run *= self.lengths[k]
            inner.insert(0, k)
        return [k for _, k in axes], inner, run

    def run_to(self, dst_strides: tuple[int, ...]) -> int | None:
        """The region's length in elements if it is one contiguous run, laid out the same in a destination of
        ``dst_strides``: the whole of a small tensor, or of its chunk along its first dim; else None."""
        if self.strides == dst_strides:  # the common case, checked without sorting the axes
            run = 1
            for n, s in zip(reversed(self.lengths), reversed(self.strides)):
                if n > 1 and s != run:
                    break
                run *= n
            else:
                return run
        outer, inner, run = self.split()
        return None if outer or not _compact(inner, self.lengths, dst_strides) else run

    def runs(self) -> tuple[np.ndarray, int]:
        """The first element of each contiguous run, and the runs' length, in elements."""
        outer, _, run = self.split()
        starts = np.array([self.base], dtype=np.int64)
        for k in outer:
            starts = (starts[:, None] + np.arange(self.lengths[k], dtype=np.int64) * self.strides[k]).ravel()
        return starts, run
