"""Where each rank's stored tensors sit in whole stored tensors, and a layout seen through whole stored tensors.

A spec resolved at a topology (each rank's items) and the same model's whole-tensor layout (a spec resolved at the
trivial topology: each stored tensor one item, keyed by its name) give, for every block of every rank's stored
tensor, the whole tensor's key and the block's offsets in it: the chunks megatron-core's torch_dist ranks write
(``chunk_boxes``: a rank's tensor may be several blocks, as SwiGLU fc1's stacked halves are) and DCP's (``place_items``:
each rank's tensor one box of the whole one, as DTensor shards it). ``through`` goes the other way: a layout that holds
stored tensors by their own dims (a DCP checkpoint of a module's state dict) seen as the logical tensors a spec
stores in them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from types import MappingProxyType

from reshard.core.geometry import row_major_strides
from reshard.core.layout import Fragment, Item, Layout, LogicalTensor, chunk_fragments, dims_of
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, PlanError

__all__ = ["chunk_boxes", "place_items", "through"]


def chunk_boxes(whole: Layout, ranks: Layout, topology: Topology) -> dict[tuple[str, tuple[int, ...]], tuple]:
    """``(global key, offsets) -> (sizes, writing rank)``: where each rank's tensors sit in the global ones.

    Each stored item of the per-rank layout is cut into blocks of fragments
    whose bounding boxes overlap (QKV's interleaved parts are one block,
    SwiGLU fc1's stacked halves two, as megatron-core writes them); a block's
    translation into the global tensor places its chunk. A chunk several
    ranks hold is written by the lowest rank.
    """
    global_of, per_item = _indexed(whole, ranks)
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


def _indexed(whole: Layout, ranks: Layout) -> tuple[dict[tuple[str, str], list[Fragment]], dict[Item, list[Fragment]]]:
    """The whole layout's fragments by (tensor, state), and the ranks' data fragments (no fill) by item."""
    global_of: dict[tuple[str, str], list[Fragment]] = {}
    for f in whole.fragments:
        global_of.setdefault((f.tensor, f.state), []).append(f)
    per_item: dict[Item, list[Fragment]] = {}
    for f in ranks.fragments:
        if not f.fill:
            per_item.setdefault(f.item, []).append(f)
    return global_of, per_item


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[list[int]]:
    """Groups of boxes connected by overlap: interleaved parts (QKV) stay one block, stacked halves (fc1) do not."""
    groups: list[list[int]] = []
    for k, (lo, hi) in enumerate(boxes):
        hits = [g for g in groups if any(all(a < d and c < b for a, b, c, d in zip(lo, hi, *boxes[j])) for j in g)]
        merged = [k] + [j for g in hits for j in g]
        groups = [g for g in groups if g not in hits] + [sorted(merged)]
    return groups


def _place(fr: Fragment, shape: tuple[int, ...], whole: Layout, global_of) -> tuple:
    """(global key, its leading stacked index, translation from the rank's tensor into the global one). Where the
    tensor is in several global ones (a tied output projection, a copy of the embedding), the one of the rank item's
    own key."""
    held = [g for g in global_of[(fr.tensor, fr.state)]
            if all(go <= o and o + n <= go + gn for o, n, go, gn
                   in zip(fr.box.offsets, fr.box.lengths, g.box.offsets, g.box.lengths))]
    gf = next((g for g in held if g.item.key == fr.item.key), held[0])
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


def place_items(whole: Layout, ranks: Layout) -> dict[Item, tuple[str, tuple[int, ...]]]:
    """Each item of ``ranks`` that holds data: (the key of the whole stored tensor it is a box of, the box's offsets
    there). Every fragment of an item must land in the same whole tensor with the same translation: one box, as DCP
    records a DTensor's local shard."""
    global_of, per_item = _indexed(whole, ranks)
    out: dict[Item, tuple[str, tuple[int, ...]]] = {}
    for item, frags in per_item.items():
        shape = ranks.items[item].shape
        places = {_place(fr, shape, whole, global_of) for fr in frags}
        key, lead, move = places.pop()
        if places or lead:
            raise CheckpointFormatError(f"{item} ({ranks.items[item].rule}): its parts land in the whole stored "
                                        f"tensors at {sorted({(key, lead, move), *places})}; it is not one box of one "
                                        "of them")
        out[item] = (key, move)
    return out


def through(layout: Layout, whole: Layout, keys: Collection[str]) -> Layout:
    """``layout`` with each tensor named in ``keys`` (a stored tensor of ``whole``, held by its own dims) seen as
    the logical tensors ``whole`` stores in it: each fragment of it becomes those tensors' fragments that fall in its
    box, at their places in its item.

    Raises:
      PlanError: a tensor of ``keys`` whose shape is not the whole stored tensor's, or that ``layout`` views through
        other axes than its dims.
    """
    frags_of: dict[str, list[Fragment]] = {}
    for f in whole.fragments:
        frags_of.setdefault(f.item.key, []).append(f)
    shapes = {it.key: info.shape for it, info in whole.items.items()}
    for name in keys:
        t = layout.tensors[name]
        if t.shape != shapes[name] or len(dims_of(t)) != len(t.axes):
            raise PlanError(f"'{name}' is held as {list(t.shape)} (axes {list(t.axes)}), which is not the stored "
                            f"tensor {list(shapes[name])} its parts are laid out in")
    fragments: list[Fragment] = []
    seen: dict[str, LogicalTensor] = {}
    for f in layout.fragments:
        if f.tensor not in keys:
            fragments.append(f)
            continue
        for g in chunk_fragments(frags_of[f.tensor], shapes[f.tensor], f.box.offsets, f.box.lengths, f.item,
                                 f.strides, f.offset):
            fragments.append(replace(g, state=f.state, fill=f.fill or g.fill))
            seen.setdefault(g.tensor, whole.tensors[g.tensor])
    tensors = {n: t for n, t in layout.tensors.items() if n not in keys} | seen
    return Layout(topology=layout.topology, tensors=MappingProxyType(tensors), items=layout.items,
                  fragments=tuple(fragments), order=layout.order)
