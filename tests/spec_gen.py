"""Random layout specs built from the grammar of ``specs/README.md``, for fuzzing parse -> resolve -> plan -> execute.

``random_case(rng)`` writes a spec statement by statement: ``let`` and ``index`` declarations, ``logical``
tensors (axes, products, aliases, ``{i}`` captures, scalars), sections whose stored rules use permuted and
regrouped axes, even / ``:chunk`` / ``:(w1, ...)`` splits over the section's mesh axes, nested splits, pads
``~m`` (``zero`` or ``last``), concatenations with pad parts, products around a concatenation, index dims
(``{i}/pp``, ``{e}/ep``), name captures (``{i/pp}``, ``{i@pp+1}``, ``{e/ep}``, ``{=expr}``), ``->`` refs,
placements, tied copies, ``scalar`` and ``blob`` state, and flat optimizer buffers with every flat op. It
draws model sizes (extents 0..16) and a source and a destination topology (degrees 1..4) that the spec is
meant to hold for; about a third of the cases then get one planted mistake (a typo'd keyword, an undeclared
axis, a wrong mesh axis, a size that does not divide, a broken bracket, a bad topology, ...).

``check_case(case)`` runs the property: either the spec, topology or plan is refused with reshard's own
error (a ``SpecError`` with a position quotes its line with a caret under the token), or both layouts
resolve, both plans validate, and moving arange-valued tensors there and back in memory is bit-exact.

Everything draws from one ``random.Random``, so a seed is a case: ``tests/properties/test_spec_fuzz.py`` and a
long-running driver share this code path.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

from conftest import assert_round_trip, logical_values

from reshard.errors import PlanError, SpecError, TopologyError
from reshard.core.resolve import resolve
from reshard.core.planner import plan
from reshard.core.spec import parse_spec
from reshard.core.topology import parse_topology

__all__ = ["SOURCE", "SpecCase", "check_case", "random_case"]

SOURCE = "fuzz.spec"
KEYWORDS = ("let", "index", "include", "logical", "section", "blob", "flat")
MESH = ("tp", "pp", "dp", "cp", "ep", "edp")
MISTAKE_RATE = 0.35
ZERO_RATE = 0.02
"""Chance that a new axis has size 0 (a tensor of no elements)."""
_CAPTURES = {"layers": "i", "experts": "e"}


@dataclass(frozen=True)
class SpecCase:
    """One fuzz case: a spec, the sizes to resolve it with, and two topologies to move between."""

    text: str
    sizes: tuple[tuple[str, int], ...]
    src: str
    dst: str
    blob_sizes: tuple[tuple[str, int], ...] = ()
    mistake: str = ""
    """The planted mistake, for messages; empty when the case is meant to plan."""

    def sizes_dict(self) -> dict[str, int]:
        return dict(self.sizes)

    def blob_sizes_dict(self) -> dict[str, int]:
        return dict(self.blob_sizes)

    def __str__(self) -> str:
        blobs = f" blobs={dict(self.blob_sizes)}" if self.blob_sizes else ""
        why = f" mistake={self.mistake}" if self.mistake else ""
        return f"{self.src} -> {self.dst} sizes={dict(self.sizes)}{blobs}{why}\n{self.text}"


def random_case(rng: random.Random) -> SpecCase:
    """A spec with sizes and two topologies, drawn from ``rng`` alone (the same seed gives the same case)."""
    case = _Gen(rng).case()
    if rng.random() < MISTAKE_RATE:
        case = _plant_mistake(rng, case)
    return case


def check_case(case: SpecCase) -> str:
    """Run the property; return "rejected" (a clean reshard error) or "planned" (plans validated, round trip bit-exact).

    Raises AssertionError if the round trip is not bit-exact or a positioned SpecError lacks its caret line;
    any other exception propagates (it is a crash).
    """
    try:
        spec = parse_spec(case.text, SOURCE)
        src, dst = (resolve(spec, parse_topology(t), case.sizes_dict(), blob_sizes=case.blob_sizes_dict())
                    for t in (case.src, case.dst))
        plan(src, dst).validate()
        plan(dst, src).validate()
    except SpecError as err:
        assert_caret(err, case.text)
        return "rejected"
    except (TopologyError, PlanError):
        return "rejected"
    states = tuple(dict.fromkeys([*src.states, *dst.states])) or ("param",)
    try:
        assert_round_trip(src, dst, logical_values(src, states))
    except PlanError as err:
        # gather() refuses a logical tensor that no rule stores anywhere (declared, never stored): a clean
        # refusal, not a wrong move. Anything partly stored is a resolver bug and propagates.
        stored = {f.tensor for f in src.fragments}
        if not str(err).endswith(": stored nowhere") or all(t.blob or n in stored for n, t in src.tensors.items()):
            raise
        return "rejected"
    return "planned"


def assert_caret(err: SpecError, text: str) -> None:
    """A SpecError with a position quotes that line of the spec and puts a caret under the token."""
    if err.line <= 0:
        return
    lines = text.splitlines()
    assert err.line <= len(lines), f"error on line {err.line} of a {len(lines)}-line spec: {err}"
    assert err.text == lines[err.line - 1], f"error quotes {err.text!r}, line {err.line} is {lines[err.line - 1]!r}"
    shown = str(err).splitlines()
    assert len(shown) >= 3 and shown[-2] == "    " + err.text, f"no quoted line in:\n{err}"
    caret = shown[-1]
    assert re.fullmatch(r" *\^+", caret), f"no caret line in:\n{err}"
    col = caret.index("^") - 4
    assert col == err.col - 1 and 0 <= col <= len(err.text), f"caret outside the line in:\n{err}"
    code_end = len(err.text.split("#", 1)[0].rstrip())
    assert col >= code_end or not err.text[col].isspace(), f"caret under a blank in:\n{err}"


# --- the generator ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _T:
    """A stored term being built: its text, and its extent at (src, dst) or None where it differs by unit."""

    text: str
    ext: tuple[int, int] | None
    name_end: bool = False
    """The text ends in a NAME pad multiple, so a following '(' would read as a function call."""


def _join(terms: list[_T]) -> str:
    nxt = [t.text for t in terms[1:]] + [""]
    return " ".join(f"({t.text})" if t.name_end and n.startswith("(") else t.text for t, n in zip(terms, nxt))


def _prod(exts: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    if any(e is None for e in exts):
        return None
    return math.prod(e[0] for e in exts), math.prod(e[1] for e in exts)


@dataclass
class _Section:
    name: str
    axes: list[str]
    states: list[str]
    lines: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    flat_ok: bool = True
    """No blobs (mostly): flat buffers may be built from it."""


class _Gen:
    """Builds one case meant to plan; ``_plant_mistake`` may then break it."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.given: dict[str, int] = {}  # sizes the caller gives
        self.env: dict[str, int] = {}  # every size variable's value, lets included
        self.head: list[str] = []  # let and index lines
        self.logicals: list[str] = []
        self.blobs: dict[str, int] = {}
        self.sections: list[_Section] = []
        self.k = 0
        self.words: list[str] = []  # keywords taken as tensor names

    def topologies(self) -> None:
        r = self.rng
        self.pipelined, self.experts = r.random() < 0.4, r.random() < 0.3
        use_cp, use_vpp = r.random() < 0.15, self.pipelined and r.random() < 0.3
        self.layers = r.randint(1, 6) if self.pipelined else 0
        self.deg: list[dict[str, int]] = []
        self.topo: list[str] = []
        for _ in range(2):
            while True:
                d = {"tp": r.choice((1, 1, 2, 2, 3, 4)), "dp": r.choice((1, 2, 2, 3, 4)),
                     "cp": r.choice((1, 2)) if use_cp else 1, "pp": r.choice((1, 2, 2, 3)) if self.pipelined else 1,
                     "vpp": r.choice((1, 2)) if use_vpp else 1}
                d["ep"] = r.choice([e for e in (1, 2, 3, 4) if d["dp"] * d["cp"] % e == 0]) if self.experts else 1
                if d["tp"] * d["dp"] * d["cp"] * d["pp"] * d["vpp"] <= 36:
                    break
            d["edp"] = d["dp"] * d["cp"] // d["ep"]
            items = [f"{a}={d[a]}" for a in ("tp", "pp", "dp", "cp", "ep", "vpp")
                     if a in ("tp", "pp", "dp") or d[a] > 1]
            virtual = d["pp"] * d["vpp"]
            if self.layers and virtual > 1 and (self.layers % virtual or r.random() < 0.3):
                cuts = sorted(r.randint(0, self.layers) for _ in range(virtual - 1))
                items.append("stages=" + "+".join(str(b - a) for a, b in zip([0, *cuts], [*cuts, self.layers])))
            if r.random() < 0.15:
                r.shuffle(items)
            self.deg.append(d)
            self.topo.append(("," if r.random() < 0.9 else ", ").join(items))

    def dd(self, axis: str) -> tuple[int, int]:
        return self.deg[0][axis], self.deg[1][axis]

    def lcm(self, *axes: str) -> int:
        return math.lcm(*(d for a in axes for d in self.dd(a)))

    # -- sizes, lets and indexes

    def fresh(self, letter: str = "") -> str:
        self.k += 1
        return f"{letter or self.rng.choice('abcfghmnrvwxyz')}{self.k}"

    def size(self, hi: int, mesh: list[str]) -> str:
        """A new axis with a size; often a multiple of some mesh degrees so that even splits divide."""
        r = self.rng
        value = r.randint(1, hi) if r.random() > ZERO_RATE else 0
        if mesh and r.random() < 0.55 and (step := self.lcm(r.choice(mesh))) <= 16:
            value = step * r.randint(1, max(1, 16 // step if r.random() < 0.2 else hi // step))
        if r.random() < 0.3 and value > 1:
            return self.let_axis(value)
        name = self.fresh()
        self.given[name] = self.env[name] = value
        return name

    def let_axis(self, value: int) -> str:
        """An axis of ``value`` defined by a ``let`` over a new given size."""
        r = self.rng
        name, b, k = self.fresh(), self.fresh(), r.randint(1, 3)
        forms = [(f"{b} * {k}", value // k if value % k == 0 else 0), (f"{b} / {k}", value * k),
                 (f"cdiv({b}, {k})", value * k - r.randint(0, k - 1)), (f"{b} // {k}", value * k + r.randint(0, k - 1)),
                 (f"roundup({b}, 1)", value), (f"{b} - {k}", value + k), (f"({b} + {k}) - {k} * 1", value),
                 (f"min({b}, {value})", value + r.randint(0, 3)), (f"max({b}, 1)", value), (f"lcm({b}, 1)", value)]
        expr, self.given[b] = r.choice([f for f in forms if f[1]])
        self.env[b] = self.given[b]
        self.head.append(f"let {name} = {expr}")
        self.env[name] = value
        if r.random() < 0.15:
            self.given[name] = value  # given and computed: must agree
        return name

    def index(self, var: str, value: int) -> str:
        """The capture ranging over ``var`` (``layers`` -> i, ``experts`` -> e), declared at its first use."""
        if var not in self.env:
            self.given[var] = self.env[var] = value
            bound = self.rng.choice([var, var, f"{var} * 1", f"({var})", f"max({var}, 0)"])
            self.head.append(f"index {_CAPTURES[var]} < {bound}")
        return _CAPTURES[var]

    def axes(self, lo: int, hi: int, mesh: list[str]) -> list[str]:
        return [self.size(self.rng.choice((2, 4, 6, 8)), mesh) for _ in range(self.rng.randint(lo, hi))]

    def group(self, axes: list[str]) -> list[list[str]]:
        out: list[list[str]] = []
        for a in axes:
            if out and len(out[-1]) < 3 and self.rng.random() < 0.3:
                out[-1].append(a)
            else:
                out.append([a])
        return out

    def logical(self, pattern: str, axes: list[str] | None, alias: str | None = None) -> None:
        r = self.rng
        order = list(axes or ())
        if r.random() < 0.2:
            r.shuffle(order)
        dims = " ".join(g[0] if len(g) == 1 and r.random() < 0.9 else "(" + " ".join(g) + ")"
                        for g in self.group(order)) if axes is not None else "scalar"
        self.logicals.append(f"logical {pattern}{' as ' + alias if alias else ''} = {dims}")

    # -- stored terms

    def multiples(self, x: str, k: int) -> list[tuple[str, tuple[int, int], bool]]:
        """Pad multiples over mesh axis ``x``: (text, value at src and dst, whether the text ends in a NAME)."""
        ds, dd = self.dd(x)
        return [(f"({k}*{x})", (k * ds, k * dd), False), (f"lcm({x}, {k})", (math.lcm(ds, k), math.lcm(dd, k)), False),
                (x, (ds, dd), True)]

    def pad(self, t: _T, mesh: list[str], multiple: tuple[str, tuple[int, int], bool] | None = None) -> _T:
        r = self.rng
        k = r.randint(1, 3)
        ints = [(str(k), (k, k), False), (f"({k})", (k, k), False), (f"({k}+0)", (k, k), False)]
        if multiple is None:
            multiple = r.choice(self.multiples(r.choice(mesh), k) if mesh and r.random() < 0.5 else ints)
        text, m, name_end = multiple
        policy = r.choice(("", "", ":zero", ":last", ":last"))
        ext = None if t.ext is None else (-(-t.ext[0] // m[0]) * m[0], -(-t.ext[1] // m[1]) * m[1])
        return _T(f"{t.text}~{text}{policy}", ext, name_end and not policy)

    def split(self, t: _T, x: str, nested: bool = False) -> _T:
        """``t/x`` in a mode that holds at both topologies: even where it divides, else chunk, widths or pad+even."""
        r = self.rng
        ds, dd = self.dd(x)
        modes = ["chunk"]
        if t.ext and t.ext[0] % ds == 0 and t.ext[1] % dd == 0:
            modes += ["even"] * 4
        if t.ext and not nested:
            modes += ["padeven"] + ["widths"] * (ds == dd and t.ext[0] == t.ext[1])
        mode = r.choice(modes)
        if mode == "padeven":
            t = self.pad(t, [], r.choice(self.multiples(x, r.randint(1, 2))))
        if mode in ("even", "padeven"):
            return _T(f"{t.text}/{x}{':even' if r.random() < 0.15 else ''}", (t.ext[0] // ds, t.ext[1] // dd))
        if mode == "widths":
            cuts = sorted(r.randint(0, t.ext[0]) for _ in range(ds - 1))
            widths = [f"{b - a}" if r.random() < 0.8 else f"{b - a}+0" for a, b in zip([0, *cuts], [*cuts, t.ext[0]])]
            return _T(f"{t.text}/{x}:({', '.join(widths)})", None)
        return _T(f"{t.text}/{x}:chunk", None)

    def decorate(self, t: _T, free: list[str], p_split: float = 0.55) -> _T:
        r = self.rng
        if r.random() < 0.12:
            t = self.pad(t, free)
        if free and r.random() < p_split:
            t = self.split(t, free.pop(r.randrange(len(free))))
            if free and r.random() < 0.15:
                t = self.split(t, free.pop(r.randrange(len(free))), nested=True)
        return self.pad(t, free) if r.random() < 0.08 else t

    def terms(self, axes: list[str], free: list[str]) -> list[_T]:
        """Stored terms holding ``axes``, permuted and regrouped, split over mesh axes taken from ``free``."""
        r = self.rng
        order = axes[:]
        if r.random() < 0.3:
            r.shuffle(order)
        out = []
        for g in self.group(order):
            if len(g) == 1 and r.random() < 0.9:
                t = _T(g[0], (self.env[g[0]],) * 2)
            else:
                inner = [self.decorate(_T(a, (self.env[a],) * 2), free, 0.2) for a in g]
                t = _T("(" + _join(inner) + ")", _prod([x.ext for x in inner]))
            out.append(self.decorate(t, free))
        return out

    def concat(self, parts: list[tuple[str, list[str]]], free: list[str]) -> _T:
        """``[ref: terms | ... | pad: n]``; each part may split over what is left in ``free``."""
        r = self.rng
        texts, exts = [], []
        for ref, own in parts:
            ts = self.terms(own, free[:])
            texts.append(f"{ref}: {_join(ts)}")
            exts.append(_prod([t.ext for t in ts]))
            if r.random() < 0.25:
                n = r.randint(0, 3)
                texts.append(f"pad: {n}" if r.random() < 0.8 else f"pad: {n} * 1")
                exts.append((n, n))
        total = None if any(e is None for e in exts) else (sum(e[0] for e in exts), sum(e[1] for e in exts))
        return _T("[" + " | ".join(texts) + "]", total)

    def place_index_dims(self, ts: list[_T], index_dims: list[_T]) -> None:
        """Index dims among the terms: a dim of their own or inside a product with a neighbour, sometimes padded."""
        r = self.rng
        for t in index_dims:
            if r.random() < 0.15:
                t = _T(f"{t.text}~{r.randint(1, 3)}{r.choice(['', ':zero', ':last'])}", None)
            k = r.randint(0, len(ts))
            if ts and r.random() < 0.25:
                k = min(k, len(ts) - 1)
                ts[k] = _T("(" + _join([t, ts[k]] if r.random() < 0.5 else [ts[k], t]) + ")", None)
            else:
                ts.insert(k, t)

    # -- rules

    def rule(self, sec: _Section, key: str, ref: str | None, place: str | None, dims: str) -> None:
        bits = [b for b in (f" -> {ref}" if ref else "", f" @{place}" if place else "") if b]
        if self.rng.random() < 0.3:
            bits.reverse()
        sec.lines.append(f"{key}{''.join(bits)} = {dims}")
        sec.keys.append(key)

    def tensor_rule(self, sec: _Section) -> None:
        """A stored rule and the logical tensors it stores, in one of several scopes (captures, index dims)."""
        r = self.rng
        n = self.fresh("s")
        other = [a for a in sec.axes if a != "pp"]
        scopes = ["global"] * 4 + ["each"] + (["layer"] * 4 + ["stack"]) * ("pp" in sec.axes and self.layers > 0)
        scope = r.choice(scopes + ["expert", "expert", "estack"] * (self.experts and bool(other)))
        free = list(sec.axes)
        lname, key, place, index_dims = "w" + n[1:], n, None, []
        if scope == "global":
            key = r.choice([lname, lname, n, f"model.{n}.weight", f"{n}.{{={r.choice(list(self.env) or ['1'])}+1}}"])
            words = [w for w in KEYWORDS + ("scalar", "per", "as") if w not in self.words]
            if words and r.random() < 0.1:  # 'section = ...' stores a tensor called section
                lname = r.choice(words)
                self.words.append(lname)
                key = r.choice([lname, key])
            if "pp" in sec.axes and r.random() < 0.35:
                place = r.choice(("first", "last"))
                free.remove("pp")
        elif scope == "each":
            i = self.index("layers", self.layers or r.randint(1, 3))
            lname, key = f"layers.{{{i}}}.{n}", f"each.{{{i}}}.{n}"
        elif scope == "layer":
            i = self.index("layers", self.layers)
            cap = r.choice([f"{{{i}/pp}}", f"{{{i}/pp}}", f"{{{i}@pp}}", f"{{{i}@pp+1}}", f"{{{i}/pp+2}}"])
            lname, key = f"layers.{{{i}}}.{n}", f"blk.{cap}.{n}"
            free.remove("pp")
            if self.experts and "ep" in sec.axes and r.random() < 0.25:
                e = self.index("experts", self.lcm("ep") * r.randint(1, 2))
                if self.env["experts"] % self.lcm("ep") == 0:
                    lname, key = f"{lname}.experts.{{{e}}}", f"{key}.local.{{{e}/ep}}"
                    free.remove("ep")
        elif scope == "stack":
            i = self.index("layers", self.layers)
            lname, key = f"layers.{{{i}}}.{n}", f"stack.{n}"
            x = r.choice(["pp", "pp", "", *other])
            index_dims.append(_T(f"{{{i}}}" + (f"/{x}" if x == "pp" else f"/{x}:chunk" if x else ""), None))
            if x:
                free.remove(x)
        else:
            e = self.index("experts", self.lcm(*(other if r.random() < 0.3 else ["ep"])) * r.randint(1, 2))
            x = r.choice([a for a in other if self.env["experts"] % self.lcm(a) == 0] or other)
            lname = f"experts.{{{e}}}.{n}"
            if scope == "expert" and self.env["experts"] % self.lcm(x) == 0:
                key = f"local.{{{e}{r.choice('/@')}{x}}}.{n}"
            else:
                even = self.env["experts"] % self.lcm(x) == 0 and r.random() < 0.7
                key = f"grouped.{n}"
                index_dims.append(_T(f"{{{e}}}/{x}{'' if even else ':chunk'}", None))
            free.remove(x)
        kind = r.choice(["plain"] * 5 + ["concat"] * 3 + ["scalar"] + ["tied"] * (place is not None))
        if kind == "scalar" and not index_dims:
            self.logical(lname, None)
            self.rule(sec, key, lname if key != lname else None, place, "scalar")
        elif kind == "concat" and ("{" not in lname or r.random() < 0.6):
            self.concat_rule(sec, n, lname, key, place, free, index_dims)
        else:
            axes = self.axes(1, 3, sec.axes)
            alias = f"A{n[1:]}" if r.random() < 0.3 else None
            self.logical(lname, axes, alias)
            ref = r.choice([x for x in (alias, lname) if x])
            ts = self.terms(axes, free[:] if kind == "tied" else free)
            self.place_index_dims(ts, index_dims)
            self.rule(sec, key, None if key == lname and r.random() < 0.7 else ref, place, _join(ts))
            if kind == "tied":  # the output layer: the same tensor again on the last stage
                self.rule(sec, f"out.{n}", ref, r.choice(("lastonly", "last")), _join(self.terms(axes, free)))

    def concat_rule(self, sec: _Section, n: str, lname: str, key: str, place: str | None, free: list[str],
                    index_dims: list[_T]) -> None:
        r = self.rng
        shared = self.axes(0, 2, sec.axes)
        parts = []
        for p in range(r.randint(2, 3)):
            own = self.axes(1, 2, sec.axes)
            name = f"{lname}{'abc'[p]}"
            alias = f"P{n[1:]}{'abc'[p]}" if "{" in name or r.random() < 0.3 else None
            self.logical(name, shared + own if r.random() < 0.5 else own + shared, alias)
            parts.append((alias or name, own))
        outer = self.terms(shared, free)
        reserved = free.pop(r.randrange(len(free))) if free and r.random() < 0.35 else None  # splits every part
        cat = self.concat(parts, free)
        if outer and r.random() < 0.4:  # a product around the concatenation: (g/tp [q: ... | k: ...])
            k = r.randrange(len(outer))
            inner = [outer.pop(k), cat] if r.random() < 0.7 else [cat, outer.pop(k)]
            cat = _T("(" + _join(inner) + ")", _prod([t.ext for t in inner]))
        if reserved:
            cat = self.split(cat, reserved)
        outer.insert(r.randint(0, len(outer)), cat)
        self.place_index_dims(outer, index_dims)
        self.rule(sec, key.replace(".s", ".fused", 1) if key.startswith("model.") else key, None, place, _join(outer))

    def blob(self, sec: _Section) -> None:
        r = self.rng
        n = self.fresh("blob")
        sec.flat_ok = sec.flat_ok and r.random() < 0.3  # now and then, a flat buffer that must refuse it
        if r.random() < 0.3:
            sec.lines.append(f"blob {n}.rng regenerate")
        else:
            self.blobs[n] = r.randint(0, 16)
            sec.lines.append(f"blob {n}")

    def flat_section(self, src: _Section) -> None:
        r = self.rng
        others = [a for a in ("dp", "cp", "edp", "tp", "ep") if a not in src.axes and self.lcm(a) > 1]
        style = r.choice(["zero", "zero", "distopt", "perparam", "coalesce"])
        x = r.choice(others) if others and style != "coalesce" and r.random() < 0.85 else None
        if style == "perparam" and not x:
            style = "zero"
        axes = src.axes + ([x] if x else [])
        r.shuffle(axes)
        states = r.choice([["exp_avg", "exp_avg_sq"], ["master"], [], ["param", "exp_avg"]])
        sec = _Section(self.fresh("optim"), axes, states)
        ops = ["reverse"] * (r.random() < 0.3) + [style] * (style in ("perparam", "coalesce"))
        if style in ("distopt", "coalesce"):
            ops += r.sample([f"align {r.randint(1, 8)}", f"buckets {r.randint(1, 40)}", "reverse"], r.randint(1, 3))
        if x:
            k = r.randint(1, 2)
            pads = [f"pad {x}", f"pad {k}*{x}", f"pad lcm({x}, {2 * k})"]
            if style == "perparam":
                pads = ["pad 1", f"pad {k}"]
            ops += [r.choice(pads), f"split {x}"]
        elif r.random() < 0.5:
            ops.append(f"pad {r.randint(1, 4)}")
        r.shuffle(ops)
        buckets = any(o.startswith("buckets") for o in ops) and style != "coalesce"
        pattern = f"{sec.name}.{'{bucket}.' if buckets else ''}{r.choice(['{state}'] * 3 + ['st_{state}_x', 'flat'])}"
        if src.keys and r.random() < 0.3:  # dense and expert buffers of their own
            glob = f"*{r.choice(src.keys).split('.')[-1].split('{')[0]}*"
            sec.lines += [f"flat {op}_{pattern} = {src.name} | " + " | ".join([f"{op} {glob}", *ops])
                          for op in ("only", "except")]
        else:
            sec.lines.append(f"flat {pattern} = {src.name}" + "".join(f" | {o}" for o in ops))
        self.sections.append(sec)

    def case(self) -> SpecCase:
        r = self.rng
        self.topologies()
        axes = [a for a, p in (("tp", 0.8), ("dp", 0.3), ("cp", 0.5))
                if r.random() < p and (a != "cp" or self.lcm("cp") > 1)]
        axes += ["pp"] * (self.pipelined and r.random() < 0.9) + ["ep"] * (self.experts and r.random() < 0.85)
        axes += ["edp"] * (self.experts and r.random() < 0.15)
        r.shuffle(axes)
        self.sections.append(model := _Section("model", axes, r.choice([[], [], ["param", "master"]])))
        for _ in range(r.randint(1, 4)):
            self.tensor_rule(model)
        if r.random() < 0.3:
            self.sections.append(misc := _Section(self.fresh("misc"), [a for a in axes if r.random() < 0.5], []))
            for _ in range(r.randint(1, 2)):
                self.blob(misc) if r.random() < 0.4 else self.tensor_rule(misc)
        if r.random() < 0.35:
            self.flat_section(r.choice([s for s in self.sections if s.flat_ok]))
        lines = self.head + self.logicals
        for sec in self.sections:
            per = f" per {' '.join(sec.axes)}" if sec.axes or r.random() < 0.1 else ""
            states = f" states {' '.join(sec.states)}" if sec.states else ""
            lines += [f"section {sec.name}{per}{states}", *sec.lines]
        if r.random() < 0.2:
            lines.insert(r.randrange(len(lines) + 1), r.choice(["", "# a comment", "   ", "\t# indented comment"]))
        if r.random() < 0.2:
            lines[r.randrange(len(lines))] += r.choice(["  # trailing comment", "   ", "\t"])
        return SpecCase("\n".join(lines) + "\n", tuple(sorted(self.given.items())), self.topo[0], self.topo[1],
                        tuple(sorted(self.blobs.items())))


# --- planted mistakes ------------------------------------------------------------------------------

_TYPOS = {"let": "lte", "index": "indx", "logical": "logcal", "section": "secton", "blob": "blb", "flat": "falt"}
_AXIS = re.compile(r"(?<![\w.{])([a-z]\d+)(?![\w}])")
_MESH = r"/(tp|pp|dp|cp|ep|edp)\b"
# (pattern, replacement) for one line: bad modes, policies, places, ops, functions, captures, refs, sizes, ...
_BAD_TOKENS = [
    (r":chunk\b", ":chunky"), (r":(zero|last)\b", ":lst"), (r"@(first|last|lastonly)\b", "@middle"),
    (r"\| (align|pad|buckets|split|reverse|perparam|coalesce)\b", "| shuffle"),
    (r"\b(lcm|cdiv|roundup|min|max)\(", "sqrt("), (r"\{(\w+)/(\w+)", r"{\1/"), (r"\{(\w+)\}", r"{\1"),
    (r"\{(\w+)\}", r"{\1/tq}"), (r"\{(\w+)\}", "{zz}"), (r"-> \S+", "-> nosuch"), (r"\[(\w+):", "[nosuch:"),
    (r"~\S+?(?=[ /)\]|:]|$)", "~0"), (r"~\S+?(?=[ /)\]|:]|$)", "~(0-2)"), (r"pad: \d+", "pad: 0-4"),
    (r"split \w+", "split tq"), (r"= (\w+) \|", "= nosuch |"), (r"per ", "per tq "), (r"per (\w+)", r"per \1 \1"),
    (r"(buckets|align) \d+", r"\1 0"), (r"index (\w+) < .*", r"index \1 < 0-1"), (r"<", "< 1 /"),
    (r"(let \w+ = )(.*)", r"\1(\2) / 0"), (r"(let \w+ = )(.*)", r"\1(\2) / 2"), (r"cdiv\(([^,]+),", r"cdiv(\1"),
    (r"roundup\(([^,]+),[^)]*\)", r"roundup(\1, 0)"), (r"\.\{", ".}{"), (r"\{=", "{=1 2 "), (r"\{=", "{="),
    (r"@pp\+", "@pp+zz"), (r"\{(\w+)/pp", r"{\1/tp"), (r"\{(\w+)/ep", r"{\1/dp"), (r"\[(\w+): [^|\]]+", r"[\1: "),
    (r"states .*", "states"), (r"\| pad [^|]+", ""), (r"^blob (\S+)", r"blob \1.{i}"),
    (r"^blob (\S+)", r"blob \1.{i/pp}"),
    (r"^flat (\S+)", r"flat \1.{i}"), (r"^flat (\S+)", r"flat \1.{i@pp}"), (r"\| (\w+): ", r"| \1: [zz: a1] "),
    (r" = (\w+)$", r" = [\1: \1] [\1: \1]"), (r"\{(\w+)\}/pp", r"{e}/pp"), (r"\[(\w+):", r"[\1: \1 | \1:"),
    (r"(\w+)/(tp|dp|ep)", r"\1/\2/\2"), (r"^(\S+) = ", r"\1 = \1 "), (r":\(([^)]*)\)", r":(\1, 1)"),
    (r"\{\w+[/@]\w+[^}]*\}", "0"), (r" [a-z]\d+( |$)", " "),
]


def _plant_mistake(rng: random.Random, case: SpecCase) -> SpecCase:
    """``case`` with one mistake; tries kinds at random until one applies."""
    for _ in range(50):
        kind, plant = rng.choice(_PLANTS)
        m = _Mistake(rng, case)
        if plant(m):
            return SpecCase("\n".join(m.lines) + "\n", tuple(sorted(m.sizes.items())), m.topo[0], m.topo[1],
                            tuple(sorted(m.blobs.items())), kind)
    return case


def _is_rule(line: str) -> bool:
    head = line.split()[:2]
    return " = " in line and (head[0] not in KEYWORDS or head[1] in ("=", "->") or head[1].startswith("@"))


class _Mistake:
    """A copy of a case to plant one mistake in; each method says whether it found a place for it."""

    def __init__(self, rng: random.Random, case: SpecCase) -> None:
        self.rng = rng
        self.lines = case.text.splitlines()
        self.sizes, self.blobs, self.topo = dict(case.sizes), dict(case.blob_sizes), [case.src, case.dst]

    def pick(self, test) -> int | None:
        ks = [k for k, line in enumerate(self.lines) if test(line)]
        return self.rng.choice(ks) if ks else None

    def sub(self, pattern: str, repl, test=lambda line: True) -> bool:
        k = self.pick(lambda line: test(line) and re.search(pattern, line) is not None)
        if k is not None:
            self.lines[k] = re.sub(pattern, repl, self.lines[k], count=1)
        return k is not None

    def sub_in_dims(self, pattern, repl) -> bool:
        k = self.pick(lambda line: _is_rule(line) and re.search(pattern, line.split(" = ", 1)[1]) is not None)
        if k is None:
            return False
        name, dims = self.lines[k].split(" = ", 1)
        m = self.rng.choice(list(re.finditer(pattern, dims)))
        self.lines[k] = f"{name} = {dims[: m.start()]}{repl(m) if callable(repl) else repl}{dims[m.end():]}"
        return True

    def size(self, value: int | None, names: list[str] | None = None) -> bool:
        """A given size (one of ``names``, default any) set to ``value``, or dropped for None."""
        names = sorted(self.sizes) if names is None else names
        if names:
            name = self.rng.choice(names)
            self.sizes.pop(name, None) if value is None else self.sizes.__setitem__(name, value)
        return bool(names)

    def insert(self, k: int | None, text: str) -> bool:
        if k is not None:
            self.lines.insert(k, text)
        return k is not None

    def junk(self) -> bool:
        k = self.pick(lambda line: line.strip() != "")
        if k is not None:
            at = self.rng.randint(0, len(self.lines[k]))
            tok = self.rng.choice([" )", "(", " |", ":", " =", ",", "~", "/", "{", " @", " ->", "%", " 3", "[", "}"])
            self.lines[k] = self.lines[k][:at] + tok + self.lines[k][at:]
        return k is not None

    def hoist(self, test, to) -> bool:
        """The line at a random place passing ``test`` (and the one above it, for a flat line) moved to line ``to``."""
        k = self.pick(test)
        if k is None or k == 0 or to(k) is None:
            return False
        moved = self.lines[k - 1: k + 1] if self.lines[k].startswith("flat ") else [self.lines[k]]
        del self.lines[k - len(moved) + 1: k + 1]
        self.lines[to(k):to(k)] = moved
        return True

    def topology(self, pattern: str, repl) -> bool:
        k = self.rng.randrange(2)
        text, self.topo[k] = self.topo[k], re.sub(pattern, repl, self.topo[k], count=1)
        return text != self.topo[k]


def _first_section(m: _Mistake):
    return lambda k: next((j for j, line in enumerate(m.lines) if line.startswith("section ")), None)


_PLANTS = [
    ("typo_keyword", lambda m: m.sub(r"^(let|index|logical|section|blob|flat) ", lambda x: _TYPOS[x.group(1)] + " ")),
    ("undeclared_axis", lambda m: m.sub_in_dims(_AXIS, "zz")),
    ("axis_dropped", lambda m: m.sub_in_dims(_AXIS, "")),
    ("wrong_mesh_axis", lambda m: m.sub_in_dims(_MESH, lambda _: "/" + m.rng.choice(["tq", *MESH]))),
    ("split_over_a_used_axis", lambda m: m.sub_in_dims(_AXIS, lambda x: f"{x.group(1)}/{m.rng.choice(MESH)}")),
    ("chunk_made_even", lambda m: m.sub_in_dims(r":(chunk|\([^)]*\))", "")),
    ("size_not_dividing", lambda m: m.size(m.rng.choice((5, 7, 11, 13)))),
    ("size_missing", lambda m: m.size(None)),
    ("size_negative_or_zero", lambda m: m.size(m.rng.choice((0, -1, -3)))),
    ("size_of_a_degree", lambda m: m.size(m.rng.randint(1, 4), ["tp", "dp", "pp", "vpp"])),
    ("size_of_a_let", lambda m: m.size(m.rng.randint(1, 20), [s.split()[1] for s in m.lines if s.startswith("let ")])),
    ("blob_size_missing", lambda m: m.blobs.pop(m.rng.choice(sorted(m.blobs)), 0) is not None if m.blobs else False),
    ("bracket_dropped", lambda m: m.sub(r"[)\]}]", "")),
    ("junk_token", lambda m: m.junk()),
    ("line_cut", lambda m: m.sub(r"(?<=.)\S.*$", lambda x: x.group(0)[: m.rng.randrange(len(x.group(0)))])),
    ("no_equals", lambda m: m.sub(" = ", m.rng.choice([" : ", " == ", " =", " "]))),
    *[("bad_token", lambda m: any(m.sub(*m.rng.choice(_BAD_TOKENS)) for _ in range(10)))] * 6,
    ("line_twice", lambda m: m.insert(k := m.pick(lambda s: s.strip() and not s.startswith("section")),
                                      m.lines[k or 0])),
    ("declaration_dropped", lambda m: m.sub(r"^(let|index|section) .*", "")),
    ("stray_statement", lambda m: m.insert(m.rng.randint(0, len(m.lines)), m.rng.choice(
        ["let tp = 2", "let vpp = 1", "include llama", "section model", "index i < 2", "logical w1 = a1 a1"]))),
    ("rule_before_section", lambda m: m.hoist(_is_rule, lambda k: 0)),
    ("flat_before_its_source", lambda m: m.hoist(lambda s: s.startswith("flat "), _first_section(m))),
    ("axis_twice_in_a_logical", lambda m: m.sub(r"^(logical .* = .*?\b([a-z]\d+)\b.*)$", r"\1 \2")),
    ("stored_dims_in_a_logical", lambda m: m.sub(r"^logical .*", lambda x: x.group(0) + m.rng.choice(
        ["/tp", "~2", " {i}", " [x: a1]"]))),
    ("arrow_or_place_added", lambda m: m.sub(" = ", lambda _: " " + m.rng.choice(
        ["-> w1", "@first", "@lastonly", "@last"]) + " = ", _is_rule)),
    ("flat_ops_that_clash", lambda m: m.sub(r"^flat .*", lambda x: x.group(0) + m.rng.choice(
        [" | perparam | align 4", " | coalesce | split dp", " | buckets 3", " | perparam | coalesce", " | only no*",
         " | split tp"]))),
    ("rule_stored_twice", lambda m: m.insert(k := m.pick(_is_rule), m.lines[k or 0].split(" = ")[0] + " = " +
                                             m.lines[m.pick(_is_rule) or 0].split(" = ", 1)[-1])),
    ("index_dim_added", lambda m: m.sub(r" = (.*)$", lambda x: " = " + m.rng.choice(
        ["{i}", "{e}", "{i}/pp", "{e}/ep"]) + ("" if x.group(1) == "scalar" else " " + x.group(1)), _is_rule)),
    ("section_line_again", lambda m: m.insert(m.rng.randint(1, len(m.lines)), m.lines[m.pick(
        lambda s: s.startswith("section ") or _is_rule(s)) or 0])),
    ("stages_dropped", lambda m: m.topology(r",?\s*stages=[0-9+]+", "")),
    ("stages_wrong", lambda m: m.topology(r"stages=(\d+)", lambda x: f"stages={int(x.group(1)) + 1}")),
    ("topology_key", lambda m: m.topology(r"$", m.rng.choice(
        [",ep=3", ",tq=2", ",vpp=0", ",order=tp-dp", ",order=tp-pp-dp-xx", ",stages=1+1", ",,", ",pp=2", ",vpp=2"]))),
    ("topology_degree", lambda m: m.topology(r"(tp|dp|pp)=\d", lambda x: f"{x.group(1)}={m.rng.choice((0, 5, 7))}")),
    ("pipeline_added", lambda m: m.topology(r"pp=1\b", "pp=2")),
]
