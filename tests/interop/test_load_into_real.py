"""``reshard.torch.load_into`` inside real torch.distributed jobs (gloo, CPU) at new world sizes: a transformers
``LlamaForCausalLM`` under FSDP2, and under a dp x tp mesh, filled straight from Hugging Face safetensors, a
Megatron tp2pp2 checkpoint, a DeepSpeed ZeRO-2 checkpoint and a DCP checkpoint saved at another world size.

The judge is DCP itself: in the same job, the same model filled by ``dcp.load`` of the checkpoint converted
to DCP by ``reshard.convert`` (or of the DCP checkpoint itself) must hold every local shard and optimizer
state bit for bit alike, and one more training step must leave both alike. Each rank reads its share of
the checkpoint's bytes (what its boxes hold, in the checkpoint's dtypes) and no more than 1.25 times it.
"""

from __future__ import annotations

import load_into_jobs as jobs
import pytest
from conftest import require

import reshard
from reshard.fixtures import make_fixture

pytestmark = pytest.mark.interop

SOURCES = {"hf": "tp=1", "megatron": "tp=2,pp=2", "deepspeed": "dp=2,zero=2"}
"""Fixture checkpoints of the ``tiny-llama`` model (fp32 masters and Adam moments, bf16 weights), by format."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job, run once: fixture sources and their DCP conversions at 2 ranks; at 2 ranks the loads of
    hf, megatron and deepspeed and a real FSDP2 save; at 3 ranks the load of that save; at 4 ranks (dp 2 x
    tp 2) the load of megatron."""
    require("transformers")
    root = tmp_path_factory.mktemp("load_into")
    for fmt, to in SOURCES.items():
        make_fixture(root / fmt, format=fmt, to=to)
        reshard.convert(root / fmt, root / f"{fmt}-dcp", format="dcp", to="dp=2")
    out = root / "out"
    out.mkdir()
    jobs.run(2, out, jobs.load("hf", "fsdp", root / "hf", root / "hf-dcp", optimizer=False, model_bytes=2),
             jobs.load("megatron", "fsdp", root / "megatron", root / "megatron-dcp"),
             jobs.load("deepspeed", "fsdp", root / "deepspeed", root / "deepspeed-dcp"),
             jobs.save(root / "fsdp2-ws2"))
    jobs.run(3, out, jobs.load("dcp", "fsdp", root / "fsdp2-ws2", root / "fsdp2-ws2"))
    jobs.run(4, out, jobs.load("2d", "2d", root / "megatron", root / "megatron-dcp"))
    return out


def _judge(runs, tag: str, world: int, *, states: list[str], steps: list[float], trained: bool = False) -> None:
    results = jobs.results(runs, tag, world)
    for rank, r in enumerate(results):
        where = f"{tag}, rank {rank}"
        assert r["loaded"] == [], f"{where}: loaded differently from dcp.load: {r['loaded'][:5]}"
        assert r["stepped"] == [], f"{where}: the next step differs: {r['stepped'][:5]}"
        assert r["losses"][0] == r["losses"][1], where
        assert r["states"] == states and r["steps"] == steps, where
        # A trained checkpoint's moments are zero where no gradient reached (embedding rows of unseen tokens).
        assert trained or r["zeros"] == [], f"{where}: nothing was loaded into {r['zeros'][:5]}"
        assert r["share"] == r["expected_share"], where
        assert r["share"] <= r["bytes_read"] <= 1.25 * r["share"], f"{where}: read {r['bytes_read']} for {r['share']}"


def test_hugging_face_safetensors_load_into_fsdp2_at_2_ranks(runs):
    _judge(runs, "hf", 2, states=["param"], steps=[])


def test_a_megatron_tp2pp2_checkpoint_loads_into_a_transformers_llama_under_fsdp2(runs):
    _judge(runs, "megatron", 2, states=["master", "exp_avg", "exp_avg_sq"], steps=[0.0])


def test_a_deepspeed_zero2_checkpoint_loads_into_fsdp2(runs):
    _judge(runs, "deepspeed", 2, states=["master", "exp_avg", "exp_avg_sq"], steps=[1.0])


def test_a_dcp_checkpoint_saved_at_2_ranks_loads_into_fsdp2_at_3_with_adam_state(runs):
    _judge(runs, "dcp", 3, states=["param", "exp_avg", "exp_avg_sq"], steps=[2.0], trained=True)


def test_a_megatron_checkpoint_loads_into_a_dp2_tp2_mesh(runs):
    _judge(runs, "2d", 4, states=["master", "exp_avg", "exp_avg_sq"], steps=[0.0])
