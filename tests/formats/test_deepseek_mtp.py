"""DeepSeek-V3's multi-token-prediction (MTP) layers and its queries without compression (``q_lora_rank`` null),
through Hugging Face, Megatron (tp, pp, ep) and DCP, every tensor compared bit for bit.

The checkpoints are written here from the family's own Hugging Face layout, every tensor deterministic random
fp32, the MTP layer (``model.layers.{num_hidden_layers}.*``) included, as the official release stores it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import reshard
from reshard.core.resolve import resolve
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, PlanError, TopologyError
from reshard.formats.specs import layout_spec
from reshard.models import family_for_config, get_family

SIZES = {"h": 16, "heads": 2, "ql": 12, "kvl": 8, "nope": 4, "rope": 2, "vd": 4, "f": 24, "fe": 6, "shared": 1,
         "experts": 4, "dense": 1, "vocab": 50, "layers": 4}
ROUTING = {"num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
           "max_position_embeddings": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _save(path: Path, *, q_lora: bool = True, mtp: int = 1, copies: bool = False) -> dict:
    """A DeepSeek-V3 Hugging Face checkpoint with ``mtp`` MTP layers (``copies``: with their own embedding and
    output projection, as the official files store them); its tensors by name."""
    from safetensors.numpy import save_file

    family = get_family("deepseek_v3" if q_lora else "deepseek_v3_noqlora")
    sizes = {k: v for k, v in SIZES.items() if q_lora or k != "ql"} | {"hf_layers": SIZES["layers"] + mtp}
    layout = resolve(layout_spec(f"hf-{family.name}"), Topology(), sizes)
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(t.shape).astype(np.float32) for name, t in layout.tensors.items()}
    if copies:
        for k in range(SIZES["layers"], SIZES["layers"] + mtp):
            tensors[f"model.layers.{k}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
            tensors[f"model.layers.{k}.shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = family.config_from_sizes(sizes, ["float32"]) | ROUTING
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def _tensors(path: Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out |= load_file(str(shard))
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no-q_lora"])
def test_mtp_layers_go_to_megatron_tp2_pp2_ep2_and_back_bit_exactly(tmp_path, q_lora):
    want = _save(tmp_path / "hf", q_lora=q_lora)
    reshard.convert(tmp_path / "hf", tmp_path / "meg", format="megatron", to="tp=2,pp=2,dp=2,ep=2")
    meg = reshard.open_checkpoint(tmp_path / "meg")
    args = meg.extra["megatron"].args
    args = args if isinstance(args, dict) else vars(args)
    assert args["mtp_num_layers"] == 1 and args["q_lora_rank"] == (SIZES["ql"] if q_lora else None)
    assert meg.spec_name == f"megatron-deepseek_v3{'' if q_lora else '_noqlora'}-mtp"
    last = {it.key for it in meg.layout.items if dict(it.unit)["pp"] == 1}
    first = {it.key for it in meg.layout.items if dict(it.unit)["pp"] == 0}
    # megatron-core builds the MTP block on the last stage, with a copy of the embedding the MTP layer embeds with
    assert "mtp.layers.0.eh_proj.weight" in last and "embedding.word_embeddings.weight" in last
    assert not any(k.startswith("mtp.") for k in first)
    q = "linear_q_up_proj.weight" if q_lora else "linear_q_proj.weight"
    assert f"mtp.layers.0.transformer_layer.self_attention.{q}" in last
    assert "mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc2.weight" in last
    reshard.convert(tmp_path / "meg", tmp_path / "back", format="hf")
    _assert_same(_tensors(tmp_path / "back"), want)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads((tmp_path / "hf" / "config.json").read_text())


def test_megatron_without_its_config_json_rebuilds_the_mtp_layers_and_q_lora_rank_from_its_args(tmp_path):
    want = _save(tmp_path / "hf", q_lora=False, mtp=2)
    reshard.convert(tmp_path / "hf", tmp_path / "meg", format="megatron", to="tp=2,pp=2,dp=2,ep=2")
    (tmp_path / "meg" / "config.json").unlink()
    reshard.convert(tmp_path / "meg", tmp_path / "meg1", to="tp=1,pp=1,ep=1")
    reshard.convert(tmp_path / "meg1", tmp_path / "back", format="hf")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and config["q_lora_rank"] is None
    assert family_for_config(config).name == "deepseek_v3_noqlora"
    _assert_same(_tensors(tmp_path / "back"), want)


@pytest.mark.parametrize(("copies", "topology"), [(True, "dp=2"), (False, "dp=3")])
def test_mtp_layers_go_through_dcp_and_hf_under_their_own_names(tmp_path, copies, topology):
    """With their embedding and head copies too (tensors the family does not name: kept by name, chunked over dp as
    FSDP2 chunks any parameter)."""
    want = _save(tmp_path / "hf", copies=copies)
    reshard.convert(tmp_path / "hf", tmp_path / "hf2", format="hf")
    _assert_same(_tensors(tmp_path / "hf2"), want)
    reshard.convert(tmp_path / "hf", tmp_path / "dcp", format="dcp", to=topology)
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    _assert_same(_tensors(tmp_path / "back"), want)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == \
        json.loads((tmp_path / "hf" / "config.json").read_text())


def test_dcp_with_tensor_parallelism_is_refused_for_transformers_packed_experts(tmp_path):
    """transformers 5 packs the fused experts' gate and up halves per tp rank (``packed_colwise``): no DCP layout of
    reshard's holds that, so a tensor-parallel DCP target is refused before anything is written."""
    _save(tmp_path / "hf", copies=False)
    with pytest.raises(TopologyError, match=r"^dcp at tp\(2\): transformers packs the fused experts of deepseek_v3"):
        reshard.convert(tmp_path / "hf", tmp_path / "dcp", format="dcp", to="dp=2,tp=2")
    assert not (tmp_path / "dcp").exists()


def test_megatron_refuses_the_mtp_layers_own_embedding_and_head_copies_naming_them(tmp_path):
    """megatron-core's MTP layers share the model's embedding and output layer: a checkpoint storing copies of
    its own would lose them there, so the conversion is refused before anything is written."""
    _save(tmp_path / "hf", copies=True)
    with pytest.raises(PlanError, match=r"(?s)has no place for 2 tensor\(s\).*'model\.layers\.4\.embed_tokens\.weight'"
                                        r".*'model\.layers\.4\.shared_head\.head\.weight'"):
        reshard.convert(tmp_path / "hf", tmp_path / "meg", format="megatron", to="tp=2,pp=2,dp=2,ep=2")
    assert not (tmp_path / "meg").exists()


def test_a_config_declaring_mtp_layers_the_files_lack_converts_without_them(tmp_path):
    """transformers saves no MTP layer though its config declares one: the checkpoint holds none to carry."""
    want = _save(tmp_path / "hf", mtp=0)
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    reshard.convert(tmp_path / "hf", tmp_path / "meg", format="megatron", to="tp=2,pp=2,dp=2,ep=2")
    meg = reshard.open_checkpoint(tmp_path / "meg")
    assert meg.spec_name == "megatron-deepseek_v3" and not any(it.key.startswith("mtp.") for it in meg.layout.items)
    reshard.convert(tmp_path / "meg", tmp_path / "back", format="hf")
    _assert_same(_tensors(tmp_path / "back"), want)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config


def test_a_gap_after_the_decoder_layers_is_refused_naming_the_layer(tmp_path):
    from safetensors.numpy import save_file

    tensors = _save(tmp_path / "hf", mtp=0)
    tensors["model.layers.5.enorm.weight"] = np.ones(SIZES["h"], np.float32)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match=r"layer 5 follows the decoder.s 4 layers without layer 4"):
        reshard.convert(tmp_path / "hf", tmp_path / "out", format="hf")
