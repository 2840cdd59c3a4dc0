"""Every registered model family, Hugging Face <-> Megatron, judged by the real frameworks.

For each family in the registry (a family without a tiny model here fails, so adding one cannot skip it):
a tiny random model saved by transformers goes to Megatron at tp=2,pp=2, is restaged to tp=1,pp=4 and comes
back; ``from_pretrained`` gives the same class, no missing or unexpected keys, bit-identical logits and the
source's ``config.json``. The Megatron args record what makes the family (window, biases, q/k norms, RoPE
scaling), and read back without the carried config they still give a model with identical logits.
megatron-core then runs the checkpoint reshard writes in its local layers (tp=1,pp=1) from nothing but its
args, with strict key matching, and matches transformers' logits.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import require

import reshard
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
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
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
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_goes_to_megatron_and_back_with_identical_logits_and_config(tmp_path, name):
    import torch
    transformers = require("transformers")
    model_class = _save_tiny(name, tmp_path / "hf")
    ids = torch.arange(48).reshape(2, 24) % VOCAB
    _, want = _logits(model_class, tmp_path / "hf", ids)

    reshard.convert(tmp_path / "hf", tmp_path / "m1", format="megatron", to="tp=2,pp=2")
    args = _args(tmp_path / "m1")
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
    # and rebuild the config.
    for carried in ("config.json", "generation_config.json"):
        (tmp_path / "m2" / carried).unlink(missing_ok=True)
    reshard.convert(tmp_path / "m2", tmp_path / "bare", format="hf")
    _, got = _logits(transformers.AutoModelForCausalLM, tmp_path / "bare", ids)
    assert torch.equal(got, want)


@pytest.mark.interop
def test_megatron_core_runs_the_checkpoints_reshard_writes_and_matches_transformers(tmp_path):
    """Each family megatron-core can build on CPU (local layers, SequentialMLP experts): a strict load of the
    tp=1,pp=1 checkpoint into a GPTModel built from the written args, and transformers' logits (fp32)."""
    import torch
    require("transformers")
    require("megatron.core")
    from jobs import run_job

    cases, skipped = [], []
    for name in FAMILIES:
        family = get_family(name)
        if family.megatron is None or family.megatron(tied=family.tied_default, local=True) is None:
            skipped.append(name)  # no --transformer-impl local layout: megatron-core on CPU cannot build it
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
    assert skipped == ["gpt2"], skipped  # GPT-2 is laid out for Transformer Engine's names only
    script = Path(__file__).parents[1] / "mcore_family_jobs.py"
    import os
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    code, output = run_job([sys.executable, str(script), *map(str, cases)], env)
    assert code == 0, output[-4000:]
    for case in cases:
        result = json.loads((case / "mcore.json").read_text())
        assert result["missing"] == [] and result["unexpected"] == [], (case.name, result)
        assert result["max_diff"] < 1e-5, (case.name, result["max_diff"])
