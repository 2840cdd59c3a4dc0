"""Expert tensor parallelism other than tp (``--expert-tensor-parallel-size 1`` at tp=2) in Megatron's torch
format and in torch_dist's distributed-optimizer state, against real megatron-core runs (``mcore_moe_jobs`` with
``etp``)."""

from __future__ import annotations

import pytest
import torch
from conftest import require

import reshard
from reshard.errors import CheckpointFormatError
from reshard.formats.megatron.dist_optim import _object
from reshard.formats.megatron.dist_zero import sharding_type
from reshard.io.dcp_metadata import read_metadata


@pytest.mark.interop
def test_real_megatron_core_at_etp1_tp2_ep2_converts_to_hf_and_tp1_and_back_and_loads_in_megatron_core(tmp_path):
    """megatron-core at tp=2, ep=2, etp=1 (world 4) saves mp_rank_00_000 and mp_rank_01_001 only, each with its
    dense tp shard and its ep rank's experts whole -> Hugging Face: every expert equal to the run's -> tp=1, ep=1
    and back at etp=1: the same rank files, args recording etp=1, which megatron-core built at tp=2, ep=2, etp=1
    loads strictly, every rank's weights equal to the saving run's (the vocabulary's pad rows zeros)."""
    require("megatron.core")
    import torch
    from safetensors.torch import load_file

    import mcore_moe_jobs as jobs

    S, f = jobs.SIZES, jobs.SIZES["f"]
    jobs.save(tmp_path / "src", tmp_path / "dump-src", tp=2, pp=1, ep=2, dp=2, etp=1)
    it = f"iter_{jobs.ITERATION:07d}"
    assert sorted(p.name for p in (tmp_path / "src" / it).iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    src = reshard.open_checkpoint(tmp_path / "src")
    assert src.spec_name == "megatron-mixtral-local-etp" and str(src.topology) == "tp=2,pp=1,dp=2,ep=2,etp=1"
    dumps = [torch.load(tmp_path / "dump-src" / f"rank{r}.pt", weights_only=False) for r in range(4)]
    reshard.convert(tmp_path / "src", tmp_path / "hf", format="hf")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    seen = set()
    for d in dumps:
        for name, value in d["params"].items():
            if ".local_experts." not in name:
                continue
            i, j = int(name.split(".")[2]), int(name.split("local_experts.")[1].split(".")[0])
            at = f"model.layers.{i}.block_sparse_moe.experts.{d['coords']['ep'] * 2 + j}."
            if ".linear_fc1." in name:  # whole: the gate rows, then the up rows
                assert torch.equal(hf[at + "w1.weight"], value[:f]) and torch.equal(hf[at + "w3.weight"], value[f:])
            else:
                assert torch.equal(hf[at + "w2.weight"], value), name
            seen.add(at)
    assert len(seen) == S["layers"] * S["experts"]
    reshard.convert(tmp_path / "src", tmp_path / "one", to="tp=1,pp=1,dp=1,ep=1")
    assert reshard.open_checkpoint(tmp_path / "one").spec_name == "megatron-mixtral-local"
    reshard.convert(tmp_path / "one", tmp_path / "back", to="tp=2,pp=1,dp=2,ep=2,etp=1")
    assert sorted(p.name for p in (tmp_path / "back" / it).iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    back = torch.load(tmp_path / "back" / it / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert (back["args"].expert_tensor_parallel_size, back["args"].tensor_model_parallel_size) == (1, 2)
    result = reshard.verify(tmp_path / "src", tmp_path / "back")
    assert result and result.compared > 0, result.differences
    jobs.load(tmp_path / "back", tmp_path / "dump-back", tp=2, pp=1, ep=2, dp=2, etp=1)
    # and at dp 1 (world 2: ep over the tp ranks), whose ranks hold what ranks 0 and 1 of the run held
    reshard.convert(tmp_path / "one", tmp_path / "dp1", to="tp=2,pp=1,dp=1,ep=2,etp=1")
    assert sorted(p.name for p in (tmp_path / "dp1" / it).iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    jobs.load(tmp_path / "dp1", tmp_path / "dump-dp1", tp=2, pp=1, ep=2, dp=1, etp=1)
    for where, r in [*(("dump-back", r) for r in range(4)), ("dump-dp1", 0), ("dump-dp1", 1)]:
        want = dumps[r]
        got = torch.load(tmp_path / where / f"rank{r}.pt", weights_only=False)
        assert got["coords"] == want["coords"] and got["params"].keys() == want["params"].keys()
        for name, value in want["params"].items():
            have = got["params"][name]
            if name in ("embedding.word_embeddings.weight", "output_layer.weight") and want["coords"]["tp"] == 1:
                real = S["vocab"] - value.shape[0]  # tp rank 1's rows inside the vocabulary; the rest pad it
                assert not have[real:].any()
                have, value = have[:real], value[:real]
            assert torch.equal(have, value), (r, name)


def test_expert_tensor_parallelism_the_torch_format_cannot_hold_is_refused_naming_the_args(tmp_path):
    """etp above tp (ranks of different etp rank would write one rank directory), and etp * ep not a multiple of tp
    (Megatron would save no rank directory for some tp ranks' dense weights), are refused before anything is
    written."""
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "a", to="tp=1,dp=4,ep=2", model="tiny-mixtral")
    with pytest.raises(CheckpointFormatError, match=r"expert_tensor_parallel_size=4 does not divide tensor_model_"
                                                    r"parallel_size=2: .* would write the same one"):
        reshard.convert(tmp_path / "a", tmp_path / "b", to="tp=2,dp=2,ep=1,etp=4")
    with pytest.raises(CheckpointFormatError, match=r"expert_tensor_parallel_size=1 times expert_model_parallel_size"
                                                    r"=1 is 1, not a multiple of tensor_model_parallel_size=2"):
        reshard.convert(tmp_path / "a", tmp_path / "c", to="tp=2,dp=2,ep=1,etp=1")
    with pytest.raises(CheckpointFormatError, match=r"expert_tensor_parallel_size=2 times expert_model_parallel_size"
                                                    r"=1 is 2, not a multiple of tensor_model_parallel_size=4"):
        reshard.convert(tmp_path / "a", tmp_path / "d", to="tp=4,dp=1,ep=1,etp=2")
    assert not any((tmp_path / n).exists() for n in "bcd")


@pytest.mark.parametrize("distopt", [False, True])
def test_an_etp_between_1_and_tp_keeps_each_rank_directory_s_etp_shard_and_round_trips_bit_exact(tmp_path, distopt):
    """tp=4, ep=2, etp=2 in the torch format: the rank directories of the ranks below etp * ep (tp rank g % 4, ep
    rank g // 2), each holding its dense tp shard and etp shard tp % 2 of its ep rank's experts (and with the
    distributed optimizer, the dense buffers in ep rank 0's and 1's files as their dense dp rank 0 writes them) ->
    tp=1 and back -> the same bytes for every tensor and state; and at tp=1 each expert equal to the etp shards
    side by side."""
    from reshard.fixtures import make_fixture

    zero = ",zero=1" if distopt else ""
    make_fixture(tmp_path / "a", to=f"tp=1,dp=2,ep=2{zero}", model="tiny-mixtral")
    reshard.convert(tmp_path / "a", tmp_path / "b", to=f"tp=4,dp=1,ep=2,etp=2{zero}")
    it = next(p for p in (tmp_path / "b").iterdir() if p.name.startswith("iter_"))
    assert sorted(p.name for p in it.iterdir()) == ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_02_001",
                                                    "mp_rank_03_001"]
    b = reshard.open_checkpoint(tmp_path / "b")
    assert b.spec_name.endswith("-etp" + ("-ep-distopt-torch" if distopt else ""))
    assert str(b.topology).endswith("etp=2" + zero)
    import torch

    def model(rank: str) -> dict:
        return torch.load(it / rank / "model_optim_rng.pt", weights_only=False)["model"]
    one = model("mp_rank_01_000")
    a = reshard.load(tmp_path / "a", to="tp=1", format="megatron", rank=0).state_dict()
    f = a["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].shape[1]
    for key, value in one.items():
        if ".linear_fc2.weight" in key and ".local_experts." in key:  # etp rank 1 of ep rank 0: the second half
            assert torch.equal(value, a[key][:, f // 2:]), key
    reshard.convert(tmp_path / "b", tmp_path / "c", to=f"tp=1,dp=2,ep=2{zero}")
    result = reshard.verify(tmp_path / "a", tmp_path / "c")
    assert result and result.compared > 0, result.differences
    result = reshard.verify(tmp_path / "a", tmp_path / "b")
    assert result and result.compared > 0, result.differences


@pytest.mark.interop
def test_real_torch_format_at_etp2_tp4_with_the_distributed_optimizer_converts_and_loads_in_megatron_core(tmp_path):
    """megatron-core at tp=4, ep=2, etp=2 (world 4; 4 query groups) with the distributed optimizer saves the torch
    format: four rank directories named by dense tp rank (mp_rank_00_000, 01_000, 02_001, 03_001), each with its
    etp shard (tp rank mod 2) of its ep rank's experts and a distrib_optim.pt -> Hugging Face, every expert equal
    to the run's etp shards side by side -> tp=1, ep=2, dp=2 and back at tp=4, ep=2, etp=2: the same rank
    directories, which megatron-core loads with every rank's weights, main params, Adam moments and steps equal to
    the saving run's."""
    require("megatron.core")
    from safetensors.torch import load_file

    import mcore_moe_jobs as jobs

    S = {**jobs.SIZES, "g": 4, "vocab": 400}  # at tp 4 every rank holds rows of the vocabulary (reshard's need)
    f = S["f"]
    run = {"groups": S["g"], "vocab": S["vocab"], "etp": 2}
    jobs.save(tmp_path / "src", tmp_path / "dump-src", tp=4, pp=1, ep=2, dp=1, distopt=True, **run)
    it = f"iter_{jobs.ITERATION:07d}"
    dirs = ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_02_001", "mp_rank_03_001"]
    assert sorted(p.name for p in (tmp_path / "src" / it).iterdir()) == dirs
    src = reshard.open_checkpoint(tmp_path / "src")
    assert src.spec_name == "megatron-mixtral-local-etp-ep-distopt-torch"
    assert str(src.topology) == "tp=4,pp=1,dp=1,ep=2,etp=2,zero=1"
    dumps = [torch.load(tmp_path / "dump-src" / f"rank{r}.pt", weights_only=False) for r in range(4)]
    reshard.convert(tmp_path / "src", tmp_path / "hf", format="hf")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    halves: dict[str, dict[int, torch.Tensor]] = {}
    for d in dumps:  # ep rank e's experts: etp shard k on the rank of tp rank 2 e + k
        for name, value in d["params"].items():
            if ".local_experts." in name:
                halves.setdefault(f"{d['coords']['ep']}.{name}", {})[d["coords"]["tp"] % 2] = value
    for key, parts in halves.items():
        e, name = key.split(".", 1)
        i, j = int(name.split(".")[2]), int(name.split("local_experts.")[1].split(".")[0])
        at = f"model.layers.{i}.block_sparse_moe.experts.{int(e) * 2 + j}."
        if ".linear_fc1." in name:  # each etp shard: its gate rows, then its up rows
            g = [parts[k][:f // 2] for k in (0, 1)], [parts[k][f // 2:] for k in (0, 1)]
            assert torch.equal(hf[at + "w1.weight"], torch.cat(g[0])) and torch.equal(hf[at + "w3.weight"],
                                                                                      torch.cat(g[1])), key
        else:
            assert torch.equal(hf[at + "w2.weight"], torch.cat([parts[0], parts[1]], 1)), key
    assert len(halves) == 2 * S["layers"] * S["experts"]
    reshard.convert(tmp_path / "src", tmp_path / "one", to="tp=1,pp=1,dp=2,ep=2,zero=1")
    reshard.convert(tmp_path / "one", tmp_path / "back", to="tp=4,pp=1,dp=1,ep=2,etp=2,zero=1")
    assert sorted(p.name for p in (tmp_path / "back" / it).iterdir()) == dirs
    jobs.load(tmp_path / "back", tmp_path / "dump-back", tp=4, pp=1, ep=2, dp=1, distopt=True, **run)
    assert_same_per_rank(tmp_path / "dump-back", tmp_path / "dump-src", 4)


@pytest.mark.interop
@pytest.mark.parametrize("sharding", ["dp_reshardable", "dp_zero_gather_scatter"])
def test_real_torch_dist_at_etp1_reads_every_expert_s_optimizer_state_and_resumes_at_tp1(tmp_path, sharding):
    """megatron-core at tp=2, ep=2, etp=1, dp=2 (world 4; bf16, buckets of 4000 elements) saves torch_dist with
    ``sharding`` state: the experts' optimizer (``chained_1.``) numbers its groups over etp * ep = 2 and holds whole
    experts -> every expert's fp32 main param and Adam moments as the run held them (Hugging Face's fused
    ``gate_up_proj`` / ``down_proj``); for a dp_reshardable source, -> dp_reshardable at the same layout (etp=1
    written: every optimizer key, chunk and bytes entry as megatron-core saved them), which megatron-core resumes
    with every rank's weights, main params and Adam moments equal to the run's, and at tp=2, dp=1, ep=2 (ep over
    the tp ranks), which megatron-core resumes with every weight and state equal; -> dp_reshardable at tp=1, ep=1,
    which megatron-core loads and steps on, and which holds what the source holds, every main param and moment."""
    require("megatron.core")
    import torch
    from test_megatron_moe import collect

    import mcore_dist_bucket_jobs
    import mcore_moe_jobs as jobs

    S = jobs.SIZES
    run = {"bf16": True, "bucket_size": 4000}
    if sharding == "dp_reshardable":
        jobs.save(tmp_path / "src", tmp_path / "dump-src", tp=2, pp=1, ep=2, dp=2, distopt=True, torch_dist=True,
                  etp=1, **run)
    else:
        mcore_dist_bucket_jobs.save(tmp_path / "src", tmp_path / "dump-src", 2, 2, sharding, ep=2, etp=1, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    assert sharding_type({}, read_metadata(ckpt)) == sharding
    mine = reshard.load(ckpt, to="dp=1", format="dcp", rank=0)
    held = {s: mine.state_dict(s) for s in ("master", "exp_avg", "exp_avg_sq")}
    want = collect(tmp_path / "dump-src", 1, 2, S, only=lambda n: ".local_experts." in n)
    assert {s for _, s in want} == {"value", "param", "exp_avg", "exp_avg_sq", "step"}
    for (name, state), value in want.items():
        if state in ("value", "step"):
            continue
        i, e = int(name.split(".")[2]), int(name.split("local_experts.")[1].split(".")[0])
        fused = "gate_up_proj" if ".linear_fc1." in name else "down_proj"
        key = f"model.layers.{i}.mlp.experts.{fused}"
        got = held["master" if state == "param" else state][f"model.{key}"]
        assert torch.equal(got[e].flatten(), value), (name, state)
    assert len(want) == S["layers"] * S["experts"] * 2 * 5

    if sharding == "dp_reshardable":
        # Written back at etp = 1 (tp 2, ep 2): megatron-core's own keys, chunks and bytes entries, and its resume
        reshard.convert(ckpt, tmp_path / "same", format="mcore-dist", to="tp=2,pp=1,dp=2,ep=2,etp=1,zero=1")
        real, ours = read_metadata(ckpt), read_metadata(tmp_path / "same")
        optim = {k for k in real.tensors if k.startswith("chained_")}
        assert optim == {k for k in ours.tensors if k.startswith("chained_")}
        for key in optim:
            assert sorted((c.offsets, c.sizes) for c in ours.tensors[key].chunks) == \
                sorted((c.offsets, c.sizes) for c in real.tensors[key].chunks), key
        entries = [k for k in real.byte_entries if k.startswith("chained_")]
        assert entries and all(_object(tmp_path / "same", ours, k) == _object(ckpt, real, k) for k in entries)
        jobs.load(tmp_path / "same", tmp_path / "dump-same", tp=2, pp=1, ep=2, dp=2, distopt=True, torch_dist=True,
                  etp=1, **run)
        assert_same_per_rank(tmp_path / "dump-same", tmp_path / "dump-src", 4)
        # ep 2 over a world of 2 (tp 2, dp 1): the experts' ranks are not tp's, and ep does not divide dp
        from test_mcore_dist_optim import gathered

        reshard.convert(tmp_path / "same", tmp_path / "dp1", format="mcore-dist", to="tp=2,dp=1,ep=2,etp=1,zero=1")
        jobs.load(tmp_path / "dp1", tmp_path / "dump-dp1", tp=2, pp=1, ep=2, dp=1, distopt=True, torch_dist=True,
                  etp=1, **run)
        whole = gathered(tmp_path / "dump-src", 1, S, experts=(1, S["experts"] // 2))
        resumed = gathered(tmp_path / "dump-dp1", 1, S, experts=(1, S["experts"] // 2))
        assert resumed.keys() == whole.keys() and {s for _, s in whole} >= {"param", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(resumed[k], v) for k, v in whole.items())

    reshard.convert(ckpt, tmp_path / "tp1", format="mcore-dist", to="tp=1,dp=1,ep=1,zero=1")
    jobs.load(tmp_path / "tp1", tmp_path / "dump-tp1", tp=1, pp=1, ep=1, dp=1, distopt=True, torch_dist=True, **run)
    resumed = reshard.load(tmp_path / "tp1", to="dp=1", format="dcp", rank=0)
    for state, tensors in held.items():
        again = resumed.state_dict(state)
        assert again.keys() == tensors.keys()
        assert all(torch.equal(again[k], v) for k, v in tensors.items()), state


def assert_same_per_rank(got_dir, want_dir, ranks: int) -> None:
    """Each rank's dump (``mcore_moe_jobs``: weights, and the main params and Adam moments of its shard) equal to
    the same rank's in another run at the same layout, but the vocabulary's padding rows (which reshard writes as
    zeros where the run kept what its optimizer made of them)."""
    import torch

    import mcore_moe_jobs as jobs

    S, v = jobs.SIZES, jobs.SIZES["vocab"]
    for r in range(ranks):
        got, want = (torch.load(d / f"rank{r}.pt", weights_only=False) for d in (got_dir, want_dir))
        assert got["coords"] == want["coords"] and got["params"].keys() == want["params"].keys()
        rows = want["params"]["embedding.word_embeddings.weight"].shape[0]
        real = max(0, min(rows, v - want["coords"]["tp"] * rows))  # this tp shard's rows inside the vocabulary

        def kept(name: str, start: int, t: torch.Tensor) -> torch.Tensor:
            if name not in ("embedding.word_embeddings.weight", "output_layer.weight") or t.dim() == 0:
                return t
            return t[:max(0, real * S["h"] - start)]
        for name, value in want["params"].items():
            assert torch.equal(kept(name, 0, got["params"][name].flatten()), kept(name, 0, value.flatten())), (r, name)
        assert got["states"].keys() == want["states"].keys()
        for name, states in want["states"].items():
            for k, (a, z, t) in states.items():
                ga, gz, gt = got["states"][name][k]
                assert (ga, gz) == (a, z) and torch.equal(kept(name, a, gt), kept(name, a, t)), (r, name, k)


def test_dp_reshardable_state_at_an_expert_tensor_parallelism_it_cannot_lay_out_is_not_written():
    """Refused by name before any bucket is laid out, never laid out at another etp silently: an etp other than tp
    at ep 1, and an etp other than tp in another rank order."""
    from reshard.core.topology import Topology
    from reshard.formats.megatron.dist_optim_target import bucket_target
    from reshard.models import get_family

    mixtral = get_family("mixtral")
    with pytest.raises(reshard.errors.TopologyError, match=r"etp\(1\) with tp\(2\) at ep\(1\): .* at ep > 1 only"):
        bucket_target(mixtral, {}, {}, Topology(tp=2, ep=1, etp=1, dp=1, zero=1))
    with pytest.raises(reshard.errors.TopologyError, match=r"etp\(2\) with tp\(4\) and order 'tp-cp-dp-ep-pp'"):
        bucket_target(mixtral, {}, {}, Topology(tp=4, ep=2, etp=2, dp=2, zero=1, order="tp-cp-dp-ep-pp"))


@pytest.mark.interop
def test_real_dp_reshardable_run_at_etp2_tp4_converts_and_resumes_at_tp1_and_at_etp2_dp2(tmp_path):
    """megatron-core at tp=4, ep=2, etp=2 (world 4; bf16; 4 query groups; buckets of 6000 elements) saves
    torch_dist with dp_reshardable state: the experts split over an expert tensor parallelism that is neither 1 nor
    tp, their buffers laid out as at tp = etp and numbered over etp * ep -> Hugging Face, every weight bit-exact;
    -> dp_reshardable at tp=1, ep=2, dp=2, and at the run's own etp 2 with dp 2 (world 8: every bucket cut anew
    over twice the ranks, the expert buffers over an expert data-parallel group of 2), which megatron-core
    resumes with every weight, main param, Adam moment and step equal to the run's. (Model space at such an etp needs nothing new: each expert's etp shards are
    chunks of the global tensor, read as at any other layout.)"""
    require("megatron.core")
    from safetensors.torch import load_file

    import mcore_moe_jobs as jobs
    import test_mcore_dist_moe
    from test_mcore_dist_optim import gathered

    S = {**jobs.SIZES, "g": 4, "vocab": 400}  # at tp 4 every rank holds rows of the vocabulary (reshard's need)
    run = {"bf16": True, "groups": S["g"], "bucket_size": 6000, "vocab": S["vocab"]}
    jobs.save(tmp_path / "src", tmp_path / "dump-src", tp=4, pp=1, ep=2, dp=1, distopt=True, torch_dist=True, etp=2,
              **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    assert sharding_type({}, read_metadata(ckpt)) == "dp_reshardable"
    experts = {k.split(".")[3] for k in read_metadata(ckpt).tensors if k.startswith("chained_1.")}
    assert experts == {f"dp_group_idx_{g}" for g in range(4)}  # etp 2 x ep 2
    assert any(".bucket_idx_1." in k for k in read_metadata(ckpt).tensors)
    want = gathered(tmp_path / "dump-src", 1, S, experts=(2, S["experts"] // 2))
    assert {s for _, s in want} == {"value", "param", "exp_avg", "exp_avg_sq", "step"}
    reshard.convert(ckpt, tmp_path / "hf", format="hf")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_mcore_dist_moe, "S", S)  # hf_of de-interleaves QKV with the run's 4 groups
        expected = test_mcore_dist_moe.hf_of(want, "mixtral")
    assert got.keys() == expected.keys()
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())

    reshard.convert(ckpt, tmp_path / "tp1", format="mcore-dist", to="tp=1,dp=2,ep=2,zero=1")
    args = torch.load(tmp_path / "tp1" / "common.pt", weights_only=False)["args"]  # the experts follow tp there
    assert (args.tensor_model_parallel_size, args.expert_tensor_parallel_size) == (1, 1)
    jobs.load(tmp_path / "tp1", tmp_path / "dump-tp1", tp=1, pp=1, ep=2, dp=2, distopt=True, torch_dist=True, **run)
    resumed = gathered(tmp_path / "dump-tp1", 1, S, experts=(1, S["experts"] // 2))
    assert resumed.keys() == want.keys()
    assert all(resumed[k].dtype == v.dtype and torch.equal(resumed[k], v) for k, v in want.items())

    reshard.convert(tmp_path / "tp1", tmp_path / "etp2", format="mcore-dist", to="tp=4,dp=2,ep=2,etp=2,zero=1")
    md = read_metadata(tmp_path / "etp2")
    assert {k.split(".")[3] for k in md.tensors if k.startswith("chained_1.")} == experts
    jobs.load(tmp_path / "etp2", tmp_path / "dump-etp2", tp=4, pp=1, ep=2, dp=2, distopt=True, torch_dist=True,
              etp=2, **run)
    resumed = gathered(tmp_path / "dump-etp2", 1, S, experts=(2, S["experts"] // 2))
    assert resumed.keys() == want.keys()
    assert all(resumed[k].dtype == v.dtype and torch.equal(resumed[k], v) for k, v in want.items())


def test_bucket_space_state_at_an_etp_that_is_no_positive_integer_is_refused_by_name():
    """The bucket formats lay experts out as at tp = etp, above or below tp; an etp that is no positive integer is
    refused, naming the args."""
    from pathlib import Path

    from reshard.formats.megatron.dist_optim import _expert_parallel
    from reshard.models import get_family

    args = {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 0, "tensor_model_parallel_size": 4}
    with pytest.raises(CheckpointFormatError, match=r"c/common.pt: args.expert_tensor_parallel_size is 0, not a "
                                                    r"positive integer"):
        _expert_parallel(args, get_family("mixtral"), Path("c/common.pt"))
    assert _expert_parallel({**args, "expert_tensor_parallel_size": 2}, get_family("mixtral"), Path("c")) == (2, 2)
    assert _expert_parallel({**args, "expert_tensor_parallel_size": 8}, get_family("mixtral"), Path("c")) == (2, 8)
    assert _expert_parallel({**args, "expert_tensor_parallel_size": 4}, get_family("mixtral"), Path("c")) == (2, None)


@pytest.mark.interop
@pytest.mark.parametrize("sharding", ["dp_reshardable", "dp_zero_gather_scatter"])
def test_real_run_with_etp_above_tp_converts_and_resumes(tmp_path, sharding):
    """megatron-core at tp=1, ep=2, etp=2, dp=4 (world 4; bf16; buckets of 4000 elements) saves ``sharding`` state:
    the experts split over more tensor-parallel ranks than the dense layers, their buffers laid out as at tp = 2.
    dp_reshardable -> Hugging Face, every weight bit-exact, and -> dp_reshardable at tp=2, dp=2 (etp = tp) and from
    there back at tp=1, etp=2, dp=4; dp_zero_gather_scatter -> dp_reshardable at its own layout. megatron-core
    resumes either with every weight, main param, Adam moment and step equal to the run's."""
    require("megatron.core")
    from safetensors.torch import load_file

    import mcore_dist_bucket_jobs
    import mcore_moe_jobs as jobs
    import test_mcore_dist_moe
    from test_mcore_dist_optim import gathered

    S = jobs.SIZES
    run = {"bf16": True, "bucket_size": 4000}
    mcore_dist_bucket_jobs.save(tmp_path / "src", tmp_path / "dump-src", 1, 4, sharding, ep=2, etp=2, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    assert sharding_type({}, read_metadata(ckpt)) == sharding
    want = gathered(tmp_path / "dump-src", 1, S, experts=(2, S["experts"] // 2))
    if sharding == "dp_reshardable":
        experts = {k.split(".")[3] for k in read_metadata(ckpt).tensors if k.startswith("chained_1.")}
        assert experts == {f"dp_group_idx_{g}" for g in range(4)}  # etp 2 x ep 2, at tp 1
        reshard.convert(ckpt, tmp_path / "hf", format="hf")
        got = load_file(tmp_path / "hf" / "model.safetensors")
        expected = test_mcore_dist_moe.hf_of(want, "mixtral")
        assert got.keys() == expected.keys()
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items())
        reshard.convert(ckpt, tmp_path / "tp2", format="mcore-dist", to="tp=2,dp=2,ep=2,zero=1")
        ckpt = tmp_path / "tp2"
    reshard.convert(ckpt, tmp_path / "back", format="mcore-dist", to="tp=1,dp=4,ep=2,etp=2,zero=1")
    jobs.load(tmp_path / "back", tmp_path / "dump-back", tp=1, pp=1, ep=2, dp=4, distopt=True, torch_dist=True,
              etp=2, **run)
    resumed = gathered(tmp_path / "dump-back", 1, S, experts=(2, S["experts"] // 2))
    assert resumed.keys() == want.keys() and {s for _, s in want} >= {"param", "exp_avg", "exp_avg_sq", "step"}
    assert all(resumed[k].dtype == v.dtype and torch.equal(resumed[k], v) for k, v in want.items())
