"""What one rank of a running job holds: each state-dict tensor's box of its global tensor, as a layout.

A job's state dict (``torch.distributed.checkpoint.state_dict.get_state_dict``) holds DTensors (FSDP2's
``fully_shard``, ``parallelize_module``'s colwise and rowwise plans, their 2-D combinations) and plain
tensors (buffers FSDP2 leaves whole, an unsharded model). Each is one box of a global tensor on this
rank: DTensor's placements give the box's shape and global offsets (the same computation DCP records
its chunks with), a plain tensor is the whole tensor. ``rank_layout`` turns those boxes into a
``Layout`` with one item per (tensor, state) this rank holds, which the planner intersects with a
checkpoint's layout like any other. No format is named, so any module can be loaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from reshard.core.geometry import Box, row_major_strides
from reshard.core.layout import Fragment, Item, ItemInfo, Layout, LogicalTensor
from reshard.core.topology import Topology
from reshard.errors import PlanError

__all__ = ["SECTION", "Shard", "local_tensor", "rank_layout", "shard_of"]

SECTION = "job"
"""The section of every item of a rank layout: the job's state dict, one item per (key, state)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """One tensor of this rank's state: which box of which logical tensor (and state) it holds."""

    key: str
    """Where it sits in the job's state dict: the parameter's fqn."""
    tensor: str
    """The checkpoint's logical tensor it is filled from."""
    state: str
    """The checkpoint's state it is filled from (``param``, ``master``, ``exp_avg``, ...)."""
    shape: tuple[int, ...]
    """The global tensor's shape, in elements."""
    offsets: tuple[int, ...]
    """The box's first element in the global tensor, per dim, in elements."""
    lengths: tuple[int, ...]
    """The box's extent per dim, in elements: the local tensor's shape."""

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def item(self) -> Item:
        return Item(SECTION, (), 0, self.state, self.key)


def local_tensor(value: Any) -> Any:
    """The tensor this rank holds of a state-dict value: a DTensor's local shard, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def shard_of(key: str, value: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(global shape, offsets, lengths)`` of the box a state-dict value holds on this rank, in elements.

    Raises:
      PlanError: a DTensor with a ``Partial`` placement (its local values are not a box of the global
        tensor's values), or one whose local tensor differs from what its placements give.
    """
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(value, DTensor):
        shape = tuple(value.shape)
        return shape, (0,) * len(shape), shape
    if any(isinstance(p, Partial) for p in value.placements):
        raise PlanError(f"'{key}' is a DTensor with a Partial placement {value.placements}: its local values are "
                        "pending a reduction, not a shard of the tensor; load it before it becomes partial")
    shape = tuple(value.shape)
    lengths, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    local = tuple(value.to_local().shape)
    if tuple(lengths) != local:
        raise PlanError(f"'{key}': placements {value.placements} on mesh {tuple(value.device_mesh.shape)} give a "
                        f"local shard of shape {list(lengths)}, the rank holds {list(local)}")
    return shape, tuple(offsets), tuple(lengths)


def rank_layout(shards: Iterable[Shard]) -> Layout:
    """The layout of what this rank holds: per shard one row-major item holding its box.

    Logical tensors are plain (one view axis per dim); the planner's ``common_views`` re-views them
    through a checkpoint's finer axes (a fused or grouped tensor) where the shapes agree. A shard with
    no elements (a rank past a short tensor's rows) gets no item: there is nothing to fill.

    Raises:
      PlanError: two shards disagree on a logical tensor's shape.
    """
    tensors: dict[str, LogicalTensor] = {}
    items: dict[Item, ItemInfo] = {}
    fragments: list[Fragment] = []
    for s in shards:
        t = tensors.setdefault(s.tensor, LogicalTensor(name=s.tensor, shape=s.shape,
                                                       axes=tuple(f"d{k}" for k in range(len(s.shape))),
                                                       view=s.shape, dim_axes=(1,) * len(s.shape)))
        if t.shape != s.shape:
            raise PlanError(f"'{s.key}' holds '{s.tensor}' as shape {list(s.shape)}, another key as {list(t.shape)}")
        if s.numel == 0:
            continue
        items[s.item] = ItemInfo(shape=s.lengths, mapped=s.numel, rule="rank shard")
        fragments.append(Fragment(tensor=s.tensor, state=s.state, box=Box(s.offsets, s.lengths), item=s.item,
                                  offset=0, strides=row_major_strides(s.lengths)))
    return Layout(topology=Topology(), tensors=MappingProxyType(tensors), items=MappingProxyType(items),
                  fragments=tuple(fragments))
