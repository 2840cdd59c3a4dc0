"""What a resolved spec is: stored items, logical tensors, and the fragments between them.

``reshard.core.resolve.resolve(spec, topology, sizes)`` returns a
``Layout``: every stored item each rank group writes, and the ``Fragment``s
that say which box of which logical tensor lives where inside it.

Coordinates. A logical tensor is viewed through its *axes* (``q_proj = (g qpg
hd) h`` has the 4-axis view ``(g, qpg, hd, h)``); a fragment's box is a box in
that view, in elements. Inside its stored item a fragment is a strided box:
``offset`` is the element offset of the box's first element in the item's
row-major flat order, ``strides`` the element stride of each view axis there.
Boxes in a view are what the planner intersects; strides are what the executor
copies with. Nothing here opens a file.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from reshard.core.geometry import Box, restrict, row_major_strides
from reshard.core.topology import Topology
from reshard.errors import PlanError

__all__ = ["MASTER", "PARAM", "Fragment", "Item", "ItemInfo", "Layout", "LogicalTensor", "box_fragments", "chunk_fragments",
           "common_views", "dims_of", "held_tensors", "new_fragment", "new_item", "new_item_info", "new_logical",
           "with_state_alias"]

PARAM = "param"
"""The state of an item holding the model's own tensor, as the model holds it (its dtype)."""
MASTER = "master"
"""The state of an item holding the optimizer's full-precision (fp32) copy of a parameter.

Every other state name is an optimizer's own (``exp_avg``, ``exp_avg_sq``, ...):
an open set, read from the checkpoint, so states are strings and only these two
are named here.
"""


@dataclass(frozen=True, slots=True, order=True, eq=True)
class Item:
    """One stored array: what one rank group writes under one key.

    ``unit`` holds the mesh coordinates that name the writing group (the
    section's ``per`` axes), ``chunk`` the virtual-pipeline model chunk.
    """

    section: str
    unit: tuple[tuple[str, int], ...]
    chunk: int
    state: str
    key: str
    _hash: int = field(init=False, repr=False, compare=False)
    _label: str | None = field(default=None, init=False, repr=False, compare=False)
    """``str(item)``, made when first asked for: manifests and resume journals label every item, some twice."""

    def __post_init__(self) -> None:
        # Items key every dict of a plan; hash the five fields once, not at each lookup.
        object.__setattr__(self, "_hash", hash((self.section, self.unit, self.chunk, self.state, self.key)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        # Built again from its fields when unpickled: string hashes differ from one process to the next.
        return Item, (self.section, self.unit, self.chunk, self.state, self.key)

    def __str__(self) -> str:
        label = self._label
        if label is None:
            unit = self.unit
            if len(unit) == 1:  # most items: one axis (a dp rank of DCP's chunks), or none
                where = f"{unit[0][0]}={unit[0][1]}"
            else:
                where = ",".join(f"{a}={c}" for a, c in unit)
            chunk = f",chunk={self.chunk}" if self.chunk else ""
            label = f"{self.section}[{where}{chunk}] {self.state}:{self.key}"
            object.__setattr__(self, "_label", label)
        return label


_new = object.__new__
_set = object.__setattr__


def new_item(section: str, unit: tuple[tuple[str, int], ...], chunk: int, state: str, key: str) -> Item:
    """``Item(section, unit, chunk, state, key)``, made at twice the speed for the loops that make them by the
    hundred thousand (a resolved layout's items): a frozen dataclass's generated ``__init__`` looks
    ``object.__setattr__`` up once per field, and ``__post_init__`` is one more call."""
    item = _new(Item)
    _set(item, "section", section)
    _set(item, "unit", unit)
    _set(item, "chunk", chunk)
    _set(item, "state", state)
    _set(item, "key", key)
    _set(item, "_hash", hash((section, unit, chunk, state, key)))
    _set(item, "_label", None)
    return item


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemInfo:
    shape: tuple[int, ...]
    """Local stored shape, in elements."""
    mapped: int
    """Elements written from logical data (padding that repeats logical data, pad policy ``last``, included);
    the rest is zero padding, or made by the format (``fill``)."""
    fill: str = "zero"
    """What the unmapped elements hold when written: ``zero``, or ``regenerate`` (the format makes them)."""
    rule: str = ""
    """The spec rule that made the item, for messages."""
    tensor: str | None = None
    """For an item of a logical tensor with no elements (a ``(0, 8)`` buffer), that tensor: no fragment links
    them (a box has no zero extent), and its dtype and its presence are still carried."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class LogicalTensor:
    name: str
    shape: tuple[int, ...]
    """The tensor's own dims (elements); ``()`` for a scalar."""
    axes: tuple[str, ...]
    view: tuple[int, ...]
    """Size of each axis; the view is a row-major reshape of ``shape``."""
    blob: bool = False
    """Non-tensor state stored as bytes."""
    dim_axes: tuple[int, ...] = ()
    """How many view axes make up each dim, in order (``(3, 1)`` for ``(g qpg hd) h``)."""


def dims_of(tensor: LogicalTensor) -> tuple[tuple[int, ...], ...]:
    """Which view axes make up each of the tensor's dims (axis indices, row-major)."""
    counts = tensor.dim_axes or (1,) * len(tensor.shape)
    if len(counts) != len(tensor.shape) or sum(counts) != len(tensor.axes):
        raise PlanError(f"{tensor.name}: dim_axes {counts} do not fit shape {tensor.shape} and axes {tensor.axes}")
    out, k = [], 0
    for n in counts:
        out.append(tuple(range(k, k + n)))
        k += n
    return tuple(out)


def box_fragments(tensor: LogicalTensor, offsets: tuple[int, ...], lengths: tuple[int, ...],
                  strides: tuple[int, ...], base: int = 0) -> list[tuple[Box, int, tuple[int, ...]]]:
    """A box over a tensor's own dims, stored strided in an item, as boxes of its axis view.

    ``offsets``/``lengths`` are per dim of ``tensor.shape``; ``strides`` are the
    item's element strides per dim and ``base`` the item offset of the box's
    first element. A range of a dim composed of several axes becomes the few
    view boxes ``restrict`` cuts it into. Returns ``(box, item offset, strides
    per view axis)`` for each: what a ``Fragment`` needs.
    """
    if len(tensor.axes) == len(tensor.shape):  # one axis per dim: the box is the view box itself
        return [(Box(tuple(offsets), tuple(lengths)), base, tuple(strides))]
    per_dim = []
    for group, o, n, st in zip(dims_of(tensor), offsets, lengths, strides):
        sizes = tuple(tensor.view[k] for k in group)
        local = row_major_strides(sizes)
        pieces = restrict((0,) * len(group), sizes, local, 0, o, o + n)
        per_dim.append([(group, offs, lens, b - o, tuple(x * st for x in local)) for offs, lens, b in pieces])
    out = []
    for combo in itertools.product(*per_dim):
        offs = [0] * len(tensor.axes)
        lens = [1] * len(tensor.axes)
        strd = [0] * len(tensor.axes)
        at = base
        for (group, o, n, rel, st), dim_stride in zip(combo, strides):
            for k, oo, nn, ss in zip(group, o, n, st):
                offs[k], lens[k], strd[k] = oo, nn, ss
            at += rel * dim_stride
        out.append((Box(tuple(offs), tuple(lens)), at, tuple(strd)))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Fragment:
    """One box of one logical tensor (one state of it) and where it lives."""

    tensor: str
    state: str
    box: Box
    """In the logical tensor's axis view, elements."""
    item: Item
    offset: int
    """Element offset of the box's first element in the item's flat order."""
    strides: tuple[int, ...]
    """Element stride in the item of each view axis."""
    fill: bool = False
    """Padding that repeats logical data (pad policy ``last``): written, never read."""


def new_fragment(tensor: str, state: str, box: Box, item: Item, offset: int, strides: tuple[int, ...],
                 fill: bool = False) -> Fragment:
    """``Fragment(tensor=..., state=..., ...)`` with its fields in order, made at nearly twice the speed for the
    loops that make them by the million (a resolved layout's fragments): the keywords and a frozen dataclass's
    per-field lookup of ``object.__setattr__`` cost more than the object."""
    f = _new(Fragment)
    _set(f, "tensor", tensor)
    _set(f, "state", state)
    _set(f, "box", box)
    _set(f, "item", item)
    _set(f, "offset", offset)
    _set(f, "strides", strides)
    _set(f, "fill", fill)
    return f



def new_item_info(shape: tuple[int, ...], mapped: int, rule: str) -> ItemInfo:
    """``ItemInfo(shape=shape, mapped=mapped, rule=rule)``, made faster, for layouts derived tensor by tensor from
    a header of 100,000 entries."""
    info = _new(ItemInfo)
    _set(info, "shape", shape)
    _set(info, "mapped", mapped)
    _set(info, "fill", "zero")
    _set(info, "rule", rule)
    _set(info, "tensor", None)
    return info


def new_logical(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> LogicalTensor:
    """``LogicalTensor(name=name, shape=shape, axes=axes, view=shape, dim_axes=(1,) * len(axes))``, one axis per
    dim, made faster, for the same layouts."""
    t = _new(LogicalTensor)
    _set(t, "name", name)
    _set(t, "shape", shape)
    _set(t, "axes", axes)
    _set(t, "view", shape)
    _set(t, "blob", False)
    _set(t, "dim_axes", (1,) * len(axes))
    return t

@dataclass(frozen=True, slots=True)
class Layout:
    topology: Topology
    tensors: Mapping[str, LogicalTensor]
    items: Mapping[Item, ItemInfo]
    fragments: tuple[Fragment, ...]
    order: Mapping[str, tuple[Item, ...]] = field(default_factory=dict)
    """Per section and (unit, chunk): items in registration order, as keys ``section/unit/chunk``."""

    @property
    def states(self) -> tuple[str, ...]:
        return tuple(sorted({f.state for f in self.fragments}))

    def to_json(self) -> dict:
        """The fragment index as JSON-ready data; ``Layout.from_json`` restores an equal layout."""
        items = list(self.items)
        index = {it: k for k, it in enumerate(items)}
        return {
            "topology": str(self.topology),
            "tensors": {n: {"shape": list(t.shape), "axes": list(t.axes), "view": list(t.view), "blob": t.blob,
                            "dim_axes": list(t.dim_axes)} for n, t in self.tensors.items()},
            "items": [{"section": it.section, "unit": [list(u) for u in it.unit], "chunk": it.chunk, "state": it.state,
                       "key": it.key, "shape": list(self.items[it].shape), "mapped": self.items[it].mapped,
                       "fill": self.items[it].fill, "rule": self.items[it].rule,
                       **({"tensor": self.items[it].tensor} if self.items[it].tensor is not None else {})}
                      for it in items],
            "fragments": [[f.tensor, f.state, list(f.box.offsets), list(f.box.lengths), index[f.item], f.offset,
                           list(f.strides), f.fill] for f in self.fragments],
        }

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        from reshard.core.topology import parse_topology

        items = [Item(d["section"], tuple((a, c) for a, c in d["unit"]), d["chunk"], d["state"], d["key"]) for d in data["items"]]
        infos = {it: ItemInfo(shape=tuple(d["shape"]), mapped=d["mapped"], fill=d["fill"], rule=d["rule"],
                              tensor=d.get("tensor"))
                 for it, d in zip(items, data["items"])}
        tensors = {n: LogicalTensor(name=n, shape=tuple(t["shape"]), axes=tuple(t["axes"]), view=tuple(t["view"]), blob=t["blob"],
                                    dim_axes=tuple(t.get("dim_axes", ()))) for n, t in data["tensors"].items()}
        frags = tuple(Fragment(tensor=t, state=s, box=Box(tuple(o), tuple(n)), item=items[i], offset=off,
                               strides=tuple(st), fill=fl) for t, s, o, n, i, off, st, fl in data["fragments"])
        return cls(topology=parse_topology(data["topology"]), tensors=MappingProxyType(tensors),
                   items=MappingProxyType(infos), fragments=frags)


def chunk_fragments(frags: list[Fragment], shape: tuple[int, ...], offsets: tuple[int, ...],
                    sizes: tuple[int, ...], item: Item, strides: tuple[int, ...] | None = None,
                    base: int = 0) -> list[Fragment]:
    """The fragments of a stored tensor that fall in one chunk of it, re-based into that chunk.

    ``frags`` describe an item of ``shape`` (a whole stored tensor, as a spec
    resolved at the trivial topology gives it); the chunk is the box
    ``offsets``/``sizes`` of it, stored row-major and contiguous as ``item``
    (a DCP chunk of a Megatron torch_dist tensor), or at element ``base`` of
    ``item`` with ``strides`` per dim (a box of it inside a flat buffer). Each
    view axis of a fragment lives in one dim of the tensor; per dim,
    ``restrict`` cuts the axes down to the chunk's range, and the pieces
    combine across dims.
    """
    outer = row_major_strides(shape)
    inner = row_major_strides(sizes) if strides is None else strides
    out: list[Fragment] = []
    for f in frags:
        per_dim: dict[int, list[int]] = {}
        for k, (n, st) in enumerate(zip(f.box.lengths, f.strides)):
            if n > 1:
                d = next(d for d in range(len(shape)) if outer[d] <= st and shape[d] > 1)
                if st % outer[d] or (n - 1) * (st // outer[d]) >= shape[d]:
                    raise PlanError(f"{f.tensor}: axis {k} (stride {st}) does not lie within one dim of {shape}")
                per_dim.setdefault(d, []).append(k)
        choices = []
        for d in range(len(shape)):
            start = (f.offset // outer[d]) % shape[d]
            lo, hi = offsets[d], offsets[d] + sizes[d]
            ks = per_dim.get(d, [])
            if not ks:
                if not lo <= start < hi:
                    break
                choices.append([(d, ks, (), (), start)])
                continue
            pieces = restrict(tuple(f.box.offsets[k] for k in ks), tuple(f.box.lengths[k] for k in ks),
                              tuple(f.strides[k] // outer[d] for k in ks), start, lo, hi)
            if not pieces:
                break
            choices.append([(d, ks, o, n, at) for o, n, at in pieces])
        else:
            for combo in itertools.product(*choices):
                offs, lens, strd = list(f.box.offsets), list(f.box.lengths), list(f.strides)
                at = base
                for d, ks, o, n, pos in combo:
                    at += (pos - offsets[d]) * inner[d]
                    for k, oo, nn in zip(ks, o, n):
                        offs[k], lens[k], strd[k] = oo, nn, f.strides[k] // outer[d] * inner[d]
                out.append(Fragment(tensor=f.tensor, state=f.state, box=Box(tuple(offs), tuple(lens)), item=item,
                                    offset=at, strides=tuple(strd), fill=f.fill))
    return out


def held_tensors(layout: Layout) -> set[str]:
    """The logical tensors the layout stores: those with a fragment, and those without elements that an item
    holds (``ItemInfo.tensor``)."""
    return {f.tensor for f in layout.fragments} | {i.tensor for i in layout.items.values() if i.tensor is not None}


def with_state_alias(layout: Layout, state: str, alias: str, only: Collection[str] | None = None) -> Layout:
    """``layout`` with every fragment of ``state`` also offered as ``alias`` (same items, same bytes), for the
    tensors in ``only`` (all when None) that hold no ``alias`` of their own (a frozen parameter keeps its
    weights; a trained one stored only as its fp32 master offers the master as its weights)."""
    own = {f.tensor for f in layout.fragments if f.state == alias}
    extra = tuple(Fragment(tensor=f.tensor, state=alias, box=f.box, item=f.item, offset=f.offset, strides=f.strides,
                           fill=f.fill) for f in layout.fragments
                  if f.state == state and f.tensor not in own and (only is None or f.tensor in only))
    return Layout(topology=layout.topology, tensors=layout.tensors, items=layout.items,
                  fragments=layout.fragments + extra, order=layout.order)


def _is_plain(t: LogicalTensor) -> bool:
    return t.view == t.shape and t.dim_axes.count(1) == len(t.dim_axes)


def _reviewed(layout: Layout, tensors: Mapping[str, LogicalTensor]) -> Layout:
    """``layout`` with each tensor named in ``tensors`` (stored plainly, view = shape) re-viewed through
    that tensor's axes: every fragment, a box of plain dims, becomes the view boxes it covers."""
    frags: list[Fragment] = []
    for f in layout.fragments:
        t = tensors.get(f.tensor)
        if t is None or len(t.axes) == len(t.shape):  # one axis per dim: the view box is the fragment's own box
            frags.append(f)
            continue
        for box, off, st in box_fragments(t, f.box.offsets, f.box.lengths, f.strides, f.offset):
            frags.append(Fragment(tensor=f.tensor, state=f.state, box=box, item=f.item, offset=off, strides=st,
                                  fill=f.fill))
    merged = dict(layout.tensors)
    merged.update(tensors)
    return Layout(topology=layout.topology, tensors=MappingProxyType(merged), items=layout.items,
                  fragments=tuple(frags), order=layout.order)


def common_views(src: Layout, dst: Layout) -> tuple[Layout, Layout]:
    """The two layouts with every shared tensor seen through the same axes.

    A format that stores tensors plainly (DCP chunks, whole tensors) describes
    them by their own dims; a spec may view the same tensor through finer
    axes (``(g qpg hd) h``). Where one side is plain and the shapes agree, it
    takes the other's view, so the planner can intersect boxes. Tensors that
    differ otherwise are left for the planner to report.
    """
    to_src: dict[str, LogicalTensor] = {}
    to_dst: dict[str, LogicalTensor] = {}
    for name, d in dst.tensors.items():
        s = src.tensors.get(name)
        if s is None or s.shape != d.shape or (s.axes == d.axes and s.view == d.view):
            continue
        if _is_plain(s):
            to_src[name] = d
        elif _is_plain(d):
            to_dst[name] = s
    return (_reviewed(src, to_src) if to_src else src), (_reviewed(dst, to_dst) if to_dst else dst)

