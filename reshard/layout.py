"""Resolve a parsed spec against a topology and model sizes into fragments.

``resolve(spec, topology, sizes)`` checks the spec's meaning (variables and axes
exist, degrees divide, every logical axis is covered exactly once, no tensor is
sharded twice over one mesh axis) and returns a ``Layout``: every stored item
each rank group writes, and the ``Fragment``s that say which box of which
logical tensor lives where inside it.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from reshard import spec as S
from reshard.errors import SpecError, TopologyError
from reshard.geometry import Box, restrict, row_major_strides, split_range
from reshard.topology import Topology

__all__ = ["Fragment", "Item", "ItemInfo", "Layout", "LogicalTensor", "box_fragments", "dims_of", "resolve"]

MESH_AXES = ("tp", "pp", "dp", "cp", "ep", "edp")
TOPOLOGY_VARS = ("tp", "pp", "dp", "cp", "ep", "edp", "vpp")
BYTES_AXIS = "nbytes"


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

    def __post_init__(self) -> None:
        # Items key every dict of a plan; hash the five fields once, not at each lookup.
        object.__setattr__(self, "_hash", hash((self.section, self.unit, self.chunk, self.state, self.key)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        where = ",".join(f"{a}={c}" for a, c in self.unit)
        chunk = f",chunk={self.chunk}" if self.chunk else ""
        return f"{self.section}[{where}{chunk}] {self.state}:{self.key}"


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
        raise ValueError(f"{tensor.name}: dim_axes {counts} do not fit shape {tensor.shape} and axes {tensor.axes}")
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
                       "fill": self.items[it].fill, "rule": self.items[it].rule} for it in items],
            "fragments": [[f.tensor, f.state, list(f.box.offsets), list(f.box.lengths), index[f.item], f.offset,
                           list(f.strides), f.fill] for f in self.fragments],
        }

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        from reshard.topology import parse_topology

        items = [Item(d["section"], tuple((a, c) for a, c in d["unit"]), d["chunk"], d["state"], d["key"]) for d in data["items"]]
        infos = {it: ItemInfo(shape=tuple(d["shape"]), mapped=d["mapped"], fill=d["fill"], rule=d["rule"])
                 for it, d in zip(items, data["items"])}
        tensors = {n: LogicalTensor(name=n, shape=tuple(t["shape"]), axes=tuple(t["axes"]), view=tuple(t["view"]), blob=t["blob"],
                                    dim_axes=tuple(t.get("dim_axes", ()))) for n, t in data["tensors"].items()}
        frags = tuple(Fragment(tensor=t, state=s, box=Box(tuple(o), tuple(n)), item=items[i], offset=off,
                               strides=tuple(st), fill=fl) for t, s, o, n, i, off, st, fl in data["fragments"])
        return cls(topology=parse_topology(data["topology"]), tensors=MappingProxyType(tensors),
                   items=MappingProxyType(infos), fragments=frags)


# --- resolution ------------------------------------------------------------------------

# A piece: part of one stored dim mapped onto axes of a target, as a tuple for speed:
# (target ref or None, axes, offsets, lengths, strides in the dim's local index, base, binds, fill)
_Piece = tuple


@dataclass(slots=True)
class _Ctx:
    spec: S.Spec
    topo: Topology
    env: dict[str, int]
    indexes: dict[str, int]
    coords: dict[str, int]
    chunk: int
    tensor: str  # the stored name being resolved, for messages
    layers: str | None  # the capture split over pp


def resolve(
    spec: S.Spec,
    topology: Topology,
    sizes: Mapping[str, int],
    *,
    blob_sizes: Mapping[str, int] | None = None,
    states: Mapping[str, tuple[str, ...]] | None = None,
) -> Layout:
    """Resolve ``spec`` for ``topology`` and model ``sizes`` into a ``Layout``.

    Args:
      spec: a parsed spec with includes expanded (``reshard.catalog.load_spec``).
      topology: the parallel layout.
      sizes: model dimensions by variable name (``h``, ``g``, ``layers``, ...).
      blob_sizes: byte size of each blob (non-tensor state) by name.
      states: per section, the state names it holds, overriding the spec's
        ``states`` list (a checkpoint's own optimizer states).

    Raises:
      SpecError: the spec does not mean anything for these sizes, with its position.
      TopologyError: a degree does not divide a tensor's dim, naming the tensor.
    """
    return _Resolver(spec, topology, dict(sizes), dict(blob_sizes or {}), dict(states or {})).run()


class _Resolver:
    def __init__(self, spec: S.Spec, topo: Topology, sizes: dict[str, int], blobs: dict[str, int], states: dict[str, tuple[str, ...]]) -> None:
        self.spec = spec
        self.topo = topo
        self.sizes = sizes
        self.blob_sizes = blobs
        self.states = states
        self.env: dict[str, int] = {}
        self.indexes: dict[str, int] = {}
        self.logicals: list[S.Logical] = []
        self.by_ref: dict[str, S.Logical] = {}
        self.tensors: dict[str, LogicalTensor] = {}
        self.items: dict[Item, ItemInfo] = {}
        self.fragments: list[Fragment] = []
        self.order: dict[str, tuple[Item, ...]] = {}
        # param-state fragments per item, for flat buffers built on a section
        self.item_frags: dict[Item, list[Fragment]] = {}
        # per source unit and chunk: its params (one per key) and their element counts
        self.flat_params: dict[str, tuple[list[Item], list[int]]] = {}

    def err(self, message: str, pos: S.Pos | None) -> SpecError:
        return self.spec.error(message, pos)

    # -- variables and declarations

    def run(self) -> Layout:
        for name in TOPOLOGY_VARS:
            self.env[name] = self.topo.degree(name)
        for name, value in self.sizes.items():
            if name in TOPOLOGY_VARS:
                if int(value) != self.env[name]:
                    raise SpecError(f"size '{name}' = {value} disagrees with the topology's {name}({self.env[name]})")
                continue
            self.env[name] = int(value)
        sections: list[tuple[S.Section, list[S.Statement]]] = []
        for st in self.spec.statements:
            if isinstance(st, S.Include):
                raise self.err(f"include '{st.path}' was not expanded; load specs with reshard.catalog.load_spec", st.pos)
            if isinstance(st, S.Let):
                if st.name in TOPOLOGY_VARS:
                    raise self.err(f"'{st.name}' is a topology degree; it cannot be redefined", st.pos)
                value = self.eval(st.expr)
                if st.name in self.sizes and int(self.sizes[st.name]) != value:
                    raise self.err(f"'{st.name}' is given as {self.sizes[st.name]} but the spec computes {value}", st.pos)
                self.env[st.name] = value
            elif isinstance(st, S.IndexDecl):
                if st.name in self.indexes:
                    raise self.err(f"index '{st.name}' is declared twice", st.pos)
                self.indexes[st.name] = self.eval(st.size)
            elif isinstance(st, S.Logical):
                self.declare(st)
            elif isinstance(st, S.Section):
                sections.append((st, []))
            else:
                if not sections:
                    raise self.err("a stored tensor, blob or flat buffer must come after a 'section' line", st.pos)
                if isinstance(st, S.Blob):
                    self.declare_blob(st)
                sections[-1][1].append(st)
        names = [s.name for s, _ in sections]
        for sec, rules in sections:
            if names.count(sec.name) > 1:
                raise self.err(f"section '{sec.name}' is declared twice", sec.pos)
            self.section(sec, rules, {s.name: s for s, _ in sections})
        return Layout(
            topology=self.topo,
            tensors=MappingProxyType(self.tensors),
            items=MappingProxyType(self.items),
            fragments=tuple(self.fragments),
            order=MappingProxyType(self.order),
        )

    def eval(self, e: S.Expr) -> int:
        if isinstance(e, S.Num):
            return e.value
        if isinstance(e, S.Var):
            if e.name not in self.env:
                known = ", ".join(sorted(self.env)) or "none"
                raise self.err(f"unknown variable '{e.name}' (bound: {known})", e.pos)
            return self.env[e.name]
        if isinstance(e, S.Call):
            args = [self.eval(a) for a in e.args]
            want = {"cdiv": 2, "roundup": 2, "lcm": None, "min": None, "max": None}[e.fn]
            if (want and len(args) != want) or not args:
                raise self.err(f"{e.fn}() takes {want or 'one or more'} arguments, got {len(args)}", e.pos)
            if e.fn in ("cdiv", "roundup") and args[1] <= 0:
                raise self.err(f"{e.fn}() divisor must be positive, got {args[1]}", e.pos)
            if e.fn == "cdiv":
                return -(-args[0] // args[1])
            if e.fn == "roundup":
                return -(-args[0] // args[1]) * args[1]
            if e.fn == "lcm":
                return math.lcm(*args)
            return min(args) if e.fn == "min" else max(args)
        a, b = self.eval(e.left), self.eval(e.right)
        if e.op == "+":
            return a + b
        if e.op == "-":
            return a - b
        if e.op == "*":
            return a * b
        if b == 0:
            raise self.err("division by zero", e.pos)
        if e.op == "//":
            return a // b
        if a % b:
            raise self.err(f"{a} / {b} is not a whole number (use // to round down or cdiv() to round up)", e.pos)
        return a // b

    def declare(self, st: S.Logical) -> None:
        axes: list[tuple[str, S.Pos]] = []
        shape: list[int] = []
        counts: list[int] = []
        for term in st.dims or ():
            dim_axes = _logical_axes(term, self)
            axes += dim_axes
            counts.append(len(dim_axes))
            shape.append(math.prod(self.axis_size(a, p) for a, p in dim_axes))
        names = [a for a, _ in axes]
        for a, p in axes:
            if names.count(a) > 1:
                raise self.err(f"axis '{a}' appears twice in logical tensor {st.pattern.text}", p)
        for cap in st.pattern.captures:
            if cap.axis is not None:
                raise self.err(f"a logical name captures global indices only; write '{{{cap.name}}}'", cap.pos)
            if cap.name not in self.indexes:
                raise self.err(f"unknown index '{cap.name}' (declared: {', '.join(self.indexes) or 'none'}; add 'index {cap.name} < N')", cap.pos)
        for key in filter(None, (st.alias, st.pattern.text)):
            if key in self.by_ref:
                raise self.err(f"logical tensor '{key}' is declared twice", st.pos)
            self.by_ref[key] = st
        view = tuple(self.axis_size(a, p) for a, p in axes)
        for values in self.capture_values(st.pattern):
            name = st.pattern.format(values)
            self.tensors[name] = LogicalTensor(name=name, shape=tuple(shape), axes=tuple(names), view=view, dim_axes=tuple(counts))
        self.logicals.append(st)

    def declare_blob(self, st: S.Blob) -> None:
        if st.pattern.text in self.by_ref:
            return
        for cap in st.pattern.captures:
            if cap.name not in self.indexes:
                raise self.err(f"unknown index '{cap.name}' (declared: {', '.join(self.indexes) or 'none'})", cap.pos)
        glob = S.Pattern(tuple(p if isinstance(p, str) else S.Capture(p.name, None, p.pos) for p in st.pattern.parts), st.pattern.text, st.pos)
        decl = S.Logical(glob, None, (S.Axis(BYTES_AXIS, st.pos),), st.pos)
        self.by_ref[st.pattern.text] = decl
        for values in self.capture_values(glob):
            name = glob.format(values)
            if not st.regenerate and name not in self.blob_sizes:
                raise self.err(f"the byte size of blob '{name}' is unknown (give it in blob_sizes)", st.pos)
            n = self.blob_sizes.get(name, 0)
            self.tensors[name] = LogicalTensor(name=name, shape=(n,), axes=(BYTES_AXIS,), view=(n,), blob=True, dim_axes=(1,))

    def axis_size(self, name: str, pos: S.Pos) -> int:
        if name not in self.env:
            known = ", ".join(sorted(k for k in self.env if k not in TOPOLOGY_VARS)) or "none"
            raise self.err(f"unknown axis '{name}' (sizes known: {known})", pos)
        return self.env[name]

    def capture_values(self, pattern: S.Pattern) -> Iterable[dict[str, int]]:
        caps = list(dict.fromkeys(c.name for c in pattern.captures))
        for combo in itertools.product(*(range(self.indexes[c]) for c in caps)):
            yield dict(zip(caps, combo))

    # -- sections

    def section(self, sec: S.Section, rules: list[S.Statement], sections: dict[str, S.Section]) -> None:
        for k, (ax, pos) in enumerate(zip(sec.axes, sec.axes_pos or (sec.pos,) * len(sec.axes))):
            if ax not in MESH_AXES:
                raise self.err(f"unknown mesh axis '{ax}' (expected one of: {', '.join(MESH_AXES)})", pos)
            if ax in sec.axes[:k]:
                raise self.err(f"mesh axis '{ax}' is listed twice", pos)
        states = self.states.get(sec.name, sec.states)
        units = [tuple(zip(sec.axes, c)) for c in itertools.product(*(range(self.topo.degree(a)) for a in sec.axes))]
        pipelined = "pp" in sec.axes
        chunks = range(self.topo.vpp) if pipelined else range(1)
        flats = [r for r in rules if isinstance(r, S.Flat)]
        tensor_rules = [r for r in rules if not isinstance(r, S.Flat)]
        if flats and tensor_rules:
            raise self.err(f"section '{sec.name}' mixes flat buffers with stored tensors; give flat buffers their own section", flats[0].pos)
        checked: set[int] = set()
        for unit in units:
            coords = dict(unit)
            for chunk in chunks:
                if flats:
                    for fl in flats:
                        self.flat(sec, fl, unit, chunk, states, sections)
                    continue
                ordered: list[Item] = []
                for rule, values in self.expand(sec, tensor_rules, coords, chunk, pipelined):
                    if id(rule) not in checked:
                        checked.add(id(rule))
                        self.check_rule(sec, rule)
                    ordered += self.stored(sec, rule, unit, coords, chunk, values, states)
                self.order[_order_key(sec.name, unit, chunk)] = tuple(ordered)

    def expand(self, sec: S.Section, rules: list[S.Statement], coords: dict[str, int], chunk: int, pipelined: bool):
        """Rules with their capture values for one unit, in registration order.

        Consecutive rules sharing the capture split over pp form a block that is
        repeated layer by layer (a transformer layer's parameters stay together).
        """
        i = 0
        while i < len(rules):
            rule = rules[i]
            layer = _pp_capture(rule)
            if layer is None:
                if self.placed(rule, coords, chunk, pipelined):
                    for values in self.rule_values(rule, coords, chunk, None):
                        yield rule, values
                i += 1
                continue
            if getattr(rule, "place", None) is not None:
                raise self.err(f"a rule with '{{{layer.name}/pp}}' sits on the stage of its layer; drop '@{rule.place}'", rule.pos)
            j = i
            while j < len(rules) and _layer_name(rules[j]) == layer.name:
                j += 1
            block = rules[i:j]
            for lv in self.layer_values(layer, coords, chunk, rule):
                for r in block:
                    for values in self.rule_values(r, coords, chunk, lv):
                        yield r, values
            i = j

    def placed(self, rule: S.Statement, coords: dict[str, int], chunk: int, pipelined: bool) -> bool:
        place = rule.place if isinstance(rule, S.Stored) else None
        if place == "lastonly" and not pipelined:
            return False
        if pipelined and place is None and _stacks_over_pp(rule):
            return True  # layers stacked on a dim split over pp: one item per (stage, chunk)
        if not pipelined or place is None:
            return chunk == 0
        if place == "first":
            return coords["pp"] == 0 and chunk == 0
        last = coords["pp"] == self.topo.pp - 1 and chunk == self.topo.vpp - 1
        return last and (place == "last" or self.topo.pp * self.topo.vpp > 1)

    def layer_values(self, cap: S.Capture, coords: dict[str, int], chunk: int, rule: S.Statement) -> list[tuple[int, int]]:
        n = self.index_size(cap)
        if "pp" not in coords:
            raise self.err(f"'{{{cap.name}/pp}}' needs 'pp' among the section's 'per' axes", cap.pos)
        try:
            places = self.topo.layer_placement(n)
        except TopologyError as e:
            raise TopologyError(f"{_name(rule)}: {e}") from None
        return [(g, p.local) for g, p in enumerate(places) if p.stage == coords["pp"] and p.chunk == chunk]

    def index_size(self, cap: S.Capture) -> int:
        if cap.name not in self.indexes:
            raise self.err(f"unknown index '{cap.name}' (declared: {', '.join(self.indexes) or 'none'})", cap.pos)
        return self.indexes[cap.name]

    def rule_values(self, rule: S.Statement, coords: dict[str, int], chunk: int, layer: tuple[int, int] | None):
        """Capture values of one rule: each a dict name -> (global, local)."""
        caps = list({c.name: c for c in rule.pattern.captures}.values())
        choices = []
        for cap in caps:
            if cap.axis == "pp":
                choices.append([layer])
            elif cap.axis is None:
                choices.append([(v, v) for v in range(self.index_size(cap))])
            else:
                n = self.index_size(cap)
                if cap.axis not in MESH_AXES:
                    raise self.err(f"unknown mesh axis '{cap.axis}' (expected one of: {', '.join(MESH_AXES)})", cap.pos)
                if cap.axis not in coords:
                    raise self.err(f"'{{{cap.name}/{cap.axis}}}' needs '{cap.axis}' among the section's 'per' axes", cap.pos)
                d = self.topo.degree(cap.axis)
                if n % d:
                    raise TopologyError(f"{_name(rule)}: {cap.name}({n}) is not divisible by {cap.axis}({d})")
                lo = coords[cap.axis] * (n // d)
                choices.append([(lo + j, j) for j in range(n // d)])
        for combo in itertools.product(*choices):
            yield dict(zip((c.name for c in caps), combo))

    # -- stored tensors

    def check_rule(self, sec: S.Section, rule: S.Statement) -> None:
        """Symbolic checks of a stored rule: each target's axes covered once, splits valid."""
        if isinstance(rule, S.Blob):
            return
        assert isinstance(rule, S.Stored)
        for cap in rule.pattern.captures:
            self.index_size(cap)
            if cap.axis is not None and cap.axis not in MESH_AXES:
                raise self.err(f"unknown mesh axis '{cap.axis}' (expected one of: {', '.join(MESH_AXES)})", cap.pos)
        targets: dict[str | None, tuple[list[tuple[str, S.Pos]], list[tuple[str, S.Pos]], list[tuple[str, S.Pos]]]] = {}
        outer: tuple[list, list, list] = ([], [], [])
        concats = [0]

        def walk(term: S.Term, acc: tuple[list, list, list], in_part: bool) -> None:
            axes, splits, indexes = acc
            if isinstance(term, S.Axis):
                axes.append((term.name, term.pos))
            elif isinstance(term, S.Index):
                indexes.append((term.name, term.pos))
            elif isinstance(term, S.Product):
                for t in term.terms:
                    walk(t, acc, in_part)
            elif isinstance(term, S.Split):
                if term.axis not in MESH_AXES:
                    raise self.err(f"unknown mesh axis '{term.axis}' (expected one of: {', '.join(MESH_AXES)})", term.pos)
                if term.axis not in sec.axes:
                    raise self.err(
                        f"split over '{term.axis}' but section '{sec.name}' is stored per {', '.join(sec.axes) or 'nothing'}"
                        f" (add '{term.axis}' to its 'per' axes)", term.pos)
                splits.append((term.axis, term.pos))
                walk(term.term, acc, in_part)
            elif isinstance(term, S.Pad):
                self.eval(term.multiple)
                walk(term.term, acc, in_part)
            elif isinstance(term, S.Concat):
                if in_part:
                    raise self.err("a concatenation inside a concatenation part is not supported", term.pos)
                concats[0] += 1
                if concats[0] > 1:
                    raise self.err("a stored tensor may have one concatenation", term.pos)
                for part in term.parts:
                    if part.ref is None:
                        self.eval(part.size)
                        continue
                    if part.ref not in self.by_ref:
                        raise self.err(f"unknown logical tensor '{part.ref}' (aliases: {', '.join(sorted(a for a in self.by_ref if '.' not in a)) or 'none'})", part.pos)
                    if part.ref in targets:
                        raise self.err(f"part '{part.ref}' appears twice", part.pos)
                    sub: tuple[list, list, list] = ([], [], [])
                    targets[part.ref] = sub
                    for t in part.terms:
                        walk(t, sub, True)

        for term in rule.dims or ():
            walk(term, outer, False)
        if not targets:
            ref = rule.ref or rule.pattern.text
            if ref not in self.by_ref:
                hint = f"no logical tensor named '{ref}'" + ("" if rule.ref else " (map it with '-> name')")
                raise self.err(hint, rule.pos)
            targets[ref] = ([], [], [])
        elif rule.ref is not None:
            raise self.err("'-> name' cannot be combined with a concatenation; the parts name their tensors", rule.pos)
        store_caps = {c.name for c in rule.pattern.captures}
        for ref, (axes, splits, indexes) in targets.items():
            decl = self.by_ref[ref]
            want = [a for a in self.tensors_axes(decl)]
            have = outer[0] + axes
            for a, p in have:
                if a not in want:
                    raise self.err(f"unknown axis '{a}' for {decl.pattern.text} (its axes: {', '.join(want) or 'none, a scalar'})", p)
                if [x for x, _ in have].count(a) > 1:
                    raise self.err(f"axis '{a}' of {decl.pattern.text} is used twice", p)
            missing = [a for a in want if a not in [x for x, _ in have]]
            if missing:
                raise self.err(f"{decl.pattern.text} axis {', '.join(repr(m) for m in missing)} is not stored by this rule", rule.pos)
            all_splits = outer[1] + splits
            for ax, p in all_splits:
                if [x for x, _ in all_splits].count(ax) > 1:
                    raise self.err(f"{decl.pattern.text} is sharded twice over '{ax}'", p)
            idx = outer[2] + indexes
            need = {c.name for c in decl.pattern.captures}
            for name, p in idx:
                if name not in need:
                    raise self.err(f"index '{{{name}}}' is not a capture of {decl.pattern.text}", p)
                if name in store_caps:
                    raise self.err(f"index '{{{name}}}' is both in the name and a dim", p)
            lacking = need - store_caps - {n for n, _ in idx}
            if lacking:
                raise self.err(f"capture {', '.join('{' + n + '}' for n in sorted(lacking))} of {decl.pattern.text} is not given by this rule's name or dims", rule.pos)

    def tensors_axes(self, decl: S.Logical) -> list[str]:
        out: list[str] = []
        for term in decl.dims or ():
            out += [a for a, _ in _logical_axes(term, self)]
        return out

    def stored(self, sec, rule, unit, coords, chunk, values, states) -> list[Item]:
        key = rule.pattern.format({k: v[1] for k, v in values.items()})
        global_values = {k: v[0] for k, v in values.items()}
        if isinstance(rule, S.Blob):
            decl = self.by_ref[rule.pattern.text]
            name = decl.pattern.format(global_values)
            n = self.tensors[name].view[0]
            out = []
            for state in states:
                item = Item(sec.name, unit, chunk, state, key)
                self.add_item(item, ItemInfo(shape=(n,), mapped=0 if rule.regenerate else n, fill="regenerate" if rule.regenerate else "zero", rule=rule.pattern.text), rule.pos)
                if not rule.regenerate and n:
                    self.add_frag(Fragment(tensor=name, state=state, box=Box((0,), (n,)), item=item, offset=0, strides=(1,)), sec)
                out.append(item)
            return out
        ctx = _Ctx(self.spec, self.topo, self.env, self.indexes, coords, chunk, key, _layer_name(rule))
        shape, combos = self.dims(rule, ctx)
        if _stacks_over_pp(rule) and 0 in shape:
            return []  # no layer of this stack on this (stage, chunk)
        item_strides = row_major_strides(shape)
        frags: list[tuple] = []
        mapped = 0
        for combo in combos:
            ref = next((p[0] for p in combo if p[0] is not None), None) or rule.ref or rule.pattern.text
            decl = self.by_ref[ref]
            binds = dict(global_values)
            where: dict[str, tuple[int, int, int]] = {}
            base = 0
            fill = False
            for d, p in enumerate(combo):
                for a, o, n, s in zip(p[1], p[2], p[3], p[4]):
                    where[a] = (o, n, s * item_strides[d])
                base += p[5] * item_strides[d]
                binds.update(p[6])
                fill = fill or p[7]
            name = decl.pattern.format(binds)
            lt = self.tensors[name]
            offs = tuple(where[a][0] for a in lt.axes)
            lens = tuple(where[a][1] for a in lt.axes)
            strides = tuple(where[a][2] for a in lt.axes)
            mapped += math.prod(lens)
            frags.append((name, Box(offs, lens), base, strides, fill))
        out = []
        for state in states:
            item = Item(sec.name, unit, chunk, state, key)
            self.add_item(item, ItemInfo(shape=shape, mapped=mapped, rule=rule.pattern.text), rule.pos)
            for name, box, base, strides, fill in frags:
                self.add_frag(Fragment(tensor=name, state=state, box=box, item=item, offset=base, strides=strides, fill=fill), sec)
            out.append(item)
        return out

    def add_item(self, item: Item, info: ItemInfo, pos: S.Pos | None = None) -> None:
        if item in self.items:
            raise self.err(f"two rules store {item} (rules '{self.items[item].rule}' and '{info.rule}')", pos)
        self.items[item] = info
        self.item_frags[item] = []

    def add_frag(self, frag: Fragment, sec: S.Section) -> None:
        self.fragments.append(frag)
        self.item_frags[frag.item].append(frag)

    def dims(self, rule: S.Stored, ctx: _Ctx) -> tuple[tuple[int, ...], list[tuple[_Piece, ...]]]:
        if rule.dims is None:
            return (), [()]
        per_dim = [_eval_term(t, ctx, self) for t in rule.dims]
        shape = tuple(e for e, _ in per_dim)
        combos = []
        for combo in itertools.product(*(p for _, p in per_dim)):
            targets = {p[0] for p in combo if p[0] is not None}
            if len(targets) <= 1:
                combos.append(combo)
        return shape, combos

    # -- flat buffers

    def flat(self, sec: S.Section, fl: S.Flat, unit, chunk: int, states: tuple[str, ...], sections: dict[str, S.Section]) -> None:
        src = sections.get(fl.source)
        if src is None:
            raise self.err(f"unknown section '{fl.source}' (declared: {', '.join(sections)})", fl.pos)
        coords = dict(unit)
        split_axes = [op.arg for op in fl.ops if op.op == "split"]
        for ax in split_axes:
            if ax not in MESH_AXES:
                raise self.err(f"unknown mesh axis '{ax}' (expected one of: {', '.join(MESH_AXES)})", fl.pos)
        extra = set(sec.axes) - set(src.axes) - set(split_axes)
        missing = set(src.axes) - set(sec.axes)
        if missing or extra:
            raise self.err(
                f"flat buffers of '{sec.name}' (per {', '.join(sec.axes)}) must be stored per the axes of "
                f"'{src.name}' ({', '.join(src.axes)}) plus their split axes ({', '.join(split_axes) or 'none'})", sec.pos)
        src_unit = tuple((a, coords[a]) for a in src.axes)
        order_key = _order_key(src.name, src_unit, chunk)
        if order_key not in self.flat_params:  # shared by every rank of the split axis
            ordered = self.order.get(order_key)
            if ordered is None:
                raise self.err(f"section '{fl.source}' must come before the flat buffer built from it", fl.pos)
            first_state: dict[str, Item] = {}
            for it in ordered:
                first_state.setdefault(it.key, it)
            self.flat_params[order_key] = (list(first_state.values()), [self.items[p].numel for p in first_state.values()])
        params, numels = self.flat_params[order_key]
        buckets = _flat_layout(fl, numels, coords, self)
        caps = {c.name for c in fl.pattern.captures}
        unknown = caps - {"state", "bucket"}
        if unknown:
            raise self.err(f"a flat buffer name may capture only {{state}} and {{bucket}}, not {{{unknown.pop()}}}", fl.pos)
        if len(buckets) > 1 and "bucket" not in caps:
            raise self.err("this flat buffer has several buckets: put '{bucket}' in its name or add '| coalesce'", fl.pos)
        for b, (length, pieces) in enumerate(buckets):
            if length == 0:
                continue
            geo: list[tuple] = []
            for p_index, a, z, dst in pieces:
                for fr in self.item_frags[params[p_index]]:
                    for offs, lens, base in restrict(fr.box.offsets, fr.box.lengths, fr.strides, fr.offset, a, z):
                        geo.append((fr.tensor, Box(offs, lens), base - a + dst, fr.strides, fr.fill))
            mapped = sum(math.prod(g[1].lengths) for g in geo if not g[4])
            for state in states:
                key = fl.pattern.format({"state": state, "bucket": b})
                item = Item(sec.name, unit, chunk, state, key)
                self.add_item(item, ItemInfo(shape=(length,), mapped=mapped, rule=fl.pattern.text), fl.pos)
                for name, box, base, strides, fill in geo:
                    if not fill:
                        self.add_frag(Fragment(tensor=name, state=state, box=box, item=item, offset=base, strides=strides), sec)


def _order_key(section: str, unit, chunk: int) -> str:
    return f"{section}/{','.join(f'{a}={c}' for a, c in unit)}/{chunk}"


def _name(rule: S.Statement) -> str:
    return rule.pattern.text


def _pp_capture(rule: S.Statement) -> S.Capture | None:
    return next((c for c in rule.pattern.captures if c.axis == "pp"), None) if hasattr(rule, "pattern") else None


def _stacks_over_pp(rule: S.Statement) -> bool:
    def walk(t: S.Term) -> bool:
        if isinstance(t, S.Split):
            return (t.axis == "pp" and isinstance(t.term, S.Index)) or walk(t.term)
        if isinstance(t, S.Pad):
            return walk(t.term)
        if isinstance(t, S.Product):
            return any(walk(x) for x in t.terms)
        if isinstance(t, S.Concat):
            return any(walk(x) for p in t.parts for x in p.terms)
        return False

    return isinstance(rule, S.Stored) and any(walk(t) for t in rule.dims or ())


def _layer_name(rule: S.Statement) -> str | None:
    cap = _pp_capture(rule)
    return cap.name if cap else None


def _logical_axes(term: S.Term, r: _Resolver) -> list[tuple[str, S.Pos]]:
    if isinstance(term, S.Axis):
        return [(term.name, term.pos)]
    if isinstance(term, S.Product):
        out = []
        for t in term.terms:
            out += _logical_axes(t, r)
        return out
    raise r.err("a logical tensor's dims are axis names and (products); splits, pads, concatenations and indices belong to stored tensors", term.pos)


def _show(term: S.Term) -> str:
    if isinstance(term, S.Axis):
        return term.name
    if isinstance(term, S.Index):
        return "{" + term.name + "}"
    if isinstance(term, S.Product):
        return "(" + " ".join(_show(t) for t in term.terms) + ")"
    if isinstance(term, S.Split):
        return f"{_show(term.term)}/{term.axis}"
    if isinstance(term, S.Pad):
        return f"{_show(term.term)}~"
    return "[" + " | ".join((p.ref or "pad") + ": " + " ".join(_show(t) for t in p.terms) for p in term.parts) + "]"


def _eval_term(term: S.Term, ctx: _Ctx, r: _Resolver) -> tuple[int, list[_Piece]]:
    """A stored dim's local extent for this unit, and its pieces."""
    if isinstance(term, S.Axis):
        n = r.axis_size(term.name, term.pos)
        return n, [(None, (term.name,), (0,), (n,), (1,), 0, (), False)] if n else []
    if isinstance(term, S.Index):
        n = ctx.indexes[term.name]
        return n, [(None, (), (), (), (), v, ((term.name, v),), False) for v in range(n)]
    if isinstance(term, S.Product):
        evs = [_eval_term(t, ctx, r) for t in term.terms]
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
            n, pcs = _eval_term(S.Product(part.terms, part.pos), ctx, r)
            pieces += [(part.ref, *p[1:5], p[5] + at, p[6], p[7]) for p in pcs]
            at += n
        return at, pieces
    if isinstance(term, S.Pad):
        n, pcs = _eval_term(term.term, ctx, r)
        m = r.eval(term.multiple)
        if m <= 0:
            raise r.err(f"pad multiple must be positive, got {m}", term.pos)
        padded = -(-n // m) * m
        if term.policy == "last" and padded > n:
            last = [(p[0], p[1], o, ln, p[4], b, p[6], True) for p in pcs for o, ln, b in restrict(p[2], p[3], p[4], p[5], n - 1, n)]
            pcs = pcs + [(p[0], p[1], p[2], p[3], p[4], j, p[6], True) for j in range(n, padded) for p in last]
        return padded, pcs
    # Split
    n, pcs = _eval_term(term.term, ctx, r)
    d = ctx.topo.degree(term.axis)
    c = ctx.coords[term.axis]
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
            raise TopologyError(f"{ctx.tensor}: {_show(term.term)}({n}) is not divisible by {term.axis}({d})")
        lo, hi = split_range(n, d, c)
    elif term.mode == "chunk":
        lo, hi = split_range(n, d, c, "chunk")
    else:
        widths = tuple(r.eval(w) for w in term.widths)
        if len(widths) != d or sum(widths) != n or min(widths) < 0:
            raise r.err(f"widths {' + '.join(map(str, widths))} must be {d} non-negative numbers summing to {_show(term.term)}({n})", term.pos)
        lo, hi = split_range(n, d, c, "widths", widths)
    out = []
    for p in pcs:
        for offs, lens, base in restrict(p[2], p[3], p[4], p[5], lo, hi):
            out.append((p[0], p[1], offs, lens, p[4], base - lo, p[6], p[7]))
    return hi - lo, out


def _flat_layout(fl: S.Flat, numels: list[int], coords: dict[str, int], r: _Resolver) -> list[tuple[int, list[tuple[int, int, int, int]]]]:
    """Where each param's elements sit in this rank's flat buffer(s).

    Returns, per output buffer (bucket), its local length and the pieces
    ``(param index, param flat start, param flat end, local offset)``; every
    number is in elements.
    """
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
    if perparam and (align > 1 or bucket_size or coalesce):
        raise r.err("'perparam' pads and splits each param on its own; it cannot be combined with align, buckets or coalesce", fl.pos)
    d = r.topo.degree(split) if split else 1
    c = coords[split] if split else 0
    if perparam:
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
    # Place params into buckets of the world buffer (before the dp split).
    buckets: list[tuple[int, int, list[tuple[int, int, int]]]] = []  # (start, unpadded end, [(param, start, end)])
    start = 0
    pos = 0
    members: list[tuple[int, int, int]] = []
    for p in order:
        pos = -(-pos // align) * align
        members.append((p, pos, pos + numels[p]))
        pos += numels[p]
        if bucket_size and pos - start >= bucket_size:
            buckets.append((start, pos, members))
            start = pos = -(-pos // pad) * pad
            members = []
    if members or not buckets:
        buckets.append((start, pos, members))
    out = []
    coalesced_at = 0
    for b_start, b_end, mem in buckets:
        padded = -(-(b_end - b_start) // pad) * pad
        if padded % d:
            raise r.err(f"bucket of {padded} elements is not divisible by {split}({d}); pad it to a multiple ('| pad N')", fl.pos)
        share = padded // d
        w0, w1 = b_start + c * share, b_start + (c + 1) * share
        pieces = []
        for p, s, e in mem:
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
