"""Stored names and their captures: which rules a unit stores, with which capture values.

A stored rule's name captures indexes (``{i}``), their local or global numbers under a
split over a mesh axis (``{i/pp}``, ``{e@ep}``), offsets and computed numbers. The
``Captures`` mixin of ``reshard.core.resolve._Resolver`` enumerates, for one unit and
virtual-pipeline chunk, the rules a section stores there with their capture values (layer
by layer, then index by index, so a layer's or a local expert's parameters stay together)
and formats the names those give. The module functions read a rule's captures.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from reshard.core import spec as S
from reshard.core.topology import Topology
from reshard.errors import SpecError, TopologyError

__all__ = ["ETP", "MESH_AXES", "Captures"]

MESH_AXES = ("tp", "pp", "dp", "cp", "ep", "edp")
ETP = "etp"
"""An axis dims may be split over, not one a section is stored per: the experts' tensor-parallel rank of a unit
stored per tp, which is its tp coordinate modulo etp, where etp divides tp (Megatron's torch format names each
rank file by its dense tp rank; the experts it holds are its etp rank's shard)."""


class Captures:
    """The resolver's name and capture handling; mixed into ``reshard.core.resolve._Resolver``,
    whose ``topo``, ``indexes``, ``err`` and ``eval`` it uses."""

    topo: Topology
    indexes: dict[str, int]
    parts: dict[str, tuple[int, int, str]]
    rule_facts: dict[int, tuple[S.Capture | None, str | None, bool, tuple[str, ...]]]
    """Per rule (by id): ``facts``."""
    rule_values_made: dict[tuple, list[dict[str, tuple[int, int]]]]
    """Per rule, layer and coordinates of the axes its captures split: ``rule_values``."""

    if TYPE_CHECKING:
        def err(self, message: str, pos: S.Pos | None) -> SpecError: ...

        def eval(self, e: S.Expr) -> int: ...

    # -- names

    def key_of(self, pattern: S.Pattern, values: dict[str, tuple[int, int]]) -> str:
        """A stored tensor's name: each capture numbered as it says (local, or global ``{i@pp}``), plus its
        offset; ``{=expr}`` parts evaluated."""
        out = []
        for p in pattern.parts:
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, S.Computed):
                out.append(str(self.eval(p.expr)))
            else:
                g, local = values[p.name]
                out.append(str((g if p.numbered == "global" else local) + (self.eval(p.offset) if p.offset else 0)))
        return "".join(out)

    def capture_values(self, pattern: S.Pattern) -> Iterable[dict[str, int]]:
        caps = list(dict.fromkeys(c.name for c in pattern.captures))
        for combo in itertools.product(*(self.index_range(c) for c in caps)):
            yield dict(zip(caps, combo))

    def index_range(self, name: str) -> range:
        """The values an index takes: ``0 .. N-1``, or its part of its parent's range."""
        lo = self.parts[name][0] if name in self.parts else 0
        return range(lo, lo + self.indexes[name])

    # -- the rules a unit stores, with their capture values

    def facts(self, rule: S.Statement) -> tuple[S.Capture | None, str | None, bool, tuple[str, ...]]:
        """A rule's capture split over pp, the name of its first capture split over another axis, whether it
        stacks layers on a dim split over pp, and the axes its captures split other than pp; read once per rule,
        as every unit asks."""
        got = self.rule_facts.get(id(rule))
        if got is None:
            axes = tuple(c.axis for c in rule.pattern.captures if c.axis not in (None, "pp")) \
                if hasattr(rule, "pattern") else ()
            got = (_pp_capture(rule), _split_capture(rule), _stacks_over_pp(rule), axes)
            self.rule_facts[id(rule)] = got
        return got

    def expand(self, sec: S.Section, rules: list[S.Statement], coords: dict[str, int], chunk: int, pipelined: bool):
        """Rules with their capture values for one unit, in registration order.

        Consecutive rules sharing the capture split over pp form a block that is
        repeated layer by layer (a transformer layer's parameters stay together);
        inside it, or outside, consecutive rules sharing a capture split over
        another axis form a block repeated index by index (a local expert's
        parameters stay together).
        """
        facts = self.facts
        i = 0
        while i < len(rules):
            rule = rules[i]
            layer = facts(rule)[0]
            if layer is None:
                j = i + 1
                while j < len(rules) and facts(rules[j])[0] is None:
                    j += 1
                placed = [r for r in rules[i:j] if self.placed(r, coords, chunk, pipelined)]
                yield from self.by_index(placed, coords, None)
                i = j
                continue
            if getattr(rule, "place", None) is not None:
                raise self.err(f"a rule with '{{{layer.name}/pp}}' sits on the stage of its layer; drop '@{rule.place}'", rule.pos)
            j = i
            while j < len(rules) and (cap := facts(rules[j])[0]) is not None and cap.name == layer.name:
                j += 1
            block = rules[i:j]
            for lv in self.layer_values(layer, coords, chunk, rule):
                yield from self.by_index(block, coords, lv)
            i = j

    def by_index(self, rules: list[S.Statement], coords: dict[str, int], layer: tuple[int, int] | None):
        """Rules with their capture values; a run of rules sharing a ``{x/axis}`` capture (axis not pp) goes index by index."""
        caps = [self.facts(r)[1] for r in rules]
        if not any(caps):
            for r in rules:
                for v in self.rule_values(r, coords, layer):
                    yield r, v
            return
        i = 0
        while i < len(rules):
            cap = caps[i]
            j = i + 1
            while cap is not None and j < len(rules) and caps[j] == cap:
                j += 1
            run = [(r, self.rule_values(r, coords, layer)) for r in rules[i:j]]
            if j - i == 1:
                yield from ((r, v) for r, vs in run for v in vs)
            else:
                for x in dict.fromkeys(v[cap][0] for _, vs in run for v in vs):
                    yield from ((r, v) for r, vs in run for v in vs if v[cap][0] == x)
            i = j

    def placed(self, rule: S.Statement, coords: dict[str, int], chunk: int, pipelined: bool) -> bool:
        place = rule.place if isinstance(rule, S.Stored) else None
        if place == "lastonly" and not pipelined:
            return False
        if place == "stage":
            return chunk == 0 and (self.stage_of(rule) == coords["pp"] or not pipelined)
        if pipelined and place is None and self.facts(rule)[2]:
            return True  # layers stacked on a dim split over pp: one item per (stage, chunk)
        if not pipelined or place is None:
            return chunk == 0
        if place == "first":
            return coords["pp"] == 0 and chunk == 0
        last = coords["pp"] == self.topo.pp - 1 and chunk == self.topo.vpp - 1
        return last and (place == "last" or self.topo.pp * self.topo.vpp > 1)

    def stage_of(self, rule: S.Stored) -> int:
        """The stage an ``@stage(expr)`` rule sits on: expr, which must name one of the topology's stages."""
        if rule.stage is None:
            raise self.err(f"'@stage' of {_name(rule)} names no stage ('@stage(1)')", rule.pos)
        n = self.eval(rule.stage)
        if not 0 <= n < self.topo.pp:
            raise TopologyError(f"{_name(rule)}: @stage({n}) is not a stage of pp({self.topo.pp}) "
                                f"(stages 0 to {self.topo.pp - 1})")
        return n

    def layer_values(self, cap: S.Capture, coords: dict[str, int], chunk: int, rule: S.Statement) -> list[tuple[int, int]]:
        """The layers of this stage and chunk, (global, local): a part of another index is placed as that
        index's layers are (the MoE layers after the dense ones keep their stages and local numbers)."""
        n = self.index_size(cap)
        if "pp" not in coords:
            raise self.err(f"'{{{cap.name}/pp}}' needs 'pp' among the section's 'per' axes", cap.pos)
        values = self.index_range(cap.name)
        try:
            places = self.topo.layer_placement(self.parts[cap.name][1] if cap.name in self.parts else n)
        except TopologyError as e:
            raise TopologyError(f"{_name(rule)}: {e}") from None
        return [(g, p.local) for g, p in enumerate(places)
                if g in values and p.stage == coords["pp"] and p.chunk == chunk]

    def index_size(self, cap: S.Capture) -> int:
        if cap.name not in self.indexes:
            raise self.err(f"unknown index '{cap.name}' (declared: {', '.join(self.indexes) or 'none'})", cap.pos)
        return self.indexes[cap.name]

    def rule_values(self, rule: S.Statement, coords: dict[str, int],
                    layer: tuple[int, int] | None) -> list[dict[str, tuple[int, int]]]:
        """Capture values of one rule: each a dict name -> (global, local), not to be changed (units alike share
        them: the layers of a stage on every expert-parallel rank)."""
        at = (id(rule), layer, tuple([coords.get(a) for a in self.facts(rule)[3]]))
        got = self.rule_values_made.get(at)
        if got is None:
            got = self.rule_values_made[at] = list(self.each_rule_values(rule, coords, layer))
        return got

    def each_rule_values(self, rule: S.Statement, coords: dict[str, int], layer: tuple[int, int] | None):
        caps = list({c.name: c for c in rule.pattern.captures}.values())
        choices = []
        for cap in caps:
            if cap.axis == "pp":
                choices.append([layer])
            elif cap.axis is None:
                self.index_size(cap)
                choices.append([(v, v) for v in self.index_range(cap.name)])
            else:
                n = self.index_size(cap)
                if cap.name in self.parts:
                    raise self.err(f"'{cap.name}' is a part of another index's range; only its layers split over pp",
                                   cap.pos)
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


def _name(rule: S.Statement) -> str:
    return rule.pattern.text


def _pp_capture(rule: S.Statement) -> S.Capture | None:
    return next((c for c in rule.pattern.captures if c.axis == "pp"), None) if hasattr(rule, "pattern") else None


def _split_capture(rule: S.Statement) -> str | None:
    """The name of a rule's first capture split over a mesh axis other than pp, if any."""
    if not hasattr(rule, "pattern"):
        return None
    return next((c.name for c in rule.pattern.captures if c.axis not in (None, "pp")), None)


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
