"""Tests of reshard.core.topology: rank order, expert view, layer placement, topology strings."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import TopologyError
from reshard.core.topology import LayerPlace, Topology, parse_topology

# Topologies whose every rank is checked; ids are their canonical strings.
TOPOLOGIES = [
    Topology(),
    Topology(tp=2, pp=2, dp=2),
    Topology(tp=4, pp=2, dp=3),
    Topology(tp=2, cp=2, dp=2, pp=2),
    Topology(tp=2, dp=4, ep=2),
    Topology(tp=2, cp=2, dp=3, ep=3, pp=2),
    Topology(tp=2, cp=2, dp=2, ep=4, pp=2, vpp=2, zero=1),
    Topology(tp=2, pp=3, dp=2, order="tp-pp-dp"),
    Topology(tp=2, pp=2, dp=4, ep=2, order="tp-pp-dp"),
    Topology(tp=2, pp=2, dp=2, cp=2, order="tp-dp-cp-pp"),
    Topology(tp=3, pp=2, dp=2, cp=2, ep=2, order="pp-tp-cp-dp-ep"),
]


def _megatron_ranks(order: list[str], sizes: dict[str, int]) -> list[dict[str, int]]:
    """Oracle: coordinates of ranks 0, 1, ... by enumeration, the first axis of ``order`` varying fastest."""
    slowest_first = order[::-1]
    return [dict(zip(slowest_first, c)) for c in itertools.product(*(range(sizes[a]) for a in slowest_first))]


def _degrees(t: Topology) -> dict[str, int]:
    return {a: t.degree(a) for a in ("tp", "cp", "dp", "pp", "ep", "edp")}


def _dense_order(t: Topology) -> list[str]:
    names = t.order.split("-")
    return [a for a in names if a != "ep"] + ([] if "cp" in names else ["cp"])


def _expert_order(t: Topology) -> list[str]:
    names = t.order.split("-")
    if "ep" not in names:
        names.insert(names.index("dp"), "ep")
    return ["edp" if a == "dp" else a for a in names if a != "cp"]


def test_rank_order_puts_tp_fastest() -> None:
    t = Topology(tp=2, dp=2, pp=2)
    assert [t.coords(r)["tp"] for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [t.coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [t.coords(r)["pp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("t", [t for t in TOPOLOGIES if t.order == "tp-cp-ep-dp-pp"], ids=str)
def test_dense_rank_is_megatrons_formula(t: Topology) -> None:
    for r in range(t.world_size):
        c = t.coords(r)
        assert r == c["tp"] + t.tp * (c["cp"] + t.cp * (c["dp"] + t.dp * c["pp"]))


@pytest.mark.parametrize("t", [t for t in TOPOLOGIES if t.order == "tp-cp-ep-dp-pp"], ids=str)
def test_expert_rank_is_megatrons_expert_formula(t: Topology) -> None:
    for r in range(t.world_size):
        c = t.coords(r)
        assert r == c["tp"] + t.tp * (c["ep"] + t.ep * (c["edp"] + t.edp * c["pp"]))


@pytest.mark.parametrize("t", TOPOLOGIES, ids=str)
def test_coords_and_rank_round_trip_for_every_rank(t: Topology) -> None:
    seen_dense, seen_expert = set(), set()
    for r in range(t.world_size):
        c = t.coords(r)
        assert t.rank(**c) == r
        seen_dense.add((c["tp"], c["cp"], c["dp"], c["pp"]))
        seen_expert.add((c["tp"], c["ep"], c["edp"], c["pp"]))
    assert len(seen_dense) == len(seen_expert) == t.world_size


@pytest.mark.parametrize("t", TOPOLOGIES, ids=str)
def test_coords_match_an_enumeration_of_megatrons_rank_generators(t: Topology) -> None:
    dense = _megatron_ranks(_dense_order(t), _degrees(t))
    expert = _megatron_ranks(_expert_order(t), _degrees(t))
    for r in range(t.world_size):
        c = t.coords(r)
        assert {a: c[a] for a in ("tp", "cp", "dp", "pp")} == dense[r]
        # the expert view agrees with the dense one on tp and pp, and adds ep, edp
        assert {a: c[a] for a in ("tp", "ep", "edp", "pp")} == expert[r]


def test_ep_and_edp_coords_of_a_hand_computed_example() -> None:
    # tp=2, dp=4, ep=2: edp = 2; ep varies right after tp, then edp
    t = Topology(tp=2, dp=4, ep=2)
    assert t.edp == 2 and t.world_size == 8
    assert [(t.coords(r)["ep"], t.coords(r)["edp"]) for r in range(8)] == [
        (0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (1, 1), (1, 1),
    ]  # fmt: skip
    assert [t.coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_an_etp_of_its_own_numbers_expert_ranks_over_etp_as_megatron_does() -> None:
    # Megatron's expert generator reads tp as etp: rank = etp_r + etp * (ep_r + ep * (edp_r + edp * pp_r))
    t = Topology(tp=2, dp=2, ep=2, etp=1)  # edp = tp * dp / (etp * ep) = 2
    assert t.edp == 2 and t.world_size == 4
    assert [(t.coords(r)["tp"], t.coords(r)["etp"], t.coords(r)["ep"], t.coords(r)["edp"]) for r in range(4)] == [
        (0, 0, 0, 0), (1, 0, 1, 0), (0, 0, 0, 1), (1, 0, 1, 1),
    ]  # fmt: skip
    t = Topology(tp=4, dp=2, ep=2, etp=2, pp=2)
    assert t.edp == 2
    assert [t.coords(r)["etp"] for r in range(4)] == [0, 1, 0, 1] and t.coords(3)["tp"] == 3
    assert [(t.coords(r)["ep"], t.coords(r)["edp"], t.coords(r)["pp"]) for r in range(0, 16, 2)] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1),
    ]  # fmt: skip
    # ep need not divide dp there: the experts use the tp ranks (a world of 2)
    t = Topology(tp=2, dp=1, ep=2, etp=1)
    assert t.edp == 1 and [t.coords(r)["ep"] for r in range(2)] == [0, 1]
    assert Topology(tp=2, dp=2, ep=2).coords(3)["etp"] == 1  # no etp of its own: tp's rank
    with pytest.raises(TopologyError, match=r"^etp\(1\) \* ep\(4\) = 4 does not divide tp\(2\) \* dp\(1\) \* cp\(1\) = 2$"):
        Topology(tp=2, dp=1, ep=4, etp=1)
    with pytest.raises(TopologyError, match=r"^ep\(2\) does not divide dp\(1\) \* cp\(1\) = 1$"):
        Topology(tp=2, dp=1, ep=2, etp=2)  # etp = tp: the experts' ranks are tp's


def test_expert_groups_span_cp_ranks() -> None:
    # cp=2, dp=2, ep=2: dense cp is fastest, and expert ep takes the same ranks
    t = Topology(cp=2, dp=2, ep=2)
    assert [(t.coords(r)["cp"], t.coords(r)["dp"]) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [(t.coords(r)["ep"], t.coords(r)["edp"]) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_deepspeed_order_puts_pp_before_dp() -> None:
    t = Topology(tp=2, pp=2, dp=2, order="tp-pp-dp")
    assert [(c["tp"], c["pp"], c["dp"]) for c in map(t.coords, range(8))] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1),
    ]  # fmt: skip


def test_order_without_ep_puts_ep_just_before_dp() -> None:
    implicit = Topology(tp=2, pp=2, dp=4, ep=2, order="tp-pp-dp")
    explicit = Topology(tp=2, pp=2, dp=4, ep=2, order="tp-pp-ep-dp")
    assert [implicit.coords(r) for r in range(16)] == [explicit.coords(r) for r in range(16)]


def test_rank_defaults_missing_coordinates_to_zero_and_ignores_expert_ones() -> None:
    t = Topology(tp=2, pp=2, dp=4, ep=2)
    assert t.rank(pp=1) == 8
    assert t.rank(tp=1, dp=3, ep=1, edp=0) == 7


def test_degree_knows_every_axis() -> None:
    t = Topology(tp=2, pp=3, dp=4, cp=2, ep=4, vpp=2)
    assert {a: t.degree(a) for a in ("tp", "pp", "dp", "cp", "ep", "edp", "vpp")} == {
        "tp": 2, "pp": 3, "dp": 4, "cp": 2, "ep": 4, "edp": 2, "vpp": 2,
    }  # fmt: skip
    assert t.world_size == 48


def test_check_world_size_accepts_the_product() -> None:
    Topology(tp=4, dp=3, pp=2).check_world_size(24)
    Topology(tp=2, dp=4, ep=4).check_world_size(8)  # ep is not a factor


def test_check_divisible_names_the_tensor() -> None:
    t = Topology(tp=3)
    t.check_divisible("model.layers.7.self_attn.q_proj.weight", "h", 96, "tp")
    with pytest.raises(TopologyError) as e:
        t.check_divisible("model.layers.7.self_attn.k_proj.weight", "g", 8, "tp")
    assert str(e.value) == "model.layers.7.self_attn.k_proj.weight: g(8) is not divisible by tp(3)"


def _places(*triples: tuple[int, int, int]) -> tuple[LayerPlace, ...]:
    return tuple(LayerPlace(*t) for t in triples)


def test_even_layer_placement_numbers_layers_locally() -> None:
    assert Topology(pp=2).layer_placement(4) == _places((0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1))
    assert Topology().layer_placement(3) == _places((0, 0, 0), (0, 0, 1), (0, 0, 2))


def test_explicit_uneven_stages_with_an_empty_last_stage() -> None:
    t = Topology(pp=3, stages=(3, 2, 0))
    assert t.layer_placement(5) == _places((0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0), (1, 0, 1))


def test_vpp_interleaves_virtual_stages_over_stages() -> None:
    # 8 layers, pp=2, vpp=2: virtual stage v on stage v % 2, chunk v // 2
    assert Topology(pp=2, vpp=2).layer_placement(8) == _places(
        (0, 0, 0), (0, 0, 1),  # layers 0-1
        (1, 0, 0), (1, 0, 1),  # layers 2-3
        (0, 1, 0), (0, 1, 1),  # layers 4-5
        (1, 1, 0), (1, 1, 1),  # layers 6-7
    )  # fmt: skip


def test_vpp_with_explicit_stages() -> None:
    t = Topology(pp=2, vpp=2, stages=(1, 2, 0, 1))
    assert t.layer_placement(4) == _places((0, 0, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0))


def test_stages_given_as_a_list_are_stored_as_a_tuple() -> None:
    t = Topology(pp=2, stages=[1, 2])  # type: ignore[arg-type]
    assert t.stages == (1, 2) and hash(t) == hash(Topology(pp=2, stages=(1, 2)))


# (topology string, the topology it denotes)
LAYOUTS = [
    ("pp=4,layout=Et|(tt|)*2,tL", Topology(pp=4, stages=(1, 2, 2, 1))),
    ("pp=4, layout = E||t|L", Topology(pp=4, stages=(0, 0, 1, 0))),
    ("pp=2,layout=Ett|(tt|)*2,tL", Topology(pp=2, vpp=2, stages=(2, 2, 2, 1))),
    ("pp=2,vpp=2,layout=Et*2|t*2|t,t|tL", Topology(pp=2, vpp=2, stages=(2, 2, 2, 1))),
    ("layout=Et*4L,tp=2", Topology(tp=2, stages=(4,))),
    ("pp=4,layout=E(t|)*3tL", Topology(pp=4, stages=(1, 1, 1, 1))),
    ("pp=5,layout=E((t|)*2)*2,L", Topology(pp=5, stages=(1, 1, 1, 1, 0))),
    ("pp=3,layout=Et|*2tL", Topology(pp=3, stages=(1, 0, 1))),
    ("pp=16,layout=Et*3|(tt|)*30,L", Topology(pp=16, vpp=2, stages=(3,) + (2,) * 30 + (0,))),
]


@pytest.mark.parametrize(("text", "expected"), LAYOUTS, ids=[t for t, _ in LAYOUTS])
def test_megatron_layout_sets_layers_per_virtual_stage(text: str, expected: Topology) -> None:
    assert parse_topology(text) == expected


def test_layout_places_embedding_and_loss_stages_as_megatron_does() -> None:
    t = parse_topology("pp=16,layout=Et*3|(tt|)*30,L")
    places = t.layer_placement(63)
    assert places[0] == LayerPlace(0, 0, 0) and places[3] == LayerPlace(1, 0, 0)
    assert places[-1] == LayerPlace(14, 1, 1)  # stage 15 chunk 1 holds only the loss


ROUND_TRIPS = [
    ("", Topology()),
    ("tp=2,pp=2,dp=4", Topology(tp=2, pp=2, dp=4)),
    ("tp=1,pp=1,dp=8,cp=2,ep=4,vpp=1,zero=3", Topology(dp=8, cp=2, ep=4, zero=3)),
    ("tp=2,pp=2,dp=1,vpp=2,stages=3+4+4+3", Topology(tp=2, pp=2, vpp=2, stages=(3, 4, 4, 3))),
    ("tp=2,pp=2,dp=2,order=tp-pp-dp", Topology(tp=2, pp=2, dp=2, order="tp-pp-dp")),
    (" dp = 4 , tp = 2 , order = tp - pp - dp ", Topology(tp=2, dp=4, order="tp-pp-dp")),
]


@pytest.mark.parametrize(("text", "expected"), ROUND_TRIPS, ids=[t or "empty" for t, _ in ROUND_TRIPS])
def test_parse_and_str_round_trip(text: str, expected: Topology) -> None:
    t = parse_topology(text)
    assert t == expected
    assert parse_topology(str(t)) == t


def test_str_omits_defaults_except_tp_pp_dp() -> None:
    assert str(Topology()) == "tp=1,pp=1,dp=1"
    assert str(Topology(tp=2, dp=4, ep=2, zero=1)) == "tp=2,pp=1,dp=4,ep=2,zero=1"
    assert str(Topology(pp=2, vpp=2, cp=2, stages=(1, 0, 2, 1))) == "tp=1,pp=2,dp=1,cp=2,vpp=2,stages=1+0+2+1"


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    tp, pp, dp, cp, vpp = (draw(st.integers(1, 4)) for _ in range(5))
    ep = draw(st.sampled_from([d for d in range(1, dp * cp + 1) if dp * cp % d == 0]))
    stages = draw(st.none() | st.tuples(*[st.integers(0, 5)] * (pp * vpp)))
    # keep cp and dp adjacent (ep may sit beside either) so both rank views agree on tp and pp
    block = draw(st.permutations(["cp", "dp"]))
    if draw(st.booleans()):
        block.insert(draw(st.integers(0, 2)), "ep")
    if cp == 1 and draw(st.booleans()):
        block.remove("cp")
    outer = draw(st.permutations(["tp", "pp", "block"]))
    order = "-".join(a for part in outer for a in (block if part == "block" else [part]))
    zero = draw(st.integers(0, 3))
    return Topology(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp, zero=zero, stages=stages, order=order)


@settings(max_examples=200)
@given(topologies())
def test_str_then_parse_is_identity(t: Topology) -> None:
    assert parse_topology(str(t)) == t


@settings(max_examples=50)
@given(topologies())
def test_generated_topologies_match_megatrons_rank_generators(t: Topology) -> None:
    dense = _megatron_ranks(_dense_order(t), _degrees(t))
    expert = _megatron_ranks(_expert_order(t), _degrees(t))
    for r in range(t.world_size):
        c = t.coords(r)
        assert t.rank(**c) == r
        assert {a: c[a] for a in dense[r]} == dense[r]
        assert {a: c[a] for a in expert[r]} == expert[r]


# (topology string, the full error message)
INVALID_TEXTS = [
    (
        "tq=2,pp=2",
        "unknown topology key 'tq' in 'tq=2,pp=2' "
        "(expected one of: tp, pp, dp, cp, ep, etp, vpp, zero, stages, layout, order)",
    ),
    ("tp=2,tp=4", "duplicate topology key 'tp' in 'tp=2,tp=4'"),
    ("tp=two", "topology key 'tp' needs an integer, got 'two' in 'tp=two'"),
    ("tp=2.0", "topology key 'tp' needs an integer, got '2.0' in 'tp=2.0'"),
    ("tp2,pp=2", "expected key=value, got 'tp2' in 'tp2,pp=2'"),
    ("tp=2,,pp=2", "empty item in 'tp=2,,pp=2'"),
    ("tp=0", "invalid topology 'tp=0': tp must be >= 1, got 0"),
    ("pp=-2", "invalid topology 'pp=-2': pp must be >= 1, got -2"),
    ("dp=4,ep=3", "invalid topology 'dp=4,ep=3': ep(3) does not divide dp(4) * cp(1) = 4"),
    ("zero=4", "invalid topology 'zero=4': zero must be 0, 1, 2 or 3, got 4"),
    ("stages=3+x", "topology key 'stages' needs integers joined by '+', got '3+x' in 'stages=3+x'"),
    ("pp=2,stages=3+3+2", "invalid topology 'pp=2,stages=3+3+2': stages has 3 entries, expected pp(2) * vpp(1) = 2"),
    ("pp=2,stages=3+-1", "invalid topology 'pp=2,stages=3+-1': stages entries must be >= 0, got 3+-1"),
    (
        "order=tp-dp-pq",
        "invalid topology 'order=tp-dp-pq': order 'tp-dp-pq' names unknown axis 'pq' "
        "(expected axes from: tp, cp, ep, dp, pp)",
    ),
    ("order=tp-dp-pp-tp", "invalid topology 'order=tp-dp-pp-tp': order 'tp-dp-pp-tp' names 'tp' twice"),
    ("order=tp-cp-dp", "invalid topology 'order=tp-cp-dp': order 'tp-cp-dp' does not name pp"),
    (
        "cp=2,order=tp-dp-pp",
        "invalid topology 'cp=2,order=tp-dp-pp': order 'tp-dp-pp' does not name cp, needed with cp(2)",
    ),
    (
        "cp=2,pp=2,order=tp-cp-pp-dp",
        "invalid topology 'cp=2,pp=2,order=tp-cp-pp-dp': order 'tp-cp-pp-dp' gives pp stride 2 in the dense view "
        "(tp-cp-pp-dp) but 1 in the expert view (tp-pp-ep-edp); both must agree",
    ),
    (
        "tp=2,dp=2,ep=2,order=ep-tp-cp-dp-pp",
        "invalid topology 'tp=2,dp=2,ep=2,order=ep-tp-cp-dp-pp': order 'ep-tp-cp-dp-pp' gives tp stride 1 "
        "in the dense view (tp-cp-dp-pp) but 2 in the expert view (ep-tp-edp-pp); both must agree",
    ),
    ("stages=1,layout=tL", "give stages or layout, not both, in 'stages=1,layout=tL'"),
    (
        "pp=2,layout=E|t|m|L",
        "invalid topology 'pp=2,layout=E|t|m|L': layout 'E|t|m|L': MTP layers ('m') are not supported",
    ),
    (
        "pp=2,layout=Et|tx|L",
        "invalid topology 'pp=2,layout=Et|tx|L': unknown layout symbol 'x' at position 4 in 'Et|tx|L' "
        "(expected one of: E, t, m, L, |, (, ), *n)",
    ),
    (
        "pp=4,layout=t|E|t|L",
        "invalid topology 'pp=4,layout=t|E|t|L': layout 't|E|t|L': 'E' (embedding) must open the first virtual stage, "
        "found in virtual stage 1 'E'",
    ),
    (
        "layout=tEtL",
        "invalid topology 'layout=tEtL': layout 'tEtL': 'E' (embedding) must open the first virtual stage, "
        "found in virtual stage 0 'tEtL'",
    ),
    (
        "pp=2,layout=Et|Lt",
        "invalid topology 'pp=2,layout=Et|Lt': layout 'Et|Lt': 'L' (loss) must close the last virtual stage, "
        "found in virtual stage 1 'Lt'",
    ),
    (
        "pp=2,layout=t|tL",
        "invalid topology 'pp=2,layout=t|tL': layout 't|tL' has 0 'E' (embedding), expected exactly one",
    ),
    (
        "pp=2,layout=EL|tL",
        "invalid topology 'pp=2,layout=EL|tL': layout 'EL|tL' has 2 'L' (loss), expected exactly one",
    ),
    (
        "pp=2,layout=E|t|tL",
        "invalid topology 'pp=2,layout=E|t|tL': layout 'E|t|tL' has 3 virtual stages, expected a multiple of pp(2)",
    ),
    (
        "pp=2,vpp=2,layout=E|tL",
        "invalid topology 'pp=2,vpp=2,layout=E|tL': layout 'E|tL' has 2 virtual stages, expected pp(2) * vpp(2) = 4",
    ),
    ("layout=E(t|L", "invalid topology 'layout=E(t|L': unclosed '(' in layout 'E(t|L'"),
    ("layout=Et)|L", "invalid topology 'layout=Et)|L': unmatched ')' at position 2 in layout 'Et)|L'"),
    ("layout=Et*|L", "invalid topology 'layout=Et*|L': '*' at position 2 in layout 'Et*|L' needs a count, e.g. t*3"),
    (
        "layout=E*2t*2*2L",
        "invalid topology 'layout=E*2t*2*2L': '*' at position 6 in layout 'E*2t*2*2L' has nothing to repeat",
    ),
    (
        "layout=Et*99999999L",
        "invalid topology 'layout=Et*99999999L': layout 'Et*99999999L' unrolls to more than 1000000 symbols",
    ),
]


@pytest.mark.parametrize(("text", "message"), INVALID_TEXTS, ids=[t for t, _ in INVALID_TEXTS])
def test_invalid_topology_strings_raise_exact_messages(text: str, message: str) -> None:
    with pytest.raises(TopologyError) as e:
        parse_topology(text)
    assert str(e.value) == message


# (a call on Topology, the full error message)
INVALID_CALLS = [
    (lambda: Topology(tp="2"), "tp must be an integer, got '2'"),
    (lambda: Topology(ep=True), "ep must be an integer, got True"),
    (lambda: Topology(pp=2, stages=(1, "2")), "stages must be a tuple of integers, got (1, '2')"),
    (lambda: Topology(tp=4, dp=3, pp=2).check_world_size(16), "tp(4) * dp(3) * pp(2) = 24 != world_size(16)"),
    (lambda: Topology(cp=2, ep=2).check_world_size(4), "tp(1) * cp(2) = 2 != world_size(4)"),
    (lambda: Topology().degree("xp"), "unknown axis 'xp' (expected one of: tp, pp, dp, cp, ep, edp, etp, vpp)"),
    (lambda: Topology(tp=2).coords(2), "rank 2 is out of range for world_size(2)"),
    (lambda: Topology(tp=2).coords(-1), "rank -1 is out of range for world_size(2)"),
    (lambda: Topology(tp=2).rank(tp=2), "tp coordinate 2 is out of range for tp(2)"),
    (lambda: Topology(tp=2).rank(vpp=0), "unknown coordinate 'vpp' (expected one of: tp, cp, dp, pp, ep, edp, etp)"),
    (
        lambda: Topology(pp=4).layer_placement(10),
        "num_layers(10) is not divisible by pp(4) * vpp(1) = 4; give explicit stages, e.g. stages=3+3+2+2",
    ),
    (
        lambda: Topology(pp=2, vpp=2).layer_placement(6),
        "num_layers(6) is not divisible by pp(2) * vpp(2) = 4; give explicit stages, e.g. stages=2+2+1+1",
    ),
    (lambda: Topology(pp=3, stages=(3, 3, 2)).layer_placement(10), "stages 3+3+2 = 8 != num_layers(10)"),
    (lambda: Topology().layer_placement(-1), "num_layers must be >= 0, got -1"),
]


@pytest.mark.parametrize(("call", "message"), INVALID_CALLS, ids=[m for _, m in INVALID_CALLS])
def test_invalid_calls_raise_exact_messages(call, message: str) -> None:
    with pytest.raises(TopologyError) as e:
        call()
    assert str(e.value) == message


def test_proposed_stages_are_accepted() -> None:
    t = parse_topology("pp=4,stages=3+3+2+2")
    assert [p.stage for p in t.layer_placement(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
