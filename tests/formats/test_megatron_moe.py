"""Megatron mixture-of-experts checkpoints: experts over ep, the dense + expert ChainedOptimizer,
and the layout real megatron-core writes and loads."""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import pytest
from conftest import require

import reshard
from reshard.errors import CheckpointFormatError
from reshard.io.torchfile import read_torch_file


def rank_file(ckpt: Path, name: str) -> dict:
    return read_torch_file(next(ckpt.glob(f"iter_*/{name}/model_optim_rng.pt")))


def test_experts_split_over_ep_into_their_own_rank_files_with_local_numbers(tmp_path):
    """ep=2 at pp=2: mp_rank_TT_PPP_EEE; rank e holds experts 2e, 2e+1 as local_experts.0/1, the dense
    weights on every ep rank; the plain optimizer is [dense, expert] with its own param groups."""
    from reshard.fixtures import make_fixture

    files = make_fixture(tmp_path / "a", to="tp=2,pp=2,dp=2,ep=2", model="tiny-mixtral")
    dirs = sorted({f.parent.name for f in files if f.name == "model_optim_rng.pt"})
    assert dirs == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    a = reshard.open_checkpoint(tmp_path / "a")
    assert a.spec_name == "megatron-mixtral" and (a.topology.ep, a.topology.dp) == (2, 2)
    one = tmp_path / "one"
    reshard.convert(tmp_path / "a", one, to="tp=1,pp=1,dp=1,ep=1")
    whole = rank_file(one, "mp_rank_00")["model"]
    for e in range(2):
        part = rank_file(tmp_path / "a", f"mp_rank_01_001_{e:03d}")
        assert part["args"].expert_model_parallel_size == 2
        # model_parallel_cuda_manual_seed: expert-parallel-rng = seed + 1024 + 100 * ep_rank + etp_rank
        tracker = part["rng_state"][0]["rng_tracker_states"]["expert-parallel-rng"]
        seed = 1234 + 100 * 1  # pp rank 1
        assert struct.unpack("<Qq", reshard_bytes(tracker)[:16])[0] == seed + 1024 + 100 * e + 1
        model = part["model"]
        # stage 1 holds layers 2 and 3 as local layers 0 and 1; tp rank 1 holds the second half of gate and up
        for j in range(2):
            fc2 = reshard_tensor(model, f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc2.weight")
            full = reshard_tensor(whole, f"decoder.layers.3.mlp.experts.local_experts.{2 * e + j}.linear_fc2.weight")
            assert (fc2 == full[:, full.shape[1] // 2:]).all()
        assert (reshard_tensor(model, "decoder.final_layernorm.weight") ==
                reshard_tensor(whole, "decoder.final_layernorm.weight")).all()
        dense, expert = part["optimizer"]
        assert [g["is_expert_parallel"] for g in dense["optimizer"]["param_groups"]] == [False, False]
        groups = expert["optimizer"]["param_groups"]
        assert [(g["is_expert_parallel"], g["wd_mult"]) for g in groups] == [(True, 1.0)]
        n_experts = sum(1 for k in model if ".local_experts." in k and not k.endswith("_extra_state"))
        assert groups[0]["params"] == list(range(n_experts)) and len(expert["fp32_from_fp16_params"][0]) == n_experts
        # the expert optimizer's state index j belongs to the j-th expert parameter in registration order
        keys = [k for k in model if ".local_experts." in k]
        m = expert["fp32_from_fp16_params"][0][3]
        assert tuple(m.shape) == tuple(model[keys[3]].shape)
    assert not isinstance(rank_file(one, "mp_rank_00")["optimizer"], list)  # ep=1: one optimizer
    # inside a job: global rank 3 of tp=2,pp=2,dp=2,ep=2 is tp 1, ep 1 of stage 0 (tp-cp-ep-dp-pp order)
    mine = reshard.load(tmp_path / "a", to="tp=2,pp=2,dp=2,ep=2", rank=3).state_dict("exp_avg")
    stored = rank_file(tmp_path / "a", "mp_rank_01_000_001")
    expert = stored["optimizer"][1]
    key = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    keys = [k for k in stored["model"] if ".local_experts." in k and not k.endswith("_extra_state")]
    assert (mine[key].numpy() == reshard_tensor(expert["optimizer"]["state"][keys.index(key)], "exp_avg")).all()
    for to in ("tp=1,pp=2,dp=4,ep=4", "tp=2,pp=1,dp=2,ep=1"):
        out = tmp_path / re.sub(r"\W", "", to)
        reshard.convert(tmp_path / "a", out, to=to)
        result = reshard.verify(tmp_path / "a", out)
        assert result and result.compared > 0, result.differences
    back = tmp_path / "back"
    reshard.convert(tmp_path / "tp1pp2dp4ep4", back, to="tp=2,pp=2,dp=2,ep=2")
    for f in (tmp_path / "a").rglob("*.pt"):  # through ep=4 and back: byte for byte the same files
        assert f.read_bytes() == (back / f.relative_to(tmp_path / "a")).read_bytes(), f


def test_distributed_optimizer_keeps_experts_in_a_buffer_of_their_own_at_ep_above_1(tmp_path):
    """zero=1: at ep=2 distrib_optim.pt is [dense, expert] in the ep rank 0 file and [None, expert] in the
    others, the expert buffer holding only expert params; at ep=1 one buffer holds everything. Through ep=4,
    ep=1 and the plain optimizer and back, every state is kept and the files come back byte for byte."""
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "a", to="tp=2,pp=2,dp=4,ep=2,zero=1", model="tiny-mixtral")
    a = reshard.open_checkpoint(tmp_path / "a")
    assert a.spec_name == "megatron-mixtral-ep-distopt-torch"
    first = read_torch_file(next((tmp_path / "a").glob("iter_*/mp_rank_00_000_000/distrib_optim.pt")))
    other = read_torch_file(next((tmp_path / "a").glob("iter_*/mp_rank_00_000_001/distrib_optim.pt")))
    assert isinstance(first, list) and first[0] is not None and other[0] is None
    model = rank_file(tmp_path / "a", "mp_rank_00_000_001")["model"]
    experts = sum(math.prod(v.shape) for k, v in model.items() if ".local_experts." in k and hasattr(v, "shape"))
    (pair, buf), = other[1][0].items()
    assert buf["numel_unpadded"] >= experts and buf["numel_unpadded"] < experts + 64 * 8  # 64-aligned starts
    assert [g["is_expert_parallel"] for g in rank_file(tmp_path / "a", "mp_rank_00_000_001")["optimizer"][1]
            ["optimizer"]["param_groups"]] == [True]
    for to, spec in (("tp=1,pp=2,dp=4,ep=4,zero=1", "megatron-mixtral-ep-distopt-torch"),
                     ("tp=2,pp=1,dp=2,ep=1,zero=1", "megatron-mixtral-distopt-torch"),
                     ("tp=1,pp=2,dp=2,ep=2,zero=0", "megatron-mixtral")):
        out = tmp_path / re.sub(r"\W", "", to)
        reshard.convert(tmp_path / "a", out, to=to)
        assert reshard.open_checkpoint(out).spec_name == spec
        result = reshard.verify(tmp_path / "a", out)
        assert result and result.compared > 0, result.differences
    single = read_torch_file(next((tmp_path / "tp2pp1dp2ep1zero1").glob("iter_*/mp_rank_01/distrib_optim.pt")))
    assert isinstance(single, dict)  # ep=1: experts are ordinary params of the one DistributedOptimizer
    for via in ("tp1pp2dp4ep4zero1", "tp2pp1dp2ep1zero1", "tp1pp2dp2ep2zero0"):
        back = tmp_path / f"back-{via}"
        reshard.convert(tmp_path / via, back, to="tp=2,pp=2,dp=4,ep=2,zero=1")
        for f in (tmp_path / "a").rglob("*.pt"):
            assert f.read_bytes() == (back / f.relative_to(tmp_path / "a")).read_bytes(), (via, f)
    with pytest.raises(CheckpointFormatError, match="at ep=1 Megatron keeps them in the dense buffer"):
        reshard.convert(tmp_path / "a", tmp_path / "x", to="tp=1,dp=2,ep=1,zero=1",
                        spec="megatron-mixtral-ep-distopt-torch")


def reshard_bytes(ref) -> bytes:
    with open(ref.path, "rb") as f:
        f.seek(ref.data_offset)
        return f.read(int(ref.storage_nbytes))


def reshard_tensor(sd: dict, key: str):
    """A model tensor's values from a read_torch_file tree (uint16 bits for bf16)."""
    import numpy as np

    ref = sd[key]
    dtype = {"bfloat16": np.uint16, "float32": np.float32}[ref.dtype]
    n = int(np.prod(ref.shape))
    with open(ref.path, "rb") as f:
        f.seek(ref.data_offset)
        return np.frombuffer(f.read(n * np.dtype(dtype).itemsize), dtype=dtype).reshape(ref.shape)


def test_experts_that_do_not_divide_over_ep_and_dense_models_at_ep_are_refused(tmp_path):
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "a", to="tp=1,pp=1,dp=2,ep=2", model="tiny-mixtral")
    with pytest.raises(reshard.ReshardError, match=r"local_experts.*: e\(4\) is not divisible by ep\(8\)"):
        reshard.convert(tmp_path / "a", tmp_path / "b", to="tp=1,dp=8,ep=8")
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").rglob("*.pt"))
    make_fixture(tmp_path / "dense", to="tp=1")
    with pytest.raises(CheckpointFormatError, match="ep > 1 needs a mixture-of-experts spec"):
        reshard.convert(tmp_path / "dense", tmp_path / "c", to="tp=1,dp=2,ep=2")
    with pytest.raises(CheckpointFormatError, match="at ep=2 Megatron gives them an optimizer of their own"):
        reshard.convert(tmp_path / "a", tmp_path / "d", to="tp=1,dp=2,ep=2,zero=1", spec="megatron-mixtral-distopt-torch")


def global_names(dump: dict, layers: int, experts: int, pp: int, ep: int) -> dict[str, str]:
    """Each dumped parameter's name with global layer and expert numbers, from megatron-core's own coordinates."""
    c = dump["coords"]
    per_stage, local = layers // pp, experts // ep

    def rename(name: str) -> str:
        name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{c['pp'] * per_stage + int(m.group(1))}.",
                      name)
        return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{c['ep'] * local + int(m.group(1))}.", name)
    return {n: rename(n) for n in dump["params"]}


def collect(dump_dir: Path, pp: int, ep: int, S: dict, only=None) -> dict[tuple[str, str], object]:
    """(global name, value or optimizer state) -> tensor over every rank's dump, optimizer states flattened and
    assembled from the ranges each rank holds; replicas must agree and every element must be held. ``only``: the
    global names to collect (a predicate), where tensor-parallel shards of the others would not agree."""
    import torch

    out: dict[tuple[str, str], torch.Tensor] = {}
    held: dict[tuple[str, str], torch.Tensor] = {}

    def put(key, start, value, target):
        have = out.setdefault(key, target)
        seen = held.setdefault(key, torch.zeros(have.shape, dtype=torch.bool))
        end = start + value.numel()
        if seen[start:end].any():
            assert torch.equal(have[start:end][seen[start:end]], value[seen[start:end]]), key
        have[start:end], seen[start:end] = value, True

    for f in sorted(dump_dir.glob("rank*.pt")):
        d = torch.load(f, weights_only=False)
        names = global_names(d, S["layers"], S["experts"], pp, ep)
        for n, v in d["params"].items():
            if only is not None and not only(names[n]):
                continue
            put((names[n], "value"), 0, v.flatten(), torch.empty(v.numel(), dtype=v.dtype))
            for k, (a, z, t) in d["states"].get(n, {}).items():
                if t.dim() == 0:
                    put((names[n], k), 0, t.reshape(1), torch.empty(1, dtype=t.dtype))
                else:
                    put((names[n], k), a, t, torch.empty(v.numel(), dtype=t.dtype))
    assert all(h.all() for h in held.values()), [k for k, h in held.items() if not h.all()][:3]
    return out


@pytest.mark.interop
@pytest.mark.parametrize("distopt", [False, True], ids=["plain-optimizer", "distributed-optimizer"])
def test_real_megatron_core_moe_checkpoint_changes_ep_and_pp_and_loads_back_into_megatron_core(tmp_path, distopt):
    """megatron-core at tp=1, pp=2, ep=2 (its ChainedOptimizer of a dense and an expert optimizer after one
    Adam step; with the distributed optimizer, distrib_optim.pt from its own save_parameter_state) -> ep=4,
    pp=1 and (distributed optimizer) -> ep=1 (one optimizer), each loaded strictly by megatron-core built at that layout: every weight
    and optimizer state equal to the source's under global layer and expert numbers; a step then runs."""
    require("megatron.core")
    import torch

    import mcore_moe_jobs as jobs

    S = jobs.SIZES
    jobs.save(tmp_path / "src", tmp_path / "dump-src", tp=1, pp=2, ep=2, dp=2, distopt=distopt)
    src = reshard.open_checkpoint(tmp_path / "src")
    assert src.spec_name == ("megatron-mixtral-local-ep-distopt-torch" if distopt else "megatron-mixtral-local")
    assert (src.topology.pp, src.topology.ep, src.topology.zero) == (2, 2, int(distopt))
    assert isinstance(rank_file(tmp_path / "src", "mp_rank_00_001_001")["optimizer"], list)  # [dense, expert]
    want = collect(tmp_path / "dump-src", 2, 2, S)
    assert {k for _, k in want} == {"value", "exp_avg", "exp_avg_sq", "step"} | ({"param"} if distopt else set())
    targets = [("tp=1,pp=1,dp=4,ep=4", (1, 4, 4)), ("tp=1,pp=2,dp=2,ep=1", (2, 1, 2))]
    for to, (pp, ep, dp) in targets if distopt else targets[:1]:  # ep 1's single optimizer: once is enough
        out = tmp_path / re.sub(r"\W", "", to)
        reshard.convert(tmp_path / "src", out, to=to)
        assert reshard.open_checkpoint(out).topology.zero == int(distopt)
        dump = tmp_path / f"dump-{out.name}"
        jobs.load(out, dump, tp=1, pp=pp, ep=ep, dp=dp, distopt=distopt)
        got = collect(dump, pp, ep, S)
        assert got.keys() == want.keys(), to
        for (name, state), value in want.items():
            have = got[(name, state)]
            if name in ("embedding.word_embeddings.weight", "output_layer.weight") and state != "step":
                # Rows past the vocabulary pad it to a multiple of 128 * tp: written as zeros (--vocab-pad)
                rows = S["vocab"] * S["h"]
                assert not have[rows:].any()
                have, value = have[:rows], value[:rows]
            assert have.dtype == value.dtype and torch.equal(have, value), (to, name, state)
