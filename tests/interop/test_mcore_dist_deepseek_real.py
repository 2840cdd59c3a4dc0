"""DeepSeek-V3 in megatron-core's torch_dist (layers keyed one by one, MLA, shared experts, the router's expert bias,
the MTP block): reshard's layout from Hugging Face against what megatron-core itself saves for the same model
(``mcore_dist_moe_jobs``: built from the args of reshard's Megatron conversion, on CPU), both ways."""

from __future__ import annotations

import json
from pathlib import Path

import mcore_dist_moe_jobs
import pytest
from conftest import require
from jobs import run_ranks
from test_families_real import _save_tiny

import reshard
from reshard.core.resolve import resolve
from reshard.core.topology import Topology
from reshard.formats.dcp.reading import _entry_bytes
from reshard.formats.specs import layout_spec
from reshard.models import get_family


def _with_mtp_layer(hf: Path) -> dict:
    """The tiny model's checkpoint with one MTP layer (``model.layers.4.*``, deterministic random, as the hub files
    store it; transformers builds none); its tensors by name."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((hf / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (hf / "config.json").write_text(json.dumps(config))
    (shard,) = hf.glob("*.safetensors")
    tensors = load_file(shard)
    sizes = get_family("deepseek_v3").sizes_from_config(config) | {"hf_layers": 5}
    rng = np.random.default_rng(0)
    for name, t in resolve(layout_spec("hf-deepseek_v3"), Topology(), sizes).tensors.items():
        if name.startswith("model.layers.4."):
            tensors[name] = torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32))
    save_file(tensors, shard, metadata={"format": "pt"})
    return tensors


def _assert_same(hf: Path, want: dict) -> None:
    """The Hugging Face checkpoint ``hf`` holds exactly the tensors ``want``, bit for bit."""
    import torch
    from safetensors.torch import load_file

    got = {}
    for shard in hf.glob("*.safetensors"):
        got |= load_file(shard)
    assert sorted(got) == sorted(want)
    assert all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in want.items())


@pytest.mark.interop
def test_deepseek_v3_torch_dist_is_what_megatron_core_saves_and_its_own_save_converts_to_hf_bit_exactly(tmp_path):
    """transformers saves a tiny DeepSeek-V3 (one dense layer, three MoE layers with a shared expert and the
    expert bias, yarn) with an MTP layer -> torch_dist in local layers: the keys (``decoder.layers.{n}.``, no stacked
    layers dim), global shapes, chunks and bytes entries megatron-core saves for the same model, which it loads
    strictly (StrictHandling.RAISE_ALL) with every weight equal; megatron-core's own save -> Hugging Face: every
    tensor of the source bit-exact."""
    require("transformers")
    require("megatron.core")
    _save_tiny("deepseek_v3", tmp_path / "hf")
    want = _with_mtp_layer(tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "meg", format="megatron", to="tp=1,pp=1",
                    spec="megatron-deepseek_v3-local-mtp")
    reshard.convert(tmp_path / "hf", tmp_path / "dist", format="mcore-dist", to="tp=1",
                    spec="mcore-dist-deepseek_v3-local-mtp")
    result = mcore_dist_moe_jobs.run(tmp_path)
    assert result["differ"] == [] and result["compared"] > 0, result

    real, ours = mcore_dist_moe_jobs.same_chunks(tmp_path / "real", tmp_path / "dist")
    assert {"decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.router.expert_bias",
            "decoder.layers.3.mlp.shared_experts.linear_fc1.weight", "decoder.layers.2.self_attention.q_layernorm.weight",
            "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight"} <= real.tensors.keys()
    assert list(real.tensors["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].size) == [4, 64, 64]
    entry = "decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_3_4"
    assert _entry_bytes(tmp_path / "dist", ours, entry, None) == _entry_bytes(tmp_path / "real", real, entry, None)

    source = reshard.open_checkpoint(tmp_path / "real")
    assert source.spec_name == "mcore-dist-deepseek_v3-local-mtp"
    reshard.convert(tmp_path / "real", tmp_path / "back", format="hf")
    _assert_same(tmp_path / "back", want)


@pytest.mark.interop
def test_deepseek_v3_torch_dist_at_tp2_is_chunk_for_chunk_what_megatron_core_saves_at_tp2(tmp_path):
    """megatron-core at tp 2 (local layers: MLA's down projections and eh_proj split on their output, the up
    projections by head, experts and shared experts as dense MLPs) saves the model of reshard's tp 2 Megatron
    conversion (``mcore_dist_tp_jobs``): reshard's torch_dist at tp 2 has its keys, chunks and bytes entries, and
    the real save converts to Hugging Face bit-exactly."""
    require("transformers")
    require("megatron.core")
    _save_tiny("deepseek_v3", tmp_path / "hf")
    want = _with_mtp_layer(tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "meg", format="megatron", to="tp=2,pp=1",
                    spec="megatron-deepseek_v3-local-mtp")
    reshard.convert(tmp_path / "hf", tmp_path / "dist", format="mcore-dist", to="tp=2",
                    spec="mcore-dist-deepseek_v3-local-mtp")
    run_ranks(str(Path(__file__).parents[1] / "mcore_dist_tp_jobs.py"), [str(tmp_path), "2"], "megatron-core tp 2")
    real, ours = mcore_dist_moe_jobs.same_chunks(tmp_path / "real", tmp_path / "dist")
    assert len(real.tensors["decoder.layers.0.self_attention.linear_q_down_proj.weight"].chunks) == 2
    reshard.convert(tmp_path / "real", tmp_path / "back", format="hf")
    _assert_same(tmp_path / "back", want)
