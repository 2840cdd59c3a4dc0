"""Fuzzing the parsers of untrusted input: the spec and topology languages, and every reader of
checkpoint files (torch zip and pickle, safetensors, DCP ``.metadata``, and whole checkpoints of every
format through the public API). Whatever the bytes, the only exception allowed is reshard's own error
type (a clear message), never a crash of another kind."""

from __future__ import annotations

import json
import pickle

import pytest
from fuzzing import REGRESSIONS, Seed, all_targets, regressions
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import ReshardError


def _scaled(n: int) -> int:
    """``n`` under the ``ci`` profile's 100 examples, proportionally more under a longer profile."""
    return max(1, n * settings.default.max_examples // 100)


FUZZ = settings(max_examples=_scaled(300))

SPEC_WORDS = ["let", "index", "logical", "section", "per", "states", "flat", "blob", "include", "as", "=", "->", "@",
              "first", "last", "(", ")", "[", "]", "|", ":", "/", "~", "{i}", "{i/pp}", "{e/ep}", "{i@pp+1}", "{=n+1}",
              "tp", "pp", "dp", "ep", "h", "g", "f", "n", "2", "0", "*", "//", "+", "-", "pad", "chunk", "zero",
              "reverse", "align", "buckets", "split", "coalesce", "only", "except", "*.x.*", "a.{i}.w", "scalar",
              "cdiv(", "lcm(", ",", "#", "\n", "  "]


@FUZZ
@given(st.lists(st.sampled_from(SPEC_WORDS) | st.text(max_size=4), max_size=40))
def test_the_spec_parser_and_resolver_only_raise_spec_errors(words):
    from reshard.core.resolve import resolve
    from reshard.core.spec import parse_spec
    from reshard.core.topology import Topology

    text = " ".join(words)
    try:
        spec = parse_spec(text)
        resolve(spec, Topology(tp=2, pp=2, dp=2), {"h": 4, "g": 2, "f": 6, "n": 3})
    except ReshardError:
        pass


@FUZZ
@given(st.text(alphabet="tpdcevzrsalyougnE0123456789=,+|-", max_size=60))
def test_the_topology_parser_only_raises_topology_errors(text):
    from reshard.core.topology import parse_topology

    try:
        parse_topology(text)
    except ReshardError:
        pass


# --- every reader of untrusted files, fed mutations of real files -------------------------------
# The targets, the mutations and the seeds live in tests/fuzzing.py, shared with the long runs of
# bench/fuzz.py. Under the default ``ci`` profile hypothesis is derandomized, so every run of the test
# command tries the same mutations; ``--hypothesis-profile=fuzz`` multiplies the counts by 200.

TARGETS = all_targets()
# Examples per target under the ``ci`` profile: the single-file readers take about a millisecond
# each, a whole-checkpoint conversion tens of milliseconds.
EXAMPLES = {"torch-zip": 300, "torch-pickle": 300, "safetensors": 300, "dcp-metadata": 300, "dcp-distcp": 300,
            "manifest": 150}



@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """Each target's real seed, built once per module on first use."""
    built: dict[str, Seed] = {}

    def get(name: str) -> Seed:
        if name not in built:
            built[name] = Seed(TARGETS[name], tmp_path_factory.mktemp(f"fuzz-{name}"))
        return built[name]

    return get


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_reader_only_raises_reshard_errors_on_mutated_real_files(seeds, name):
    seed = seeds(name)

    @settings(max_examples=_scaled(EXAMPLES.get(name, 40)))
    @given(rng=st.randoms(use_true_random=False))
    def mutated(rng):
        rel, data = seed.draw(rng)
        crash = seed.run(rel, data)
        assert crash is None, f"{name}: {rel} mutated -> {crash.error} at {crash.where}"

    mutated()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_crash_fuzzing_found_stays_fixed(seeds, name):
    """The files bench/fuzz.py saved under tests/fuzz_regressions/<target>/, replayed."""
    seed = seeds(name)
    found = list(regressions(name))
    for rid, rel, data in found:
        crash = seed.run(rel, data)
        assert crash is None, f"{name}/{rid}: {rel} -> {crash.error} at {crash.where}"
    assert all(rel in seed.files for _, rel, _ in found)


def test_every_spec_fuzzing_found_stays_fixed():
    """Specs bench/fuzz.py's ``spec`` target saved under tests/fuzz_regressions/spec/: each is refused
    with a clear error or plans and round-trips bit-exactly now."""
    from spec_gen import SpecCase, check_case

    for side in sorted((REGRESSIONS / "spec").glob("*.json")):
        case = json.loads(side.read_text())["case"]
        pairs = {k: tuple(tuple(p) for p in case[k]) for k in ("sizes", "blob_sizes")}
        assert check_case(SpecCase(**{**case, **pairs})) in ("planned", "rejected"), side.name


def test_a_pickle_that_would_run_code_is_refused_by_every_reader(tmp_path):
    """The fuzzers' one hard rule, checked directly: a __reduce__ payload never runs."""
    from reshard.io.dcp_metadata import parse_metadata

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(ReshardError):
        parse_metadata(pickle.dumps(Payload()))
    assert not marker.exists()
