"""torch_dist checkpoints whose distributed-optimizer state is in megatron-core's older bucket formats:
``dp_zero_gather_scatter`` (distrib_optim.pt's dict as one object per model-parallel group) and
``fully_sharded_bucket_space`` (each bucket padded, ``[dp, L]``), both written by megatron-core itself
(``mcore_dist_bucket_jobs``; 0.14's torch_dist strategy, which fails on a second flat piece of a key,
patched there to save each piece as it is) and checked against what the run held."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import releases, require
from mcore_releases import NEWEST
from test_mcore_dist_optim import assert_resumed, gathered, hf_of

import reshard
from reshard.errors import CheckpointFormatError
from reshard.formats.megatron.dist_zero import sharding_type
from reshard.io.dcp_metadata import read_metadata


_LOCAL_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
"""The run's local layers' names of the norms a dense torch_dist target fuses into the next linear."""


def full_state(path) -> dict[tuple[str, str], torch.Tensor]:
    """A torch_dist fully_reshardable checkpoint's weights and optimizer states per layer, as ``gathered`` keys
    them (``param`` the fp32 main params), the vocabulary's padding rows dropped."""
    import mcore_moe_jobs as jobs

    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in stored.items() if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=path)
    out = {}
    for key, value in state.items():
        name, kind = key, "value"
        if key.startswith("optimizer.state."):
            kind, _, name = key.removeprefix("optimizer.state.").partition(".")
        if name.startswith("decoder.layers."):  # a dense target has Transformer Engine's fused norms
            rest = _LOCAL_NAMES.get(name.removeprefix("decoder.layers."), name.removeprefix("decoder.layers."))
            out |= {(f"decoder.layers.{i}.{rest}", kind): value[i] for i in range(value.shape[0])}
        else:
            out[(name, kind)] = value[:jobs.SIZES["vocab"]] if "word_embeddings" in name or "output_layer" in name \
                else value
    return out


def check_against_the_run(tmp_path, ckpt, dump) -> None:
    """Every weight, fp32 main param and Adam moment reshard reads from ``ckpt``, written as fully_reshardable
    at tp 1, equal to what the run's ranks held; the step from the param groups."""
    reshard.convert(ckpt, tmp_path / "full", format="mcore-dist", to="tp=1,dp=1,zero=1", dist_optim="fully_reshardable")
    have = full_state(tmp_path / "full")
    import mcore_moe_jobs as jobs

    want = {k: v for k, v in gathered(dump, 1, jobs.SIZES).items() if k[1] != "step"}
    assert {s for _, s in want} == {"value", "param", "exp_avg", "exp_avg_sq"}
    assert have.keys() == want.keys()
    for key, value in want.items():
        assert have[key].dtype == value.dtype and torch.equal(have[key], value), key


@pytest.mark.interop
@releases(NEWEST)
def test_real_dp_zero_gather_scatter_state_converts_to_hf_and_to_dp_reshardable_at_another_layout(tmp_path, mcore):
    """megatron-core (0.16.1, and 0.19.2) trains one step at tp 1, dp 2 (bf16 weights, fp32 main params, buckets of 4000
    elements) and saves torch_dist with dp_zero_gather_scatter optimizer state -> every optimizer tensor equal to
    what the run held; -> dp_reshardable at tp 2, dp 1, which megatron-core resumes: every weight, main param,
    Adam moment and step as the run held them, and the step after equal to the run's next; -> Hugging Face: every
    weight equal."""
    require("megatron.core")
    from safetensors.torch import load_file

    import mcore_dist_bucket_jobs
    import mcore_moe_jobs as jobs

    run = {"dense": True, "bf16": True, "next": True}
    mcore_dist_bucket_jobs.save(tmp_path / "src", tmp_path / "dump", 1, 2, mcore_dist_bucket_jobs.ZERO,
                                bucket_size=4000, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    md = read_metadata(ckpt)
    assert "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1" in md.byte_entries
    assert not any(k.startswith("optimizer") for k in md.tensors)
    assert sharding_type({}, md) == "dp_zero_gather_scatter"
    src = reshard.open_checkpoint(ckpt)
    assert src.spec_name == "mcore-dist-llama" and src.progress.step == 1
    assert src.layout.states == ("exp_avg", "exp_avg_sq", "master", "param")
    check_against_the_run(tmp_path, ckpt, tmp_path / "dump")
    reshard.convert(ckpt, tmp_path / "dist", format="mcore-dist", to="tp=2,dp=1,zero=1")
    assert sharding_type({}, read_metadata(tmp_path / "dist")) == "dp_reshardable"
    jobs.load(tmp_path / "dist", tmp_path / "dump-dist", tp=2, pp=1, ep=1, dp=1, distopt=True, bucket_size=4000,
              torch_dist=True, **run)
    assert_resumed(tmp_path, "dump", "dump-dist")
    reshard.convert(ckpt, tmp_path / "hf", format="hf")
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf |= load_file(f)
    want = gathered(tmp_path / "dump", 1, jobs.SIZES)
    expected = hf_of({n: v for (n, s), v in want.items() if s == "value"}, jobs.SIZES)
    assert hf.keys() == expected.keys()
    for name, value in expected.items():
        assert hf[name].dtype == value.dtype and torch.equal(hf[name], value), name


@pytest.mark.interop
def test_real_fully_sharded_bucket_space_state_of_megatron_core_0_14_decodes_per_parameter(tmp_path, mcore_legacy):
    """megatron-core 0.14 trains one step at tp 1, dp 2 (buckets of 4000 elements) and saves torch_dist with
    fully_sharded_bucket_space optimizer state (each bucket padded, [dp, L]) -> every optimizer tensor equal to
    what the run held; -> dp_reshardable at tp 2, dp 1, which megatron-core 0.16 resumes: every tensor as the 0.14
    run held it, the step after equal to the 0.14 run's own; a bucket tensor of another shape is refused naming
    the key and both shapes."""
    require("megatron.core")
    import mcore_dist_bucket_jobs
    import mcore_moe_jobs as jobs

    run = {"dense": True, "bf16": True, "next": True}
    mcore_dist_bucket_jobs.save(tmp_path / "src", tmp_path / "dump", 1, 2, mcore_dist_bucket_jobs.BUCKET_SPACE,
                                bucket_size=4000, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    md = read_metadata(ckpt)
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_1.param"
    assert md.tensors[key].size == (2, 2368) and len(md.tensors[key].chunks) > 2  # 4736 padded, 4672 unpadded
    assert sharding_type({}, md) == "fully_sharded_bucket_space"
    src = reshard.open_checkpoint(ckpt)
    assert src.progress.step == 1 and src.layout.states == ("exp_avg", "exp_avg_sq", "master", "param")
    check_against_the_run(tmp_path, ckpt, tmp_path / "dump")
    reshard.convert(ckpt, tmp_path / "dist", format="mcore-dist", to="tp=2,dp=1,zero=1")
    jobs.load(tmp_path / "dist", tmp_path / "dump-dist", tp=2, pp=1, ep=1, dp=1, distopt=True, bucket_size=4000,
              torch_dist=True, **run)
    assert_resumed(tmp_path, "dump", "dump-dist")
    common = torch.load(ckpt / "common.pt", weights_only=False)
    common["content_metadata"]["distrib_optim_sharding_type"] = "dp_reshardable"  # the shapes say otherwise
    torch.save(common, ckpt / "common.pt")
    with pytest.raises(CheckpointFormatError, match=r"\.metadata: '.*bucket_idx_0\.\w+' is \[2, 6144\]"):
        reshard.open_checkpoint(ckpt)


@pytest.mark.interop
def test_real_mixture_of_experts_dp_zero_gather_scatter_state_converts_and_resumes_at_ep1(tmp_path):
    """megatron-core 0.16 trains a Mixtral-style MoE one step at ep 2, dp 2 (bf16, buckets of 4000 elements) and saves
    dp_zero_gather_scatter state: a dense optimizer (``chained_0.``, one group) and an expert one (``chained_1.``,
    one group per ep rank) -> Hugging Face: every weight as the run held it; -> dp_reshardable at ep 1, dp 1 (the
    experts back in the one buffer), which megatron-core resumes with every weight, main param, Adam moment and step
    as the run held them, and the step after equal to the run's next."""
    require("megatron.core")
    from safetensors.torch import load_file
    from test_mcore_dist_moe import assert_same_values
    from test_mcore_dist_moe import hf_of as moe_hf_of
    from test_mcore_dist_moe_optim import assert_same_but_padding
    from test_megatron_moe import collect

    import mcore_dist_bucket_jobs
    import mcore_moe_jobs as jobs

    run = {"bf16": True, "next": True, "bucket_size": 4000}
    mcore_dist_bucket_jobs.save(tmp_path / "src", tmp_path / "dump", 1, 2, mcore_dist_bucket_jobs.ZERO, ep=2, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    md = read_metadata(ckpt)
    assert sorted(k for k in md.byte_entries if k.endswith("param_state/shard_0_1")) == [
        "chained_0.optimizer.distributed.dp_group_idx_0.param_state/shard_0_1",
        *(f"chained_1.optimizer.distributed.dp_group_idx_{g}.param_state/shard_0_1" for g in (0, 1))]
    assert sharding_type({}, md) == "dp_zero_gather_scatter"
    want = {now: collect(tmp_path / now, 1, 2, jobs.SIZES) for now in ("dump", "dump/next")}
    assert {s for _, s in want["dump"]} == {"value", "param", "exp_avg", "exp_avg_sq", "step"}
    reshard.convert(ckpt, tmp_path / "hf", format="hf")
    assert_same_values(load_file(tmp_path / "hf" / "model.safetensors"), moe_hf_of(want["dump"], "mixtral"), "hf")
    reshard.convert(ckpt, tmp_path / "ep1", format="mcore-dist", to="tp=1,dp=1,ep=1,zero=1")
    assert sharding_type({}, read_metadata(tmp_path / "ep1")) == "dp_reshardable"
    jobs.load(tmp_path / "ep1", tmp_path / "dump-ep1", tp=1, pp=1, ep=1, dp=1, distopt=True, torch_dist=True, **run)
    for now, then in (("dump", "dump-ep1"), ("dump/next", "dump-ep1/next")):
        assert_same_but_padding(collect(tmp_path / then, 1, 1, jobs.SIZES), want[now], then)
