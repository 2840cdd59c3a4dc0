"""The resolver's shared work gives the layouts that working out every unit on its own gives.

The resolver works out once what units share: a stored rule's dims and item info per split coordinates, its
fragments per capture values (the attention of every expert-parallel rank), a rule's capture values per layer and
split coordinates, a flat buffer's placement and its buckets' parts per params' content and rank of the split axis,
the cuts of a param's fragments. With every one of those caches forgetting what it is told, each unit is worked
out from scratch: the reference.
"""

from __future__ import annotations

import random

import pytest
from spec_gen import random_case

from reshard.core import resolve as resolve_module
from reshard.core.resolve import resolve
from reshard.core.spec import parse_spec
from reshard.core.terms import FlatCuts
from reshard.core.topology import parse_topology
from reshard.errors import ReshardError
from reshard.formats.specs import layout_spec


class _Forgetful(dict):
    """A cache that keeps nothing."""

    def __setitem__(self, key, value) -> None:
        pass

    def setdefault(self, key, default=None):
        return default


@pytest.fixture
def unshared(monkeypatch):
    """Resolve with every shared result forgotten: each unit worked out on its own."""
    init = resolve_module._Resolver.__init__

    def forgetting(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        for name in ("shaped", "stored_made", "rule_values_made", "flat_places", "flat_shares", "flat_contents"):
            setattr(self, name, _Forgetful())
        self.flat_cuts = FlatCuts(spans=_Forgetful(), boxes=_Forgetful())

    def run(spec, topology, sizes, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(resolve_module._Resolver, "__init__", forgetting)
            return resolve(spec, topology, sizes, **kwargs)

    return run


def _layout_or_error(make, spec, topology, sizes, **kwargs):
    try:
        layout = make(spec, parse_topology(topology), sizes, **kwargs)
    except ReshardError as e:
        return str(e)
    return (layout.fragments, list(layout.items.items()), dict(layout.order))


LLAMA = {"h": 64, "heads": 8, "g": 4, "hd": 8, "f": 160, "vocab": 1100, "layers": 6, "vocab_div": 128, "bucket_size": 0}
DSV3 = {"ql": 48, "kvl": 32, "nope": 16, "rope": 8, "vd": 16, "shared": 1, "vocab_div": 128, "experts": 16, "h": 64,
        "heads": 4, "f": 96, "fe": 16, "dense": 1, "vocab": 1000, "layers": 6, "hf_layers": 6, "bucket_size": 3000}


@pytest.mark.parametrize(("name", "sizes", "topology"), [
    ("megatron-llama-distopt", LLAMA, "tp=2,pp=2,dp=4,stages=2+4"),
    ("megatron-llama-distopt-torch", LLAMA, "tp=2,pp=3,dp=2"),
    ("megatron-mixtral-ep-distopt", {**LLAMA, "f": 48, "experts": 8}, "tp=2,pp=2,ep=4,dp=4"),
    ("megatron-deepseek_v3-ep-distopt", DSV3, "pp=2,ep=4,dp=8"),
    ("megatron-deepseek_v3-ep-distopt", DSV3, "tp=2,pp=3,ep=2,dp=2,vpp=2"),
    ("deepspeed-llama", LLAMA, "dp=3"),
])
def test_shared_units_resolve_as_units_on_their_own(name, sizes, topology, unshared):
    spec = layout_spec(name)
    assert _layout_or_error(resolve, spec, topology, sizes) == _layout_or_error(unshared, spec, topology, sizes)


@pytest.mark.parametrize("seeds", [range(0, 60), range(60, 120)])
def test_random_specs_resolve_as_units_on_their_own(seeds, unshared):
    """Random specs of the grammar (``tests/spec_gen.py``), both topologies of each: the same layout, or the same
    error."""
    for seed in seeds:
        case = random_case(random.Random(seed))
        try:
            spec = parse_spec(case.text, "case.spec")
        except ReshardError:
            continue
        for topology in (case.src, case.dst):
            kwargs = {"blob_sizes": case.blob_sizes_dict()}
            want = _layout_or_error(unshared, spec, topology, case.sizes_dict(), **kwargs)
            assert _layout_or_error(resolve, spec, topology, case.sizes_dict(), **kwargs) == want, (seed, topology)
