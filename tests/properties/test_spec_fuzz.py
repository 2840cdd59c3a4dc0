"""Fuzzing the spec language end to end: specs generated from the grammar reach the resolver, the planner
and the in-memory executor.

``tests/spec_gen.py`` writes syntactically valid specs (random axes, lets, indexes, splits, pads,
concatenations, captures, placements, flat optimizer buffers, scalars, blobs) with sizes and a source
and a destination topology, and plants one mistake in about a third of them. The property, for every
case: reshard refuses it with its own error (a positioned ``SpecError`` quotes the line with a caret
under the token), or both plans validate and moving arange-valued tensors there and back is bit-exact.
Any other exception is a crash. The hypothesis profile (``ci`` or ``fuzz``, ``tests/conftest.py``) sets
the number of examples; a long-running driver can call ``random_case``/``check_case`` on its own seeds.
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from spec_gen import SpecCase, check_case, random_case

from reshard.errors import ReshardError
from reshard.core.resolve import resolve
from reshard.core.spec import parse_spec
from reshard.core.topology import parse_topology

SEEDS = 300


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False))
def test_a_generated_spec_is_refused_cleanly_or_moves_there_and_back_bit_exactly(rng: random.Random) -> None:
    case = random_case(rng)
    note(str(case))
    assert check_case(case) in ("planned", "rejected")


def test_most_generated_specs_reach_the_planner_and_the_rest_are_refused_cleanly() -> None:
    outcomes = Counter(check_case(random_case(random.Random(seed))) for seed in range(SEEDS))
    planned = outcomes["planned"] / SEEDS
    print(f"spec fuzz over {SEEDS} seeds: {planned:.0%} planned, {outcomes['rejected'] / SEEDS:.0%} rejected")
    assert planned >= 0.5, outcomes
    assert outcomes["rejected"] >= 0.1 * SEEDS, outcomes  # the error paths are exercised too


def test_the_same_seed_gives_the_same_case() -> None:
    first, again = ([random_case(random.Random(seed)) for seed in range(20)] for _ in range(2))
    assert first == again
    assert len({random_case(random.Random(seed)).text for seed in range(20)}) == 20


# Crashes the fuzzer found, reduced by hand: each was an exception other than reshard's own (or a
# silently incomplete layout) before the fix named beside it.
REGRESSIONS = {
    # resolve._Resolver.axis_size: a negative size reached geometry.Box as a ValueError.
    "negative_size": (SpecCase("logical w = n\nsection model per tp\nw = n/tp:chunk\n", (("n", -1),), "tp=1", "tp=2"),
                      "axis 'n' has size -1"),
    "negative_let_axis": (SpecCase("let k = n - 5\nlogical w = k\nsection model\nw = k\n", (("n", 3),), "tp=1", "tp=2"),
                          "axis 'k' has size -2"),
    # resolve._Resolver.run: a negative index range made a stacked dim of extent -1 (numpy ValueError).
    "negative_index": (SpecCase("index i < 0-1\nlogical l.{i}.w = n\nsection model\nstack -> l.{i}.w = {i} n\n",
                                (("n", 3),), "tp=1", "tp=2"), "index 'i' ranges over -1 values"),
    # resolve._Resolver.declare_blob: a negative blob byte size reached geometry.Box as a ValueError.
    "negative_blob": (SpecCase("logical w = n\nsection model\nw = n\nblob args\n", (("n", 2),), "tp=1", "tp=2",
                               (("args", -1),)), "blob 'args' has byte size -1"),
    # resolve._Resolver.check_rule: a negative pad part shifted the next part back over the previous one.
    "negative_pad_part": (SpecCase("logical a = n\nlogical b = m\nsection model\nw = [a: n | pad: 0-2 | b: m]\n",
                                   (("m", 3), ("n", 3)), "tp=1", "tp=2"), "a pad part must be >= 0 elements"),
    # terms.flat_layout: 'buckets' below 0 closed a bucket after every param instead of being refused.
    "negative_buckets": (SpecCase("logical a = n\nlogical b = m\nsection model\na = n\nb = m\nsection optim\n"
                                  "flat opt.{bucket} = model | buckets 0-3\n", (("m", 3), ("n", 3)), "tp=1", "tp=2"),
                         "buckets takes a number >= 0"),
    # resolve._Resolver.flat: a split axis missing from the flat section's per axes was a KeyError in flat_layout.
    "flat_split_not_per": (SpecCase("logical w = n\nsection model per tp\nw = n/tp\nsection optim per tp\n"
                                    "flat opt.{state} = model | pad dp | split dp\n", (("n", 4),),
                                    "tp=2,dp=2", "tp=1,dp=2"),
                           "plus its split axis (dp)"),
    # resolve._Resolver.flat: of two 'split' ops the check took both, flat_layout the last (KeyError).
    "flat_two_splits": (SpecCase("logical w = n\nsection model per tp\nw = n/tp\nsection optim per tp cp\n"
                                 "flat opt.{state} = model | split cp | pad 2 | split dp\n", (("n", 4),),
                                 "tp=2,dp=2,cp=2", "tp=1,dp=2,cp=2"), "plus its split axis (dp)"),
    "flat_two_splits_last_wins": (SpecCase("logical w = n\nsection model per tp\nw = n/tp\nsection optim per tp dp\n"
                                           "flat opt.{state} = model | split cp | pad 2 | split dp\n", (("n", 4),),
                                           "tp=2,dp=2", "tp=1,dp=2"), None),
    # resolve._Resolver.check_rule: a placement on one stage plus a split over pp, or a {e/ep} capture plus a
    # split over ep, resolved to a layout that stores part of the tensor nowhere.
    "placed_and_split_over_pp": (SpecCase("logical w = n\nsection model per pp\nw @first = n/pp\n", (("n", 4),),
                                          "pp=2", "pp=2"), "'@first' stores it on one stage"),
    "captured_and_split_over_ep": (SpecCase("index e < experts\nlogical experts.{e}.w = f\nsection model per ep\n"
                                            "local.{e/ep}.w -> experts.{e}.w = f/ep\n", (("experts", 2), ("f", 2)),
                                            "dp=2,ep=2", "dp=2,ep=2"), "sharded twice over 'ep': by '{e/ep}'"),
    # resolve._Resolver.flat: a flat buffer over a section with a blob mixed bytes into a float buffer,
    # and the round trip was not bit-exact.
    "blob_in_flat_buffer": (SpecCase("logical w = n\nsection model\nw = n\nblob args\nsection optim per dp\n"
                                     "flat opt.{state} = model | pad dp | split dp\n", (("n", 2),), "dp=1", "dp=2",
                                     (("args", 3),)), "flat buffers hold tensors only"),
    "blob_kept_out_of_flat_buffer": (SpecCase("logical w = n\nsection model\nw = n\nblob args\nsection optim per dp\n"
                                              "flat opt.{state} = model | except args | pad dp | split dp\n",
                                              (("n", 2),), "dp=1", "dp=2", (("args", 3),)), None),
    # arrays.gather: a tensor of zero elements has no fragment and was reported "stored nowhere".
    "zero_size_tensor": (SpecCase("logical w = n\nlogical v = m\nsection model per tp\nw = n/tp:chunk\nv = m\n",
                                  (("m", 3), ("n", 0)), "tp=1", "tp=2"), None),
}


@pytest.mark.parametrize("name", REGRESSIONS)
def test_a_case_that_once_crashed_is_now_a_clean_error_or_a_plan(name: str) -> None:
    case, message = REGRESSIONS[name]
    assert check_case(case) == ("planned" if message is None else "rejected")
    if message is not None:
        spec = parse_spec(case.text, "fuzz.spec")
        with pytest.raises(ReshardError, match=re.escape(message)):
            for topology in (case.src, case.dst):
                resolve(spec, parse_topology(topology), case.sizes_dict(), blob_sizes=case.blob_sizes_dict())
