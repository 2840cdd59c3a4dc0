"""torch_dist checkpoints whose distributed-optimizer state is ``fully_reshardable`` (model space), written and
checked, and the ``dp_reshardable`` resume of GPT-2 and Qwen2 style models.

The real-framework tests train megatron-core itself (``mcore_moe_jobs.py``'s dense bf16 options, buckets of
4000 elements), convert, and resume the result in megatron-core at another tp and dp; the oracle is what the
run held (``gathered``). The fast test writes ``fully_reshardable`` from a hand-made ``dp_reshardable``
checkpoint with several buckets and reads each state back with torch's own DCP reader.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import releases, require
from mcore_releases import NEWEST
from test_mcore_dist_optim import STATES, gathered, write_dp_reshardable
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import reshard
from reshard.errors import CheckpointFormatError, ReshardError


def flat(path, tmp_path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(path, tmp_path / "flat.pt")
    return torch.load(tmp_path / "flat.pt", weights_only=True)


def test_fully_reshardable_is_written_as_the_weights_chunks_per_state_and_passes_the_bucket_check(tmp_path):
    """dp_reshardable with several buckets -> fully_reshardable at tp 2, dp 1: per weight key and state a key
    ``optimizer.state.<param|exp_avg|exp_avg_sq>.<key>`` of the weight's global shape and chunks, fp32, each
    value the source's; common.pt as megatron-core 0.16's trainer saves it; read back (the bucket check
    compares main params and weights of a bucket after a padded one: reshard's own file passes) equal."""
    write_dp_reshardable(tmp_path / "src")
    reshard.convert(tmp_path / "src", tmp_path / "out", format="mcore-dist", to="tp=2,dp=1,zero=1",
                    dist_optim="fully_reshardable")
    md = pickle.loads((tmp_path / "out" / ".metadata").read_bytes()).state_dict_metadata
    weights = [k for k, v in md.items() if not k.startswith("optimizer.") and hasattr(v, "chunks")]
    assert weights and not any(k.startswith("optimizer.distributed.") for k in md)
    for key in weights:
        for state in STATES:
            t = md[f"optimizer.state.{state}.{key}"]
            assert t.size == md[key].size and t.properties.dtype == torch.float32
            assert sorted(c.offsets for c in t.chunks) == sorted(c.offsets for c in md[key].chunks)
    common = torch.load(tmp_path / "out" / "common.pt", weights_only=False)
    assert common["content_metadata"] == {"distrib_optim_sharding_type": "fully_reshardable",
                                          "distrib_optim_fully_reshardable_mem_efficient": False,
                                          "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert [(g["wd_mult"], g["step"]) for g in groups] == [(1.0, 3.0), (0.0, 3.0)]
    assert common["args"].dist_ckpt_optim_fully_reshardable
    # Back to dp_reshardable: every bucket tensor's parameter elements as first written
    again = reshard.open_checkpoint(tmp_path / "out")
    assert again.progress.step == 3 and set(again.layout.states) == {"exp_avg", "exp_avg_sq", "master", "param"}
    for d in ("src", "out"):
        reshard.convert(tmp_path / d, tmp_path / f"torch-{d}", format="megatron", to="tp=1,dp=1,zero=1")
    a, b = (torch.load(tmp_path / f"torch-{d}" / "iter_0000010" / "mp_rank_00" / "distrib_optim.pt",
                       weights_only=True)[0] for d in ("src", "out"))
    (x,), (y,) = a.values(), b.values()
    assert all(torch.equal(x[s], y[s]) for s in STATES)


def test_dist_optim_is_refused_outside_the_mcore_dist_format_and_without_zero_1(tmp_path):
    write_dp_reshardable(tmp_path / "src")
    with pytest.raises(ReshardError, match="dist_optim applies to the mcore-dist format"):
        reshard.plan(tmp_path / "src", format="megatron", to="tp=1,zero=1", dist_optim="fully_reshardable")
    with pytest.raises(CheckpointFormatError, match="dist_optim 'fully_reshardable' is the distributed optimizer's"):
        reshard.plan(tmp_path / "src", to="tp=1,zero=0", dist_optim="fully_reshardable")
    with pytest.raises(CheckpointFormatError, match="dist_optim 'zero_gather': expected one of dp_reshardable, "
                                                    "fully_reshardable"):
        reshard.plan(tmp_path / "src", to="tp=1,zero=1", dist_optim="zero_gather")


def _equal_runs(tmp_path, pairs, pp: int, sizes: dict, gated: bool) -> None:
    for now, then in pairs:
        have, wanted = gathered(tmp_path / then, pp, sizes, gated), gathered(tmp_path / now, 1, sizes, gated)
        assert have.keys() == wanted.keys()
        for key, value in wanted.items():
            assert have[key].dtype == value.dtype and torch.equal(have[key], value), (then, key)


@pytest.mark.interop
@pytest.mark.parametrize("family,sharding,mcore", [("qwen2", "fully_reshardable", None), ("gpt2", "dp_reshardable", None),
                                                   ("gpt2", "dp_reshardable", NEWEST)], indirect=["mcore"],
                         ids=["qwen2-fully_reshardable", "gpt2-dp_reshardable", f"gpt2-dp_reshardable-mcore-{NEWEST}"])
def test_real_dp_reshardable_run_resumes_in_megatron_core_at_tp2_and_gpt2_at_pp2(tmp_path, family, sharding, mcore):
    """megatron-core trains one step of a Qwen2 style (q/k/v biases, tied) or GPT-2 style (LayerNorm, biases,
    learned positions, tied) model at tp 1, dp 2 in buckets and
    saves dp_reshardable -> torch_dist at tp 2, dp 1 with the optimizer state fully_reshardable (resumed with
    other buckets: one) or dp_reshardable (in the run's buckets), loaded by megatron-core's
    dist_checkpointing.load: every weight, main param, Adam moment and step equal to what the run held, and
    the next step equal too; GPT-2's also at pp 2 (``_resumed_at_pp2``)."""
    require("megatron.core")
    import mcore_moe_jobs as jobs

    run = {"dense": True, "bf16": True, "next": True, "family": family}
    jobs.save(tmp_path / "src", tmp_path / "dump-src", tp=1, pp=1, ep=1, dp=2, distopt=True, bucket_size=4000,
              torch_dist=True, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    src = reshard.open_checkpoint(ckpt)
    tied = "" if family == "gpt2" else "-tied"  # GPT-2 is always tied: its layout names no option for it
    assert src.spec_name == f"mcore-dist-{family}{tied}" and src.progress.step == 1
    assert any(k.endswith(".bucket_idx_2.param") for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    reshard.convert(ckpt, tmp_path / "dist", format="mcore-dist", to="tp=2,dp=1,zero=1", dist_optim=sharding)
    full = sharding == "fully_reshardable"
    assert reshard.open_checkpoint(tmp_path / "dist").progress.step == 1  # main params are the weights: no shift
    jobs.load(tmp_path / "dist", tmp_path / "dump-dist", tp=2, pp=1, ep=1, dp=1, distopt=True,
              bucket_size=None if full else 4000, torch_dist=True, fully_reshardable=full, **run)
    _equal_runs(tmp_path, (("dump-src", "dump-dist"), ("dump-src/next", "dump-dist/next")), 1, jobs.SIZES,
                gated=family != "gpt2")
    if family == "gpt2":
        _resumed_at_pp2(tmp_path, ckpt, run)


@pytest.mark.interop
@releases(NEWEST)
def test_real_fully_reshardable_checkpoint_of_several_buckets_is_refused_naming_the_shifted_state(tmp_path, mcore):
    """megatron-core (0.16.1, and 0.19.2, which still has the bug) saves fully_reshardable with buckets of 4000 elements at dp 2: the state of the
    parameters after the first padded bucket comes from shifted offsets (their main params are the weights
    shifted; those of bucket 0 match) -> refused, naming the key, the bucket and the shift."""
    require("megatron.core")
    import mcore_moe_jobs as jobs

    jobs.save(tmp_path / "src", tmp_path / "dump", tp=1, pp=1, ep=1, dp=2, distopt=True, bucket_size=4000,
              torch_dist=True, dense=True, bf16=True, fully_reshardable=True)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    stored = flat(ckpt, tmp_path)
    main = "optimizer.state.param."
    ok = {k[len(main):]: torch.equal(v.to(torch.bfloat16), stored[k[len(main):]]) for k, v in stored.items()
          if k.startswith(main)}
    assert ok["output_layer.weight"] and not ok["embedding.word_embeddings.weight"]  # bucket 0, and the last one
    with pytest.raises(CheckpointFormatError, match=r"'optimizer\.state\.param\.decoder\.layers\.[a-z_.0-9]+' "
                                                    r"\(chunk at \[[0-9,]+\]\) is corrupt: its fp32 main params "
                                                    r"are its weights shifted by ([1-9][0-9]*) elements .* lies in "
                                                    r"bucket [1-9] of the grad buffer of tp=0, pp=0 .* padded by \1 "):
        reshard.open_checkpoint(ckpt)


def _resumed_at_pp2(tmp_path, ckpt, run: dict) -> None:
    """megatron-core gives a tied embedding a bucket of its own at pp > 1, on the first stage (the embedding) and
    on the last (its copy, the output layer): a tied run at pp 1 -> torch_dist dp_reshardable and the torch
    format's distrib_optim.pt at pp 2, dp 1, each resumed by megatron-core with every weight, main param, Adam
    moment and step equal to the run's, the last stage's output layer equal to the embedding, and the next step
    equal too."""
    import mcore_moe_jobs as jobs

    reshard.convert(ckpt, tmp_path / "pp2", format="mcore-dist", to="tp=1,pp=2,dp=1,zero=1")
    jobs.load(tmp_path / "pp2", tmp_path / "dump-pp2", tp=1, pp=2, ep=1, dp=1, distopt=True, bucket_size=4000,
              torch_dist=True, **run)
    reshard.convert(ckpt, tmp_path / "meg", format="megatron", to="tp=1,pp=2,dp=1,zero=1",
                    spec="megatron-gpt2-local-distopt-torch")
    jobs.load(tmp_path / "meg", tmp_path / "dump-meg", tp=1, pp=2, ep=1, dp=1, distopt=True, bucket_size=4000, **run)
    for dump in ("dump-pp2", "dump-meg"):
        for now, then in (("dump-src", dump), ("dump-src/next", f"{dump}/next")):
            have, wanted = gathered(tmp_path / then, 2, jobs.SIZES, False), gathered(tmp_path / now, 1, jobs.SIZES,
                                                                                     False)
            head = {s: have.pop(("output_layer.weight", s)) for s in ("value", *STATES, "step")}
            assert have.keys() == wanted.keys()
            for key, value in wanted.items():
                assert have[key].dtype == value.dtype and torch.equal(have[key], value), (then, key)
            for s, value in head.items():
                assert torch.equal(value, wanted[("embedding.word_embeddings.weight", s)]), (then, s)
