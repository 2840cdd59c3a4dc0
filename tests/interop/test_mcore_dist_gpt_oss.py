"""GPT-OSS in megatron-core's torch_dist: reshard's layout from Hugging Face against what megatron-core itself saves
(``mcore_dist_moe_jobs``) for the same model, built from the args of reshard's Megatron conversion."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import require
from jobs import run_job
from test_families_real import _save_tiny

import reshard
from reshard.io.dcp_metadata import read_metadata


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
    script = Path(__file__).parents[1] / "mcore_dist_moe_jobs.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    code, output = run_job([sys.executable, str(script), str(tmp_path)], env)
    assert code == 0, output[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["differ"] == [] and result["compared"] > 0, result
    real, ours = read_metadata(tmp_path / "real"), read_metadata(tmp_path / "dist")
    assert ours.tensors.keys() == real.tensors.keys() and sorted(ours.byte_entries) == sorted(real.byte_entries)
    assert "decoder.layers.mlp.experts.experts.linear_fc2.bias" in real.tensors
    for key, t in real.tensors.items():
        assert sorted((c.offsets, c.sizes) for c in ours.tensors[key].chunks) == \
            sorted((c.offsets, c.sizes) for c in t.chunks), key
