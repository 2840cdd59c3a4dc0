"""torch_dist checkpoints of mixtures of experts whose distributed-optimizer state is ``dp_reshardable``.

At ep > 1 megatron-core's ChainedOptimizer saves two bucket spaces: ``chained_0.`` the dense params' buffer
(groups numbered over tp and pp), ``chained_1.`` the experts' own buffer (buckets of their own, sharded over the
expert-data-parallel group, groups numbered over tp, ep and pp). The references are independent: a Megatron
torch-format fixture's ``distrib_optim.pt`` read with ``torch.load``, and megatron-core's own ranks
(``mcore_moe_jobs``), which dump every weight, fp32 main param and Adam moment they hold, and resume what
reshard writes.
"""

from __future__ import annotations

import mcore_moe_jobs as jobs
import pytest
import torch
from conftest import releases, require
from mcore_releases import NEWEST, common_state
from test_mcore_dist_moe import assert_same_values, hf_of
from test_megatron_moe import collect

import reshard
from reshard.errors import CheckpointFormatError
from reshard.io.dcp_metadata import read_metadata

S = jobs.SIZES
STATES = ("param", "exp_avg", "exp_avg_sq")


def distrib_optim(path) -> dict:
    """Each rank file's ``distrib_optim.pt`` (the fixture's or reshard's), by rank directory name."""
    files = sorted(path.glob("iter_*/mp_rank_*/distrib_optim.pt"))
    return {f.parent.name: torch.load(f, weights_only=True) for f in files}


def test_an_expert_parallel_bucket_space_round_trips_through_the_torch_format_at_any_ep(tmp_path):
    """A Mixtral fixture with the distributed optimizer at ep 2, dp 4 (distrib_optim.pt: a dense and an expert
    buffer) -> torch_dist dp_reshardable at ep 2, dp 4 (chained_0. dense groups, chained_1. expert groups, one
    per ep rank) -> back to the torch format at ep 2, dp 4: every buffer equal to the fixture's; at ep 4 the
    expert groups are four."""
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "meg", format="megatron", to="tp=1,pp=1,dp=4,ep=2,zero=1", model="tiny-mixtral")
    reshard.convert(tmp_path / "meg", tmp_path / "dist", format="mcore-dist", to="tp=1,dp=4,ep=2,zero=1")
    md = read_metadata(tmp_path / "dist")
    groups = {f"{k.split('.')[0]}.{k.split('.')[3]}" for k in md.tensors if k.startswith("chained_")}
    assert groups == {"chained_0.dp_group_idx_0", "chained_1.dp_group_idx_0", "chained_1.dp_group_idx_1"}
    assert reshard.open_checkpoint(tmp_path / "dist").progress.step is not None
    reshard.convert(tmp_path / "dist", tmp_path / "back", format="megatron", to="tp=1,pp=1,dp=4,ep=2,zero=1",
                    spec="megatron-mixtral-ep-distopt-torch")
    want, got = distrib_optim(tmp_path / "meg"), distrib_optim(tmp_path / "back")
    assert want.keys() == got.keys() == {"mp_rank_00_000", "mp_rank_00_001"}
    for rank, buffers in want.items():
        assert len(buffers) == len(got[rank]) == 2  # the dense optimizer's, the expert optimizer's
        for a, b in zip(buffers, got[rank]):
            assert (a is None) == (b is None), rank  # the dense buffer is in the file of its dp rank 0 only
            if a is not None:
                (x,), (y,) = a[0].values(), b[0].values()  # {0: {(param dtype, grad dtype): {state: tensor}}}
                assert all(torch.equal(x[s], y[s]) for s in STATES), rank
    reshard.convert(tmp_path / "dist", tmp_path / "ep4", format="mcore-dist", to="tp=1,dp=4,ep=4,zero=1")
    expert = {k.split(".")[3] for k in read_metadata(tmp_path / "ep4").tensors if k.startswith("chained_1.")}
    assert expert == {f"dp_group_idx_{e}" for e in range(4)}


def test_a_bucket_count_the_layout_does_not_give_is_refused_naming_the_expert_buffer(tmp_path):
    from reshard.fixtures import make_fixture
    from reshard.formats.megatron.torch_dist import COMMON

    make_fixture(tmp_path / "meg", format="megatron", to="tp=1,pp=1,dp=2,ep=2,zero=1", model="tiny-mixtral")
    reshard.convert(tmp_path / "meg", tmp_path / "dist", format="mcore-dist", to="tp=1,dp=2,ep=2,zero=1")
    common = torch.load(tmp_path / "dist" / COMMON, weights_only=False)
    common["args"].overlap_grad_reduce, common["args"].ddp_bucket_size = True, 1  # a bucket per parameter
    torch.save(common, tmp_path / "dist" / COMMON)
    with pytest.raises(CheckpointFormatError, match=r"chained_0\.dp_group_idx_0 \(tp=0, pp=0\) has 1 buckets in "
                                                    r"per_bucket_numel_unpadded, the layout \(megatron-mixtral-ep-"
                                                    r"distopt, bucket_size 1 .*\) has \d+"):
        reshard.open_checkpoint(tmp_path / "dist")


def assert_same_but_padding(got: dict, want: dict, then: str) -> None:
    """Every (name, state) of ``want`` equal in ``got`` but the vocabulary's padding rows, which reshard writes as
    zeros where the run kept what its optimizer made of them."""
    rows = S["vocab"] * S["h"]
    assert got.keys() == want.keys(), then
    for (name, state), value in want.items():
        have = got[(name, state)]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight") and state != "step":
            have, value = have[:rows], value[:rows]
        assert have.dtype == value.dtype and torch.equal(have, value), (then, name, state)


@pytest.mark.interop
@releases(NEWEST)
def test_real_mixtral_dp_reshardable_at_ep2_converts_and_resumes_in_megatron_core_at_ep1_and_back(tmp_path, mcore):
    """megatron-core (0.16.1, and 0.19.2) trains a Mixtral-style model one step at ep 2, dp 2 (bf16, fp32 main params, buckets of
    4000 elements: four dense buckets, eight expert ones) and saves torch_dist with its default dp_reshardable
    state -> Hugging Face: every weight bit-exact; -> reshard's own rewrite at the same layout: every key, chunk
    and bytes entry as megatron-core wrote them; -> the torch format at ep 1, dp 1, which megatron-core loads
    (experts back in the dense buffer) with every weight, main param, Adam moment and step equal to the run's,
    and the next step equal; -> torch_dist dp_reshardable at ep 1, dp 1 and from there at ep 2 again (a dense
    and an expert optimizer), each resumed by megatron-core's dist_checkpointing.load the same way; -> torch_dist
    fully_reshardable at ep 2 (the dense and expert optimizers' param groups in common.pt) and at ep 1 (one
    optimizer), each resumed the same way."""
    require("megatron.core")
    from safetensors.torch import load_file

    from reshard.formats.megatron.dist_optim import _object

    run = {"bf16": True, "next": True, "bucket_size": 4000}
    jobs.save(tmp_path / "src", tmp_path / "dump", tp=1, pp=1, ep=2, dp=2, distopt=True, torch_dist=True, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    real = read_metadata(ckpt)
    assert sum(k.startswith("chained_1.") and k.endswith(".param") for k in real.tensors) == 16  # 8 buckets, ep 2
    want = {now: collect(tmp_path / now, 1, 2, S) for now in ("dump", "dump/next")}
    assert {s for _, s in want["dump"]} == {"value", "param", "exp_avg", "exp_avg_sq", "step"}
    assert reshard.open_checkpoint(ckpt).progress.step == 1
    reshard.convert(ckpt, tmp_path / "hf", format="hf")
    assert_same_values(load_file(tmp_path / "hf" / "model.safetensors"), hf_of(want["dump"], "mixtral"), "hf")
    reshard.convert(ckpt, tmp_path / "same", to="tp=1,dp=2,ep=2,zero=1")
    ours = read_metadata(tmp_path / "same")
    assert ours.tensors.keys() == real.tensors.keys() and sorted(ours.byte_entries) == sorted(real.byte_entries)
    for key, t in real.tensors.items():
        if key.startswith("chained_"):
            assert sorted((c.offsets, c.sizes) for c in ours.tensors[key].chunks) == \
                sorted((c.offsets, c.sizes) for c in t.chunks), key
    for key in real.byte_entries:
        if key.startswith("chained_"):
            assert _object(tmp_path / "same", ours, key) == _object(ckpt, real, key), key

    def resumed(dump: str, ep: int, dp: int) -> None:
        for now, then in (("dump", dump), ("dump/next", f"{dump}/next")):
            assert_same_but_padding(collect(tmp_path / then, 1, ep, S), want[now], then)

    reshard.convert(ckpt, tmp_path / "meg", format="megatron", to="tp=1,pp=1,dp=1,ep=1,zero=1",
                    spec="megatron-mixtral-local-distopt-torch")
    jobs.load(tmp_path / "meg", tmp_path / "dump-meg", tp=1, pp=1, ep=1, dp=1, distopt=True, **run)
    resumed("dump-meg", 1, 1)
    reshard.convert(ckpt, tmp_path / "ep1", format="mcore-dist", to="tp=1,dp=1,ep=1,zero=1")
    assert not any(k.startswith("chained_") for k in read_metadata(tmp_path / "ep1").tensors)
    jobs.load(tmp_path / "ep1", tmp_path / "dump-ep1", tp=1, pp=1, ep=1, dp=1, distopt=True, torch_dist=True, **run)
    resumed("dump-ep1", 1, 1)
    reshard.convert(tmp_path / "ep1", tmp_path / "ep2", format="mcore-dist", to="tp=1,dp=2,ep=2,zero=1")
    jobs.load(tmp_path / "ep2", tmp_path / "dump-ep2", tp=1, pp=1, ep=2, dp=2, distopt=True, torch_dist=True, **run)
    resumed("dump-ep2", 2, 2)
    reshard.convert(ckpt, tmp_path / "full", format="mcore-dist", to="tp=1,dp=2,ep=2,zero=1",
                    dist_optim="fully_reshardable")
    assert (tmp_path / "full" / "common.pt").is_file() == (mcore != NEWEST)  # the source's form of common state
    groups = common_state(tmp_path / "full")["optimizer"]
    assert sorted(groups) == [0, 1] and all(g["param_state_sharding_type"] == "fully_reshardable"
                                            for g in groups.values())
    jobs.load(tmp_path / "full", tmp_path / "dump-full", tp=1, pp=1, ep=2, dp=2, distopt=True, torch_dist=True,
              fully_reshardable=True, **run)
    resumed("dump-full", 2, 2)
    reshard.convert(ckpt, tmp_path / "full1", format="mcore-dist", to="tp=1,dp=1,ep=1,zero=1",
                    dist_optim="fully_reshardable")  # one optimizer at ep 1: written as a dense model's
    jobs.load(tmp_path / "full1", tmp_path / "dump-full1", tp=1, pp=1, ep=1, dp=1, distopt=True, torch_dist=True,
              fully_reshardable=True, **run)
    resumed("dump-full1", 1, 1)
