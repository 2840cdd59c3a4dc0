"""The distributed optimizer's ``fully_sharded_model_space`` state in a torch_dist checkpoint, decoded per parameter.

Megatron-core 0.8 to 0.14 save the ``DistributedOptimizer``'s state by default in model space
(``sharded_param_state_fs_model_space``): per model tensor and state one key::

    optimizer.state.{fp32_param|exp_avg|exp_avg_sq}.<model key>

``fp32_param`` is the fp32 main copy (reshard's ``MASTER``). Each dp rank holds a flat range of
each tp shard of a parameter (its piece of the row-major flattened shard), and megatron-core's
torch_dist strategy stores such ranges *reformulated*: the key's global shape is the model
tensor's chunk grid (one axis per dim: stacked layers, tp pieces, SwiGLU's two halves) plus one
flat axis of the shard's element count, and each piece a chunk ``(*cell, range start)`` of sizes
``(1, ..., 1, range length)``. So ``optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight``
(``[layers, 2·ffn, h]``, each tp rank's ``[gate; up]`` rows stored as two chunks) is
``[layers, 2·tp, 1, (ffn/tp)·h]`` at tp 2.

The model tensor's own chunks in the same ``.metadata`` give each cell's box of the global
tensor (its offsets over its sizes, per dim); a stored piece is the flat range
``[start, start + length)`` of that box in row-major order, cut here into the few boxes
(a partial row, whole rows, a partial row, per dim) that ``chunk_fragments`` places. The
megatron-core release that wrote the checkpoint is not needed: nothing depends on its
buckets. Checkpoints of megatron-core 0.7 and older stored the same ranges 1-D (no chunk
grid); they are refused by name. The step and param groups are in ``common.pt``
(``optimizer.optimizer.param_groups``), as for ``fully_reshardable``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from reshard.core.geometry import row_major_strides
from reshard.core.layout import MASTER, Fragment, Item, chunk_fragments
from reshard.errors import CheckpointFormatError
from reshard.formats.megatron.small import _capture
from reshard.io.dcp_metadata import DcpChunk, DcpMetadata

__all__ = ["FLAT_MAIN_STATE", "FlatState", "common_param_groups", "flat_fragments", "flat_ranges", "is_model_space"]

FLAT_MAIN_STATE = "fp32_param"
"""The model-space format's name for the fp32 main params: reshard's ``MASTER``."""
_PREFIX = "optimizer.state."
_STATES = (FLAT_MAIN_STATE, "exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatState:
    """One stored key of model-space state: which model tensor and state it holds, and where each cell sits."""

    state: str
    """Reshard's state name (``MASTER`` for ``fp32_param``)."""
    model_key: str
    """The model tensor's stored key."""
    shape: tuple[int, ...]
    """The model tensor's global shape."""
    cells: Mapping[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]]
    """Chunk-grid cell -> the box (offsets, sizes; elements of the global tensor) it flattens."""


def is_model_space(md: DcpMetadata) -> bool:
    """Whether the checkpoint's optimizer state is ``fully_sharded_model_space`` (its ``fp32_param`` keys)."""
    return any(k.startswith(f"{_PREFIX}{FLAT_MAIN_STATE}.") for k in md.tensors)


def flat_ranges(md: DcpMetadata, shapes: Mapping[str, tuple[int, ...]],
                problems: list[str]) -> dict[str, FlatState]:
    """Every ``optimizer.state.<state>.<model key>`` key of a model-space checkpoint, decoded.

    ``shapes`` are the model tensors' global shapes by key (the spec's). Each key whose model tensor
    is unknown, whose state is not one of ``fp32_param``/``exp_avg``/``exp_avg_sq``, or whose shape is
    not the model tensor's chunk grid plus one flat axis of the cell's element count adds a line
    naming the key and the reason to ``problems`` and is left out.
    """
    out: dict[str, FlatState] = {}
    for key, t in md.tensors.items():
        if not key.startswith(_PREFIX):
            continue
        state, _, model_key = key[len(_PREFIX):].partition(".")
        if state not in _STATES:
            problems.append(f"'{key}': state '{state}' is not one of fully_sharded_model_space's "
                            f"({', '.join(_STATES)})")
            continue
        shape, model = shapes.get(model_key), md.tensors.get(model_key)
        if shape is None or model is None:
            problems.append(f"'{key}' ({list(t.size)}) is the state of '{model_key}', which "
                            f"{'the checkpoint does not store' if shape else 'the spec does not know'}")
            continue
        cells = _grid(model_key, model.chunks, shape, problems)
        if cells is None:
            continue
        grid = tuple(max(c[d] for c in cells) + 1 for d in range(len(shape)))
        cell_numel = math.prod(next(iter(cells.values()))[1])
        if tuple(t.size) != (*grid, cell_numel):
            legacy = len(t.size) == 1
            problems.append(
                f"'{key}' is {list(t.size)}; fully_sharded_model_space state of '{model_key}' {list(shape)} stored "
                f"in chunks of {list(next(iter(cells.values()))[1])} is {[*grid, cell_numel]} (its chunk grid and "
                f"one flat axis){': 1-D flattened state, as megatron-core 0.7 and older wrote it, is not read' if legacy else ''}")
            continue
        out[key] = FlatState(state=MASTER if state == FLAT_MAIN_STATE else state, model_key=model_key,
                             shape=tuple(shape), cells=cells)
    return out


def _grid(model_key: str, chunks: tuple[DcpChunk, ...], shape: tuple[int, ...],
          problems: list[str]) -> dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """The model tensor's chunks as a regular grid: cell -> (offsets, sizes); None (and a problem) if they are not."""
    sizes = {c.sizes for c in chunks}
    if len(sizes) != 1:
        problems.append(f"'{model_key}' is stored in chunks of {len(sizes)} different sizes, so its optimizer state's "
                        "chunk grid is not regular")
        return None
    (size,) = sizes
    cells = {}
    for c in chunks:
        if any(s == 0 or o % s for o, s in zip(c.offsets, size)):
            problems.append(f"'{model_key}' has a chunk at {list(c.offsets)} that is not on its grid of "
                            f"{list(size)}")
            return None
        cells[tuple(o // s for o, s in zip(c.offsets, size))] = (c.offsets, c.sizes)
    if len(cells) != math.prod(-(-n // s) for n, s in zip(shape, size)):
        problems.append(f"'{model_key}' {list(shape)}: its {len(cells)} chunks of {list(size)} do not tile it")
        return None
    return cells


def flat_fragments(flat: FlatState, frags: list[Fragment], chunk: DcpChunk, item: Item,
                   where: str) -> list[Fragment]:
    """The fragments of one stored piece (``chunk`` of a model-space key), re-based into ``item``.

    ``frags`` are the model tensor's fragments in its whole global tensor.

    Raises:
      CheckpointFormatError: the chunk is not a flat range of one cell of the grid (naming ``where``:
        the file and key).
    """
    cell, start, length = chunk.offsets[:-1], chunk.offsets[-1], chunk.sizes[-1]
    box = flat.cells.get(tuple(cell))
    if box is None or any(n != 1 for n in chunk.sizes[:-1]):
        raise CheckpointFormatError(f"{where}: a chunk at {list(chunk.offsets)} of {list(chunk.sizes)} is no flat "
                                    "range of one cell of its chunk grid (fully_sharded_model_space)")
    offsets, sizes = box
    out: list[Fragment] = []
    strides = row_major_strides(sizes)
    for sub_offsets, sub_sizes in _runs(sizes, start, start + length):
        at = sum(o * s for o, s in zip(sub_offsets, strides)) - start
        for f in chunk_fragments(frags, flat.shape, tuple(o + s for o, s in zip(offsets, sub_offsets)), sub_sizes,
                                 item):
            out.append(replace(f, offset=f.offset + at, state=flat.state))
    return out


def _runs(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat range ``[lo, hi)`` (elements, row-major) of a box of ``shape`` as boxes (offsets, sizes) in flat
    order, each contiguous in it: a partial leading row, whole rows, a partial trailing row, recursively."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first_full, end_full = -(-lo // inner), hi // inner
    if first_full > end_full:  # within one row
        row = lo // inner
        return [((row, *o), (1, *n)) for o, n in _runs(shape[1:], lo - row * inner, hi - row * inner)]
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if lo < first_full * inner:
        row = lo // inner
        out += [((row, *o), (1, *n)) for o, n in _runs(shape[1:], lo - row * inner, inner)]
    if end_full > first_full:
        out.append(((first_full,) + (0,) * (len(shape) - 1), (end_full - first_full, *shape[1:])))
    if hi > end_full * inner:
        out += [((end_full, *o), (1, *n)) for o, n in _runs(shape[1:], 0, hi - end_full * inner)]
    return out


def common_param_groups(common: Mapping[str, Any], where: str) -> list[dict[str, Any]] | None:
    """``common.pt``'s optimizer param groups (``optimizer.optimizer.param_groups``, where the model-space formats
    keep them, Adam's ``step`` in each), small tensors read by value; None without them."""
    optimizer = common.get("optimizer")
    if isinstance(optimizer, Mapping) and 0 in optimizer:  # a ChainedOptimizer's (MoE at ep > 1): the dense one's
        optimizer = optimizer[0]
    inner = optimizer.get("optimizer") if isinstance(optimizer, Mapping) else None
    groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        return None
    return [dict(_capture(g, where)) for g in groups]
