"""Property tests of the planner: the plan invariants of STYLE.md G10 over generated specs.

Hypothesis draws a source and a destination topology (tp, dp in 1..4, pp in
1..3 with explicit ``stages=`` when the layers do not divide), then a spec of
one to three tensors built from a small grammar of layouts: replicated, even
and ``:chunk`` splits, nested splits, 2-D grids, transposed storage, padded
dims, concatenations of two logical tensors, products of axes, pipeline layers
``{i/pp}``, and ZeRO-1 / ZeRO-3 flat optimizer buffers. Extents run 1..13, so
most of them do not divide the degrees. The checks here are independent of
``Plan.validate()``: write counts are taken with numpy over each destination item.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from conftest import assert_round_trip, convert, layouts, logical_values
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

from reshard.execution.arrays import apply, scatter
from reshard.core.layout import Layout
from reshard.core.planner import Plan, plan

PROPERTY = settings(
    max_examples=50,
    deadline=None,
    database=None,  # keep no example database in the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --- a small grammar of stored layouts -------------------------------------------------------


@dataclass(frozen=True)
class Ax:
    """An axis as a stored term, with splits applied left to right: ``(mesh axis, 'even' | 'chunk')``."""

    name: str
    splits: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Pd:
    """``name~(4*tp)``, zero- or last-padded; appears only inside a ``Pr``."""

    name: str
    policy: str


@dataclass(frozen=True)
class Pr:
    """``(t1 t2 ...)`` with splits of the whole product."""

    terms: tuple[Ax | Pd, ...]
    splits: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Cat:
    """``[ta: ... | tb: ... | pad: n]``; a part names its logical tensor by index into ``Tensor.logicals``."""

    parts: tuple[tuple[int, tuple[Ax, ...]], ...]
    pad: int


@dataclass(frozen=True)
class Logical:
    name: str
    dims: tuple[tuple[str, ...], ...]
    """Each dim is the row-major product of these axes."""


@dataclass(frozen=True)
class Tensor:
    kind: str
    key: str
    logicals: tuple[Logical, ...]
    stored: tuple[Ax | Pr | Cat, ...]
    layered: bool
    place: str | None


@dataclass(frozen=True)
class Style:
    """Ways to write the same spec: redundant parentheses, ``-> ALIAS`` for ``-> full.name``, ``:even``."""

    parens: bool = False
    alias: bool = False
    explicit_even: bool = False


@dataclass(frozen=True)
class Case:
    tensors: tuple[Tensor, ...]
    sizes: tuple[tuple[str, int], ...]
    layers: int
    flat: str | None  # None, "zero1" or "zero3"
    src: str
    dst: str

    @property
    def states(self) -> tuple[str, ...]:
        return ("param", "exp_avg", "exp_avg_sq") if self.flat else ("param",)

    def text(self, style: Style = Style()) -> str:
        return render(self, style)

    def layouts(self, style: Style = Style()) -> tuple[Layout, Layout]:
        text = self.text(style)
        note(f"{self.src} -> {self.dst}, sizes {dict(self.sizes)}, spec:\n{text}")  # shown for a failing example
        return layouts(text, dict(self.sizes), self.src, self.dst)


FLAT_LINES = {
    "zero1": "flat optimizer.{state} = model | pad 2*dp | split dp",
    "zero3": "flat fp32.{state} = model | perparam | split dp",
}


def render(case: Case, style: Style) -> str:
    def axis(name: str) -> str:
        return f"({name})" if style.parens else name

    def splits(sp: tuple[tuple[str, str], ...]) -> str:
        mode_text = {"chunk": ":chunk", "even": ":even" if style.explicit_even else ""}
        return "".join(f"/{mesh}{mode_text[mode]}" for mesh, mode in sp)

    def full(t: Tensor, lg: Logical) -> str:
        return f"layers.{{i}}.{lg.name}" if t.layered else lg.name

    def ref(t: Tensor, lg: Logical) -> str:
        # A concatenation part names its tensor with a plain NAME, so layered parts always go by alias.
        return lg.name.upper() if style.alias or (t.layered and t.kind == "concat") else full(t, lg)

    def term(t: Tensor, x: Ax | Pd | Pr | Cat) -> str:
        if isinstance(x, Ax):
            return axis(x.name) + splits(x.splits)
        if isinstance(x, Pd):
            return axis(x.name) + "~(4*tp)" + (":last" if x.policy == "last" else "")
        if isinstance(x, Pr):
            return "(" + " ".join(term(t, y) for y in x.terms) + ")" + splits(x.splits)
        parts = [f"{ref(t, t.logicals[i])}: " + " ".join(term(t, y) for y in terms) for i, terms in x.parts]
        return "[" + " | ".join(parts + ([f"pad: {x.pad}"] if x.pad else [])) + "]"

    def logical_dim(d: tuple[str, ...]) -> str:
        return axis(d[0]) if len(d) == 1 else "(" + " ".join(axis(a) for a in d) + ")"

    lines = ["index i < layers"] if case.layers else []
    for t in case.tensors:
        for lg in t.logicals:
            alias = f" as {lg.name.upper()}" if style.alias or (t.layered and t.kind == "concat") else ""
            lines.append(f"logical {full(t, lg)}{alias} = " + " ".join(logical_dim(d) for d in lg.dims))
    pp = " pp" if case.layers else ""
    lines.append(f"section model per tp{'' if case.flat else ' dp'}{pp}")
    for t in case.tensors:
        name = f"blocks.{{i/pp}}.{t.key}" if t.layered else t.key
        arrow = "" if t.kind == "concat" else f" -> {ref(t, t.logicals[0])}"
        place = f" @{t.place}" if t.place else ""
        lines.append(f"{name}{arrow}{place} = " + " ".join(term(t, x) for x in t.stored))
    if case.flat:
        lines.append(f"section optim per tp dp{pp} states exp_avg exp_avg_sq")
        lines.append(FLAT_LINES[case.flat])
    return "\n".join(lines) + "\n"


MODEL_KINDS = ("replicated", "tp", "dp_chunk", "nested", "grid", "transposed", "padded", "concat", "product")
FLAT_KINDS = ("replicated", "tp", "transposed", "padded", "concat", "product")  # the model section is per tp only


@st.composite
def topologies(draw, layers: int) -> tuple[int, str]:
    tp, dp = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    pp = draw(st.integers(1, 3)) if layers else 1
    text = f"tp={tp},pp={pp},dp={dp}"
    if pp > 1 and (layers % pp or draw(st.booleans())):
        cuts = sorted(draw(st.lists(st.integers(0, layers), min_size=pp - 1, max_size=pp - 1)))
        stages = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, layers])]
        text += ",stages=" + "+".join(map(str, stages))
    return tp, text


@st.composite
def tensors(
    draw, k: int, kind: str, family: str, tp_lcm: int, sizes: dict[str, int], layered: bool, pipelined: bool
) -> Tensor:
    """Tensor ``k`` of ``kind``; its axes' extents go into ``sizes``. Even tp splits need ``tp_lcm`` to divide."""
    def new_axis(letter: str, hi: int = 13) -> str:
        name = f"{letter}{k}"
        sizes[name] = draw(st.integers(1, hi))
        return name

    def tp_split(extent: int) -> tuple[str, str]:
        return ("tp", "even" if extent % tp_lcm == 0 and draw(st.booleans()) else "chunk")

    def plain(ndim_lo: int = 1) -> list[str]:
        return [new_axis(c) for c in "abc"[: draw(st.integers(ndim_lo, 3))]]

    name = f"t{k}"
    place = draw(st.sampled_from([None, "first"])) if pipelined and not layered else None
    if kind == "concat":
        x, y = new_axis("x"), new_axis("y")
        shared = [new_axis(c) for c in "zw"[: draw(st.integers(0, 2))]]
        rest = tuple((s,) for s in shared)
        logicals = (Logical(name + "a", ((x,), *rest)), Logical(name + "b", ((y,), *rest)))
        cat = Cat(((0, (Ax(x, (tp_split(sizes[x]),)),)), (1, (Ax(y, (tp_split(sizes[y]),)),))), draw(st.integers(0, 2)))
        return Tensor(kind, f"s{k}", logicals, (cat, *(Ax(s) for s in shared)), layered, place)
    if kind == "product":
        a, b = new_axis("a", 5), new_axis("b", 5)
        rest = [new_axis("c") for _ in range(draw(st.integers(0, 1)))]
        if draw(st.booleans()):
            head = Pr((Ax(a), Ax(b)), (tp_split(sizes[a] * sizes[b]),))
        else:
            head = Pr((Ax(a, (tp_split(sizes[a]),)), Ax(b)))
        logicals = (Logical(name, ((a, b), *((c,) for c in rest))),)
        return Tensor(kind, f"s{k}", logicals, (head, *(Ax(c) for c in rest)), layered, place)
    names = plain(2 if kind in ("grid", "transposed") else 1)
    stored: list[Ax | Pr] = [Ax(n) for n in names]
    i = draw(st.integers(0, len(names) - 1))
    if kind == "tp":
        stored[i] = Ax(names[i], (tp_split(sizes[names[i]]),))
    elif kind == "dp_chunk":
        stored[i] = Ax(names[i], (("dp", "chunk"),))
    elif kind == "nested":
        stored[i] = Ax(names[i], (tp_split(sizes[names[i]]), ("dp", "chunk")))
    elif kind == "grid":
        j = draw(st.integers(0, len(names) - 1).filter(lambda j: j != i))
        stored[i] = Ax(names[i], (tp_split(sizes[names[i]]),))
        stored[j] = Ax(names[j], (("dp", "chunk"),))
    elif kind == "padded":
        stored[i] = Pr((Pd(names[i], draw(st.sampled_from(["zero", "last"]))),), (("tp", "even"),))
    elif kind == "transposed":
        if draw(st.booleans()):
            stored[i] = Ax(names[i], (tp_split(sizes[names[i]]),))
        j = draw(st.integers(0, len(names) - 1))
        if family == "model" and j != i and draw(st.booleans()):
            stored[j] = Ax(names[j], (("dp", "chunk"),))
        order = draw(st.permutations(range(len(names))).filter(lambda p: list(p) != sorted(p)))
        stored = [stored[p] for p in order]
    return Tensor(kind, f"s{k}", (Logical(name, tuple((n,) for n in names)),), tuple(stored), layered, place)


@st.composite
def cases(draw, family: str | None = None) -> Case:
    family = family or draw(st.sampled_from(["model", "flat"]))
    pipelined = draw(st.booleans())
    layers = draw(st.integers(1, 6)) if pipelined else 0
    (src_tp, src), (dst_tp, dst) = draw(topologies(layers)), draw(topologies(layers))
    tp_lcm = math.lcm(src_tp, dst_tp)
    sizes: dict[str, int] = {"layers": layers} if pipelined else {}
    out = []
    for k in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(MODEL_KINDS if family == "model" else FLAT_KINDS))
        layered = pipelined and (k == 0 or draw(st.booleans()))
        out.append(draw(tensors(k, kind, family, tp_lcm, sizes, layered, pipelined)))
    flat = draw(st.sampled_from(["zero1", "zero3"])) if family == "flat" else None
    return Case(tuple(out), tuple(sorted(sizes.items())), layers, flat, src, dst)


# --- independent checks --------------------------------------------------------------------


def region_positions(numel: int, offset: int, strides: tuple[int, ...], lengths: tuple[int, ...]) -> np.ndarray:
    """Flat positions (elements) of a strided region inside an item of ``numel`` elements; asserts the bounds."""
    first = offset + sum((n - 1) * s for n, s in zip(lengths, strides) if s < 0)
    last = offset + sum((n - 1) * s for n, s in zip(lengths, strides) if s > 0)
    assert 0 <= first and last < numel, f"region offset={offset} strides={strides} lengths={lengths} outside {numel}"
    positions = np.arange(numel, dtype=np.int64)
    return as_strided(positions[offset:], shape=lengths, strides=tuple(s * positions.itemsize for s in strides)).ravel()


def write_counts(p: Plan) -> dict:
    """How many copies write each element of each destination item."""
    counts = {item: np.zeros(info.numel, dtype=np.int64) for item, info in p.dst_items.items()}
    for c in p.copies:
        assert c.src in p.src_items and c.dst in p.dst_items, str(c)
        region_positions(p.src_items[c.src].numel, c.src_offset, c.src_strides, c.lengths)
        np.add.at(counts[c.dst], region_positions(p.dst_items[c.dst].numel, c.dst_offset, c.dst_strides, c.lengths), 1)
    return counts


def facts(p: Plan) -> tuple:
    return p.copies, dict(p.src_items), dict(p.dst_items), dict(p.tensors)


# --- properties ------------------------------------------------------------------------------


@PROPERTY
@given(cases())
def test_every_copy_is_in_bounds_and_writes_each_mapped_destination_element_exactly_once(case: Case) -> None:
    a, b = case.layouts()
    p = plan(a, b)
    p.validate()
    for item, count in write_counts(p).items():
        info = p.dst_items[item]
        assert count.max(initial=0) <= 1, f"{item}: elements written twice at {np.flatnonzero(count > 1)[:10]}"
        assert int((count == 0).sum()) == info.numel - info.mapped, f"{item}: unwritten elements != padding"


# The smallest case found by shrinking: tp=2 chunks t0 (3) into 2 + 1, so the replicated t1 sits at
# flat offset 2 on tp rank 0 and 1 on tp rank 1, and the dp=2 split cuts the two replicas differently.
OVERLAPPING_REPLICAS = Case(
    tensors=(
        Tensor("tp", "s0", (Logical("t0", (("a0",),)),), (Ax("a0", (("tp", "chunk"),)),), False, None),
        Tensor("replicated", "s1", (Logical("t1", (("a1",),)),), (Ax("a1"),), False, None),
    ),
    sizes=(("a0", 3), ("a1", 2)),
    layers=0,
    flat="zero1",
    src="tp=2,pp=1,dp=2",
    dst="tp=2,pp=1,dp=2",
)


@PROPERTY
@given(cases())
@example(OVERLAPPING_REPLICAS)
def test_planning_a_layout_onto_itself_copies_every_item_in_place(case: Case) -> None:
    a, _ = case.layouts()
    p = plan(a, a)
    # Pad policy 'last' repeats logical data into padding, which is written but never read: such a
    # copy reads the logical element it repeats (possibly in another item, when an item holds only
    # padding), never itself. Every other copy is an item copied onto itself, in place.
    repeats = defaultdict(set)
    for f in a.fragments:
        if f.fill:
            numel = a.items[f.item].numel
            repeats[f.item].update(region_positions(numel, f.offset, f.strides, f.box.lengths).tolist())
    for c in p.copies:
        written = region_positions(p.dst_items[c.dst].numel, c.dst_offset, c.dst_strides, c.lengths)
        if not set(written.tolist()) <= repeats[c.dst]:
            assert (c.src, c.src_offset, c.src_strides) == (c.dst, c.dst_offset, c.dst_strides), str(c)
    items = scatter(a, logical_values(a, case.states))
    out = apply(p, items)
    assert out.keys() == items.keys()
    for item, arr in items.items():
        np.testing.assert_array_equal(out[item].view(np.uint8), arr.view(np.uint8), err_msg=str(item))


@PROPERTY
@given(cases())
def test_moving_to_another_layout_and_back_is_byte_identical(case: Case) -> None:
    a, b = case.layouts()
    assert_round_trip(a, b, logical_values(a, case.states))


@PROPERTY
@given(cases())
def test_a_plan_survives_a_json_round_trip(case: Case) -> None:
    p = plan(*case.layouts())
    back = Plan.from_json(json.loads(json.dumps(p.to_json())))
    assert facts(back) == facts(p)


@PROPERTY
@given(cases(), st.builds(Style, st.booleans(), st.booleans(), st.booleans()))
def test_two_spellings_of_one_layout_give_equal_plans(case: Case, style: Style) -> None:
    plain, other = plan(*case.layouts()), plan(*case.layouts(style))
    assert facts(other) == facts(plain)


def test_redundant_parentheses_and_aliases_are_the_same_layout() -> None:
    # By hand: `(a b)/tp c` and `((a) (b))/tp:even (c)`, `-> alias` and `-> full name`.
    sizes = {"a": 3, "b": 4, "c": 5}
    one = "logical w = (a b) c\nsection model per tp\nw = (a b)/tp c\n"
    two = "logical w as W = ((a) (b)) c\nsection model per tp\nstored -> W = ((a) (b))/tp:even (c)\n"
    three = "logical w = (a b) c\nsection model per tp\nstored -> w = (a b)/tp c\n"
    p1, p2, p3 = (plan(*layouts(t, sizes, "tp=2", "tp=3")) for t in (one, two, three))
    assert facts(p2) == facts(p3)
    # Only the stored name (the item key) differs from the first spelling.
    assert [(c.src_offset, c.dst_offset, c.lengths, c.box) for c in p1.copies] == [
        (c.src_offset, c.dst_offset, c.lengths, c.box) for c in p2.copies
    ]


@PROPERTY
@given(cases())
def test_reads_list_each_source_region_once_however_many_destinations_need_it(case: Case) -> None:
    a, b = case.layouts()
    p = plan(a, b)
    reads = p.reads()
    for item, regions in reads.items():
        assert regions == sorted(set(regions)), f"{item}: a region is listed twice"
    assert {(c.src, (c.src_offset, c.src_strides, c.lengths)) for c in p.copies} == {
        (item, r) for item, regions in reads.items() for r in regions
    }
    # A replica fanned out to items the source lacks is read from one place.
    sources = defaultdict(set)
    for c in p.copies:
        if c.dst not in p.src_items:
            sources[(c.tensor, c.state, c.box)].add((c.src, c.src_offset, c.src_strides))
    assert all(len(s) == 1 for s in sources.values()), {k: v for k, v in sources.items() if len(v) > 1}


def test_replicated_norm_going_from_tp1_to_tp4_is_read_once_and_copied_four_times() -> None:
    a, b = layouts("logical norm = h\nsection model per tp\nnorm = h\n", {"h": 8}, "tp=1", "tp=4")
    p = plan(a, b)
    (src,) = a.items
    assert p.reads() == {src: [(0, (1,), (8,))]}
    assert len(p.copies) == 4 and {c.src for c in p.copies} == {src}
    assert sorted(dict(c.dst.unit)["tp"] for c in p.copies) == [0, 1, 2, 3]
    assert p.summary()["elements_read"] == 8 and p.summary()["elements_written"] == 32
    out = convert(a, b, scatter(a, logical_values(a)))
    assert all(arr.tolist() == out[next(iter(out))].tolist() for arr in out.values())
