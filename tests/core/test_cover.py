"""The planner's fast paths give the plans and layouts a straightforward computation gives.

``Cover.meet`` intersects many destination boxes at once with numpy; its loop (``_meet_one``) is the reference.
``terms.flat_pieces`` keeps whole fragments and reuses cuts; ``geometry.restrict`` on each fragment is the
reference. The resolver shares a rule's dims among the layers of a stage; a layout resolved at a topology whose
stages hold different layers is compared with the same layout built layer by layer through the flat rule.
"""

from __future__ import annotations

import random

import pytest
from spec_gen import random_case

from reshard.core import cover as cover_module
from reshard.core import planner as planner_module
from reshard.core.cover import Cover
from reshard.core.geometry import Box, restrict
from reshard.core.layout import Fragment, Item
from reshard.core.planner import plan
from reshard.core.resolve import resolve
from reshard.core.spec import parse_spec
from reshard.core.terms import FlatCuts, flat_pieces
from reshard.core.topology import parse_topology
from reshard.errors import ReshardError


def _layouts(seed: int):
    case = random_case(random.Random(seed))
    try:
        spec = parse_spec(case.text, "case.spec")
        return tuple(resolve(spec, parse_topology(t), case.sizes_dict(), blob_sizes=case.blob_sizes_dict())
                     for t in (case.src, case.dst))
    except ReshardError:
        return None


def _plan_or_error(src, dst):
    try:
        return plan(src, dst).copies
    except ReshardError as e:
        return str(e)


def _plans_agree(seeds, monkeypatch, fast, reference) -> int:
    """Random specs of the grammar (``tests/spec_gen.py``), each planned in both directions with ``fast(m)`` and
    with ``reference(m)`` applied to a monkeypatch context ``m``: the same copies in the same order, or the same
    error. Returns how many were planned (not refused)."""
    planned = 0
    for seed in seeds:
        layouts = _layouts(seed)
        if layouts is None:  # the case is refused before planning
            continue
        src, dst = layouts
        with monkeypatch.context() as m:
            fast(m)
            got = [_plan_or_error(src, dst), _plan_or_error(dst, src)]
        with monkeypatch.context() as m:
            reference(m)
            assert [_plan_or_error(src, dst), _plan_or_error(dst, src)] == got, seed
        planned += not isinstance(got[0], str)
    return planned


@pytest.mark.parametrize("seeds", [range(0, 40), range(40, 80)])
def test_vectorized_meeting_plans_what_the_loop_plans(seeds, monkeypatch):
    """Numpy for every box against the loop for every box."""
    planned = _plans_agree(seeds, monkeypatch, lambda m: m.setattr(cover_module, "_VECTOR_MIN", 0),
                           lambda m: m.setattr(cover_module, "_VECTOR_MIN", 10**9))
    assert planned >= len(seeds) // 3


@pytest.mark.parametrize("seeds", [range(0, 40), range(40, 80)])
def test_a_box_inside_the_only_source_fragment_is_copied_as_meeting_them_copies_it(seeds, monkeypatch):
    """The planner takes a destination box that the one source fragment of its (tensor, state) holds whole without
    meeting them: the same plans as meeting every such box, with the shortcut taken."""
    sole, taken = planner_module._sole_holder, []

    def counted(held, box):
        got = sole(held, box)
        taken.append(got is not None)
        return got

    planned = _plans_agree(seeds, monkeypatch, lambda m: m.setattr(planner_module, "_sole_holder", counted),
                           lambda m: m.setattr(planner_module, "_sole_holder", lambda held, box: None))
    assert planned >= len(seeds) // 3 and sum(taken) > 0


def _item(k: int) -> Item:
    return Item("s", (("dp", k),), 0, "param", f"t{k}")


def _random_fragments(rng: random.Random, count: int, shape: tuple[int, int], items: int) -> list[Fragment]:
    out = []
    for _ in range(count):
        lo = tuple(rng.randrange(n) for n in shape)
        lens = tuple(rng.randint(1, n - o) for o, n in zip(lo, shape))
        strides = (rng.randint(lens[1], 3 * lens[1]), 1) if rng.random() < 0.7 else (1, rng.randint(lens[0], lens[0] + 9))
        out.append(Fragment(tensor="w", state="param", box=Box(lo, lens), item=_item(rng.randrange(items)),
                            offset=rng.randrange(100), strides=strides))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_meeting_overlapping_replicated_boxes_all_at_once_equals_one_at_a_time(seed):
    """Overlapping source boxes (cut into disjoint pieces), replicas in several items, destination boxes in
    the same items or others: every part, its replica and both offsets as the loop finds them."""
    rng = random.Random(seed)
    shape = (rng.randint(1, 12), rng.randint(1, 12))
    src = _random_fragments(rng, rng.randint(2, 10), shape, 4)
    src.append(Fragment(tensor="w", state="param", box=Box((0, 0), shape), item=_item(0), offset=0, strides=(shape[1], 1)))
    src += [Fragment(tensor="w", state="param", box=f.box, item=_item(rng.randrange(4)), offset=f.offset + 7,
                     strides=f.strides) for f in rng.sample(src, len(src) // 2)]  # replicas
    dst = _random_fragments(rng, rng.randint(1, 30), shape, 6)
    cover = Cover(src)
    assert cover.lo is not None  # several distinct boxes
    owned = cover.owned(dst)
    assert cover._meet_all(dst, owned) == [cover._meet_one(f, own) for f, own in zip(dst, owned)]
    # the replica in a destination fragment's own item, as the planner gives them and as the cover finds them
    assert cover.meet(dst) == cover.meet(dst, [[a for a in src if a.item == f.item] or None for f in dst])


@pytest.mark.parametrize("seed", range(40))
def test_flat_pieces_equal_restricting_every_fragment(seed):
    rng = random.Random(seed)
    params, frags_of = [], {}
    for p in range(rng.randint(1, 4)):
        rows, cols = rng.randint(1, 6), rng.randint(1, 6)
        item = _item(p)
        params.append(item)
        # a param item of rows x cols holding two tensors side by side (columns split at ``cut``)
        cut = rng.randint(1, cols)
        frags_of[item] = [Fragment(tensor="a", state="param", box=Box((0, 0), (rows, cut)), item=item, offset=0,
                                   strides=(cols, 1))]
        if cut < cols:
            frags_of[item].append(Fragment(tensor="b", state="param", box=Box((0, 0), (rows, cols - cut)),
                                           item=item, offset=cut, strides=(cols, 1)))
    cuts = FlatCuts()
    for _ in range(6):  # the same cuts again and again, as ranks of a split axis and stages make them
        pieces = []
        for p, item in enumerate(params):
            n = sum(f.box.volume for f in frags_of[item])
            a = rng.randrange(n)
            pieces.append((p, a, rng.randint(a + 1, n), rng.randrange(50)))
        want = [(f.tensor, Box(offs, lens), base - a + dst, f.strides, f.fill)
                for p, a, z, dst in pieces for f in frags_of[params[p]]
                for offs, lens, base in restrict(f.box.offsets, f.box.lengths, f.strides, f.offset, a, z)]
        assert flat_pieces(params, frags_of, pieces, cuts) == want


@pytest.mark.parametrize(("name", "sizes", "src", "dst"), [
    ("megatron-llama-distopt", {"h": 64, "heads": 8, "g": 4, "hd": 8, "f": 160, "vocab": 1100, "layers": 14,
                                "vocab_div": 128, "bucket_size": 0}, "tp=2,pp=4,dp=4,stages=3+4+4+3", "tp=2,pp=2,dp=8"),
    ("megatron-mixtral-ep-distopt", {"h": 64, "heads": 8, "g": 4, "hd": 8, "f": 48, "vocab": 1100, "layers": 4,
                                     "vocab_div": 128, "bucket_size": 0, "experts": 8}, "pp=2,ep=4,dp=4", "ep=2,dp=2"),
])
def test_meetings_reused_for_alike_tensors_plan_what_a_cover_each_plans(name, sizes, src, dst, monkeypatch):
    """Layers that sit alike in their stages and optimizer states laid out alike reuse one meeting: the same plan
    as a cover made for every (tensor, state)."""
    from reshard.formats.specs import layout_spec

    spec = layout_spec(name)
    a, b = (resolve(spec, parse_topology(t), sizes) for t in (src, dst))
    want = [plan(a, b).copies, plan(b, a).copies]
    monkeypatch.setattr(cover_module.Meetings, "meet", lambda self, sources, frags, owned: Cover(sources).meet(frags))
    assert [plan(a, b).copies, plan(b, a).copies] == want
