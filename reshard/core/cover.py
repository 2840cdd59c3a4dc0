"""What a source layout stores of one logical tensor, and where it meets the boxes a destination needs.

``Cover`` holds disjoint boxes covering the source's fragments of one (tensor, state): each box with the
fragments that hold it (its replicas). ``Cover.meet`` intersects a list of destination fragments with them, all
at once: one vectorized pass per (tensor, state), not one per destination fragment, so a plan of a hundred
thousand fragments costs a few thousand numpy calls. ``Meetings`` makes that pass once per geometry: the
(tensor, state)s laid out alike (an optimizer's states, layers placed alike in their stages) reuse it. The
planner (``reshard.core.planner``) turns what they return into copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reshard.core.geometry import Box, contains, intersect, subtract
from reshard.core.layout import Fragment, Item

__all__ = ["Cover", "Meeting", "Meetings"]

Meeting = tuple[Fragment, Box, int, int]
"""One part of a destination fragment's box and where it comes from: ``(source fragment, the box, its offset in
the source item, its offset in the destination item)``."""

_VECTOR_MIN = 24
"""Destination fragments times boxes from which ``meet`` intersects with numpy (below, a loop is faster)."""
_INT64 = (1 << 63) - 1
"""The largest offset numpy's int64 holds; past it, ``meet`` works on Python's ints."""


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
        replicas = _by_box(frags)
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

    def meet(self, frags: list[Fragment], owned: list[list[Fragment] | None] | None = None) -> list[list[Meeting]]:
        """For each destination fragment, the parts of its box the source holds, in the order of the boxes.

        A part is read from the replica in the destination fragment's own item when there is one, else from
        the first replica. ``owned`` gives, for each destination fragment, the source's fragments in its item
        (in the source's order; None for none), as the planner has them; without it they are looked for here.
        """
        if owned is None:
            owned = self.owned(frags)
        if self.lo is None or len(frags) * len(self.entries) < _VECTOR_MIN or not self.lo.shape[1]:
            return [self._meet_one(f, own) for f, own in zip(frags, owned)]
        try:
            return self._meet_all(frags, owned)
        except OverflowError:  # a number past int64: the loop works on Python's ints
            return [self._meet_one(f, own) for f, own in zip(frags, owned)]

    def owned(self, frags: list[Fragment]) -> list[list[Fragment] | None]:
        """For each destination fragment, the source's fragments in its item, in the source's order."""
        by_item: dict[Item, list[Fragment]] = {}
        seen: set[int] = set()
        for _, reps in self.entries:
            for a in reps:
                if id(a) not in seen:
                    seen.add(id(a))
                    by_item.setdefault(a.item, []).append(a)
        return [by_item.get(f.item) for f in frags]

    def _meet_one(self, f: Fragment, own: list[Fragment] | None = None) -> list[Meeting]:
        out: list[Meeting] = []
        box = f.box
        for ebox, alts in self.entries:
            # Most often one source box holds the whole destination box (a whole tensor, chunked).
            common = box if contains(ebox, box) else intersect(ebox, box)
            if common is None:
                continue
            s = alts[0] if len(alts) == 1 or not own else _pick(alts, own)
            out.append((s, common, offset_of(s, common), offset_of(f, common)))
        return out

    def _meet_all(self, frags: list[Fragment], owned: list[list[Fragment] | None]) -> list[list[Meeting]]:
        entries = self.entries
        rank = self.lo.shape[1]
        # One row per destination fragment: its box's offsets and lengths, its strides and offset.
        d = np.array([f.box.offsets + f.box.lengths + f.strides + (f.offset,) for f in frags], dtype=np.int64)
        dlo, dstr, doff = d[:, :rank], d[:, 2 * rank:3 * rank], d[:, 3 * rank]
        dhi = dlo + d[:, rank:2 * rank]
        hit = ((self.lo[None, :, :] < dhi[:, None, :]) & (self.hi[None, :, :] > dlo[:, None, :])).all(axis=2)
        di, ei = np.nonzero(hit)  # by destination fragment, then by box: the order of the loop in _meet_one
        if not len(di):
            return [[] for _ in frags]
        # The replica each part is read from: the first, or the first in the destination fragment's own item.
        alts = [reps[0] for _, reps in entries]
        ai = ei
        mine = [k for k, own in enumerate(owned) if own]
        if mine and any(len(reps) > 1 for _, reps in entries):
            ai = ei.tolist()
            for k in np.flatnonzero(np.isin(di, mine)).tolist():
                reps = entries[ai[k]][1]
                if len(reps) > 1:
                    picked = _pick(reps, owned[int(di[k])])
                    if picked is not reps[0]:
                        alts.append(picked)
                        ai[k] = len(alts) - 1
            ai = np.array(ai, dtype=np.int64)
        # One row per replica read from: its box's offsets, its strides and offset.
        used, back = np.unique(ai, return_inverse=True)
        s = np.array([alts[a].box.offsets + alts[a].strides + (alts[a].offset,) for a in used.tolist()],
                     dtype=np.int64).reshape(len(used), 2 * rank + 1)
        # Offsets are sums of (coordinate * stride) over the axes, each coordinate below the destination's ends:
        # numpy's int64 holds them unless the numbers are huge.
        dtop, smax = np.abs(d).max(axis=0).tolist(), np.abs(s).max(axis=0).tolist()
        top = max(dtop[:rank]) + max(dtop[rank:2 * rank])
        step = max(dtop[2 * rank:3 * rank] + smax[rank:2 * rank])
        if rank * top * step + max(dtop[3 * rank], smax[2 * rank]) > _INT64:
            return [self._meet_one(f, own) for f, own in zip(frags, owned)]
        at = s[back.reshape(-1)]
        lo_d, hi_d = dlo[di], dhi[di]
        clo = np.maximum(lo_d, self.lo[ei])
        chi = np.minimum(hi_d, self.hi[ei])
        whole = ((clo == lo_d) & (chi == hi_d)).all(axis=1).tolist()
        src_at = (at[:, 2 * rank] + ((clo - at[:, :rank]) * at[:, rank:2 * rank]).sum(axis=1)).tolist()
        dst_at = (doff[di] + ((clo - lo_d) * dstr[di]).sum(axis=1)).tolist()
        out: list[list[Meeting]] = [[] for _ in frags]
        clo, lens = clo.tolist(), (chi - clo).tolist()
        # Destination fragments laid out alike in other items (replicas) meet the same parts: one Box each.
        made: dict[tuple[tuple[int, ...], tuple[int, ...]], Box] = {}
        for k, (f, a) in enumerate(zip(di.tolist(), ai.tolist())):
            if whole[k]:
                box = frags[f].box
            else:
                corner = (tuple(clo[k]), tuple(lens[k]))
                box = made.get(corner)
                if box is None:
                    box = made[corner] = Box(*corner)
            out[f].append((alts[a], box, src_at[k], dst_at[k]))
        return out


@dataclass(frozen=True, slots=True)
class Meetings:
    """``Cover.meet`` for one plan, made once per geometry.

    An optimizer's states of one tensor (``master``, ``exp_avg``, ...) are most often laid out alike, in items
    that differ by their state, and so are the layers that sit alike in their pipeline stages on both sides: the
    same boxes at the same offsets with the same strides. Where the source and destination fragments of a
    (tensor, state) are, one by one, those of one met before, and each box had one replica there (so no item
    decided where a part is read), the parts are the same: only the fragments they come from change.
    """

    done: dict[tuple, list[tuple[list[Fragment], list[Fragment], list[list[Meeting]]]]] = field(default_factory=dict)

    def meet(self, sources: list[Fragment], frags: list[Fragment],
             owned: list[list[Fragment] | None]) -> list[list[Meeting]]:
        """``Cover(sources).meet(frags, owned)``."""
        if len(sources) == 1:  # one fragment holds what the source has of it (a whole tensor, an expert)
            return [_meet_single(sources[0], f) for f in frags]
        first, last, want = sources[0], sources[-1], frags[0]
        seen = self.done.setdefault((len(sources), len(frags), first.box.offsets, first.box.lengths, first.offset,
                                     last.offset, want.box.offsets, want.box.lengths, want.offset), [])
        for src_ref, dst_ref, meetings in seen:
            if _alike(src_ref, sources) and _alike(dst_ref, frags):
                index = {id(f): k for k, f in enumerate(src_ref)}
                return [[(sources[index[id(s)]], f.box if box is was.box else box, src_at, dst_at)
                         for s, box, src_at, dst_at in meets]
                        for was, f, meets in zip(dst_ref, frags, meetings)]
        cover = Cover(sources)
        meetings = cover.meet(frags, owned)
        if all(len(reps) == 1 for _, reps in cover.entries):
            seen.append((sources, frags, meetings))
        return meetings


def _by_box(frags: list[Fragment]) -> dict[Box, list[Fragment]]:
    """The fragments by their box, in order: each box with the fragments that hold it, in the order given."""
    # Replicas most often share one Box object (a resolver makes each once): grouped by identity, which hashes
    # in C, then by value where distinct objects are equal boxes.
    by_id: dict[int, list[Fragment]] = {}
    for f in frags:
        group = by_id.get(id(f.box))
        if group is None:
            by_id[id(f.box)] = [f]
        else:
            group.append(f)
    out: dict[Box, list[Fragment]] = {}
    for group in by_id.values():
        box = group[0].box
        held = out.get(box)
        if held is None:
            out[box] = group
        else:  # an equal box made apart: keep the fragments in the order given
            out[box] = [f for f in frags if f.box == box]
    return out


def _pick(reps: list[Fragment], own: list[Fragment]) -> Fragment:
    """The replica a part is read from: the first of ``reps`` (fragments of one box, in the source's order) in the
    destination fragment's item, whose fragments ``own`` are (in the source's order), else the first."""
    box = reps[0].box
    return next((a for a in own if a.box is box or a.box == box), reps[0])


def _meet_single(s: Fragment, f: Fragment) -> list[Meeting]:
    """What ``Cover([s]).meet([f])`` gives: the part of ``f``'s box in ``s``'s, if any."""
    box = f.box
    common = box if contains(s.box, box) else intersect(s.box, box)
    return [] if common is None else [(s, common, offset_of(s, common), offset_of(f, common))]


def _alike(a: list[Fragment], b: list[Fragment]) -> bool:
    """Whether two lists of fragments have, one by one, the same boxes, offsets and strides."""
    return len(a) == len(b) and all(
        (x.box is y.box or x.box == y.box) and x.offset == y.offset and (x.strides is y.strides or x.strides == y.strides)
        for x, y in zip(a, b))


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
