"""Hugging Face Llama <-> Megatron, judged by transformers itself: identical logits after a round trip.

A ``LlamaForCausalLM`` (GQA, untied and tied, bf16, a vocabulary Megatron pads)
saved by transformers as sharded safetensors goes to Megatron at tp=2,pp=2, is
restaged to tp=1,pp=4 with two virtual stages, and comes back to Hugging Face;
``from_pretrained`` of the result must give bit-identical logits, so the weights
and the config (epsilon, rope base, tying) all survive.
"""

from __future__ import annotations

import json

import pytest
from conftest import assert_same_logits, require, save_tiny_mixtral

import reshard


@pytest.mark.interop
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_to_megatron_and_a_virtual_pipeline_and_back_gives_identical_logits(tmp_path, tied):
    import torch
    transformers = require("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, vocab_size=1000, num_hidden_layers=8,
                                      rms_norm_eps=1e-6, rope_theta=500000.0, max_position_embeddings=4096,
                                      tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()

    reshard.convert(tmp_path / "hf", tmp_path / "m1", format="megatron", to="tp=2,pp=2")
    args = reshard.open_checkpoint(tmp_path / "m1").extra["megatron"].args
    args = args if isinstance(args, dict) else vars(args)
    assert (args["norm_epsilon"], args["rotary_base"], args["max_position_embeddings"]) == (1e-6, 500000.0, 4096)
    assert args["untie_embeddings_and_output_weights"] is (not tied) and args["padded_vocab_size"] == 1024
    reshard.convert(tmp_path / "m1", tmp_path / "m2", to="tp=1,pp=4,vpp=2")
    m2 = reshard.open_checkpoint(tmp_path / "m2")
    assert (m2.topology.tp, m2.topology.pp, m2.topology.vpp) == (1, 4, 2)
    reshard.convert(tmp_path / "m2", tmp_path / "back", format="hf")

    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["tie_word_embeddings"] is tied and written["rms_norm_eps"] == 1e-6
    for name in ("config.json", "generation_config.json"):  # through both Megatron stages as transformers wrote them
        assert json.loads((tmp_path / "back" / name).read_text()) == json.loads((tmp_path / "hf" / name).read_text())
    ids = torch.arange(48).reshape(2, 24) % 1000
    with torch.no_grad():  # both loaded alike (a model cast in memory keeps a bf16 rope buffer a loaded one has not)
        before = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
        after, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
        assert not any(info.values()), info  # nothing missing, unexpected or mismatched
        assert after.config.rope_parameters["rope_theta"] == 500000.0
        assert torch.equal(after.eval()(ids).logits, before)


@pytest.mark.interop
def test_hf_to_megatrons_legacy_model_and_back_gives_identical_logits(tmp_path):
    """The legacy GPTModel's nested names (``--use-legacy-models``), at tp=2,pp=2, restaged to tp=1,pp=2."""
    import torch
    transformers = require("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, vocab_size=1000, num_hidden_layers=4,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "legacy", format="megatron", to="tp=2,pp=2",
                    spec="megatron-legacy-llama")
    reshard.convert(tmp_path / "legacy", tmp_path / "legacy-pp2", to="tp=1,pp=2")
    reshard.convert(tmp_path / "legacy-pp2", tmp_path / "back", format="hf")
    assert_same_logits(transformers.LlamaForCausalLM, tmp_path / "hf", tmp_path / "back", 1000)


@pytest.mark.interop
@pytest.mark.parametrize("name,spec", [("gpt2", "megatron-legacy-gpt2"), ("qwen2", "megatron-legacy-qwen2-tied"),
                                       ("llama", "megatron-legacy-llama-tied")])
def test_the_legacy_model_of_gpt2_qwen2_and_a_tied_llama_goes_there_and_back_with_identical_logits(tmp_path, name,
                                                                                                  spec):
    """Megatron-LM's legacy GPTModel of GPT-2 (learned positions, biases), Qwen2 (q/k/v biases) and Llama 3.2, all
    tied (the last stage's ``word_embeddings_for_head``): at tp=2,pp=2, read back by its args, restaged to tp=1,
    pp=2, and to Hugging Face the same class, the files bit for bit and identical logits."""
    import torch
    from interop.test_families_real import _logits, _save_tiny
    from safetensors.torch import load_file

    require("transformers")
    model_class = _save_tiny(name, tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "legacy", format="megatron", to="tp=2,pp=2", spec=spec)
    last = torch.load(tmp_path / "legacy" / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt",
                      weights_only=False)["model"]
    assert sorted(last) == ["language_model", "word_embeddings_for_head"] and list(last["language_model"]) == ["encoder"]
    assert reshard.open_checkpoint(tmp_path / "legacy").spec_name == spec
    reshard.convert(tmp_path / "legacy", tmp_path / "pp2", to="tp=1,pp=2")
    reshard.convert(tmp_path / "pp2", tmp_path / "back", format="hf")
    files, back = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(files) and all(torch.equal(back[k], v) for k, v in files.items())
    ids = torch.arange(12).reshape(2, 6)
    (cls_a, a), (cls_b, b) = _logits(model_class, tmp_path / "hf", ids), _logits(model_class, tmp_path / "back", ids)
    assert cls_a is cls_b is model_class and torch.equal(a, b)


@pytest.mark.interop
def test_a_mixtral_to_megatron_moe_and_back_gives_identical_logits(tmp_path):
    """MixtralForCausalLM -> Megatron-core MoE (SequentialMLP experts) at tp=2,pp=2,ep=2 -> tp=1,pp=4,vpp=2,ep=4
    -> HF."""
    transformers = require("transformers")
    from reshard.io.torchfile import read_torch_file

    save_tiny_mixtral(tmp_path / "hf", layers=8)
    reshard.convert(tmp_path / "hf", tmp_path / "m1", format="megatron", to="tp=2,pp=2,dp=2,ep=2")
    rank = read_torch_file(tmp_path / "m1" / "iter_0000000" / "mp_rank_01_001_001" / "model_optim_rng.pt")
    args = rank["args"] if isinstance(rank["args"], dict) else vars(rank["args"])
    assert (args["num_experts"], args["moe_router_topk"], args["moe_ffn_hidden_size"]) == (4, 2, 48)
    layer = [k for k in rank["model"] if k.startswith("decoder.layers.0.")]
    assert layer[3:8] == ["decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.router.weight",
                          *(f"decoder.layers.0.mlp.experts.local_experts.0.linear_fc{n}.weight" for n in (1, 2)),
                          "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]  # registration order
    assert rank["model"]["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"].shape == (48, 32)  # 2f/tp
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in rank["model"]  # E/ep = 2 each
    assert reshard.open_checkpoint(tmp_path / "m1").spec_name == "megatron-mixtral"
    reshard.convert(tmp_path / "m1", tmp_path / "m2", to="tp=1,pp=4,vpp=2,dp=4,ep=4")
    assert (tmp_path / "m2" / "iter_0000000" / "mp_rank_00_003_003" / "model_optim_rng.pt").is_file()
    reshard.convert(tmp_path / "m2", tmp_path / "back", format="hf")
    assert_same_logits(transformers.MixtralForCausalLM, tmp_path / "hf", tmp_path / "back", 100)
