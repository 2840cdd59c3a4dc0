"""Pure box and index arithmetic.

Everything here is in **elements**, never bytes. A *box* is an axis-aligned
hyper-rectangle: per axis an offset and a length. A *strided box* adds where
its elements live in some flat, row-major index space (a stored tensor, a flat
optimizer buffer): the position of the box's first element (``base``) and a
stride per axis, so element ``(o_0 + j_0, o_1 + j_1, ...)`` of the box sits at
``base + sum(j_k * strides[k])``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reshard.errors import PlanError

__all__ = [
    "Box",
    "contains",
    "intersect",
    "restrict",
    "row_major_strides",
    "split_range",
    "subtract",
    "volume",
]


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned box; offsets and lengths in elements, one entry per axis."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        # min() of a tuple runs in C: boxes are made by the million in a large plan.
        if len(self.offsets) != len(self.lengths):
            raise PlanError(f"box rank mismatch: offsets {self.offsets} vs lengths {self.lengths}")
        if self.lengths and (min(self.lengths) <= 0 or min(self.offsets) < 0):
            raise PlanError(f"empty or negative box: offsets {self.offsets}, lengths {self.lengths}")

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    @property
    def volume(self) -> int:
        return math.prod(self.lengths)

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths)) + "]"


def volume(box: Box) -> int:
    return math.prod(box.lengths)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None."""
    offsets = []
    lengths = []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo = ao if ao > bo else bo
        hi = min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def contains(outer: Box, inner: Box) -> bool:
    for oo, ol, io, il in zip(outer.offsets, outer.lengths, inner.offsets, inner.lengths):
        if io < oo or io + il > oo + ol:
            return False
    return True


def subtract(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as disjoint boxes (at most ``2 * rank`` of them)."""
    common = intersect(a, b)
    if common is None:
        return [a]
    out: list[Box] = []
    offsets = list(a.offsets)
    lengths = list(a.lengths)
    # Peel off the slab before and after the common part, one axis at a time.
    for k in range(len(offsets)):
        lo, hi = common.offsets[k], common.offsets[k] + common.lengths[k]
        if lo > offsets[k]:
            out.append(Box(tuple(offsets), tuple(lengths[:k] + [lo - offsets[k]] + lengths[k + 1 :])))
        end = offsets[k] + lengths[k]
        if hi < end:
            out.append(Box(tuple(offsets[:k] + [hi] + offsets[k + 1 :]), tuple(lengths[:k] + [end - hi] + lengths[k + 1 :])))
        offsets[k], lengths[k] = lo, hi - lo
    return out


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return tuple(strides)


def split_range(extent: int, parts: int, index: int, mode: str = "even", widths: tuple[int, ...] = ()) -> tuple[int, int]:
    """The ``[lo, hi)`` range (elements) that part ``index`` of ``parts`` holds.

    Modes:
      ``even``   -- ``extent`` must divide by ``parts``; the caller checks and reports.
      ``chunk``  -- ``torch.chunk`` semantics: pieces of ``ceil(extent / parts)``, the
                    last ones shorter or empty (128 rows over 3 parts -> 43, 43, 42;
                    5 rows over 4 parts -> 2, 2, 1, 0).
      ``widths`` -- explicit widths, one per part, summing to ``extent``.
    """
    if mode == "widths":
        lo = sum(widths[:index])
        return lo, lo + widths[index]
    if mode == "chunk":
        size = -(-extent // parts) if parts else 0
        lo = min(extent, index * size)
        return lo, min(extent, lo + size)
    size = extent // parts
    return index * size, (index + 1) * size


def restrict(
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    strides: tuple[int, ...],
    base: int,
    lo: int,
    hi: int,
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Cut a strided box down to the elements whose flat position is in ``[lo, hi)``.

    The strides must be *nested*: sorted by decreasing stride, each axis's stride is
    at least the whole span of the axes inside it -- true of any box taken from a
    row-major tensor, with gaps (a concatenation) or permuted axes (transposed
    storage) allowed. Returns disjoint sub-boxes as ``(offsets, lengths, base)``.
    A contiguous range cuts at most two partial blocks per axis, so the result has
    at most ``2 * rank - 1`` boxes; each is contiguous in flat order when the
    input box is.
    """
    order = sorted((k for k in range(len(lengths)) if lengths[k] > 1), key=lambda k: -strides[k])
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    fixed = list(offsets)
    lens = list(lengths)

    def span_from(depth: int) -> int:
        return 1 + sum((lengths[k] - 1) * strides[k] for k in order[depth:])

    spans = [span_from(d) for d in range(len(order) + 1)]

    def walk(depth: int, start: int) -> None:
        if start >= hi or start + spans[depth] <= lo:
            return
        if start >= lo and start + spans[depth] <= hi:
            box_lens = lens[:]
            for k in order[:depth]:
                box_lens[k] = 1
            out.append((tuple(fixed), tuple(box_lens), start))
            return
        k = order[depth]
        n, s, inner = lengths[k], strides[k], spans[depth + 1]
        # Blocks j (positions start + j*s .. + inner) that overlap [lo, hi).
        j0 = max(0, (lo - start - inner) // s + 1)
        j1 = min(n, -(-(hi - start) // s))
        # Of those, the ones wholly inside.
        f0 = max(j0, -(-(lo - start) // s))
        f1 = min(j1, (hi - start - inner) // s + 1)
        if f1 > f0:
            box_off = list(fixed)
            box_off[k] = offsets[k] + f0
            box_lens = lens[:]
            for kk in order[:depth]:
                box_lens[kk] = 1
            box_lens[k] = f1 - f0
            out.append((tuple(box_off), tuple(box_lens), start + f0 * s))
        else:
            f0 = f1 = j0
        for j in list(range(j0, f0)) + list(range(max(f1, f0), j1)):
            fixed[k] = offsets[k] + j
            walk(depth + 1, start + j * s)
        fixed[k] = offsets[k]

    if hi > lo:
        walk(0, base)
    # Re-base each output box: positions relative to its own first element.
    return out
