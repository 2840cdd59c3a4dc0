"""Hand-checked plans: every copy written out, with the intervals each rank holds and wants.

Interval comments follow DCP's test_planner: ``[lo, hi[`` in elements of the
logical tensor. A copy is written ``(src rank, src offset, dst rank, dst
offset, lengths)``; offsets are in elements, relative to each rank's item.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import convert, layouts, logical_values

from reshard.execution.arrays import scatter
from reshard.errors import PlanError
from reshard.core.resolve import resolve
from reshard.core.planner import Plan, plan
from reshard.core.spec import parse_spec
from reshard.core.topology import parse_topology

CHUNKED = """
logical w = n
section model per dp
w = n/dp:chunk
"""

EVEN = """
logical w = n
section model per dp
w = n/dp
"""

# (spec, n, src topology, dst topology, expected copies in plan order: by dst rank, then dst offset)
GOLDEN_1D = [
    pytest.param(CHUNKED, 120, "dp=4", "dp=3", [
        # src dp=4 holds 30 each: rank 0 [0, 30[, 1 [30, 60[, 2 [60, 90[, 3 [90, 120[.
        # dst rank 0 wants [0, 40[; src rank 0 holds [0, 30[, all of it; src rank 1 holds [30, 60[, its first 10.
        (0, 0, 0, 0, (30,)),
        (1, 0, 0, 30, (10,)),
        # dst rank 1 wants [40, 80[; src rank 1 holds [30, 60[, [40, 60[ from its offset 10; src rank 2 holds [60, 90[.
        (1, 10, 1, 0, (20,)),
        (2, 0, 1, 20, (20,)),
        # dst rank 2 wants [80, 120[; src rank 2 holds [60, 90[, [80, 90[ from its offset 20; src rank 3 [90, 120[.
        (2, 20, 2, 0, (10,)),
        (3, 0, 2, 10, (30,)),
    ], id="dp4->dp3-chunk-120"),
    pytest.param(CHUNKED, 120, "dp=3", "dp=4", [
        # src dp=3 holds 40 each: rank 0 [0, 40[, 1 [40, 80[, 2 [80, 120[.
        # dst rank 0 wants [0, 30[; src rank 0 holds [0, 40[, its first 30.
        (0, 0, 0, 0, (30,)),
        # dst rank 1 wants [30, 60[; src rank 0 holds [30, 40[ at its offset 30; src rank 1 holds [40, 60[ at 0.
        (0, 30, 1, 0, (10,)),
        (1, 0, 1, 10, (20,)),
        # dst rank 2 wants [60, 90[; src rank 1 holds [60, 80[ at its offset 20; src rank 2 holds [80, 90[ at 0.
        (1, 20, 2, 0, (20,)),
        (2, 0, 2, 20, (10,)),
        # dst rank 3 wants [90, 120[; src rank 2 holds it at its offset 10.
        (2, 10, 3, 0, (30,)),
    ], id="dp3->dp4-chunk-120"),
    pytest.param(EVEN, 64, "dp=8", "dp=4", [
        # src dp=8 holds 8 each, rank r [8r, 8r + 8[; dst rank r wants [16r, 16r + 16[: src ranks 2r and 2r + 1, whole.
        *[(s, 0, r, 8 * (s - 2 * r), (8,)) for r in range(4) for s in (2 * r, 2 * r + 1)],
    ], id="dp8->dp4-even-64"),
    pytest.param(EVEN, 64, "dp=4", "dp=8", [
        # src dp=4 holds 16 each, rank s [16s, 16s + 16[; dst rank r wants [8r, 8r + 8[: half of src rank r // 2.
        (0, 0, 0, 0, (8,)), (0, 8, 1, 0, (8,)),
        (1, 0, 2, 0, (8,)), (1, 8, 3, 0, (8,)),
        (2, 0, 4, 0, (8,)), (2, 8, 5, 0, (8,)),
        (3, 0, 6, 0, (8,)), (3, 8, 7, 0, (8,)),
    ], id="dp4->dp8-even-64"),
    pytest.param(CHUNKED, 5, "dp=4", "dp=2", [
        # torch.chunk: src dp=4 holds 2, 2, 1, 0: [0, 2[, [2, 4[, [4, 5[ and nothing; dst dp=2 wants [0, 3[, [3, 5[.
        # dst rank 0 wants [0, 3[; src rank 0 holds [0, 2[; src rank 1 holds [2, 4[, its first element.
        (0, 0, 0, 0, (2,)),
        (1, 0, 0, 2, (1,)),
        # dst rank 1 wants [3, 5[; src rank 1 holds [3, 4[ at its offset 1; src rank 2 holds [4, 5[.
        # src rank 3 is empty and is never read.
        (1, 1, 1, 0, (1,)),
        (2, 0, 1, 1, (1,)),
    ], id="dp4->dp2-chunk-5-empty-rank"),
]


def dp_copies(p: Plan) -> list[tuple]:
    return [(dict(c.src.unit)["dp"], c.src_offset, dict(c.dst.unit)["dp"], c.dst_offset, c.lengths) for c in p.copies]


@pytest.mark.parametrize(("text", "n", "src", "dst", "expected"), GOLDEN_1D)
def test_one_dim_reshard_copies_exactly_the_hand_computed_intervals(text, n, src, dst, expected):
    a, b = layouts(text, {"n": n}, src, dst)
    p = plan(a, b)
    p.validate()
    assert dp_copies(p) == expected
    assert {(c.src_strides, c.dst_strides, c.tensor, c.state) for c in p.copies} == {((1,), (1,), "w", "param")}
    out = convert(a, b, scatter(a, logical_values(a)))
    w = logical_values(a)[("w", "param")]
    for item, arr in out.items():
        lo = sum(b.items[it].numel for it in b.items if it < item)
        np.testing.assert_array_equal(arr, w[lo : lo + arr.size], err_msg=str(item))


COLUMNS = """
logical w = r c
section model per tp
w = r c/tp
"""


def test_merging_column_shards_copies_each_with_its_own_strides():
    # w is 2 x 4. tp=2: rank t holds columns [2t, 2t + 2[ as a 2 x 2 item (strides 2, 1).
    # tp=1 wants the 2 x 4 tensor (strides 4, 1): rank t's block lands at column 2t, offset 2t.
    a, b = layouts(COLUMNS, {"r": 2, "c": 4}, "tp=2", "tp=1")
    p = plan(a, b)
    p.validate()
    got = [(dict(c.src.unit)["tp"], c.src_offset, c.src_strides, dict(c.dst.unit)["tp"], c.dst_offset, c.dst_strides,
            c.lengths) for c in p.copies]
    assert got == [
        (0, 0, (2, 1), 0, 0, (4, 1), (2, 2)),
        (1, 0, (2, 1), 0, 2, (4, 1), (2, 2)),
    ]
    # And back: each tp=2 rank reads a 2 x 2 window of the 2 x 4 item, starting at column 2t.
    back = plan(b, a).copies
    assert [(dict(c.dst.unit)["tp"], c.src_offset, c.src_strides, c.dst_offset, c.dst_strides) for c in back] == [
        (0, 0, (4, 1), 0, (2, 1)),
        (1, 2, (4, 1), 0, (2, 1)),
    ]


def test_identity_plan_reads_an_overlapping_replica_from_its_own_item():
    # w (3 elements) is stored twice: split over dp=2 in section a ([0, 2[ and [2, 3[), whole in section b.
    # Planned onto itself, every item is copied in place; b's item must not be read from a's items.
    text = """
logical w = n
section a per dp
w = n/dp:chunk
section b
whole -> w = n
"""
    a, _ = layouts(text, {"n": 3}, "dp=2", "dp=2")
    p = plan(a, a)
    got = [(str(c.src), c.src_offset, str(c.dst), c.dst_offset, c.lengths) for c in p.copies]
    assert got == [
        ("a[dp=0] param:w", 0, "a[dp=0] param:w", 0, (2,)),
        ("a[dp=1] param:w", 0, "a[dp=1] param:w", 0, (1,)),
        ("b[] param:whole", 0, "b[] param:whole", 0, (3,)),
    ]


# --- errors ------------------------------------------------------------------------------------


def test_a_tensor_missing_from_the_source_is_named_with_the_destination_item():
    src = parse_spec("logical w = n\nsection model per dp\nw = n/dp:chunk\n")
    dst = parse_spec("logical w = n\nlogical b = m\nsection model per dp\nw = n/dp:chunk\nb = m\n")
    topo = parse_topology("dp=1")
    with pytest.raises(PlanError) as e:
        plan(resolve(src, topo, {"n": 8}), resolve(dst, topo, {"n": 8, "m": 5}))
    assert str(e.value) == (
        "the source does not hold everything the destination needs:\n"
        "  b [param] [0:5] for model[dp=0] param:b: no such tensor in the source"
    )


ZERO = """
logical w = n
section model
w = n
section optim per dp states exp_avg exp_avg_sq
flat optimizer.{state} = model | pad 2*dp | split dp
"""


def test_an_optimizer_state_missing_from_the_source_is_named_with_the_states_it_has():
    spec, topo = parse_spec(ZERO), parse_topology("dp=2")
    src = resolve(spec, topo, {"n": 8}, states={"optim": ("exp_avg",)})
    with pytest.raises(PlanError) as e:
        plan(src, resolve(spec, topo, {"n": 8}))
    assert str(e.value) == (
        "the source does not hold everything the destination needs:\n"
        "  w [exp_avg_sq] [0:4] for optim[dp=0] exp_avg_sq:optimizer.exp_avg_sq:"
        " state 'exp_avg_sq' not in the source (it has: exp_avg, param)\n"
        "  w [exp_avg_sq] [4:8] for optim[dp=1] exp_avg_sq:optimizer.exp_avg_sq:"
        " state 'exp_avg_sq' not in the source (it has: exp_avg, param)"
    )


@pytest.mark.parametrize(("src_text", "src_sizes", "dst_text", "dst_sizes", "message"), [
    pytest.param(
        "logical w = n\nsection model\nw = n\n", {"n": 64},
        "logical w = n\nsection model\nw = n\n", {"n": 120},
        "w: source view {'n': 64} (shape (64,)) != destination view {'n': 120} (shape (120,))",
        id="other-size",
    ),
    pytest.param(
        "logical w = (g hd) h\nsection model\nw = (g hd) h\n", {"g": 2, "hd": 3, "h": 4},
        "logical w = g hd h\nsection model\nw = g hd h\n", {"g": 2, "hd": 3, "h": 4},
        "w: source view {'g': 2, 'hd': 3, 'h': 4} (shape (6, 4))"
        " != destination view {'g': 2, 'hd': 3, 'h': 4} (shape (2, 3, 4))",
        id="same-axes-other-dims",
    ),
])
def test_two_specs_that_disagree_on_a_logical_shape_cannot_be_planned(
    src_text, src_sizes, dst_text, dst_sizes, message
):
    topo = parse_topology("")
    src = resolve(parse_spec(src_text), topo, src_sizes)
    dst = resolve(parse_spec(dst_text), topo, dst_sizes)
    with pytest.raises(PlanError) as e:
        plan(src, dst)
    assert str(e.value) == "the layouts disagree on logical tensors:\n  " + message


# --- work units ---------------------------------------------------------------------------------

TP_ONLY = """
logical col = f h
logical row = h f
section model per tp
col = f/tp h
row = h f/tp
"""


def test_same_tp_degree_splits_into_one_independent_unit_per_rank():
    a, b = layouts(TP_ONLY, {"f": 8, "h": 4}, "tp=2", "tp=2")
    assert plan(a, b).work_units() == [
        (["model[tp=0]"], ["model[tp=0]"]),
        (["model[tp=1]"], ["model[tp=1]"]),
    ]


def test_merging_tp_ranks_is_one_unit_reading_both_source_files():
    a, b = layouts(TP_ONLY, {"f": 8, "h": 4}, "tp=2", "tp=1")
    assert plan(a, b).work_units() == [(["model[tp=0]", "model[tp=1]"], ["model[tp=0]"])]


# --- validate() ---------------------------------------------------------------------------------


@pytest.fixture
def dp4_to_dp3() -> Plan:
    p = plan(*layouts(CHUNKED, {"n": 120}, "dp=4", "dp=3"))
    p.validate()
    return p


def with_copies(p: Plan, copies: list) -> Plan:
    return Plan(src_items=p.src_items, dst_items=p.dst_items, copies=tuple(copies), tensors=p.tensors)


def test_validate_catches_a_copy_shifted_onto_its_neighbour(dp4_to_dp3):
    # Copy 0 writes [0, 30[ of dst rank 0; shifted by one it writes [1, 31[ and meets copy 1's [30, 40[ at 30.
    copies = list(dp4_to_dp3.copies)
    copies[0] = dataclasses.replace(copies[0], dst_offset=copies[0].dst_offset + 1)
    with pytest.raises(PlanError) as e:
        with_copies(dp4_to_dp3, copies).validate()
    assert str(e.value) == "invalid plan:\n  model[dp=0] param:w: w [0:30] and w [30:40] both write element 30"


def test_validate_catches_a_copy_shifted_past_the_end_of_its_item(dp4_to_dp3):
    # The last copy writes [10, 40[ of dst rank 2's 40 elements; shifted by one it ends at 40, one past the end.
    copies = list(dp4_to_dp3.copies)
    copies[-1] = dataclasses.replace(copies[-1], dst_offset=copies[-1].dst_offset + 1)
    with pytest.raises(PlanError) as e:
        with_copies(dp4_to_dp3, copies).validate()
    assert str(e.value) == (
        "invalid plan:\n  w [90:120]: destination region [11, 40] is outside model[dp=2] param:w of 40 elements"
    )


def test_validate_checks_copies_in_any_order_alike(dp4_to_dp3):
    # Copies come grouped by destination item; validate looks each item up once per run, and must not rely on it.
    want = dp4_to_dp3.validate()
    assert with_copies(dp4_to_dp3, list(reversed(dp4_to_dp3.copies))).validate() == want
    assert with_copies(dp4_to_dp3, dp4_to_dp3.copies[1::2] + dp4_to_dp3.copies[::2]).validate() == want


def test_validate_names_every_copy_of_an_item_not_in_the_plan(dp4_to_dp3):
    copies = list(dp4_to_dp3.copies)
    ghost = dataclasses.replace(copies[0].src, key="ghost")
    copies[0] = dataclasses.replace(copies[0], src=ghost)
    copies[1] = dataclasses.replace(copies[1], dst=ghost)
    copies[2] = dataclasses.replace(copies[2], src=ghost, dst=ghost)
    with pytest.raises(PlanError) as e:
        with_copies(dp4_to_dp3, copies).validate()
    lines = str(e.value).splitlines()
    assert lines[1:4] == [f"  source item {ghost} of w {copies[0].box} is not in the plan",
                          f"  destination item {ghost} of w {copies[1].box} is not in the plan",
                          f"  source item {ghost} of w {copies[2].box} is not in the plan"]
    assert lines[4] == f"  destination item {ghost} of w {copies[2].box} is not in the plan"


def test_validate_catches_a_destination_item_left_partly_unwritten(dp4_to_dp3):
    # Without copy 1 (src rank 1's [30, 40[), dst rank 0 gets 30 of its 40 elements.
    copies = [c for k, c in enumerate(dp4_to_dp3.copies) if k != 1]
    with pytest.raises(PlanError) as e:
        with_copies(dp4_to_dp3, copies).validate()
    assert str(e.value) == (
        "invalid plan:\n  model[dp=0] param:w: copies write 30 elements, the item maps 40 (of 40); tensors written: w"
    )


@pytest.fixture
def dp2_to_dp2() -> Plan:
    """One whole copy per destination item: what ``validate`` checks through its per-shape shortcuts."""
    p = plan(*layouts(CHUNKED, {"n": 120}, "dp=2", "dp=2"))
    assert p.validate() == {"copies": 2, "runs": 2, "unchecked_items": 0}
    return p


def test_validate_catches_a_lone_copy_too_short_for_its_item(dp2_to_dp2):
    copies = list(dp2_to_dp2.copies)
    c = copies[1]
    copies[1] = dataclasses.replace(c, lengths=(59,), box=dataclasses.replace(c.box, lengths=(59,)))
    with pytest.raises(PlanError) as e:
        with_copies(dp2_to_dp2, copies).validate()
    assert str(e.value) == (
        "invalid plan:\n  model[dp=1] param:w: copies write 59 elements, the item maps 60 (of 60); tensors written: w"
    )


@pytest.mark.parametrize("side, field, value, region", [
    ("source", "src_offset", 1, "[1, 60]"),
    ("destination", "dst_offset", 1, "[1, 60]"),
    ("source", "src_offset", -1, "[-1, 58]"),
    ("destination", "dst_strides", (2,), "[0, 118]"),
])
def test_validate_catches_a_lone_copy_outside_its_item(dp2_to_dp2, side, field, value, region):
    copies = list(dp2_to_dp2.copies)
    copies[0] = dataclasses.replace(copies[0], **{field: value})
    with pytest.raises(PlanError) as e:
        with_copies(dp2_to_dp2, copies).validate()
    item = copies[0].src if side == "source" else copies[0].dst
    assert str(e.value).splitlines()[1] == f"  w [0:60]: {side} region {region} is outside {item} of 60 elements"


def test_validate_checks_a_lone_copy_with_a_negative_stride_the_long_way(dp2_to_dp2):
    copies = list(dp2_to_dp2.copies)
    copies[0] = dataclasses.replace(copies[0], src_offset=59, src_strides=(-1,))
    assert with_copies(dp2_to_dp2, copies).validate() == {"copies": 2, "runs": 2, "unchecked_items": 0}
    copies[0] = dataclasses.replace(copies[0], src_offset=58, src_strides=(-1,))
    with pytest.raises(PlanError, match=r"source region \[-1, 58\] is outside"):
        with_copies(dp2_to_dp2, copies).validate()
