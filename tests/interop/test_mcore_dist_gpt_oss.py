"""GPT-OSS in megatron-core's torch_dist: reshard's layout from Hugging Face against what megatron-core itself saves
(``mcore_dist_moe_jobs``) for the same model, built from the args of reshard's Megatron conversion."""

from __future__ import annotations

import mcore_dist_moe_jobs
import pytest
from conftest import require
from test_families_real import _save_tiny

import reshard


@pytest.mark.interop
def test_gpt_oss_torch_dist_from_hugging_face_is_what_megatron_core_saves_and_loads_strictly(tmp_path):
    """transformers saves a tiny GPT-OSS (learned sinks, biases on every linear, the router's and the experts'
    included) -> torch_dist in local layers: the keys, chunks and bytes entries megatron-core saves for the same
    model (built from the args of reshard's Megatron conversion), which megatron-core loads strictly with every
    weight equal."""
    require("transformers")
    require("megatron.core")
    _save_tiny("gpt_oss", tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "meg", format="megatron", to="tp=1,pp=1", spec="megatron-gpt_oss-local")
    reshard.convert(tmp_path / "hf", tmp_path / "dist", format="mcore-dist", to="tp=1", spec="mcore-dist-gpt_oss-local")
    result = mcore_dist_moe_jobs.run(tmp_path)
    assert result["differ"] == [] and result["compared"] > 0, result
    real, ours = mcore_dist_moe_jobs.same_chunks(tmp_path / "real", tmp_path / "dist")
    assert "decoder.layers.mlp.experts.experts.linear_fc2.bias" in real.tensors
