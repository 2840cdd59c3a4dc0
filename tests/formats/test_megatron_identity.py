"""A model's identity through Megatron: the Hugging Face config.json, generation_config.json and tokenizer files a
source carries are written beside every Megatron checkpoint (torch format and torch_dist) and reach the Hugging
Face output of any chain of conversions unchanged; the args must agree with the config they carry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reshard.fixtures import make_fixture

import reshard
from reshard.errors import CheckpointFormatError

GENERATION = {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6}
TOKENIZER = b'{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}\n\x00\xff not json either'
CONFIGS = ("config.json", "generation_config.json")


def hf_source(path: Path) -> dict:
    """tiny-llama as a Hugging Face checkpoint with a generation config and a tokenizer file; its config."""
    make_fixture(path, format="hf")
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    (path / "tokenizer.json").write_bytes(TOKENIZER)
    return json.loads((path / "config.json").read_text())


def identity(path: Path) -> tuple[dict, dict, bytes]:
    return (json.loads((path / "config.json").read_text()), json.loads((path / "generation_config.json").read_text()),
            (path / "tokenizer.json").read_bytes())


def dtype_aside(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}


CHAINS = {
    "megatron": [("megatron", "tp=2")],
    "megatron-restaged": [("megatron", "tp=2,pp=2"), ("megatron", "tp=1,pp=2,dp=2,zero=1")],
    "mcore-dist": [("mcore-dist", "tp=2")],
    "megatron-mcore-dist-megatron": [("megatron", "tp=2,pp=2"), ("mcore-dist", "tp=1,pp=2"), ("megatron", "tp=2")],
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_the_models_identity_reaches_hugging_face_through_megatron(tmp_path, chain):
    config = hf_source(tmp_path / "hf")
    src = tmp_path / "hf"
    for k, (fmt, to) in enumerate(CHAINS[chain]):
        dst = tmp_path / f"{k}-{fmt}"
        reshard.convert(src, dst, format=fmt, to=to)
        assert identity(dst) == (config, GENERATION, TOKENIZER), dst  # each Megatron stage keeps it as carried
        assert reshard.open_checkpoint(dst).model.config == config
        src = dst
    reshard.convert(src, tmp_path / "back", format="hf")
    got_config, got_generation, got_tokenizer = identity(tmp_path / "back")
    assert dtype_aside(got_config) == dtype_aside(config) and got_config["dtype"] == "bfloat16"  # the weights'
    assert got_generation == GENERATION and got_tokenizer == TOKENIZER
    check = reshard.verify(tmp_path / "hf", tmp_path / "back")
    assert check.identical and check.compared == 39, check.differences


def test_megatron_without_a_carried_config_writes_none_and_keeps_reading_its_args(tmp_path):
    make_fixture(tmp_path / "meg", format="megatron", to="tp=2")
    reshard.convert(tmp_path / "meg", tmp_path / "out", to="tp=1,pp=2")
    assert not any((tmp_path / "out" / name).exists() for name in (*CONFIGS, "tokenizer.json"))
    source = reshard.open_checkpoint(tmp_path / "out")
    assert source.model.config is None and source.model.family == "llama"


def test_a_torch_dist_config_of_another_family_than_its_args_is_refused(tmp_path):
    hf_source(tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "dist", format="mcore-dist", to="tp=2")
    config = json.loads((tmp_path / "dist" / "config.json").read_text())
    (tmp_path / "dist" / "config.json").write_text(json.dumps({**config, "model_type": "granite"}))
    with pytest.raises(CheckpointFormatError) as e:
        reshard.open_checkpoint(tmp_path / "dist")
    assert str(e.value) == (
        f"{tmp_path / 'dist' / 'config.json'}: model_type 'granite' names no model family reshard knows, but the args "
        f"in {tmp_path / 'dist' / 'common.pt'} describe a llama model (swiglu=True, normalization=RMSNorm, "
        "position_embedding_type=rope, num_experts=None); which one this checkpoint holds is not reshard's guess to "
        "make: remove the config.json of the other model, or give a spec")
    assert reshard.open_checkpoint(tmp_path / "dist", spec="mcore-dist-llama").model.config["model_type"] == "granite"


def test_a_torch_dist_checkpoint_without_args_takes_its_family_and_sizes_from_the_config(tmp_path):
    config = hf_source(tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "dist", format="mcore-dist", to="tp=2")
    common = torch.load(tmp_path / "dist" / "common.pt", weights_only=False)
    del common["args"]
    torch.save(common, tmp_path / "dist" / "common.pt")
    source = reshard.open_checkpoint(tmp_path / "dist")
    assert source.spec_name == "mcore-dist-llama" and source.model.config == config
    assert {k: source.sizes[k] for k in ("h", "heads", "g", "f", "vocab", "layers")} == \
        {"h": config["hidden_size"], "heads": config["num_attention_heads"], "g": config["num_key_value_heads"],
         "f": config["intermediate_size"], "vocab": config["vocab_size"], "layers": config["num_hidden_layers"]}
    reshard.convert(tmp_path / "dist", tmp_path / "back", format="hf")
    check = reshard.verify(tmp_path / "hf", tmp_path / "back")
    assert check.identical and check.compared == 39, check.differences
