"""Box arithmetic against brute-force oracles."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

from reshard.core.geometry import Box, intersect, restrict, split_range, subtract
from reshard.core.layout import LogicalTensor, box_fragments


@st.composite
def strided_boxes(draw):
    """A box with nested strides: permuted axes and gaps, as rows of a concatenation or a transpose."""
    rank = draw(st.integers(0, 4))
    lengths = tuple(draw(st.integers(1, 4)) for _ in range(rank))
    perm = draw(st.permutations(range(rank)))
    strides = [0] * rank
    s = 1
    for k in reversed(perm):
        strides[k] = s
        s = s * lengths[k] + draw(st.sampled_from([0, 0, 1, 3]))
    offsets = tuple(draw(st.integers(0, 3)) for _ in range(rank))
    base = draw(st.integers(0, 5))
    top = base + sum((n - 1) * x for n, x in zip(lengths, strides)) + 3
    lo = draw(st.integers(0, top))
    hi = draw(st.integers(lo, top + 1))
    return offsets, lengths, tuple(strides), base, lo, hi


@settings(max_examples=400, deadline=None)
@given(strided_boxes())
def test_restrict_keeps_exactly_the_elements_whose_position_is_in_range(case):
    offsets, lengths, strides, base, lo, hi = case
    where = {tuple(o + i for o, i in zip(offsets, idx)): base + sum(i * s for i, s in zip(idx, strides))
             for idx in itertools.product(*(range(n) for n in lengths))}
    got = {}
    for offs, lens, b in restrict(offsets, lengths, strides, base, lo, hi):
        for idx in itertools.product(*(range(n) for n in lens)):
            point = tuple(o + i for o, i in zip(offs, idx))
            assert point not in got
            got[point] = b + sum(i * s for i, s in zip(idx, strides))
    assert got == {p: f for p, f in where.items() if lo <= f < hi}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), min_size=3, max_size=3))
def test_subtract_leaves_disjoint_boxes_covering_a_minus_b(a_dims, b_dims):
    a = Box(tuple(o for o, _ in a_dims), tuple(n for _, n in a_dims))
    b = Box(tuple(o for o, _ in b_dims[: len(a_dims)]), tuple(n for _, n in b_dims[: len(a_dims)]))

    def points(box):
        return set(itertools.product(*(range(o, o + n) for o, n in zip(box.offsets, box.lengths))))

    pieces = subtract(a, b)
    covered = [points(p) for p in pieces]
    assert sum(len(c) for c in covered) == len(set().union(*covered)) if covered else True
    assert set().union(*covered) == points(a) - points(b)
    common = intersect(a, b)
    assert (common is None) == (not (points(a) & points(b)))


def test_split_range_follows_torch_chunk():
    assert [split_range(128, 3, c, "chunk") for c in range(3)] == [(0, 43), (43, 86), (86, 128)]
    assert [split_range(5, 4, c, "chunk") for c in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [split_range(8, 2, c, "widths", (3, 5)) for c in range(2)] == [(0, 3), (3, 8)]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_box_over_dims_becomes_view_boxes_that_hold_the_same_elements(data):
    groups = data.draw(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=0, max_size=3))
    view = tuple(x for g in groups for x in g)
    shape = tuple(int(np.prod(g)) for g in groups)
    t = LogicalTensor(name="t", shape=shape, axes=tuple(f"a{k}" for k in range(len(view))), view=view,
                      dim_axes=tuple(len(g) for g in groups))
    offs = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
    lens = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, offs))
    full = np.arange(int(np.prod(shape))).reshape(shape)
    sub = full[tuple(slice(o, o + n) for o, n in zip(offs, lens))].copy()
    item = sub.ravel()
    strides = tuple(int(x) // sub.itemsize for x in sub.strides)
    got = np.full(view, -1)
    for box, at, strd in box_fragments(t, offs, lens, strides):
        got[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))] = as_strided(
            item[at:], shape=box.lengths, strides=[x * item.itemsize for x in strd])
    want = np.full(shape, -1)
    want[tuple(slice(o, o + n) for o, n in zip(offs, lens))] = sub
    np.testing.assert_array_equal(got.reshape(shape), want)
