"""Every registered model family, Hugging Face <-> Megatron, judged by the real frameworks.

For each family in the registry (a family without a tiny model here fails, so adding one cannot skip it):
a tiny random model saved by transformers goes to Megatron at tp=2,pp=2 (and ep=2 with experts), is restaged
to tp=1,pp=4 and comes back; ``from_pretrained`` gives the same class, no missing or unexpected keys, bit-identical logits and the
source's ``config.json``. The Megatron args record what makes the family (window, biases, q/k norms, RoPE
scaling), and read back without the carried config they still give a model with identical logits. Gemma, Gemma 2
and Gemma 3 go to Megatron-Bridge's layout and read back only with the carried config (no args say Gemma); OLMo 2,
which Megatron cannot hold, is refused there and goes through DCP instead.
megatron-core then runs the checkpoint reshard writes in its local layers (tp=1,pp=1) from nothing but its
args, with strict key matching, and matches transformers' logits; each family it cannot build on CPU is named
with its reason.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import require

import reshard
from reshard.errors import CheckpointFormatError, SpecError
from reshard.models import FAMILIES, get_family

VOCAB = 300  # not a multiple of 128: Megatron pads it
COMMON = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
          "vocab_size": VOCAB, "num_hidden_layers": 4}

TINY = {
    # family: (config class, fields, Megatron args the conversion must write)
    "llama": ("LlamaConfig", {"rope_theta": 500000.0, "tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}},
        {"use_rope_scaling": True, "rope_scaling_factor": 8.0, "rotary_base": 500000.0}),
    "mistral": ("MistralConfig", {"sliding_window": 6, "head_dim": 32, "rope_theta": 1e6},
                {"window_size": (5, 0), "kv_channels": 32, "rotary_base": 1e6}),
    "qwen2": ("Qwen2Config", {"rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
              {"add_qkv_bias": True, "norm_epsilon": 1e-6, "untie_embeddings_and_output_weights": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "rope_theta": 1e6},
              {"qk_layernorm": True, "kv_channels": 32, "add_qkv_bias": False}),
    "phi3": ("Phi3Config", {"sliding_window": 7, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
             {"window_size": (6, 0)}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2},
                {"num_experts": 4, "moe_router_topk": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": False, "rope_theta": 1e6},
                  {"qk_layernorm": True, "kv_channels": 32, "num_experts": 4, "moe_router_topk": 2,
                   "moe_ffn_hidden_size": 32, "moe_router_pre_softmax": True}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                 "head_dim": 32, "sliding_window": 6},
                {"softmax_type": "learnable", "window_size": (5, 0), "window_attn_skip_freq": 2, "kv_channels": 32,
                 "position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 32.0, "quick_geglu": True,
                 "activation_func_clamp_value": 7.0, "glu_linear_offset": 1.0, "add_bias_linear": True}),
    # DeepSeek-V3: MLA (q_lora 48, kv_lora 32, nope 16, rope 8, v 16), one dense layer then 3 MoE layers of 4 routed
    # experts (top 2 in groups: 2 groups, 1 chosen) and a shared one, yarn; no multi-token prediction.
    "deepseek_v3": ("DeepseekV3Config", {
        "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0, "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 16}},
        {"multi_latent_attention": True, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_head_dim": 16,
         "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "num_experts": 4, "moe_router_topk": 2,
         "moe_ffn_hidden_size": 32, "ffn_hidden_size": 96, "moe_shared_expert_intermediate_size": 32,
         "moe_layer_freq": (0, 1, 1, 1), "moe_router_score_function": "sigmoid",
         "moe_router_enable_expert_bias": True, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
         "moe_router_topk_scaling_factor": 2.5, "rope_type": "yarn", "rotary_scaling_factor": 4.0,
         "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # DeepSeek-V3 without the queries' compression (q_lora_rank null: q_proj, Megatron's linear_q_proj), yarn off.
    "deepseek_v3_noqlora": ("DeepseekV3Config", {
        "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0, "max_position_embeddings": 64},
        {"multi_latent_attention": True, "q_lora_rank": None, "kv_lora_rank": 32, "num_experts": 4,
         "moe_layer_freq": (0, 1, 1, 1), "rope_type": "rope", "mtp_num_layers": None}),
    # Gemma: head_dim 32 != 64 / 4; Megatron-Bridge's layout and args, the identity in the carried config.json.
    "gemma": ("GemmaConfig", {"head_dim": 32},
              {"kv_channels": 32, "layernorm_zero_centered_gamma": True, "gated_linear_unit": True, "swiglu": False,
               "openai_gelu": True, "untie_embeddings_and_output_weights": False, "norm_epsilon": 1e-6}),
    "gemma2": ("Gemma2Config", {"head_dim": 32, "sliding_window": 6, "query_pre_attn_scalar": 64},
               {"kv_channels": 32, "window_size": (5, 0), "window_attn_skip_freq": 2, "softmax_scale": 0.125,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                "layernorm_zero_centered_gamma": True}),
    "gemma3_text": ("Gemma3TextConfig", {
        "head_dim": 32, "sliding_window": 6, "query_pre_attn_scalar": 64,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}},
        {"kv_channels": 32, "qk_layernorm": True, "window_size": (5, 0), "window_attn_skip_freq": 4,
         "softmax_scale": 0.125, "rotary_base": (10000.0, 1e6), "rope_scaling_factor": 8.0}),
    "olmo2": ("Olmo2Config", {"head_dim": 32, "pad_token_id": 0, "eos_token_id": 2}, None),  # no Megatron: via DCP
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_head": 4, "n_layer": 4, "n_positions": 64, "vocab_size": VOCAB},
             {"position_embedding_type": "learned_absolute"}),
}


def _save_tiny(name: str, path: Path):
    """The family's tiny random model, saved by transformers in fp32; its class."""
    import torch
    transformers = require("transformers")
    assert name in TINY, f"no tiny model for family '{name}': add one to TINY"
    config_class, fields, _ = TINY[name]
    kwargs = fields if name == "gpt2" else {**COMMON, **fields}
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a misplaced one shows in the logits
        for key, p in model.named_parameters():
            if p.dim() == 1 or key.endswith("_bias"):  # GPT-OSS's expert biases are [experts, width]
                p.add_(torch.randn_like(p) * 0.1)
        for key, b in model.named_buffers():  # DeepSeek-V3's expert-choice bias, a persistent buffer
            if key.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    return type(model)


def _logits(model_class, path: Path, ids):
    import torch

    with torch.no_grad():
        model, info = model_class.from_pretrained(path, output_loading_info=True)
        assert not any(info.values()), info  # nothing missing, unexpected or mismatched
        return type(model), model.eval()(ids).logits


def _args(path: Path) -> dict:
    args = reshard.open_checkpoint(path).extra["megatron"].args
    return args if isinstance(args, dict) else vars(args)


@pytest.mark.interop
@pytest.mark.parametrize("name", [n for n in FAMILIES if get_family(n).megatron is not None])
def test_a_family_goes_to_megatron_and_back_with_identical_logits_and_config(tmp_path, name):
    import torch
    transformers = require("transformers")
    model_class = _save_tiny(name, tmp_path / "hf")
    ids = torch.arange(48).reshape(2, 24) % VOCAB
    _, want = _logits(model_class, tmp_path / "hf", ids)

    experts = get_family(name).experts  # split over ep as well
    reshard.convert(tmp_path / "hf", tmp_path / "m1", format="megatron",
                    to="tp=2,pp=2,dp=2,ep=2" if experts else "tp=2,pp=2")
    args = _args(tmp_path / "m1")
    assert args["expert_model_parallel_size"] == (2 if experts else 1)
    expected = TINY[name][2]
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in args.items() if k in expected} == expected
    reshard.convert(tmp_path / "m1", tmp_path / "m2", to="tp=1,pp=4")
    assert reshard.open_checkpoint(tmp_path / "m2").spec_name.startswith(f"megatron-{name}")
    reshard.convert(tmp_path / "m2", tmp_path / "back", format="hf")

    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads((tmp_path / "hf" / "config.json").read_text())
    cls, got = _logits(transformers.AutoModelForCausalLM, tmp_path / "back", ids)
    assert cls is model_class and torch.equal(got, want)

    # Without the carried config.json, the args alone name a family (a Phi-3's: Mistral, the same function)
    # and rebuild the config; the args of a family plain megatron-core cannot express (Gemma) name none.
    for carried in ("config.json", "generation_config.json"):
        (tmp_path / "m2" / carried).unlink(missing_ok=True)
    if get_family(name).plain_megatron:
        with pytest.raises(CheckpointFormatError, match=r"the args describe no model family reshard knows"):
            reshard.convert(tmp_path / "m2", tmp_path / "bare", format="hf")
        assert not (tmp_path / "bare").exists()
        return
    reshard.convert(tmp_path / "m2", tmp_path / "bare", format="hf")
    _, got = _logits(transformers.AutoModelForCausalLM, tmp_path / "bare", ids)
    assert torch.equal(got, want)


@pytest.mark.interop
@pytest.mark.parametrize("name", [n for n in FAMILIES if get_family(n).megatron is None])
def test_a_family_megatron_cannot_hold_is_refused_there_and_goes_through_dcp_with_identical_logits(tmp_path, name):
    """OLMo 2: a Megatron target is refused before anything is written, naming what Megatron cannot compute; DCP
    (dp=2) and back keeps its logits bit-identical and its config.json."""
    import torch
    transformers = require("transformers")
    model_class = _save_tiny(name, tmp_path / "hf")
    ids = torch.arange(48).reshape(2, 24) % VOCAB
    _, want = _logits(model_class, tmp_path / "hf", ids)
    with pytest.raises(SpecError, match=rf"^megatron-{name}: no Megatron layout for {name} \(model_type '{name}': "
                                        r"q_norm and k_norm normalise the whole q and k projections"):
        reshard.convert(tmp_path / "hf", tmp_path / "meg", format="megatron", to="tp=2,pp=2")
    assert not (tmp_path / "meg").exists()

    reshard.convert(tmp_path / "hf", tmp_path / "dcp", format="dcp", to="dp=2")
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads((tmp_path / "hf" / "config.json").read_text())
    cls, got = _logits(transformers.AutoModelForCausalLM, tmp_path / "back", ids)
    assert cls is model_class and torch.equal(got, want)


@pytest.mark.interop
def test_megatron_core_runs_the_checkpoints_reshard_writes_and_matches_transformers(tmp_path):
    """Each family megatron-core can build on CPU (local layers, SequentialMLP experts): a strict load of the
    tp=1,pp=1 checkpoint into a GPTModel built from the written args, and transformers' logits (fp32)."""
    import torch
    require("transformers")
    require("megatron.core")
    from jobs import run_job

    cases, skipped = [], {}
    for name in FAMILIES:
        family = get_family(name)
        if family.megatron is None or family.megatron(tied=family.tied_default, local=True) is None:
            # no --transformer-impl local layout: megatron-core on CPU cannot build it
            skipped[name] = family.plain_megatron or "laid out for Transformer Engine's names only"
            continue
        case = tmp_path / name
        model_class = _save_tiny(name, case / "hf")
        ids = torch.arange(40).reshape(2, 20) % VOCAB
        _, logits = _logits(model_class, case / "hf", ids)
        torch.save({"ids": ids, "logits": logits}, case / "hf_logits.pt")
        tied = json.loads((case / "hf" / "config.json").read_text()).get("tie_word_embeddings", False)
        local = f"megatron-{name}{'-tied' if tied and family.can_tie else ''}-local"
        reshard.convert(case / "hf", case / "meg", format="megatron", to="tp=1,pp=1", spec=local)
        shutil.rmtree(case / "hf")
        cases.append(case)
    # Not run here, each for its reason: Gemma's zero-centred
    # (1 + w) norms exist only in Transformer Engine's layers, and plain megatron-core has no embedding scaling,
    # post norms or soft-caps (Gemma 2/3; Megatron-Bridge's modules compute them); OLMo 2 has no Megatron layout.
    assert set(skipped) == {"gemma", "gemma2", "gemma3_text", "olmo2"}, skipped
    assert all("megatron-core" in why or "Transformer Engine" in why for why in skipped.values()), skipped
    # A negative control: DeepSeek-V3's args without yarn's attention scale (mscale_all_dim) must not match.
    control = tmp_path / "deepseek_v3-no-mscale"
    shutil.copytree(tmp_path / "deepseek_v3", control)
    (rank_file,) = control.glob("meg/iter_*/mp_rank_*/model_optim_rng.pt")
    saved = torch.load(rank_file, weights_only=False)  # the file this test just wrote
    saved["args"].mscale_all_dim = 0.0
    torch.save(saved, rank_file)
    script = Path(__file__).parents[1] / "mcore_family_jobs.py"
    import os
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    code, output = run_job([sys.executable, str(script), *map(str, cases), str(control)], env)
    assert code == 0, output[-4000:]
    for case in cases:
        result = json.loads((case / "mcore.json").read_text())
        assert result["missing"] == [] and result["unexpected"] == [], (case.name, result)
        assert result["max_diff"] < 1e-5, (case.name, result["max_diff"])
        assert result["in_registration_order"], case.name
    assert json.loads((control / "mcore.json").read_text())["max_diff"] > 1e-3


@pytest.mark.interop
def test_deepseek_v3_multi_token_prediction_layers_go_to_megatron_and_back_byte_identical(tmp_path):
    """A DeepSeek-V3 checkpoint holding its MTP layer (``model.layers.{num_hidden_layers}.*``, as the hub files do;
    transformers builds no MTP module, so the tensors are written into its safetensors here, deterministic random)
    goes to Megatron's MTP block (tp=2,pp=2,ep=2, then tp=1,pp=4) and back: every tensor byte-identical, the same
    config.json, and transformers (which ignores the MTP layer) gives bit-identical logits."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from reshard.core.resolve import resolve
    from reshard.core.topology import Topology
    from reshard.formats.specs import layout_spec

    model_class = _save_tiny("deepseek_v3", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (shard,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(shard)
    family = get_family("deepseek_v3")
    sizes = family.sizes_from_config(config) | {"hf_layers": 5}
    rng = np.random.default_rng(0)
    for name, t in resolve(layout_spec("hf-deepseek_v3"), Topology(), sizes).tensors.items():
        if name.startswith("model.layers.4."):
            tensors[name] = torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32))
    save_file(tensors, shard, metadata={"format": "pt"})

    reshard.convert(tmp_path / "hf", tmp_path / "m1", format="megatron", to="tp=2,pp=2,dp=2,ep=2")
    assert _args(tmp_path / "m1")["mtp_num_layers"] == 1
    reshard.convert(tmp_path / "m1", tmp_path / "m2", to="tp=1,pp=4")
    reshard.convert(tmp_path / "m2", tmp_path / "back", format="hf")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config
    back = {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        back |= load_file(f)
    assert sorted(back) == sorted(tensors)
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in tensors.items())

    ids = torch.arange(48).reshape(2, 24) % VOCAB
    with torch.no_grad():
        logits = []
        for path in (tmp_path / "hf", tmp_path / "back"):
            model, info = model_class.from_pretrained(path, output_loading_info=True)
            assert not info["missing_keys"] and all(k.startswith("model.layers.4.") for k in info["unexpected_keys"])
            logits.append(model.eval()(ids).logits)
    assert torch.equal(logits[0], logits[1])
