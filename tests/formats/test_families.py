"""The contract every registered model family passes, run from the registry: adding a family cannot skip it.

For each family, every format rule that can hold it gives a spec that parses, resolves at several
topologies, and moves the family's weights (and optimizer states, where the format has them) from
the Hugging Face layout and back bit-exactly. The family's config round-trips through its sizes.
"""

from __future__ import annotations

import pytest

from conftest import assert_round_trip, logical_values
from reshard.core.resolve import resolve
from reshard.core.topology import parse_topology
from reshard.errors import CheckpointFormatError, SpecError
from reshard.formats.specs import FORMAT_RULES, family_of, layout_spec, spec_text, tied_head
from reshard.models import FAMILIES, family_for_config, family_for_megatron_args, get_family, megatron_family_of_config

SIZES = {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "layers": 4, "vocab_div": 8, "positions": 32,
         "experts": 4, "vpad": 128, "bucket_size": 0,
         # DeepSeek-V3's MLA ranks and head dims, expert and shared widths, dense layers
         "ql": 12, "kvl": 8, "nope": 4, "rope": 2, "vd": 4, "fe": 6, "shared": 1, "dense": 1, "hf_layers": 4}

# Options each format rule is exercised with, and the topologies its layouts must resolve at.
RULES = {
    "hf": ([()], ["tp=1"]),
    "deepspeed": ([(), ("hf-trainer",), ("zero3",)], ["dp=1", "dp=3"]),
    "deepspeed-pipe": ([()], ["pp=2,dp=2", "tp=2,pp=4"]),
    "dcp": ([()], ["dp=3", "dp=2,tp=2"]),
    "megatron": ([(), ("distopt", "torch"), ("distopt",), ("ep", "distopt", "torch")],
                 ["tp=2,pp=2,dp=2", "tp=1,pp=4", "tp=2,pp=2,ep=2,dp=2"]),
    "megatron-legacy": ([()], ["tp=2,pp=2"]),
    "mcore-dist": ([(), ("tied",)], ["tp=1"]),
}


def _cases():
    for name in FAMILIES:
        for prefix, (options, topologies) in RULES.items():
            for opts in options:
                spec = "-".join((prefix, name, *opts))
                for topo in topologies:
                    yield pytest.param(name, spec, topo, id=f"{spec}@{topo}")


def test_every_format_rule_is_exercised():
    assert set(RULES) == set(FORMAT_RULES)


@pytest.mark.parametrize(("name", "spec", "topology"), list(_cases()))
def test_every_family_in_every_format_round_trips_bit_exactly(name, spec, topology):
    family = get_family(name)
    try:
        text = spec_text(spec)
    except SpecError as e:  # a layout this family does not have (legacy Megatron of Mixtral): said plainly
        assert str(e).startswith(f"{spec}: no ") and f"layout for {name}" in str(e), e
        return
    assert family_of(spec) is family
    topo = parse_topology(topology)
    layout = resolve(layout_spec(spec), topo, SIZES)
    hf = resolve(layout_spec(f"hf-{name}" + ("-tied" if "tied" in spec.split("-") else "")), parse_topology("tp=1"),
                 SIZES)
    common = set(layout.tensors) & set(hf.tensors)
    assert common == set(hf.tensors), f"{spec} lacks {set(hf.tensors) - common}"
    tie = tied_head(family)
    if spec.startswith("deepspeed-") and not spec.startswith("deepspeed-pipe-") and "zero3" not in spec and tie:
        # the module's state dict holds the tied output projection as a copy of the embedding, as DeepSpeed saves it
        head = {f.tensor for f in layout.fragments if f.item.key == tie[0]}
        assert head == {tie[1].name}, (spec, head)
    states = layout.states
    source = resolve(layout_spec(spec), parse_topology("tp=1"), SIZES) if states != ("param",) else hf
    values = logical_values(source, states)
    assert_round_trip(source, layout, values)
    assert text.startswith(family.preamble.strip())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_recognizes_its_config_and_reads_its_sizes_back(name):
    family = get_family(name)
    sizes = {k: SIZES[k] for k in family.sizes}
    if family.name == "gpt2":
        sizes["hd"] = sizes["h"] // sizes["heads"]
    config = family.config_from_sizes(sizes, ["bfloat16", "bfloat16", "float32"])
    config.setdefault("num_experts_per_tok", 2)
    assert family_for_config(config) is family
    assert config["architectures"] == [family.architectures[0]] and config["dtype"] == "bfloat16"
    assert family.sizes_from_config(config, "config.json") == sizes


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("window", [None, 6], ids=["no-window", "window"])
def test_a_family_recognizes_the_megatron_args_it_implies_and_reads_its_config_back(name, window):
    """The args a Megatron run of the family starts with name that family and no other, or a family whose
    Megatron tensors are the same (a Phi-3's args are a Llama's, a Mistral's with a window), or none for a family
    plain megatron-core cannot express (Gemma: Megatron-Bridge's layout, named by its config); the Hugging Face
    fields they record (config_hints) give back the args a config implies (args_from_config)."""
    family = get_family(name)
    if family.megatron_args is None:
        return
    sizes = {k: SIZES[k] for k in family.sizes}
    config = family.config_from_sizes(sizes, ())
    if window is not None:
        if "sliding_window" not in config:  # a family without a window on every layer
            return
        config["sliding_window"] = window
    args = family.megatron_args(sizes, family.tied_default) | family.args_from_config(config) | (
        {"num_experts": SIZES["experts"], "moe_router_topk": 2} if family.experts else {})
    found = family_for_megatron_args(args)
    if family.plain_megatron:  # Megatron-Bridge's layout: no args name it, only its carried config.json
        assert found is None and family.is_megatron is None, (name, found)
    else:
        assert found is family or found.megatron(tied=False) == family.megatron(tied=False), (name, found)
    assert megatron_family_of_config(family, config | {"num_experts_per_tok": 2}) is found
    hints = family.config_hints(args)
    config |= hints
    assert {k: args[k] for k in family.args_from_config(config)} == family.args_from_config(config)
    if family.experts:
        assert hints["num_experts_per_tok"] == 2 and family.megatron_moe_args(sizes, config, {}, "x")[
            "moe_router_topk"] == 2


def test_a_spec_name_of_no_family_or_option_is_a_spec_error():
    with pytest.raises(SpecError, match=r"^no spec 'megatron-granite': 'granite' is not a model family"):
        spec_text("megatron-granite")
    with pytest.raises(SpecError, match=r"^megatron-llama: unknown option 'fused'"):
        spec_text("megatron-llama-fused")
    with pytest.raises(SpecError, match=r"^no spec 'safetensors-llama'"):
        spec_text("safetensors-llama")
    with pytest.raises(CheckpointFormatError, match=r"model_type 'granite' is not a model family"):
        family_for_config({"model_type": "granite"})


@pytest.mark.parametrize("name", ["mistral", "qwen3"])
def test_a_family_megatron_lms_legacy_model_cannot_hold_is_refused_saying_why(name):
    with pytest.raises(SpecError, match=rf"^megatron-legacy-{name}: no legacy Megatron-LM layout for {name}: "
                                        r"Megatron-LM's legacy model .* holds llama, qwen2, gpt2 only, its attention "
                                        rf"without a window or q/k norms; the megatron-core layout is megatron-{name}$"):
        spec_text(f"megatron-legacy-{name}")
