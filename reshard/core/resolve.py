"""Resolve a parsed spec against a topology and model sizes into a ``Layout``.

``resolve(spec, topology, sizes)`` checks the spec's meaning (variables and axes
exist, degrees divide, every logical axis is covered exactly once, no tensor is
sharded twice over one mesh axis) and enumerates, unit by unit, every stored
item and the fragments of logical tensors inside it. Pure: nothing here opens
a file.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from types import MappingProxyType

from reshard.core import spec as S
from reshard.core.collector import collector_paused
from reshard.core.geometry import Box, row_major_strides
from reshard.core.layout import Fragment, Item, ItemInfo, Layout, LogicalTensor, new_fragment, new_item
from reshard.core.flats import FlatBuffers, order_key
from reshard.core.names import ETP, MESH_AXES, Captures, _layer_name
from reshard.core.terms import Ctx, eval_term
from reshard.core.topology import Topology
from reshard.errors import SpecError

__all__ = ["BYTES_AXIS", "MESH_AXES", "TOPOLOGY_VARS", "resolve"]

TOPOLOGY_VARS = ("tp", "pp", "dp", "cp", "ep", "edp", "vpp")
BYTES_AXIS = "nbytes"


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
      spec: a parsed spec with includes expanded (``reshard.models.catalog.load_spec``).
      topology: the parallel layout.
      sizes: model dimensions by variable name (``h``, ``g``, ``layers``, ...).
      blob_sizes: byte size of each blob (non-tensor state) by name.
      states: per section, the state names it holds, overriding the spec's
        ``states`` list (a checkpoint's own optimizer states).

    Raises:
      SpecError: the spec does not mean anything for these sizes, with its position.
      TopologyError: a degree does not divide a tensor's dim, naming the tensor.
    """
    with collector_paused():
        return _Resolver(spec, topology, dict(sizes), dict(blob_sizes or {}), dict(states or {})).run()


class _Resolver(Captures, FlatBuffers):
    def __init__(self, spec: S.Spec, topo: Topology, sizes: dict[str, int], blobs: dict[str, int], states: dict[str, tuple[str, ...]]) -> None:
        self.spec = spec
        self.topo = topo
        self.sizes = sizes
        self.blob_sizes = blobs
        self.states = states
        self.env: dict[str, int] = {}
        self.indexes: dict[str, int] = {}
        self.parts: dict[str, tuple[int, int, str]] = {}
        """A part of another index's range (``index m in i from k``): its first value, the parent's size (which
        places its values over pipeline stages) and the parent, whose capture a rule capturing the part gives."""
        self.logicals: list[S.Logical] = []
        self.by_ref: dict[str, S.Logical] = {}
        self.tensors: dict[str, LogicalTensor] = {}
        self.items: dict[Item, ItemInfo] = {}
        self.fragments: list[Fragment] = []
        self.order: dict[str, tuple[Item, ...]] = {}
        # param-state fragments per item, for flat buffers built on a section
        self.item_frags: dict[Item, list[Fragment]] = {}
        self.init_flats()
        # items holding a blob's bytes: flat buffers hold tensors, not bytes
        self.blob_items: set[Item] = set()
        # per stored rule, chunk and coordinates of its split axes: its shape, fragment templates (``templates``) and
        # item infos, shared by the layers; with capture values too, what ``stored_parts`` gives, shared by the units
        # alike
        self.shaped: dict[tuple, tuple[tuple[int, ...], list[tuple], dict[tuple, ItemInfo]]] = {}
        self.stored_made: dict[tuple, tuple] = {}
        self.rule_splits: dict[int, tuple[str, ...]] = {}
        self.rule_facts: dict[int, tuple[S.Capture | None, str | None, bool, tuple[str, ...]]] = {}
        self.rule_values_made: dict[tuple, list[dict[str, tuple[int, int]]]] = {}

    def err(self, message: str, pos: S.Pos | None) -> SpecError:
        return self.spec.error(message, pos)

    # -- variables and declarations

    def run(self) -> Layout:
        for name in TOPOLOGY_VARS:
            self.env[name] = self.topo.degree(name)
        self.env[ETP] = self.topo.degree(ETP)  # the experts' tensor parallelism; a size 'etp' given overrides it
        for name, value in self.sizes.items():
            if name in TOPOLOGY_VARS:
                if int(value) != self.env[name]:
                    raise SpecError(f"size '{name}' = {value} disagrees with the topology's {name}({self.env[name]})")
                continue
            self.env[name] = int(value)
        sections: list[tuple[S.Section, list[S.Statement]]] = []
        for st in self.spec.statements:
            if isinstance(st, S.Include):
                raise self.err(f"include '{st.path}' was not expanded; load specs with reshard.models.catalog.load_spec", st.pos)
            if isinstance(st, S.Let):
                if st.name in TOPOLOGY_VARS:
                    raise self.err(f"'{st.name}' is a topology degree; it cannot be redefined", st.pos)
                value = self.eval(st.expr)
                if st.name in self.sizes and int(self.sizes[st.name]) != value:
                    raise self.err(f"'{st.name}' is given as {self.sizes[st.name]} but the spec computes {value}", st.pos)
                self.env[st.name] = value
            elif isinstance(st, S.IndexDecl):
                self.declare_index(st)
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

    def declare_index(self, st: S.IndexDecl) -> None:
        if st.name in self.indexes:
            raise self.err(f"index '{st.name}' is declared twice", st.pos)
        if st.parent is None:
            if st.size is None:
                raise self.err(f"index '{st.name}' has no range ('index {st.name} < N')", st.pos)
            self.indexes[st.name] = self.eval(st.size)
            if self.indexes[st.name] < 0:
                raise self.err(f"index '{st.name}' ranges over {self.indexes[st.name]} values; a range must be >= 0", st.pos)
            return
        if st.parent not in self.indexes or st.parent in self.parts:
            raise self.err(f"index '{st.name}' is a part of '{st.parent}', which must be declared before it with "
                           f"'index {st.parent} < N'", st.pos)
        full = self.indexes[st.parent]
        lo = self.eval(st.start) if st.start is not None else 0
        hi = self.eval(st.size) if st.size is not None else full
        if not 0 <= lo <= hi <= full:
            raise self.err(f"index '{st.name}' takes {st.parent} from {lo} to {hi}, outside {st.parent}'s 0 to {full}",
                           st.pos)
        self.indexes[st.name] = hi - lo
        self.parts[st.name] = (lo, full, st.parent)

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
            if cap.axis is not None or not st.pattern.plain:
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
        if not st.pattern.plain:
            raise self.err("a blob name takes plain captures only ('{name}')", st.pos)
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
            if n < 0:
                raise self.err(f"blob '{name}' has byte size {n}; a size must be >= 0", st.pos)
            self.tensors[name] = LogicalTensor(name=name, shape=(n,), axes=(BYTES_AXIS,), view=(n,), blob=True, dim_axes=(1,))

    def axis_size(self, name: str, pos: S.Pos) -> int:
        if name not in self.env:
            known = ", ".join(sorted(k for k in self.env if k not in (*TOPOLOGY_VARS, ETP))) or "none"
            raise self.err(f"unknown axis '{name}' (sizes known: {known})", pos)
        if self.env[name] < 0:
            raise self.err(f"axis '{name}' has size {self.env[name]}; a size must be >= 0", pos)
        return self.env[name]

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
        etp = self.env[ETP]
        for unit in units:
            coords = dict(unit)
            if "tp" in coords:
                coords[ETP] = coords["tp"] % etp
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
                self.order[order_key(sec.name, unit, chunk)] = tuple(ordered)

    # -- stored tensors

    def check_rule(self, sec: S.Section, rule: S.Statement) -> None:
        """Symbolic checks of a stored rule: each target's axes covered once, splits valid."""
        if isinstance(rule, S.Blob):
            return
        if not isinstance(rule, S.Stored):
            raise self.err(f"a section holds stored tensors and blobs, not {type(rule).__name__.lower()} lines", rule.pos)
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
                if term.axis not in MESH_AXES and term.axis != ETP:
                    raise self.err(f"unknown mesh axis '{term.axis}' (expected one of: {', '.join(MESH_AXES)}, {ETP})",
                                   term.pos)
                per = "tp" if term.axis == ETP else term.axis  # a unit's etp rank is its tp rank mod etp
                if per not in sec.axes:
                    raise self.err(
                        f"split over '{term.axis}' but section '{sec.name}' is stored per {', '.join(sec.axes) or 'nothing'}"
                        f" (add '{per}' to its 'per' axes)", term.pos)
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
                        if (n := self.eval(part.size)) < 0:
                            raise self.err(f"a pad part must be >= 0 elements, got {n}", part.pos)
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
        store_caps |= {self.parts[c][2] for c in store_caps if c in self.parts}  # a part gives its parent
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
                # A name capture over an axis, or a placement on one stage, already picks the part a unit
                # holds; splitting the dims over that axis as well would leave the other parts stored nowhere.
                cap = next((c for c in rule.pattern.captures if c.axis == ax), None)
                if cap is not None:
                    sep = "@" if cap.numbered == "global" else "/"
                    raise self.err(f"{decl.pattern.text} is sharded twice over '{ax}': by '{{{cap.name}{sep}{ax}}}' "
                                   f"in the name and by this split", p)
                if ax == "pp" and rule.place is not None:
                    raise self.err(f"{decl.pattern.text} is split over 'pp' but '@{rule.place}' stores it on one stage; "
                                   f"drop the placement or the split", p)
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
        if isinstance(rule, S.Blob):
            return self.blob(sec, rule, unit, chunk, values, states)
        # Units that split the rule's dims alike store the same fragments under the same key (the attention of
        # every expert-parallel rank): worked out once, only the items differ.
        at = (id(rule), chunk, tuple(values.items()), tuple(map(coords.__getitem__, self.split_axes(rule))))
        made = self.stored_made.get(at)
        if made is None:
            made = self.stored_parts(rule, coords, chunk, values, at)
            self.stored_made[at] = made
        if not made:
            return []  # no layer of this stack on this (stage, chunk)
        key, frags, info = made
        out = []
        for state in states:
            item = new_item(sec.name, unit, chunk, state, key)
            made_frags = [new_fragment(name, state, box, item, base, strides, fill)
                          for name, box, base, strides, fill in frags]
            self.add_item(item, info, rule.pos, made_frags)
            self.fragments += made_frags
            out.append(item)
        return out

    def blob(self, sec, rule: S.Blob, unit, chunk: int, values, states) -> list[Item]:
        key = self.key_of(rule.pattern, values)
        decl = self.by_ref[rule.pattern.text]
        name = decl.pattern.format(self.global_values(values))
        n = self.tensors[name].view[0]
        out = []
        for state in states:
            item = Item(sec.name, unit, chunk, state, key)
            self.blob_items.add(item)
            self.add_item(item, ItemInfo(shape=(n,), mapped=0 if rule.regenerate else n, fill="regenerate" if rule.regenerate else "zero", rule=rule.pattern.text), rule.pos)
            if not rule.regenerate and n:
                self.add_frag(Fragment(tensor=name, state=state, box=Box((0,), (n,)), item=item, offset=0, strides=(1,)), sec)
            out.append(item)
        return out

    def global_values(self, values) -> dict[str, int]:
        """Each capture's global value; a part of an index gives its parent's capture too (layer m is layer i = m)."""
        out = {k: v[0] for k, v in values.items()}
        for k, v in values.items():
            if k in self.parts:
                out.setdefault(self.parts[k][2], v[0])
        return out

    def split_axes(self, rule: S.Stored) -> tuple[str, ...]:
        """The mesh axes a stored rule's dims are split over: the only coordinates of a unit its dims depend on."""
        axes = self.rule_splits.get(id(rule))
        if axes is None:
            found: list[str] = []
            todo = list(rule.dims or ())
            while todo:
                t = todo.pop()
                if isinstance(t, S.Split):
                    found.append(t.axis)
                    todo.append(t.term)
                elif isinstance(t, S.Product):
                    todo += t.terms
                elif isinstance(t, S.Pad):
                    todo.append(t.term)
                elif isinstance(t, S.Concat):
                    todo += [term for part in t.parts for term in part.terms]
            axes = self.rule_splits[id(rule)] = tuple(sorted(set(found)))
        return axes

    def stored_parts(self, rule: S.Stored, coords, chunk: int, values, at: tuple) -> tuple:
        """A stored rule's item key, fragments ``(tensor, box, offset, strides, fill)`` and item info for one unit's
        capture values; ``()`` where a stack over pp has no layer on this (stage, chunk)."""
        key = self.key_of(rule.pattern, values)
        global_values = self.global_values(values)
        # A rule's dims depend on the split coordinates and chunk, not on the layer: the layers of a stage share them.
        shaped = self.shaped.get((at[0], at[1], at[3]))
        if shaped is None:
            shape, combos = self.dims(rule, Ctx(self.spec, self.topo, self.env, self.indexes, coords, chunk, key,
                                                _layer_name(rule)))
            shaped = (shape, self.templates(rule, shape, combos), {})
            self.shaped[(at[0], at[1], at[3])] = shaped
        shape, templates, infos = shaped
        if 0 in shape and self.facts(rule)[2]:
            return ()
        frags: list[tuple] = []
        mapped = 0
        for decl, extra, where, base, fill, made in templates:
            name = decl.pattern.format({**global_values, **extra} if extra else global_values)
            lt = self.tensors[name]
            boxed = made.get(lt.axes)
            if boxed is None:
                lens = tuple(where[a][1] for a in lt.axes)
                boxed = (Box(tuple(where[a][0] for a in lt.axes), lens), tuple(where[a][2] for a in lt.axes),
                         math.prod(lens))
                made[lt.axes] = boxed
            mapped += boxed[2]
            frags.append((name, boxed[0], base, boxed[1], fill))
        empty = self.empty_tensor(rule, global_values) if not frags and 0 in shape else None
        # The layers of a stage share their item info too (it says the same of each).
        info = infos.get((mapped, empty))
        if info is None:
            info = infos[(mapped, empty)] = ItemInfo(shape=self.stored_shape(rule, shape), mapped=mapped,
                                                     rule=rule.pattern.text, tensor=empty)
        return key, frags, info

    def stored_shape(self, rule: S.Stored, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The item's shape: its dims' extents, or the rule's ``as (...)``, a row-major reshape of them (the
        elements keep the dims' order)."""
        if rule.shape is None:
            return shape
        stored = tuple(self.eval(e) for e in rule.shape)
        if math.prod(stored) != math.prod(shape):
            raise self.err(f"{rule.pattern.text}: 'as' shape {stored} holds {math.prod(stored)} elements but its dims "
                           f"{shape} hold {math.prod(shape)}", rule.shape[0].pos)
        return stored

    def empty_tensor(self, rule: S.Stored, values: dict[str, object]) -> str | None:
        """The logical tensor a stored rule of no elements holds, which no fragment can say."""
        decl = self.by_ref.get(rule.ref or rule.pattern.text)
        try:
            name = decl.pattern.format(values) if decl is not None else None
        except KeyError:
            return None
        return name if name in self.tensors else None

    def add_item(self, item: Item, info: ItemInfo, pos: S.Pos | None = None, frags: list[Fragment] | None = None) -> None:
        """Record ``item`` and the fragments it holds (``frags``; none yet when None)."""
        # One lookup of the item, not two: a resolved layout has hundreds of thousands.
        count = len(self.items)
        held = self.items.setdefault(item, info)
        if len(self.items) == count:
            raise self.err(f"two rules store {item} (rules '{held.rule}' and '{info.rule}')", pos)
        self.item_frags[item] = [] if frags is None else frags

    def add_frag(self, frag: Fragment, sec: S.Section) -> None:
        self.fragments.append(frag)
        self.item_frags[frag.item].append(frag)

    def templates(self, rule: S.Stored, shape: tuple[int, ...], combos: list[tuple]) -> list[tuple]:
        """Per combination of the dims' pieces, what every layer's fragment of it shares: the logical tensor's
        declaration and the captures the pieces bind, each view axis's ``(offset, length, stride in the item)``,
        the offset and fill, and a cache of its box and strides per axis order."""
        item_strides = row_major_strides(shape)
        out = []
        for combo in combos:
            ref = next((p[0] for p in combo if p[0] is not None), None) or rule.ref or rule.pattern.text
            where: dict[str, tuple[int, int, int]] = {}
            extra: dict[str, int] = {}
            base = 0
            fill = False
            for d, p in enumerate(combo):
                for a, o, n, s in zip(p[1], p[2], p[3], p[4]):
                    where[a] = (o, n, s * item_strides[d])
                base += p[5] * item_strides[d]
                extra.update(p[6])
                fill = fill or p[7]
            out.append((self.by_ref[ref], extra, where, base, fill, {}))
        return out

    def dims(self, rule: S.Stored, ctx: Ctx) -> tuple[tuple[int, ...], list[tuple]]:
        if rule.dims is None:
            return (), [()]
        per_dim = [eval_term(t, ctx, self) for t in rule.dims]
        shape = tuple(e for e, _ in per_dim)
        combos = []
        for combo in itertools.product(*(p for _, p in per_dim)):
            targets = {p[0] for p in combo if p[0] is not None}
            if len(targets) <= 1:
                combos.append(combo)
        return shape, combos


def _logical_axes(term: S.Term, r: _Resolver) -> list[tuple[str, S.Pos]]:
    if isinstance(term, S.Axis):
        return [(term.name, term.pos)]
    if isinstance(term, S.Product):
        out = []
        for t in term.terms:
            out += _logical_axes(t, r)
        return out
    raise r.err("a logical tensor's dims are axis names and (products); splits, pads, concatenations and indices belong to stored tensors", term.pos)

