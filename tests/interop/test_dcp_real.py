"""Real FSDP2, DTensor TP and 2-D checkpoints from gloo jobs (``dcp_jobs.py``) through reshard and back into torch.

The oracles are torch's own: ``dcp_to_torch_save`` of the original
checkpoint, and ``dcp.load`` at a new mesh in a real job, after which one
training step must run. Every comparison is bit-exact, optimizer state
included.
"""

from __future__ import annotations

import json
import math

import dcp_jobs
import pytest
import torch
from conftest import require
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import reshard
from reshard.io.dcp_metadata import read_metadata

pytestmark = pytest.mark.interop


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of the same model written by real jobs: FSDP2 at 3 ranks, TP at 2, FSDP2 x TP at 2 x 2."""
    require("transformers")
    root = tmp_path_factory.mktemp("dcp-real")
    out = {}
    for name, mode, world, dp in (("fsdp3", "fsdp", 3, None), ("tp2", "tp", 2, None), ("2d4", "2d", 4, 2)):
        dcp_jobs.save(root / name, mode, world, dp=dp)
        (root / name / "config.json").write_text(json.dumps(dcp_jobs.CONFIG))
        dcp_to_torch_save(root / name, root / f"{name}.pt")
        out[name] = (root / name, dcp_jobs.flatten(torch.load(root / f"{name}.pt", weights_only=True)))
    return out


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_the_jobs_wrote_the_layouts_fsdp2_and_dtensor_give(saved):
    q = "model.model.layers.0.self_attn.q_proj.weight"
    chunks = {n: sorted((c.offsets, c.sizes) for c in read_metadata(p).tensors[q].chunks) for n, (p, _) in saved.items()}
    assert chunks["fsdp3"] == [((0, 0), (22, 64)), ((22, 0), (22, 64)), ((44, 0), (20, 64))]  # torch.chunk: 22/22/20
    assert chunks["tp2"] == [((0, 0), (32, 64)), ((32, 0), (32, 64))]  # colwise
    assert chunks["2d4"] == [((0, 0), (16, 64)), ((16, 0), (16, 64)), ((32, 0), (16, 64)), ((48, 0), (16, 64))]


@pytest.mark.parametrize("name", ["fsdp3", "tp2", "2d4"])
def test_real_dcp_to_hf_equals_torchs_own_consolidation(saved, tmp_path, name):
    from safetensors.torch import load_file

    src, ref = saved[name]
    reshard.convert(src, tmp_path / "hf", format="hf")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    model = {k[len("model."):]: v for k, v in ref.items() if k.startswith("model.")}
    assert hf.keys() == model.keys()
    for k, v in model.items():
        assert same(hf[k], v), k


@pytest.mark.parametrize("name,via", [("fsdp3", ("megatron", "tp=2,pp=2")), ("2d4", ("deepspeed", "dp=3,zero=2"))])
def test_real_dcp_through_megatron_or_deepspeed_and_back_keeps_model_and_optimizer(saved, tmp_path, name, via):
    src, ref = saved[name]
    fmt, topology = via
    reshard.convert(src, tmp_path / fmt, format=fmt, to=topology)
    reshard.convert(tmp_path / fmt, tmp_path / "back", format="dcp", to="dp=2")
    dcp_to_torch_save(tmp_path / "back", tmp_path / "back.pt")
    back = dcp_jobs.flatten(torch.load(tmp_path / "back.pt", weights_only=True))
    tensors = [k for k, v in ref.items() if torch.is_tensor(v) and v.dim() > 0]
    assert len(tensors) == 9 * 2 * 3 + 3 * 3  # 2 layers of 9 params, 3 more; each with exp_avg and exp_avg_sq
    for k in tensors:
        assert same(back[k], ref[k]), k


@pytest.mark.parametrize("name,to,mode,world,dp", [
    ("fsdp3", "dp=2", "fsdp", 2, None),          # shrink FSDP2 3 -> 2
    ("tp2", "dp=4", "fsdp", 4, None),            # TP -> FSDP2 at 4
    ("fsdp3", "tp=2,dp=2", "2d", 4, 2),          # FSDP2 -> FSDP2 x TP, _StridedShard written by reshard
    ("2d4", "tp=2", "tp", 2, None),              # 2-D -> TP only
])
def test_reshard_written_dcp_loads_in_a_real_job_at_the_new_mesh(saved, tmp_path, name, to, mode, world, dp):
    src, ref = saved[name]
    reshard.convert(src, tmp_path / "dst", to=to)
    files = sorted(p.name for p in (tmp_path / "dst").glob("*.distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(world)]
    dcp_jobs.load(tmp_path / "dst", mode, world, tmp_path / "dump.pt", dp=dp)
    dump = torch.load(tmp_path / "dump.pt", weights_only=True)
    assert math.isfinite(dump.pop("loss_after_step"))
    assert dump.keys() == ref.keys()
    for k, v in ref.items():
        assert same(dump[k], v), k
