"""What each Llama-style family's config says to Megatron and back: RoPE in both spellings, windows, and
the refusals of what Megatron's args cannot express, each naming the field and its value; which family a
Megatron checkpoint is, from its args and a carried config.json.
"""

from __future__ import annotations

import json
import re

import pytest

import reshard
from fixtures import make_fixture
from reshard.errors import CheckpointFormatError
from reshard.models import family_for_config, family_for_megatron_args, get_family

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("config", [
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}},  # transformers 4.x
    {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}},  # 4.x, older key
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}},  # transformers 5.x
], ids=["4.x", "4.x-type", "5.x"])
def test_llama3_scaling_in_either_spelling_is_megatrons_rope_scaling_and_comes_back(config):
    llama = get_family("llama")
    args = llama.args_from_config(config)
    assert args == {"use_rope_scaling": True, "rope_scaling_factor": 8.0, "rotary_base": 500000.0}
    hints = llama.config_hints(args)
    assert hints["rope_scaling"] == {"rope_type": "llama3", **LLAMA3} and hints["rope_theta"] == 500000.0
    assert llama.args_from_config(hints) == args


@pytest.mark.parametrize(("config", "message"), [
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "low_freq_factor": 2.0}},
     "rope_scaling: llama3 scaling with low_freq_factor = 2.0; megatron-core fixes low_freq_factor 1, "
     "high_freq_factor 4, original_max_position_embeddings 8192 (only the factor is an arg), so the model would "
     "change"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3,
                          "original_max_position_embeddings": 4096}},
     "rope_parameters: llama3 scaling with original_max_position_embeddings = 4096; megatron-core fixes"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     'rope_parameters.rope_type = "yarn": Megatron\'s args express RoPE unscaled or llama3-scaled only'),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     'rope_scaling.rope_type = "longrope": Megatron\'s args express RoPE'),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}}, 'rope_scaling.rope_type = "su"'),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 'rope_scaling.rope_type = "linear"'),
    ({"partial_rotary_factor": 0.75, "rope_scaling": None}, "partial_rotary_factor = 0.75: reshard writes"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor = 0.5"),
], ids=["llama3-low", "llama3-original", "yarn", "longrope", "su", "linear", "partial-4.x", "partial-5.x"])
def test_rope_megatron_cannot_express_is_refused_naming_the_field_and_value(config, message):
    for name in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
        with pytest.raises(CheckpointFormatError) as e:
            get_family(name).args_from_config(config)
        assert str(e.value).startswith(message), (name, str(e.value))


def test_a_sliding_window_is_megatrons_inclusive_window_and_comes_back():
    mistral = get_family("mistral")
    assert mistral.args_from_config({"sliding_window": 4096})["window_size"] == (4095, 0)
    assert mistral.args_from_config({"sliding_window": None}).get("window_size") is None
    assert mistral.config_hints({"window_size": (4095, 0)})["sliding_window"] == 4096
    assert mistral.config_hints({"window_size": None})["sliding_window"] is None  # not MistralConfig's 4096
    assert get_family("phi3").args_from_config({"sliding_window": 2047})["window_size"] == (2046, 0)


@pytest.mark.parametrize(("config", "message"), [
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2, "num_hidden_layers": 4},
     "use_sliding_window = true, sliding_window = 4096, max_window_layers = 2: a sliding window on some layers only"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
     "sliding_window = 8: a sliding window on some layers only"),
])
def test_a_qwen_window_on_some_layers_is_refused(config, message):
    for name in ("qwen2", "qwen3"):
        with pytest.raises(CheckpointFormatError, match="^" + message):
            get_family(name).args_from_config(config)
    # switched on but reaching no layer: nothing to refuse
    assert "window_size" not in get_family("qwen2").args_from_config(
        {"use_sliding_window": True, "max_window_layers": 4, "num_hidden_layers": 4})


def test_each_megatron_flag_names_one_family_and_a_mix_names_none():
    base = get_family("llama").megatron_args({"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 8, "vocab": 10,
                                              "layers": 2}, False)
    cases = {(): "llama", (("add_qkv_bias", True),): "qwen2", (("qk_layernorm", True),): "qwen3",
             (("window_size", (5, 0)),): "mistral", (("add_qkv_bias", True), ("qk_layernorm", True)): None,
             (("window_size", (5, 3)),): None, (("add_qkv_bias", True), ("window_size", (5, 0))): None,
             (("num_experts", 4),): "mixtral", (("num_experts", 4), ("qk_layernorm", True)): "qwen3_moe",
             (("num_experts", 4), ("qk_layernorm", True), ("moe_router_pre_softmax", True)): "qwen3_moe",
             (("num_experts", 4), ("moe_router_pre_softmax", True)): None,  # HF Mixtral renormalises the top k
             (("num_experts", 4), ("qk_layernorm", True), ("add_qkv_bias", True)): None,
             (("num_experts", 4), ("swiglu", False), ("quick_geglu", True), ("glu_linear_offset", 1.0),
              ("add_bias_linear", True), ("add_qkv_bias", True), ("softmax_type", "learnable")): "gpt_oss"}
    for extra, want in cases.items():
        found = family_for_megatron_args(base | dict(extra))
        assert (found.name if found else None) == want, extra


def _megatron_llama(tmp_path):
    make_fixture(tmp_path / "m", format="megatron", to="tp=2", model="tiny-llama", states=("param",))
    return tmp_path / "m"


SIZES = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
         "intermediate_size": 160, "vocab_size": 1100, "num_hidden_layers": 4}


def test_a_carried_config_decides_between_families_whose_megatron_args_are_the_same(tmp_path):
    path = _megatron_llama(tmp_path)
    phi3 = get_family("phi3").config_from_sizes({"h": 64, "heads": 8, "g": 4, "hd": 8, "f": 160, "vocab": 1100,
                                                 "layers": 4})
    (path / "config.json").write_text(json.dumps(phi3))
    source = reshard.open_checkpoint(path)
    assert source.spec_name == "megatron-phi3" and source.model.family == "phi3"
    reshard.convert(path, tmp_path / "hf", format="hf")
    back = reshard.open_checkpoint(tmp_path / "hf")
    assert back.spec_name == "hf-phi3" and "model.layers.0.self_attn.qkv_proj.weight" in {
        it.key for it in back.layout.items}
    mistral = {**SIZES, "model_type": "mistral", "sliding_window": 6}  # a window Megatron's args do not have
    (path / "config.json").write_text(json.dumps(mistral))
    with pytest.raises(CheckpointFormatError, match="model_type 'mistral' names the mistral family, but the args"):
        reshard.open_checkpoint(path)
    (path / "config.json").write_text(json.dumps({**SIZES, "model_type": "qwen2"}))  # biases the args lack
    with pytest.raises(CheckpointFormatError, match="model_type 'qwen2' names the qwen2 family, but the args"):
        reshard.open_checkpoint(path)


def test_a_config_megatron_cannot_express_is_refused_with_its_file(tmp_path):
    make_fixture(tmp_path / "hf", format="hf", model="tiny-llama", states=("param",))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", **LLAMA3, "high_freq_factor": 2.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError) as e:
        reshard.convert(tmp_path / "hf", tmp_path / "m", format="megatron", to="tp=2")
    assert str(e.value).startswith(f"{tmp_path / 'hf'}: config.json: rope_scaling: llama3 scaling with "
                                   "high_freq_factor = 2.0; megatron-core fixes")
    assert not (tmp_path / "m").exists()


QWEN3_MOE = {**SIZES, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts_per_tok": 2}


@pytest.mark.parametrize("experts", [{"num_experts": 4}, {"num_local_experts": 4}, {"num_experts": 4,
                                                                                   "num_local_experts": 4}],
                         ids=["4.x", "5.x", "both"])
@pytest.mark.parametrize("norm", [True, False, None], ids=["renormalised", "not", "absent"])
def test_qwen3_moe_experts_in_either_spelling_and_its_routing_are_megatrons_and_come_back(experts, norm):
    family = get_family("qwen3_moe")
    config = QWEN3_MOE | experts | ({} if norm is None else {"norm_topk_prob": norm})
    sizes = family.sizes_from_config(config)
    assert (sizes["experts"], sizes["f"]) == (4, 32)
    args = family.megatron_moe_args(sizes, config, {}, "config.json")
    assert (args["num_experts"], args["moe_router_topk"], args["moe_ffn_hidden_size"]) == (4, 2, 32)
    assert args["moe_router_pre_softmax"] is (not norm)  # Qwen3MoeConfig's norm_topk_prob defaults to false
    hints = family.config_hints(family.megatron_args(sizes, False) | args)
    assert (hints["num_experts"], hints["num_experts_per_tok"], hints["norm_topk_prob"]) == (4, 2, bool(norm))
    assert family_for_megatron_args(family.megatron_args(sizes, False) | args) is family


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_experts": 4, "mlp_only_layers": [1]},
     "mlp_only_layers = [1]: dense MLP layers among the mixture-of-experts ones"),
    ({"num_experts": 4, "decoder_sparse_step": 2},
     "decoder_sparse_step = 2: dense MLP layers between the mixture-of-experts ones"),
    ({"num_experts": 4, "tie_word_embeddings": True},
     "tie_word_embeddings = true: the Qwen3-MoE layout stores its output projection"),
    ({"num_experts": 4, "num_local_experts": 8}, "num_experts = 4, num_local_experts = 8: disagree"),
    ({"num_experts": 0}, "num_experts = 0: must be a positive integer"),
    ({}, "'num_experts' (or 'num_local_experts') is missing"),
    ({"num_experts": 4, "norm_topk_prob": "yes"}, 'norm_topk_prob = "yes": expected true or false'),
])
def test_a_qwen3_moe_config_reshard_cannot_lay_out_is_refused_naming_the_field(fields, message):
    family = get_family("qwen3_moe")
    config = QWEN3_MOE | {"mlp_only_layers": [], "decoder_sparse_step": 1} | fields
    with pytest.raises(CheckpointFormatError, match="^" + re.escape("config.json: " + message)):
        family.megatron_moe_args(family.sizes_from_config(config), config, {}, "config.json")


def test_a_qwen3_moe_with_dense_layers_is_refused_before_anything_is_written(tmp_path):
    from typer.testing import CliRunner

    from reshard.cli.main import app

    make_fixture(tmp_path / "hf", format="hf", model="tiny-llama", states=("param",))
    config = QWEN3_MOE | {"num_experts": 4, "mlp_only_layers": [0, 2]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "hf"), str(tmp_path / "m"), "--format", "megatron"])
    assert result.exit_code == 2, result.output
    assert "mlp_only_layers = [0, 2]: dense MLP layers" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "m").exists()


GPT_OSS = {**SIZES, "model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2}
YARN = {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096,
        "truncate": False}


@pytest.mark.parametrize("rope", [
    {},  # GptOssConfig's own yarn
    {"rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", **YARN}},  # transformers 4.x
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, **YARN}},  # 5.x
], ids=["default", "4.x", "5.x"])
def test_gpt_oss_yarn_window_pattern_and_clamp_are_megatrons_and_come_back(rope):
    family = get_family("gpt_oss")
    args = family.args_from_config(GPT_OSS | rope)
    assert {k: args[k] for k in (
        "position_embedding_type", "rotary_base", "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
        "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int", "window_size",
        "window_attn_skip_freq", "activation_func_clamp_value")} == {
        "position_embedding_type": "yarn", "rotary_base": 150000.0, "yarn_rotary_scaling_factor": 32.0,
        "yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,
        "yarn_correction_range_round_to_int": False, "window_size": (127, 0), "window_attn_skip_freq": 2,
        "activation_func_clamp_value": 7.0}
    sizes = family.sizes_from_config(GPT_OSS)
    full = family.megatron_args(sizes, False) | args | family.megatron_moe_args(sizes, GPT_OSS, {}, "config.json")
    assert family_for_megatron_args(full) is family
    hints = family.config_hints(full)
    assert hints["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 150000.0, **YARN}
    assert (hints["sliding_window"], hints["layer_types"][:2], hints["swiglu_limit"]) == (
        128, ["sliding_attention", "full_attention"], 7.0)
    assert family.args_from_config(GPT_OSS | hints).items() >= args.items()  # and the epsilon Megatron records


@pytest.mark.parametrize(("fields", "message"), [
    ({"swiglu_alpha": 1.5}, "swiglu_alpha = 1.5: megatron-core's quick_gelu has slope 1.702 only"),
    ({"swiglu_limit": None}, "swiglu_limit = null: expected a positive number"),
    ({"layer_types": ["full_attention", "sliding_attention"] * 2},
     'layer_types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]: megatron-core '
     "alternates a window from the first layer"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, **YARN, "attention_factor": 2.0}},
     "rope_parameters: yarn with attention_factor = 2.0; reshard writes megatron-core's yarn factor"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     'rope_parameters.rope_type = "longrope": Megatron\'s args express RoPE unscaled or llama3-scaled only'),
])
def test_a_gpt_oss_config_megatron_cannot_express_is_refused_naming_the_field(fields, message):
    with pytest.raises(CheckpointFormatError, match="^" + re.escape(message)):
        get_family("gpt_oss").args_from_config(GPT_OSS | fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"attention_bias": False}, "attention_bias = false: the GPT-OSS layout has q/k/v/o biases"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings = true: the GPT-OSS layout stores its output projection"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, 'quantization_config.quant_method = "mxfp4": quantized'),
])
def test_a_gpt_oss_config_reshard_cannot_lay_out_is_refused_naming_the_field(fields, message):
    with pytest.raises(CheckpointFormatError, match="^" + re.escape("config.json: " + message)):
        get_family("gpt_oss").sizes_from_config(GPT_OSS | fields)


DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
            "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "intermediate_size": 96, "moe_intermediate_size": 32, "n_shared_experts": 1, "n_routed_experts": 8,
            "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "first_k_dense_replace": 1, "vocab_size": 300, "num_hidden_layers": 4,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "num_nextn_predict_layers": 0,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096}}


def test_a_deepseek_v3_config_is_mla_with_group_limited_sigmoid_routing_in_megatrons_args_and_comes_back():
    family = get_family("deepseek_v3")
    sizes = family.sizes_from_config(DEEPSEEK)
    assert sizes == {"h": 64, "heads": 4, "ql": 48, "kvl": 32, "nope": 16, "rope": 8, "vd": 16, "f": 96, "fe": 32,
                     "shared": 1, "experts": 8, "dense": 1, "vocab": 300, "layers": 4, "hf_layers": 4}
    args = (family.megatron_args(sizes, False) | family.args_from_config(DEEPSEEK)
            | family.megatron_moe_args(sizes, DEEPSEEK, {}, "config.json"))
    assert {k: args[k] for k in (
        "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
        "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_router_score_function",
        "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
        "moe_router_topk_scaling_factor", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
        "original_max_position_embeddings", "rotary_base", "norm_epsilon")} == {
        "multi_latent_attention": True, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "moe_layer_freq": [0, 1, 1, 1],
        "moe_shared_expert_intermediate_size": 32, "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
        "moe_router_topk_scaling_factor": 2.5, "rope_type": "yarn", "rotary_scaling_factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "rotary_base": 10000.0,
        "norm_epsilon": 1e-6}
    # MLA's args carry qk_layernorm and num_experts: neither Qwen3-MoE nor Mixtral claims them
    assert family_for_megatron_args(args) is family
    assert family_for_megatron_args(args | {"multi_latent_attention": False}) is get_family("qwen3_moe")
    hints = family.config_hints(args)
    assert hints["rope_parameters"] == DEEPSEEK["rope_parameters"]
    assert {k: hints[k] for k in ("num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor")} == {
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
    assert family.args_from_config(family.config_from_sizes(sizes) | hints).items() <= args.items()
    unscaled = family.args_from_config(DEEPSEEK | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert unscaled == {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                        "rotary_base": 1e4, "norm_epsilon": 1e-6, "max_position_embeddings": 64}


@pytest.mark.parametrize(("fields", "message"), [
    ({"q_lora_rank": None}, "q_lora_rank = null: queries without compression (self_attn.q_proj) are the family "
                            "deepseek_v3_noqlora"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers = -1: expected a number of layers"),
    ({"quantization_config": {"quant_method": "fp8"}}, 'quantization_config.quant_method = "fp8": quantized weights '
                                                        "(FP8 blocks with *_scale_inv scales)"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings = true: the DeepSeek-V3 layout stores its output"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace = 4: no mixture-of-experts layer"),
])
def test_a_deepseek_v3_config_reshard_cannot_lay_out_is_refused_naming_the_field(fields, message):
    with pytest.raises(CheckpointFormatError, match="^" + re.escape("config.json: " + message)):
        get_family("deepseek_v3").sizes_from_config(DEEPSEEK | fields)


YARN40 = DEEPSEEK["rope_parameters"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"rope_interleave": False}, "rope_interleave = false: megatron-core's MLA rotates the rope dims interleaved"),
    ({"attention_bias": True}, "attention_bias = true: megatron-core's MLA projections have no biases"),
    ({"rope_parameters": YARN40 | {"truncate": False}}, "rope_parameters.truncate = false: megatron-core's MLA "
                                                         "rounds"),
    ({"rope_parameters": YARN40 | {"attention_factor": 1.2}}, "rope_parameters.attention_factor = 1.2: "
                                                               "megatron-core's MLA yarn has"),
    ({"rope_parameters": YARN40 | {"mscale": 0}}, "rope_parameters.mscale = 0: with mscale_all_dim set"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
     'rope_parameters.rope_type = "llama3": megatron-core\'s MLA has RoPE unscaled or yarn only'),
])
def test_a_deepseek_v3_config_megatron_cannot_express_is_refused_naming_the_field(fields, message):
    with pytest.raises(CheckpointFormatError, match="^" + re.escape(message)):
        get_family("deepseek_v3").args_from_config(DEEPSEEK | fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"norm_topk_prob": False}, "x: norm_topk_prob = false: megatron-core's sigmoid router renormalises"),
    ({"topk_group": 1}, "x: topk_group = 1: transformers scores a group by its top 2 experts, megatron-core by its "
                        "top num_experts_per_tok // topk_group = 4"),
    ({"num_experts_per_tok": None}, "x: num_experts_per_tok = null: Megatron's args need moe_router_topk"),
])
def test_deepseek_v3_routing_megatron_computes_differently_is_refused_naming_the_field(fields, message):
    family = get_family("deepseek_v3")
    with pytest.raises(CheckpointFormatError, match="^" + re.escape(message)):
        family.megatron_moe_args(family.sizes_from_config(DEEPSEEK), DEEPSEEK | fields, {}, "x")


def test_a_deepseek_v3_config_without_q_compression_is_the_noqlora_family_and_megatron_q_lora_rank_none():
    """``q_lora_rank`` null names the other DeepSeek-V3 family, by config and by Megatron's args, and back."""
    config = DEEPSEEK | {"q_lora_rank": None, "num_nextn_predict_layers": 1}
    family = family_for_config(config)
    assert family.name == "deepseek_v3_noqlora" and family_for_config(DEEPSEEK) is get_family("deepseek_v3")
    sizes = family.sizes_from_config(config)
    assert "ql" not in sizes and sizes["hf_layers"] == sizes["layers"]  # MTP layers: counted from the files
    args = family.megatron_args(sizes | {"hf_layers": 5}, False) | family.args_from_config(config)
    assert args["q_lora_rank"] is None and args["mtp_num_layers"] == 1
    assert family_for_megatron_args(args) is family
    assert family_for_megatron_args(args | {"q_lora_rank": 48}) is get_family("deepseek_v3")
    built = family.config_from_sizes(sizes | {"hf_layers": 5})
    assert built["q_lora_rank"] is None and built["num_nextn_predict_layers"] == 1
    with pytest.raises(CheckpointFormatError, match=r"^config\.json: q_lora_rank = 48: queries compressed"):
        family.sizes_from_config(DEEPSEEK)
