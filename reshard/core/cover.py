"""What a source layout stores of one logical tensor, and where it meets the boxes a destination needs.

``Cover`` holds disjoint boxes covering the source's fragments of one (tensor, state): each box with the
fragments that hold it (its replicas). ``Cover.meet`` intersects a list of destination fragments with them, all
at once: one vectorized pass per (tensor, state), not one per destination fragment, so a plan of a hundred
thousand fragments costs a few thousand numpy calls. The planner (``reshard.core.planner``) turns what it
returns into copies.
"""

from __future__ import annotations

import numpy as np

from reshard.core.geometry import Box, contains, intersect, subtract
from reshard.core.layout import Fragment

__all__ = ["Cover", "Meeting"]

Meeting = tuple[Fragment, Box, int, int]
"""One part of a destination fragment's box and where it comes from: ``(source fragment, the box, its offset in
the source item, its offset in the destination item)``."""

_VECTOR_MIN = 24
"""Destination fragments times boxes from which ``meet`` intersects with numpy (below, a loop is faster)."""
_INT64 = (1 << 63) - 1


class Cover:
    """Disjoint boxes covering what the source stores of one (tensor, state).

    Each box keeps every fragment that holds it exactly (its replicas), in
    item order; a box that only partly overlaps earlier ones keeps just its
    new part. The boxes' bounds are numpy arrays, so ``meet`` tests every
    destination box against every source box in one pass.
    """

    __slots__ = ("entries", "lo", "hi")

    def __init__(self, frags: list[Fragment]) -> None:
        # Replicas are preferred in the order the source layout lists them (item order).
        replicas: dict[Box, list[Fragment]] = {}
        for f in frags:
            replicas.setdefault(f.box, []).append(f)
        self.lo = self.hi = None
        if len(replicas) == 1:  # one box (a whole tensor and its replicas): nothing to subtract or search
            self.entries = list(replicas.items())
            return
        boxes = list(replicas)
        lo, hi = bounds(boxes)
        # Boxes that overlap no other box are taken whole; the rest, in order, minus what came before.
        overlaps = ((lo[:, None, :] < hi[None, :, :]) & (hi[:, None, :] > lo[None, :, :])).all(axis=2)
        np.fill_diagonal(overlaps, False)
        if not overlaps.any():
            self.entries = list(replicas.items())
            self.lo, self.hi = lo, hi
            return
        entries: list[tuple[Box, list[Fragment]]] = []
        taken: list[Box] = []
        for k, box in enumerate(boxes):
            if not overlaps[k].any():
                entries.append((box, replicas[box]))
                continue
            pieces = [box]
            for other in taken:
                pieces = [p for piece in pieces for p in subtract(piece, other)]
            taken.append(box)
            entries += [(p, replicas[box]) for p in pieces]
        self.entries = entries
        self.lo, self.hi = bounds([b for b, _ in entries])

    def meet(self, frags: list[Fragment]) -> list[list[Meeting]]:
        """For each destination fragment, the parts of its box the source holds, in the order of the boxes.

        A part is read from the replica in the destination fragment's own item when there is one, else from
        the first replica.
        """
        if self.lo is None or len(frags) * len(self.entries) < _VECTOR_MIN or not self.lo.shape[1]:
            return [self._meet_one(f) for f in frags]
        try:
            return self._meet_all(frags)
        except OverflowError:  # a number past int64: the loop works on Python's ints
            return [self._meet_one(f) for f in frags]

    def _meet_one(self, f: Fragment) -> list[Meeting]:
        out: list[Meeting] = []
        box = f.box
        for ebox, alts in self.entries:
            # Most often one source box holds the whole destination box (a whole tensor, chunked).
            common = box if contains(ebox, box) else intersect(ebox, box)
            if common is None:
                continue
            s = alts[0] if len(alts) == 1 else next((a for a in alts if a.item == f.item), alts[0])
            out.append((s, common, offset_of(s, common), offset_of(f, common)))
        return out

    def _meet_all(self, frags: list[Fragment]) -> list[list[Meeting]]:
        entries = self.entries
        dlo, dhi = bounds([f.box for f in frags])
        dstr = np.array([f.strides for f in frags], dtype=np.int64).reshape(dlo.shape)
        doff = np.array([f.offset for f in frags], dtype=np.int64)
        hit = ((self.lo[None, :, :] < dhi[:, None, :]) & (self.hi[None, :, :] > dlo[:, None, :])).all(axis=2)
        di, ei = np.nonzero(hit)  # by destination fragment, then by box: the order of the loop in _meet_one
        # The replica each part is read from: the first, or one in the destination fragment's own item.
        firsts = [alts[0] for _, alts in entries]
        chosen = [firsts[e] for e in ei.tolist()]
        if any(len(alts) > 1 for _, alts in entries):
            for k, (d, e) in enumerate(zip(di.tolist(), ei.tolist())):
                alts = entries[e][1]
                if len(alts) > 1:
                    item = frags[d].item
                    chosen[k] = next((a for a in alts if a.item == item), alts[0])
        slo = np.array([s.box.offsets for s in chosen], dtype=np.int64).reshape(len(chosen), dlo.shape[1])
        sstr = np.array([s.strides for s in chosen], dtype=np.int64).reshape(slo.shape)
        soff = np.array([s.offset for s in chosen], dtype=np.int64)
        # Offsets are sums of (coordinate * stride) per axis: numpy's int64 holds them unless the numbers are huge.
        rank = dlo.shape[1]
        top = max(int(dhi.max()), int(self.hi.max())) if len(di) else 0
        step = max(int(np.abs(dstr).max()), int(np.abs(sstr).max())) if len(di) else 0
        if rank * top * step + max(int(np.abs(doff).max()), int(np.abs(soff).max()) if len(di) else 0) > _INT64:
            return [self._meet_one(f) for f in frags]
        clo = np.maximum(dlo[di], self.lo[ei])
        chi = np.minimum(dhi[di], self.hi[ei])
        whole = ((clo == dlo[di]) & (chi == dhi[di])).all(axis=1)
        src_at = (soff + ((clo - slo) * sstr).sum(axis=1)).tolist()
        dst_at = (doff[di] + ((clo - dlo[di]) * dstr[di]).sum(axis=1)).tolist()
        out: list[list[Meeting]] = [[] for _ in frags]
        parts = np.flatnonzero(~whole)
        made = {}
        if len(parts):
            for k, o, n in zip(parts.tolist(), clo[parts].tolist(), (chi - clo)[parts].tolist()):
                made[k] = Box(tuple(o), tuple(n))
        for k, (d, s, sa, da) in enumerate(zip(di.tolist(), chosen, src_at, dst_at)):
            out[d].append((s, made[k] if k in made else frags[d].box, sa, da))
        return out


def bounds(boxes: list[Box]) -> tuple[np.ndarray, np.ndarray]:
    """The boxes' first and past-the-end corners, one row per box."""
    rank = len(boxes[0].offsets) if boxes else 0
    lo = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(len(boxes), rank)
    hi = lo + np.array([b.lengths for b in boxes], dtype=np.int64).reshape(len(boxes), rank)
    return lo, hi


def offset_of(f: Fragment, box: Box) -> int:
    """Where the first element of ``box`` (inside the fragment's box) sits in the fragment's item."""
    if box.offsets == f.box.offsets:
        return f.offset
    at = f.offset
    for o, fo, s in zip(box.offsets, f.box.offsets, f.strides):
        at += (o - fo) * s
    return at
