"""torch_dist checkpoints whose distributed-optimizer state is ``fully_sharded_model_space`` (megatron-core 0.8-0.14).

Each state of each model tensor is stored reformulated: the model tensor's chunk grid plus one
flat axis, each dp rank's piece a flat range of one cell (MEGATRON-DISTOPT.md §5.3). The
hand-written checkpoint stores every tensor whole (one cell) and is checked against the bucket
oracle of ``test_mcore_dist_optim``; the real-framework tests train megatron-core 0.14 itself
(installed beside 0.16 by ``.ci/run``, ``mcore_legacy_jobs``), migrate its checkpoint to
``dp_reshardable`` at another layout and resume it in the installed megatron-core 0.16.
"""

from __future__ import annotations

import argparse
import json
import math
import re

import mcore_jobs
import mcore_releases
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import require
from test_mcore_dist_optim import STATES, assert_resumed, check_one_coalesced_buffer, gathered, registered
from torch.distributed.checkpoint import DefaultSavePlanner

import reshard
from reshard.errors import CheckpointFormatError
from reshard.formats.megatron.model_space import _runs

S = mcore_jobs.SIZES
STORED = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def write_model_space(path, *, squash: str | None = None) -> dict[str, list[torch.Tensor]]:
    """A torch_dist checkpoint (tp 1, one process) with fully_sharded_model_space optimizer state, every tensor
    one chunk; returns each state's per-parameter values in registration order. ``squash`` stores that state
    key 1-D, as megatron-core 0.7 and older did."""
    params = registered(mcore_jobs.padded_vocab(1))
    gen = torch.Generator().manual_seed(7)
    values = {s: [torch.randn(shape, generator=gen) for _, shape in params] for s in ("weight", *STATES)}
    state: dict[str, object] = {}
    for s in ("weight", *STATES):
        by_name = dict(zip((n for n, _ in params), values[s]))
        for name, _ in params:
            m = re.fullmatch(r"decoder\.layers\.0\.(.*)", name)
            if m:
                name = f"decoder.layers.{m.group(1)}"
                whole = torch.stack([by_name[f"decoder.layers.{i}.{m.group(1)}"] for i in range(S["layers"])])
            elif name.startswith("decoder.layers."):
                continue
            else:
                whole = by_name[name]
            if s == "weight":
                state[name] = whole
            else:  # one cell of the chunk grid: (1, ..., 1, numel)
                key = f"optimizer.state.{STORED[s]}.{name}"
                state[key] = whole.reshape(-1) if key == squash else whole.reshape(*[1] * whole.dim(), -1)
    dcp.save(state, checkpoint_id=path, planner=DefaultSavePlanner(flatten_state_dict=False))
    args = vars(mcore_jobs._args(1, 1)) | {"data_parallel_size": 2, "use_distributed_optimizer": True}
    groups = [{"wd_mult": 1.0, "lr": 1e-3, "step": 3.0}, {"wd_mult": 0.0, "lr": 1e-3, "step": 3.0}]
    torch.save({"args": argparse.Namespace(**args), "iteration": 10, "checkpoint_version": 3.0,
                "content_metadata": {"distrib_optim_sharding_type": "fully_sharded_model_space"},
                "optimizer": {"optimizer": {"param_groups": groups},
                              "param_state_sharding_type": "fully_sharded_model_space"}}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return values


@pytest.mark.parametrize("shape,lo,hi", [((4, 3, 5), 0, 60), ((4, 3, 5), 7, 53), ((4, 3, 5), 16, 19),
                                         ((4, 3, 5), 15, 45), ((2, 64), 63, 65), ((7,), 2, 6), ((3, 4), 5, 5)])
def test_a_flat_range_is_cut_into_contiguous_boxes_in_order(shape, lo, hi):
    flat = torch.arange(math.prod(shape)).reshape(shape)
    pieces = [flat[tuple(slice(o, o + n) for o, n in zip(offs, sizes))].reshape(-1) for offs, sizes in
              _runs(shape, lo, hi)]
    assert torch.equal(torch.cat(pieces) if pieces else torch.arange(0), torch.arange(lo, hi))
    assert len(pieces) <= 2 * len(shape) - 1


def test_model_space_state_decodes_per_parameter_with_the_groups_step(tmp_path):
    """Model-space state (one cell per tensor) -> the torch format at tp 1, dp 1 with one bucket: each parameter's
    main param and Adam moments where the hand layout puts them; the step and param groups from common.pt."""
    values = write_model_space(tmp_path / "src")
    check_one_coalesced_buffer(tmp_path, values)


def test_one_dimensional_flattened_state_is_refused_naming_key_and_file(tmp_path):
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"
    write_model_space(tmp_path / "src", squash=key)
    numel = S["layers"] * S["h"] * S["f"]
    with pytest.raises(CheckpointFormatError, match=rf"(?s){tmp_path / 'src'}: .*'{re.escape(key)}' is \[{numel}\]; "
                                                   rf"fully_sharded_model_space state of .* is \[1, 1, 1, {numel}\] "
                                                   r".*1-D flattened state, as megatron-core 0.7 and older wrote it"):
        reshard.open_checkpoint(tmp_path / "src")


@pytest.mark.interop
def test_megatron_core_0_14_model_space_checkpoint_resumes_in_0_16_and_0_19_as_dp_reshardable(tmp_path, mcore_legacy,
                                                                                              monkeypatch):
    """megatron-core 0.14 trains one step at tp 2, dp 2 (bf16 weights, fp32 main params, buckets of 4000
    elements, so each dp rank holds pieces of parameters) and saves torch_dist with its default
    fully_sharded_model_space optimizer state -> torch_dist dp_reshardable at tp 1, dp 2 (the run's buckets),
    which megatron-core 0.16 loads with dist_checkpointing.load, and so does the newest release, 0.19.2: every
    weight, main param, Adam moment and step equal to what the 0.14 run held, and the step after equal to the
    0.14 run's own next step."""
    require("megatron.core")
    import mcore_legacy_jobs
    import mcore_moe_jobs as jobs

    run = {"dense": True, "bf16": True, "next": True}
    tp, dp, (t_tp, t_dp) = 2, 2, (1, 2)
    mcore_legacy_jobs.save(tmp_path / "src", tmp_path / "dump-src", tp=tp, dp=dp, bucket_size=4000, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    stored = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    fc1 = stored["optimizer.state.fp32_param.decoder.layers.mlp.linear_fc1.weight"]
    assert fc1.size[:-1] == (jobs.SIZES["layers"], 2 * tp, 1) and len(fc1.chunks) > jobs.SIZES["layers"] * 2 * tp
    src = reshard.open_checkpoint(ckpt)
    assert src.spec_name == "mcore-dist-llama" and src.progress.step == 1
    assert src.layout.states == ("exp_avg", "exp_avg_sq", "master", "param")
    reshard.convert(ckpt, tmp_path / "dist", format="mcore-dist", to=f"tp={t_tp},dp={t_dp},zero=1")
    assert any(k.endswith(".bucket_idx_3.param") for k in dcp.FileSystemReader(tmp_path / "dist").read_metadata()
               .state_dict_metadata)
    jobs.load(tmp_path / "dist", tmp_path / "dump-dist", tp=t_tp, pp=1, ep=1, dp=t_dp, distopt=True,
              bucket_size=4000, torch_dist=True, **run)
    assert {s for _, s in gathered(tmp_path / "dump-src", 1, jobs.SIZES)} == \
        {"value", "param", "exp_avg", "exp_avg_sq", "step"}
    assert_resumed(tmp_path, "dump-src", "dump-dist")
    if problem := mcore_releases.missing(mcore_releases.NEWEST):
        pytest.fail(problem, pytrace=False)
    monkeypatch.setenv("PYTHONPATH", mcore_releases.python_path(mcore_releases.NEWEST))
    jobs.load(tmp_path / "dist", tmp_path / "dump-newest", tp=t_tp, pp=1, ep=1, dp=t_dp, distopt=True,
              bucket_size=4000, torch_dist=True, **run)
    assert_resumed(tmp_path, "dump-src", "dump-newest")


@pytest.mark.interop
def test_megatron_core_0_14_mixture_of_experts_resumes_in_0_16_at_ep2(tmp_path, mcore_legacy):
    """megatron-core 0.14 trains a Mixtral-style model one step at ep 2, dp 2 (a dense and an expert optimizer;
    bf16, buckets of 4000) and saves its default fully_sharded_model_space state, experts stacked in model space
    -> Hugging Face, every weight bit-exact; -> torch_dist dp_reshardable at ep 2, dp 2 (chained_0. dense,
    chained_1. expert groups), which megatron-core 0.16 resumes with every weight, main param, Adam moment and
    step equal to the 0.14 run's, and the step after equal to 0.14's own."""
    require("megatron.core")
    from safetensors.torch import load_file
    from test_mcore_dist_moe import assert_same_values, hf_of
    from test_mcore_dist_moe_optim import assert_same_but_padding
    from test_megatron_moe import collect

    import mcore_legacy_jobs
    import mcore_moe_jobs as jobs

    run = {"bf16": True, "bucket_size": 4000, "next": True}
    mcore_legacy_jobs.save(tmp_path / "src", tmp_path / "dump-src", tp=1, dp=2, ep=2, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    src = reshard.open_checkpoint(ckpt)
    assert src.spec_name == "mcore-dist-mixtral-local" and src.progress.step == 1
    want = {now: collect(tmp_path / now, 1, 2, jobs.SIZES) for now in ("dump-src", "dump-src/next")}
    reshard.convert(ckpt, tmp_path / "hf", format="hf")
    assert_same_values(load_file(tmp_path / "hf" / "model.safetensors"), hf_of(want["dump-src"], "mixtral"), "hf")
    reshard.convert(ckpt, tmp_path / "ep2", format="mcore-dist", to="tp=1,dp=2,ep=2,zero=1")
    assert any(k.startswith("chained_1.") for k in dcp.FileSystemReader(tmp_path / "ep2").read_metadata()
               .state_dict_metadata)
    jobs.load(tmp_path / "ep2", tmp_path / "dump-ep2", tp=1, pp=1, ep=2, dp=2, distopt=True, torch_dist=True, **run)
    for now, then in (("dump-src", "dump-ep2"), ("dump-src/next", "dump-ep2/next")):
        assert_same_but_padding(collect(tmp_path / then, 1, 2, jobs.SIZES), want[now], then)
