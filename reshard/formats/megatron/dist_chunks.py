"""Where each rank's tensors sit in torch_dist's global tensors: the chunks megatron-core's ranks write.

A per-rank Megatron layout (the family's ``megatron`` layout at the target topology) and the whole-tensor
torch_dist layout of the same model give, for every block of every rank's stored tensor, the global key, the
offsets and the sizes of its chunk, and the rank that writes it.
"""

from __future__ import annotations

from reshard.core.geometry import row_major_strides
from reshard.core.layout import Fragment, Item, Layout
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError

__all__ = ["chunk_boxes"]


def chunk_boxes(whole: Layout, ranks: Layout, topology: Topology) -> dict[tuple[str, tuple[int, ...]], tuple]:
    """``(global key, offsets) -> (sizes, writing rank)``: where each rank's tensors sit in the global ones.

    Each stored item of the per-rank layout is cut into blocks of fragments
    whose bounding boxes overlap (QKV's interleaved parts are one block,
    SwiGLU fc1's stacked halves two, as megatron-core writes them); a block's
    translation into the global tensor places its chunk. A chunk several
    ranks hold is written by the lowest rank.
    """
    global_of: dict[tuple[str, str], list[Fragment]] = {}
    for f in whole.fragments:
        global_of.setdefault((f.tensor, f.state), []).append(f)
    per_item: dict[Item, list[Fragment]] = {}
    for f in ranks.fragments:
        if not f.fill:
            per_item.setdefault(f.item, []).append(f)
    padding = [it for it, info in ranks.items.items() if it not in per_item and info.numel and info.tensor is None]
    if padding:  # nothing places such a chunk in the global tensor: it would be left out of the checkpoint
        raise CheckpointFormatError(
            f"{padding[0]} ({ranks.items[padding[0]].rule}) holds only padding at this tp "
            f"({topology.degree('tp')}): megatron-core writes that chunk, reshard cannot place it; convert at a smaller "
            "tp, or with a vocabulary of more rows than make_vocab_size_divisible_by * tp")
    out: dict[tuple[str, tuple[int, ...]], tuple] = {}
    for item, frags in per_item.items():
        shape = ranks.items[item].shape
        rank = topology.rank(**{a: c for a, c in item.unit if a in ("tp", "pp", "dp", "cp")})
        boxes = [_local_box(fr, shape) for fr in frags]
        for members in _overlapping(boxes):
            places = {_place(frags[k], shape, whole, global_of) for k in members}
            if len(places) != 1:
                raise CheckpointFormatError(f"{item}: parts of one stored block land in the global tensors at "
                                            f"{sorted(places)}; it cannot be written as one chunk")
            key, lead_pos, move = places.pop()
            lo, hi = (0,) * len(shape), shape  # one block: the whole tensor, padding included
            if len(members) < len(frags):
                lo = tuple(min(boxes[k][0][d] for k in members) for d in range(len(shape)))
                hi = tuple(max(boxes[k][1][d] for k in members) for d in range(len(shape)))
            offsets = tuple(lead_pos) + tuple(m + l for m, l in zip(move, lo))
            sizes = (1,) * len(lead_pos) + tuple(h - l for l, h in zip(lo, hi))
            known = out.get((key, offsets))
            if known is None or rank < known[1]:
                out[(key, offsets)] = (sizes, rank)
    return out


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[list[int]]:
    """Groups of boxes connected by overlap: interleaved parts (QKV) stay one block, stacked halves (fc1) do not."""
    groups: list[list[int]] = []
    for k, (lo, hi) in enumerate(boxes):
        hits = [g for g in groups if any(all(a < d and c < b for a, b, c, d in zip(lo, hi, *boxes[j])) for j in g)]
        merged = [k] + [j for g in hits for j in g]
        groups = [g for g in groups if g not in hits] + [sorted(merged)]
    return groups


def _place(fr: Fragment, shape: tuple[int, ...], whole: Layout, global_of) -> tuple:
    """(global key, its leading stacked index, translation from the rank's tensor into the global one)."""
    gf = next(g for g in global_of[(fr.tensor, fr.state)]
              if all(go <= o and o + n <= go + gn for o, n, go, gn
                     in zip(fr.box.offsets, fr.box.lengths, g.box.offsets, g.box.lengths)))
    gshape = whole.items[gf.item].shape
    flat = gf.offset + sum((o - go) * st for o, go, st in zip(fr.box.offsets, gf.box.offsets, gf.strides))
    pos_g, pos_r = _unravel(flat, gshape), _unravel(fr.offset, shape)
    lead = len(gshape) - len(shape)
    return gf.item.key, pos_g[:lead], tuple(a - b for a, b in zip(pos_g[lead:], pos_r))


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        flat, r = divmod(flat, n)
        out.append(r)
    return tuple(reversed(out))


def _local_box(fr: Fragment, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The bounding box, in the dims of its item, of the elements a fragment covers."""
    strides = row_major_strides(shape)
    lo = list(_unravel(fr.offset, shape))
    hi = [x + 1 for x in lo]
    for n, st in zip(fr.box.lengths, fr.strides):
        if n > 1:
            d = next(d for d in range(len(shape)) if strides[d] <= st and shape[d] > 1)
            hi[d] += (n - 1) * (st // strides[d])
    return tuple(lo), tuple(hi)
