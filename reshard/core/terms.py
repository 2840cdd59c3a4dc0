"""Evaluate a stored tensor's dims, and a flat buffer's ops, for one unit of a topology.

A stored dim evaluates to its local extent and its *pieces*: parts of the dim
mapped onto axes of a target logical tensor, each a strided box in the dim's
local index. Splits and flat partitions cut pieces with ``geometry.restrict``.
The resolver (``reshard.core.resolve``) combines the dims' pieces into fragments.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reshard.core import spec as S
from reshard.core.geometry import Box, restrict, row_major_strides, split_range
from reshard.core.names import ETP
from reshard.core.topology import Topology
from reshard.errors import TopologyError

if TYPE_CHECKING:
    from reshard.core.resolve import _Resolver

__all__ = ["Ctx", "FlatCuts", "eval_term", "flat_layout", "flat_pieces", "show"]

# A piece: part of one stored dim mapped onto axes of a target, as a tuple for speed:
# (target ref or None, axes, offsets, lengths, strides in the dim's local index, base, binds, fill)
_Piece = tuple


@dataclass(slots=True)
class Ctx:
    spec: S.Spec
    topo: Topology
    env: dict[str, int]
    indexes: dict[str, int]
    coords: dict[str, int]
    chunk: int
    tensor: str  # the stored name being resolved, for messages
    layers: str | None  # the capture split over pp



def show(term: S.Term) -> str:
    if isinstance(term, S.Axis):
        return term.name
    if isinstance(term, S.Index):
        return "{" + term.name + "}"
    if isinstance(term, S.Product):
        return "(" + " ".join(show(t) for t in term.terms) + ")"
    if isinstance(term, S.Split):
        return f"{show(term.term)}/{term.axis}"
    if isinstance(term, S.Pad):
        return f"{show(term.term)}~"
    return "[" + " | ".join((p.ref or "pad") + ": " + " ".join(show(t) for t in p.terms) for p in term.parts) + "]"


def eval_term(term: S.Term, ctx: Ctx, r: _Resolver) -> tuple[int, list[_Piece]]:
    """A stored dim's local extent for this unit, and its pieces."""
    if isinstance(term, S.Axis):
        n = r.axis_size(term.name, term.pos)
        return n, [(None, (term.name,), (0,), (n,), (1,), 0, (), False)] if n else []
    if isinstance(term, S.Index):
        if term.name in r.parts:
            raise r.err(f"'{{{term.name}}}' is a part of another index's range, which cannot stack on a dim", term.pos)
        n = ctx.indexes[term.name]
        return n, [(None, (), (), (), (), v, ((term.name, v),), False) for v in range(n)]
    if isinstance(term, S.Product):
        evs = [eval_term(t, ctx, r) for t in term.terms]
        extents = [e for e, _ in evs]
        suffix = row_major_strides(tuple(extents)) if extents else ()
        pieces = []
        for combo in itertools.product(*(p for _, p in evs)):
            target = None
            axes: tuple = ()
            offs: tuple = ()
            lens: tuple = ()
            strides: tuple = ()
            base = 0
            binds: tuple = ()
            fill = False
            for k, p in enumerate(combo):
                if p[0] is not None:
                    if target is not None and target != p[0]:
                        break
                    target = p[0]
                axes += p[1]
                offs += p[2]
                lens += p[3]
                strides += tuple(s * suffix[k] for s in p[4])
                base += p[5] * suffix[k]
                binds += p[6]
                fill = fill or p[7]
            else:
                pieces.append((target, axes, offs, lens, strides, base, binds, fill))
        return math.prod(extents), pieces
    if isinstance(term, S.Concat):
        at = 0
        pieces = []
        for part in term.parts:
            if part.ref is None:
                at += r.eval(part.size)
                continue
            n, pcs = eval_term(S.Product(part.terms, part.pos), ctx, r)
            pieces += [(part.ref, *p[1:5], p[5] + at, p[6], p[7]) for p in pcs]
            at += n
        return at, pieces
    if isinstance(term, S.Pad):
        n, pcs = eval_term(term.term, ctx, r)
        m = r.eval(term.multiple)
        if m <= 0:
            raise r.err(f"pad multiple must be positive, got {m}", term.pos)
        padded = -(-n // m) * m
        if term.policy == "last" and padded > n:
            last = [(p[0], p[1], o, ln, p[4], b, p[6], True) for p in pcs for o, ln, b in restrict(p[2], p[3], p[4], p[5], n - 1, n)]
            pcs = pcs + [(p[0], p[1], p[2], p[3], p[4], j, p[6], True) for j in range(n, padded) for p in last]
        return padded, pcs
    # Split
    n, pcs = eval_term(term.term, ctx, r)
    d = r.env[ETP] if term.axis == ETP else ctx.topo.degree(term.axis)
    c = ctx.coords[term.axis]
    if term.axis == ETP and ctx.topo.tp % d:
        raise TopologyError(f"{ctx.tensor}: split over etp({d}), which does not divide tp({ctx.topo.tp}): a unit "
                            "stored per tp holds the experts' shard of etp rank tp mod etp only where it does")
    if term.axis == "pp" and isinstance(term.term, S.Index):
        if term.term.name != ctx.layers and ctx.layers is not None:
            raise r.err(f"only the pipelined index '{ctx.layers}' can be split over pp", term.pos)
        try:
            places = ctx.topo.layer_placement(n)
        except TopologyError as e:
            raise TopologyError(f"{ctx.tensor}: {e}") from None
        mine = [g for g, p in enumerate(places) if p.stage == c and p.chunk == ctx.chunk]
        lo, hi = (mine[0], mine[-1] + 1) if mine else (0, 0)
    elif term.mode == "even":
        if n % d:
            raise TopologyError(f"{ctx.tensor}: {show(term.term)}({n}) is not divisible by {term.axis}({d})")
        lo, hi = split_range(n, d, c)
    elif term.mode == "chunk":
        lo, hi = split_range(n, d, c, "chunk")
    else:
        widths = tuple(r.eval(w) for w in term.widths)
        if len(widths) != d or sum(widths) != n or min(widths) < 0:
            raise r.err(f"widths {' + '.join(map(str, widths))} must be {d} non-negative numbers summing to {show(term.term)}({n})", term.pos)
        lo, hi = split_range(n, d, c, "widths", widths)
    out = []
    for p in pcs:
        for offs, lens, base in restrict(p[2], p[3], p[4], p[5], lo, hi):
            out.append((p[0], p[1], offs, lens, p[4], base - lo, p[6], p[7]))
    return hi - lo, out


def flat_layout(fl: S.Flat, numels: list[int], coords: dict[str, int], r: _Resolver, cache: dict | None = None,
                key: object = None, alone: frozenset[int] = frozenset()) -> list[tuple[int, list[tuple[int, int, int, int]]]]:
    """Where each param's elements sit in this rank's flat buffer(s).

    Returns, per output buffer (bucket), its local length and the pieces
    ``(param index, param flat start, param flat end, local offset)``; every
    number is in elements. ``cache[key]`` keeps the placement in the world
    buffer (the same for every rank of the split axis), so a rank's share costs
    the params it holds, not all of them. ``alone``: the params (indices) that
    the ``alone`` ops give a bucket of their own.
    """
    if cache is not None and key in cache:
        opts, buckets = cache[key]
    else:
        opts, buckets = _place_flat(fl, numels, r, alone)
        if cache is not None:
            cache[key] = (opts, buckets)
    split, coalesce, pad = opts
    if isinstance(buckets, tuple):  # perparam: (pad, order)
        return _perparam_share(buckets, numels, r.topo.degree(split) if split else 1, coords[split] if split else 0)
    d = r.topo.degree(split) if split else 1
    c = coords[split] if split else 0
    out = []
    coalesced_at = 0
    for b_start, b_end, mem, ends in buckets:
        padded = -(-(b_end - b_start) // pad) * pad
        if padded % d:
            raise r.err(f"bucket of {padded} elements is not divisible by {split}({d}); pad it to a multiple ('| pad N')", fl.pos)
        share = padded // d
        w0, w1 = b_start + c * share, b_start + (c + 1) * share
        pieces = []
        for p, s, e in mem[bisect.bisect_right(ends, w0):]:  # members are in place order; skip those ending by w0
            if s >= w1:
                break
            lo, hi = max(s, w0), min(e, w1)
            if hi > lo:
                local = (lo - w0) if not coalesce else (lo - b_start + coalesced_at)
                pieces.append((p, lo - s, hi - s, local))
        if coalesce:
            if split:
                raise r.err("'coalesce' joins whole buckets; it cannot be combined with 'split'", fl.pos)
            out.append((b_end - b_start, pieces))
            coalesced_at += b_end - b_start
        else:
            out.append((share, pieces))
    if coalesce:
        total = sum(n for n, _ in out)
        return [(total, [pc for _, pcs in out for pc in pcs])]
    return out


@dataclass(frozen=True, slots=True)
class FlatCuts:
    """What ``flat_pieces`` keeps for one resolve: per param item, its fragments with the flat range each spans
    there; per fragment geometry and range of it, the boxes ``restrict`` cuts (pipeline stages of the same layers
    cut their params alike, so most cuts are made once)."""

    spans: dict = field(default_factory=dict)
    boxes: dict = field(default_factory=dict)


def flat_pieces(params: list, item_frags: dict, pieces: list[tuple[int, int, int, int]],
                cuts: FlatCuts) -> list[tuple]:
    """The parts of the params' fragments a flat buffer's pieces hold, in piece order.

    ``pieces`` are ``flat_layout``'s: ``(param index, param flat start, param flat end, local offset)``;
    ``item_frags`` gives the fragments of each param item. Returns ``(tensor, box, offset in the buffer,
    strides, fill)`` per part: a fragment wholly inside its piece is kept as it is, one across a piece's
    edge is cut by ``restrict``.
    """
    spans, boxes = cuts.spans, cuts.boxes
    geo: list[tuple] = []
    for p_index, a, z, dst in pieces:
        param = params[p_index]
        held = spans.get(param)
        if held is None:
            held = [(fr, fr.offset, fr.offset + 1 + sum((n - 1) * s for n, s in zip(fr.box.lengths, fr.strides)))
                    for fr in item_frags[param]]
            spans[param] = held
        for fr, lo, hi in held:
            if a <= lo and hi <= z:
                geo.append((fr.tensor, fr.box, lo - a + dst, fr.strides, fr.fill))
            elif lo < z and a < hi:
                key = (fr.box, fr.strides, a - lo, z - lo)
                cut = boxes.get(key)
                if cut is None:
                    cut = [(Box(offs, lens), base) for offs, lens, base
                           in restrict(fr.box.offsets, fr.box.lengths, fr.strides, 0, a - lo, z - lo)]
                    boxes[key] = cut
                geo += [(fr.tensor, box, lo + base - a + dst, fr.strides, fr.fill) for box, base in cut]
    return geo


def _perparam_share(placed: tuple, numels: list[int], d: int, c: int) -> list[tuple[int, list[tuple[int, int, int, int]]]]:
    """``perparam``: each param padded to a multiple of ``pad * d`` and split on its own; rank ``c``'s pieces."""
    pad, order = placed
    local = 0
    pieces = []
    for p in order:
        n = numels[p]
        share = -(-n // (pad * d)) * pad if pad > 1 else -(-n // d)
        lo, hi = min(n, c * share), min(n, (c + 1) * share)
        if hi > lo:
            pieces.append((p, lo, hi, local))
        local += share
    return [(local, pieces)]


def _place_flat(fl: S.Flat, numels: list[int], r: _Resolver, alone: frozenset[int] = frozenset()) -> tuple[tuple, object]:
    """The flat rule's options (split axis, coalesce, pad) and its params' places in the world buffer, before the
    split: per bucket ``(start, unpadded end, members (param, start, end), the members' ends)``; for ``perparam``,
    ``(pad, order)``."""
    order = list(range(len(numels)))
    align = 1
    bucket_size = 0
    pad = 1
    split: str | None = None
    perparam = False
    coalesce = False
    for op in fl.ops:
        if op.op == "reverse":
            order.reverse()
        elif op.op == "align":
            align = r.eval(op.arg)
        elif op.op == "buckets":
            bucket_size = r.eval(op.arg)
        elif op.op == "pad":
            pad = r.eval(op.arg)
        elif op.op == "split":
            split = op.arg
        elif op.op == "perparam":
            perparam = True
        elif op.op == "coalesce":
            coalesce = True
    if min(align, pad) <= 0:
        raise r.err("align and pad take positive numbers", fl.pos)
    if bucket_size < 0:
        raise r.err(f"buckets takes a number >= 0 (0: one bucket), got {bucket_size}", fl.pos)
    if perparam and (align > 1 or bucket_size or coalesce or alone):
        raise r.err("'perparam' pads and splits each param on its own; it cannot be combined with align, buckets, "
                    "alone or coalesce", fl.pos)
    opts = (split, coalesce, pad)
    if perparam:
        return opts, (pad, order)
    # Place params into buckets of the world buffer (before the dp split).
    buckets: list[tuple[int, int, list[tuple[int, int, int]]]] = []  # (start, unpadded end, [(param, start, end)])
    start = 0
    pos = 0
    members: list[tuple[int, int, int]] = []
    for p in order:
        pos = -(-pos // align) * align
        if p in alone and members:  # the open bucket closes before it (its aligned start the bucket's end)
            buckets.append((start, pos, members))
            start = pos = -(-pos // pad) * pad
            members = []
        members.append((p, pos, pos + numels[p]))
        pos += numels[p]
        if (bucket_size and pos - start >= bucket_size) or p in alone:
            buckets.append((start, pos, members))
            start = pos = -(-pos // pad) * pad
            members = []
    if members or not buckets:
        buckets.append((start, pos, members))
    return opts, [(b0, b1, mem, [e for _, _, e in mem]) for b0, b1, mem in buckets]
