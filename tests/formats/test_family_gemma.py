"""Gemma, Gemma 2, Gemma 3 (text) and OLMo 2: what their configs say to Megatron-Bridge's layout and args, the
refusals of what it cannot compute (each naming the field and its value), and the names that must not be
confused (``post_attention_layernorm`` is Gemma 2/3's post-attention norm, Gemma 1's pre-MLP norm).
"""

from __future__ import annotations

import re

import pytest

from reshard.errors import CheckpointFormatError, SpecError
from reshard.formats.specs import spec_text
from reshard.models import get_family

SIZES = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "intermediate_size": 96, "vocab_size": 300, "num_hidden_layers": 12}
GEMMA3 = {**SIZES, "model_type": "gemma3_text", "sliding_window": 512, "query_pre_attn_scalar": 256}


@pytest.mark.parametrize("config", [
    {"rope_theta": 1e6, "rope_local_base_freq": 10000.0, "rope_scaling": {"type": "linear", "factor": 8.0},
     "sliding_window_pattern": 6},  # transformers 4.x
    {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
     "layer_types": ["full_attention" if (n + 1) % 6 == 0 else "sliding_attention" for n in range(12)]},  # 5.x
], ids=["4.x", "5.x"])
def test_gemma3_rope_bases_scaling_and_five_to_one_window_are_megatron_bridges_in_either_spelling(config):
    args = get_family("gemma3_text").args_from_config(GEMMA3 | config)
    assert {k: args[k] for k in ("rotary_base", "rope_scaling_factor", "window_size", "window_attn_skip_freq",
                                 "softmax_scale", "query_pre_attn_scalar")} == {
        "rotary_base": (10000.0, 1e6), "rope_scaling_factor": 8.0, "window_size": (511, 0),
        "window_attn_skip_freq": 6, "softmax_scale": 1 / 16, "query_pre_attn_scalar": 256}


@pytest.mark.parametrize(("types", "window"), [
    (["sliding_attention", "full_attention"] * 2, {"window_size": (5, 0), "window_attn_skip_freq": 2}),
    (["sliding_attention"] * 4, {"window_size": (5, 0), "window_attn_skip_freq": None}),
    (["full_attention"] * 4, {"window_size": None}),
    (["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
     {"window_size": (5, 0), "window_attn_skip_freq": [1, 0, 0, 1]}),
], ids=["alternating", "all-sliding", "all-full", "irregular"])
def test_gemma2_layer_types_are_megatrons_window_on_exactly_those_layers(types, window):
    config = {**SIZES, "num_hidden_layers": 4, "model_type": "gemma2", "sliding_window": 6, "layer_types": types}
    args = get_family("gemma2").args_from_config(config)
    assert {k: args.get(k) for k in window} == window
    assert (args["attn_logit_softcapping"], args["final_logit_softcapping"]) == (50.0, 30.0)  # transformers' defaults


def test_gemma_head_dim_is_256_unless_given_and_one_key_value_head_is_mqa():
    config = {k: v for k, v in SIZES.items() if k != "head_dim"} | {"model_type": "gemma", "num_key_value_heads": 1}
    sizes = get_family("gemma").sizes_from_config(config, "config.json")
    assert (sizes["hd"], sizes["g"], sizes["heads"]) == (256, 1, 4)
    assert get_family("gemma").megatron_args(sizes, True)["kv_channels"] == 256


@pytest.mark.parametrize(("name", "fields", "message"), [
    ("gemma", {"hidden_act": "relu"}, 'hidden_act = "relu": Megatron-Bridge\'s Gemma runs tanh GELU only'),
    ("gemma2", {"hidden_activation": "gelu"}, 'hidden_activation = "gelu": Megatron-Bridge\'s Gemma runs tanh GELU'),
    ("gemma2", {"query_pre_attn_scalar": None}, "query_pre_attn_scalar = null: Gemma 2/3 scale attention by it"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0},
     "attn_logit_softcapping = 50.0: Megatron-Bridge's Gemma 3 applies no soft-capping"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                         "full_attention": {"rope_type": "default"}}},
     'rope_parameters.sliding_attention.rope_type = "linear": Megatron-Bridge\'s Gemma 3 scales only the full'),
    ("gemma3_text", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}},
     'rope_scaling.rope_type = "yarn": Megatron-Bridge\'s Gemma 3 scales only the full layers\' RoPE, linearly'),
    ("gemma3_text", {"use_bidirectional_attention": True},
     "use_bidirectional_attention = true: a Megatron GPT attends causally"),
])
def test_a_gemma_config_megatron_bridge_cannot_compute_is_refused_naming_the_field(name, fields, message):
    with pytest.raises(CheckpointFormatError, match="^" + re.escape(message)):
        get_family(name).args_from_config({**SIZES, "model_type": name} | fields)


def test_an_untied_gemma_is_refused_naming_the_field():
    with pytest.raises(CheckpointFormatError, match=r"^config.json: tie_word_embeddings = false: Gemma's output "):
        get_family("gemma2").sizes_from_config({**SIZES, "tie_word_embeddings": False}, "config.json")


def test_post_attention_layernorm_is_gemma2s_post_attention_norm_and_gemma1s_pre_mlp_norm():
    """Megatron-Bridge's names: Gemma 2/3's post_attention_layernorm goes inside linear_proj, its
    pre_feedforward_layernorm into linear_fc1; Gemma 1's post_attention_layernorm is Llama's pre-MLP norm."""
    gemma2 = spec_text("megatron-gemma3_text")
    assert "logical model.layers.{i}.post_attention_layernorm.weight as post_attn = h" in gemma2
    assert "decoder.layers.{i/pp}.self_attention.linear_proj.post_layernorm.weight -> post_attn = h" in gemma2
    assert "logical model.layers.{i}.pre_feedforward_layernorm.weight as ln2 = h" in gemma2
    assert "decoder.layers.{i/pp}.mlp.linear_fc1.layer_norm_weight -> ln2 = h" in gemma2
    assert "decoder.layers.{i/pp}.mlp.linear_fc2.post_layernorm.weight -> post_ffn = h" in gemma2
    assert "decoder.layers.{i/pp}.self_attention.q_layernorm.weight -> q_norm = hd" in gemma2
    assert "output_layer.weight -> embed @lastonly" in gemma2  # tied, always
    gemma = spec_text("megatron-gemma")
    assert "logical model.layers.{i}.post_attention_layernorm.weight as ln2 = h" in gemma
    assert "post_layernorm" not in gemma and "lm_head" not in gemma


@pytest.mark.parametrize(("spec", "message"), [
    ("megatron-gemma-local", "megatron-gemma-local: no Megatron layout for gemma tied in local layers (model_type "
                             "'gemma': embeddings scaled by sqrt(hidden_size) and (1 + w) RMSNorms stored zero-centred"),
    ("megatron-gemma2-local", "megatron-gemma2-local: no Megatron layout for gemma2 tied in local layers (model_type "
                              "'gemma2': attn_logit_softcapping and final_logit_softcapping, post_attention_layernorm"),
    ("megatron-gemma3_text-local", "megatron-gemma3_text-local: no Megatron layout for gemma3_text tied in local "
                                   "layers (model_type 'gemma3_text': a RoPE base per layer type, "
                                   "attn_logit_softcapping"),
    ("megatron-olmo2-distopt-torch", "megatron-olmo2-distopt-torch: no Megatron layout for olmo2 (model_type "
                                     "'olmo2': q_norm and k_norm normalise the whole q and k projections (width "
                                     "heads * head_dim, not megatron-core's per-head qk_layernorm"),
    ("mcore-dist-gemma2-local", "mcore-dist-gemma2-local: no torch_dist layout for gemma2 in local layers "
                                "(model_type 'gemma2': "),
    ("mcore-dist-olmo2", "mcore-dist-olmo2: no torch_dist layout for olmo2 (model_type 'olmo2': "),
])
def test_a_plain_megatron_core_layout_of_them_is_refused_naming_what_it_cannot_compute(spec, message):
    with pytest.raises(SpecError, match="^" + re.escape(message)):
        spec_text(spec)


def test_olmo2s_full_width_q_k_norms_are_replicated_over_tp_in_dcp_as_transformers_plan_gathers_q_and_k():
    text = spec_text("dcp-olmo2")
    assert "logical model.layers.{i}.self_attn.q_norm.weight as q_norm = (g qpg hd)" in text
    assert "model.model.layers.{i}.self_attn.q_norm.weight -> q_norm = (g qpg hd)/dp:chunk" in text
    assert "model.model.layers.{i}.self_attn.q_proj.weight -> q = (g qpg hd)/tp/dp:chunk h" in text
    assert get_family("olmo2").megatron_args is None and get_family("olmo2").megatron is None
