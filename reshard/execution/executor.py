"""Carry out a plan against files: read only the spans the plan names, window by window.

The only module besides the format adapters that opens checkpoint files.
``ByteReader`` is the whole read surface (``pread`` on cached descriptors,
every byte counted); ``PlanFill`` answers a writer's ``fill(item, lo, hi)``
by cutting the plan's copies into that window of the destination item,
collecting the contiguous runs of source bytes they need, merging runs of one
source item that touch (or nearly), and reading each merged span once. Memory
is one window plus the source spans feeding it.
"""

from __future__ import annotations

import bisect
import math
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from reshard.core.dtypes import itemsize
from reshard.core.geometry import restrict
from reshard.core.layout import Item
from reshard.core.planner import Copy, Plan
from reshard.errors import CheckpointFormatError
from reshard.execution.arrays import view
from reshard.io.smallfiles import Located

__all__ = ["ByteReader", "PlanFill", "SourceReader", "destination_dtypes", "uint_dtype"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# Runs of one source item closer than this many bytes are read as one span. Zero:
# read exactly the bytes needed (overlapping and touching runs still merge); raise
# it to trade gap bytes for fewer syscalls on sparse (transposed) layouts.
_MERGE_GAP = 0

# A source run of at least this many bytes that is contiguous in the destination too is read
# straight into the destination window (no gather buffer, no second copy).
_DIRECT_RUN = 256 << 10


def uint_dtype(dtype: str) -> np.dtype:
    """An unsigned integer dtype of the same size: copies move bits, never values."""
    size = itemsize(dtype)
    if size not in _UINT:
        raise CheckpointFormatError(f"dtype '{dtype}' of {size} bytes cannot be copied element-wise")
    return np.dtype(_UINT[size])


class ByteReader:
    """Reads byte ranges of files and counts them; the whole read surface.

    Paths are kept open (a checkpoint has a bounded number of files) and read
    with ``os.pread`` so concurrent windows never share a file position.
    """

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0
        self.reads = 0

    def read_into(self, path: Path, offset: int, out: memoryview) -> None:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointFormatError(f"{path}: cannot open ({e.strerror})") from None
            self._fds[path] = fd
        if offset < 0:
            raise CheckpointFormatError(f"{path}: a read at byte {offset}, before the file's start")
        done = 0
        while done < len(out):
            try:
                n = os.preadv(fd, [out[done:]], offset + done)
            except (OSError, OverflowError) as e:  # an offset past what the OS can address
                raise CheckpointFormatError(f"{path}: cannot read {len(out) - done} bytes at byte {offset + done} "
                                            f"({getattr(e, 'strerror', None) or e})") from None
            if n == 0:
                raise CheckpointFormatError(f"{path}: file ends at byte {offset + done}, expected {len(out) - done} more bytes")
            done += n
        self.bytes_read += len(out)
        self.reads += 1

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ByteReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    for c in plan.copies:
        dt = where[c.src].dtype
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
    """Strided regions of source items, read with as few reads as their runs allow.

    Args:
      where: where each source item's bytes are (``Source.where``).
      reader: the byte reader (shared, so bytes read add up across files).
    """

    def __init__(self, where: Mapping[Item, Located], reader: ByteReader) -> None:
        self.where = where
        self.reader = reader

    def _read_direct(self, region: _Region, out: np.ndarray, at: int, dst_strides: tuple[int, ...]) -> bool:
        """Read a region straight into the destination window when each of its contiguous source runs is
        contiguous there too and long enough to be worth its own read; False to gather it instead."""
        outer, inner, run = region.split()
        if run * out.itemsize < _DIRECT_RUN or len(outer) > 1:
            return False
        # Inner axes must keep the same compact layout in the destination.
        step = 1
        for k in reversed(inner):
            if dst_strides[k] != step:
                return False
            step *= region.lengths[k]
        loc = self.where.get(region.item)
        if loc is None or out.itemsize != itemsize(loc.dtype):
            return False
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

    def read_region(self, item: Item, base: int, strides: tuple[int, ...], lengths: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The elements of a strided region of a source item, as an array of shape ``lengths``."""
        region = _Region(item, base, strides, lengths)
        return self._read([region], dtype).get(region)

    def _read(self, regions: list[_Region], dtype: np.dtype) -> _Window:
        """Read what ``regions`` need: their contiguous runs, merged per source item, each byte once."""
        runs: dict[Item, list[tuple[int, int]]] = defaultdict(list)
        for r in regions:
            loc = self.where.get(r.item)
            if loc is None:
                raise CheckpointFormatError(f"source item {r.item} has no location in the checkpoint")
            if dtype.itemsize != itemsize(loc.dtype):
                raise CheckpointFormatError(f"{r.item}: stored as {loc.dtype}, copied as {dtype.itemsize}-byte elements")
            starts, run = r.runs()
            runs[r.item] += [(int(s), int(s) + run) for s in starts]
        window = _Window(dtype)
        gap = _MERGE_GAP // dtype.itemsize  # 0: only overlapping or touching runs merge
        for item, spans in runs.items():
            spans.sort()
            merged = [list(spans[0])]
            for a, b in spans[1:]:
                if a <= merged[-1][1] + gap:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            loc = self.where[item]
            for a, b in merged:
                buf = np.empty(b - a, dtype=dtype)
                self.reader.read_into(loc.path, loc.offset + a * dtype.itemsize, memoryview(buf).cast("B"))
                window.add(item, a, buf)
        return window


class PlanFill(SourceReader):
    """``fill(item, lo, hi)`` for a format writer, backed by a plan and source files.

    Args:
      plan: the copy plan.
      where: where each source item's bytes are (``Source.where``).
      reader: the byte reader (shared, so bytes read add up across files).
      dtypes: each destination item's dtype, when the caller has them (``destination_dtypes``); a plan
        holding only some destination items' copies (a worker's share) needs them.
    """

    def __init__(self, plan: Plan, where: Mapping[Item, Located], reader: ByteReader,
                 dtypes: Mapping[Item, str] | None = None) -> None:
        super().__init__(where, reader)
        self._copies: dict[Item, list[Copy]] = defaultdict(list)
        for c in plan.copies:
            self._copies[c.dst].append(c)
        self._extents: dict[Item, tuple[np.ndarray, np.ndarray]] = {}
        for dst, copies in self._copies.items():
            starts = np.array([c.dst_offset for c in copies], dtype=np.int64)
            ends = np.array([c.dst_offset + sum((n - 1) * s for n, s in zip(c.lengths, c.dst_strides)) + 1 for c in copies], dtype=np.int64)
            self._extents[dst] = (starts, ends)
        self.dtypes = destination_dtypes(plan, where) if dtypes is None else dtypes

    def __call__(self, item: Item, lo: int, hi: int) -> memoryview:
        dtype = uint_dtype(self.dtypes.get(item, "uint8"))
        pieces = []
        copies = self._copies.get(item)
        if copies:
            starts, ends = self._extents[item]
            for k in np.nonzero((starts < hi) & (ends > lo))[0]:
                c = copies[int(k)]
                for offs, lens, base in restrict(c.box.offsets, c.lengths, c.dst_strides, c.dst_offset, lo, hi):
                    src_base = c.src_offset + sum((o - b) * s for o, b, s in zip(offs, c.box.offsets, c.src_strides))
                    pieces.append((_Region(c.src, src_base, c.src_strides, lens), base - lo, c.dst_strides))
        covered = sum(math.prod(r.lengths) for r, _, _ in pieces)  # pieces never overlap in the destination
        out = np.empty(hi - lo, dtype=dtype) if covered == hi - lo else np.zeros(hi - lo, dtype=dtype)
        gathered = []
        for region, at, strides in pieces:
            if not self._read_direct(region, out, at, strides):
                gathered.append((region, at, strides))
        if gathered:
            window = self._read([r for r, _, _ in gathered], dtype)
            for region, at, strides in gathered:
                view(out, at, strides, region.lengths)[...] = window.get(region)
        return memoryview(out).cast("B")


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

    def runs(self) -> tuple[np.ndarray, int]:
        outer, _, run = self.split()
        starts = np.array([self.base], dtype=np.int64)
        for k in outer:
            starts = (starts[:, None] + np.arange(self.lengths[k], dtype=np.int64) * self.strides[k]).ravel()
        return starts, run


class _Window:
    """Source bytes read for one destination window: merged spans per item, by start element."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.spans: dict[Item, tuple[list[int], list[np.ndarray]]] = defaultdict(lambda: ([], []))

    def add(self, item: Item, start: int, buf: np.ndarray) -> None:
        starts, bufs = self.spans[item]
        starts.append(start)
        bufs.append(buf)

    def _locate(self, item: Item, start: int) -> tuple[np.ndarray, int]:
        starts, bufs = self.spans[item]
        k = bisect.bisect_right(starts, start) - 1
        return bufs[k], start - starts[k]

    def get(self, r: _Region) -> np.ndarray:
        last = r.base + sum((n - 1) * s for n, s in zip(r.lengths, r.strides))
        buf, at = self._locate(r.item, r.base)
        if at + last - r.base < len(buf):  # the whole region sits in one span
            return view(buf, at, r.strides, r.lengths)
        outer, inner, run = r.split()
        out = np.empty(r.lengths, dtype=self.dtype)
        starts, _ = r.runs()
        sel: list = [slice(None)] * len(r.lengths)
        inner_shape = tuple(r.lengths[k] for k in inner)
        order = [inner.index(k) for k in sorted(inner)]
        for idx, start in zip(np.ndindex(*(r.lengths[k] for k in outer)), starts):
            buf, at = self._locate(r.item, int(start))
            for i, k in zip(idx, outer):
                sel[k] = i
            block = buf[at : at + run].reshape(inner_shape).transpose(order)
            out[tuple(sel)] = block.reshape(tuple(r.lengths[k] for k in sorted(inner)))
        return out
