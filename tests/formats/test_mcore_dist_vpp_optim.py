"""torch_dist ``dp_reshardable`` state with virtual pipeline chunks, against real megatron-core 0.16.1 runs.

With ``--num-layers-per-virtual-pipeline-stage`` megatron-core builds one model chunk per virtual stage, each with
its own ``DistributedDataParallel`` and grad buffer; the one ``DistributedOptimizer`` numbers those buffers in
chunk order, so a key's ``gbuf_idx`` is its model chunk (``dp_group_idx`` stays ``pp_rank * tp + tp_rank``) and
``per_bucket_numel[_unpadded]`` list one entry per chunk. Only chunk 0 of pp rank 0 has several buckets (the
trainer disables bucketing elsewhere).
"""

from __future__ import annotations

import mcore_moe_jobs as moe
import pytest
import torch
from conftest import require
from mcore_dist_moe_jobs import same_chunks
from test_mcore_dist_optim import gathered, hf_of

import reshard
from reshard.io.dcp_metadata import read_metadata
from reshard.io.torch_read import read_torch_file


def _object(ckpt, key: str):
    md = read_metadata(ckpt)
    s = md.storage[(key, None)] if (key, None) in md.storage else next(v for (k, _), v in md.storage.items()
                                                                           if k == key)
    return read_torch_file(ckpt / s.relative_path, offset=s.offset, length=s.length)


@pytest.mark.interop
def test_real_vpp_dp_reshardable_state_is_written_as_megatron_core_saves_it_and_read_back_per_parameter(tmp_path):
    """megatron-core trains one step at tp 1, pp 1, dp 2 (bf16, buckets of 4000 elements) and saves torch_dist ->
    torch_dist at pp 2, vpp 2 (a grad buffer per model chunk, gbuf_idx_1 keys), which megatron-core resumes
    with every weight, main param, Adam moment and step equal and the next step equal; megatron-core's own save
    of that state has the same keys, chunks and bucket counts, and reads back, per parameter, bit-exact, as does
    its save of it as dp_zero_gather_scatter (a buffer per model chunk in each group's dict)."""
    require("megatron.core")
    import mcore_vpp_jobs as vpp_jobs

    run = {"dense": True, "bf16": True, "next": True}
    moe.save(tmp_path / "src", tmp_path / "dump-src", tp=1, pp=1, ep=1, dp=2, distopt=True, bucket_size=4000,
             torch_dist=True, **run)
    reshard.convert(tmp_path / "src" / "iter_0000010", tmp_path / "vpp", format="mcore-dist",
                    to="pp=2,vpp=2,dp=1,zero=1")
    vpp_jobs.load(tmp_path / "vpp", tmp_path / "dump-vpp", pp=2, vpp=2, dp=1, bucket_size=4000, resave=True)
    for now, then in (("dump-src", "dump-vpp"), ("dump-src/next", "dump-vpp/next")):
        have, wanted = gathered(tmp_path / then, 1, moe.SIZES), gathered(tmp_path / now, 1, moe.SIZES)
        assert have.keys() == wanted.keys() and {s for _, s in wanted} == {"value", "param", "exp_avg",
                                                                            "exp_avg_sq", "step"}
        for key, value in wanted.items():
            assert have[key].dtype == value.dtype and torch.equal(have[key], value), (then, key)

    real = tmp_path / "dump-vpp" / "resaved" / "iter_0000010"  # megatron-core's save of the state it resumed
    md, _ = same_chunks(real, tmp_path / "vpp")
    assert any(".gbuf_idx_1." in k for k in md.tensors) and sum(".bucket_idx_1." in k for k in md.tensors) == 3
    for group in ("optimizer.distributed.dp_group_idx_0", "optimizer.distributed.dp_group_idx_1"):
        for what in ("per_bucket_numel", "per_bucket_numel_unpadded"):
            key = f"{group}.{what}/shard_0_1"
            assert _object(tmp_path / "vpp", key) == _object(real, key), key

    wanted = gathered(tmp_path / "dump-src", 1, moe.SIZES)
    zero = tmp_path / "dump-vpp" / "resaved-zero" / "iter_0000010"  # the same state as dp_zero_gather_scatter
    assert "optimizer.distributed.dp_group_idx_1.param_state/shard_0_1" in read_metadata(zero).byte_entries
    for saved in (real, zero):
        src = reshard.open_checkpoint(saved)
        assert src.spec_name == "mcore-dist-llama" and src.progress.step == 1
        mine = reshard.load(saved, to="dp=1", format="dcp", rank=0)
        for state, name in (("param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            held = mine.state_dict(name)
            expected = hf_of({k: v for (k, s), v in wanted.items() if s == state}, moe.SIZES)
            assert len(held) == len(expected)
            for k, value in expected.items():
                got = held["model." + k if name == "master" else f"optim.state.{k}.{name}"]
                assert got.dtype == value.dtype and torch.equal(got, value), (saved, state, k)
