"""Carry out a plan against files: read only the spans the plan names, window by window.

The only module besides the format adapters that opens checkpoint files.
``ByteReader`` is the whole read surface (``pread`` on cached descriptors,
every byte counted); ``PlanFill`` answers a writer's ``fill(item, lo, hi)``
by cutting the plan's copies into that window of the destination item and
reading just their source regions. Memory is one window plus the source
regions feeding it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from reshard.arrays import view
from reshard.errors import CheckpointFormatError
from reshard.formats.base import Located, itemsize
from reshard.geometry import restrict
from reshard.layout import Item
from reshard.planner import Copy, Plan

__all__ = ["ByteReader", "PlanFill", "uint_dtype"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# Read a strided region's whole byte range in one call when the gaps cost at most
# this factor over the bytes needed; otherwise read its contiguous runs one by one.
_DENSE_ENOUGH = 2.0
# A read this small costs about the same whatever its gaps: take the whole span.
_SMALL_READ = 4096


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
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
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


class PlanFill:
    """``fill(item, lo, hi)`` for a format writer, backed by a plan and source files.

    Args:
      plan: the copy plan.
      where: where each source item's bytes are (``Source.where``).
      reader: the byte reader (shared, so bytes read add up across files).
    """

    def __init__(self, plan: Plan, where: Mapping[Item, Located], reader: ByteReader) -> None:
        self.where = where
        self.reader = reader
        self._copies: dict[Item, list[Copy]] = defaultdict(list)
        for c in plan.copies:
            self._copies[c.dst].append(c)
        self._extents: dict[Item, tuple[np.ndarray, np.ndarray]] = {}
        self.dtypes: dict[Item, str] = {}
        for dst, copies in self._copies.items():
            starts = np.array([c.dst_offset for c in copies], dtype=np.int64)
            ends = np.array([c.dst_offset + sum((n - 1) * s for n, s in zip(c.lengths, c.dst_strides)) + 1 for c in copies], dtype=np.int64)
            self._extents[dst] = (starts, ends)
            kinds = {where[c.src].dtype for c in copies}
            if len(kinds) > 1:
                raise CheckpointFormatError(f"{dst} would mix source dtypes {sorted(kinds)}")
            self.dtypes[dst] = kinds.pop()
        self.bytes_written = 0

    def dtype_of(self, item: Item, default: str) -> str:
        return self.dtypes.get(item, default)

    def __call__(self, item: Item, lo: int, hi: int) -> memoryview:
        dtype = uint_dtype(self.dtypes.get(item, "uint8"))
        out = np.zeros(hi - lo, dtype=dtype)
        copies = self._copies.get(item)
        if copies:
            starts, ends = self._extents[item]
            for k in np.nonzero((starts < hi) & (ends > lo))[0]:
                c = copies[int(k)]
                for offs, lens, base in restrict(c.box.offsets, c.lengths, c.dst_strides, c.dst_offset, lo, hi):
                    src_base = c.src_offset + sum((o - b) * s for o, b, s in zip(offs, c.box.offsets, c.src_strides))
                    region = self.read_region(c.src, src_base, c.src_strides, lens, dtype)
                    view(out, base - lo, c.dst_strides, lens)[...] = region
        self.bytes_written += out.nbytes
        return memoryview(out).cast("B")

    def read_region(self, item: Item, base: int, strides: tuple[int, ...], lengths: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The elements of a strided region of a source item, as an array of shape ``lengths``."""
        loc = self.where.get(item)
        if loc is None:
            raise CheckpointFormatError(f"source item {item} has no location in the checkpoint")
        size = dtype.itemsize
        if size != itemsize(loc.dtype):
            raise CheckpointFormatError(f"{item}: stored as {loc.dtype}, copied as {size}-byte elements")
        last = base + sum((n - 1) * s for n, s in zip(lengths, strides))
        needed = int(np.prod(lengths))
        span = last - base + 1
        if span <= _DENSE_ENOUGH * needed or span * size <= _SMALL_READ:
            buf = np.empty(span, dtype=dtype)
            self.reader.read_into(loc.path, loc.offset + base * size, memoryview(buf).cast("B"))
            return view(buf, 0, strides, lengths)
        # Sparse: read contiguous runs (innermost dense axes) one by one.
        axes = sorted(((s, n, k) for k, (s, n) in enumerate(zip(strides, lengths)) if n > 1), reverse=True)
        run, inner = 1, []
        while axes and axes[-1][0] == run:
            s, n, k = axes.pop()
            run *= n
            inner.append(k)
        out = np.empty(lengths, dtype=dtype)
        outer = [k for _, _, k in axes]
        for idx in np.ndindex(*(lengths[k] for k in outer)):
            start = base + sum(i * strides[k] for i, k in zip(idx, outer))
            buf = np.empty(run, dtype=dtype)
            self.reader.read_into(loc.path, loc.offset + start * size, memoryview(buf).cast("B"))
            sel = [slice(None)] * len(lengths)
            for i, k in zip(idx, outer):
                sel[k] = i
            sub_lengths = tuple(lengths[k] for k in sorted(inner))
            # The run is row-major over the inner axes ordered by decreasing stride.
            order = sorted(inner, key=lambda k: -strides[k])
            block = buf.reshape(tuple(lengths[k] for k in order)) if order else buf.reshape(())
            block = np.transpose(block, [order.index(k) for k in sorted(inner)]) if order else block
            out[tuple(sel)] = block.reshape(sub_lengths)
        return out
