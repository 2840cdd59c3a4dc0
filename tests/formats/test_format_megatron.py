"""The megatron torch format: rank files as Megatron's save_checkpoint writes them, read back item by item.

Every check compares against an independent numpy construction of Megatron's state
dicts (``megatron_state_dicts``: the QKV group interleave, SwiGLU [gate; up], the padded
vocab, stage-local layer numbers) or against files written by ``torch.save`` itself.
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import logical_values

from reshard.execution.arrays import gather, scatter
from reshard.formats.specs import layout_spec
from reshard.errors import CheckpointFormatError
from reshard.execution.executor import ByteReader, PlanFill
from reshard.formats.base import Source, itemsize
from reshard.formats.megatron import FORMAT, OptimizerKind, SmallTensor, megatron_args, write_fixture_extra
from reshard.core.resolve import resolve
from reshard.core.planner import plan
from reshard.core.topology import Topology, parse_topology
from reshard.io.torchfile import TorchDtype
from reshard.models import FAMILIES

SIZES = {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "vocab_div": 8, "layers": 4}
STATES = ("param", "master", "exp_avg", "exp_avg_sq")
H, G, HD, F, V, L = 16, 2, 4, 24, 100, 4


# --- an independent construction of Megatron's state dicts -------------------------------


def padded_vocab(tp: int) -> int:
    return -(-V // (8 * tp)) * 8 * tp


def layer_places(pp: int, vpp: int, stages: tuple[int, ...] | None = None) -> dict[int, tuple[int, int, int]]:
    """Global layer -> (stage, chunk, local): virtual stage v = chunk * pp + stage, filled in order."""
    stages = stages or (L // (pp * vpp),) * (pp * vpp)
    out, g = {}, 0
    for v, n in enumerate(stages):
        for j in range(n):
            out[g] = (v % pp, v // pp, j)
            g += 1
    return out


def megatron_state_dicts(values: dict, state: str, tp: int, pp: int, vpp: int = 1, tied: bool = False,
                         stages: tuple[int, ...] | None = None) -> dict[tuple[int, int, int], OrderedDict]:
    """Per (tp, pp, chunk), the state dict Megatron-core holds, in its registration order."""
    def val(name):
        return values[(name, state)]

    out: dict[tuple[int, int, int], OrderedDict] = {}
    places = layer_places(pp, vpp, stages)
    for t in range(tp):
        rows = padded_vocab(tp) // tp
        def padded(name):  # vocab rows padded with zeros to a multiple of vocab_div * tp
            return np.concatenate([val(name), np.zeros((padded_vocab(tp) - V, H), val(name).dtype)])

        emb = padded("model.embed_tokens.weight")
        head = padded("model.embed_tokens.weight" if tied else "lm_head.weight")
        for p in range(pp):
            for c in range(vpp):
                sd = OrderedDict()
                if p == 0 and c == 0:
                    sd["embedding.word_embeddings.weight"] = emb[t * rows:(t + 1) * rows]
                for g_layer, (s, cc, j) in places.items():
                    if (s, cc) != (p, c):
                        continue
                    pre = f"model.layers.{g_layer}."
                    q = val(pre + "self_attn.q_proj.weight").reshape(G, -1, H)
                    k = val(pre + "self_attn.k_proj.weight").reshape(G, HD, H)
                    v = val(pre + "self_attn.v_proj.weight").reshape(G, HD, H)
                    per = G // tp
                    qkv = np.concatenate([q, k, v], axis=1)[t * per:(t + 1) * per].reshape(-1, H)
                    fs = F // tp
                    fc1 = np.concatenate([val(pre + "mlp.gate_proj.weight")[t * fs:(t + 1) * fs],
                                          val(pre + "mlp.up_proj.weight")[t * fs:(t + 1) * fs]])
                    cols = 4 * HD // tp
                    d = f"decoder.layers.{j}."
                    o = val(pre + "self_attn.o_proj.weight")
                    sd[d + "self_attention.linear_proj.weight"] = o[:, t * cols:(t + 1) * cols]
                    sd[d + "self_attention.linear_qkv.layer_norm_weight"] = val(pre + "input_layernorm.weight")
                    sd[d + "self_attention.linear_qkv.weight"] = qkv
                    sd[d + "mlp.linear_fc1.layer_norm_weight"] = val(pre + "post_attention_layernorm.weight")
                    sd[d + "mlp.linear_fc1.weight"] = fc1
                    sd[d + "mlp.linear_fc2.weight"] = val(pre + "mlp.down_proj.weight")[:, t * fs:(t + 1) * fs]
                if p == pp - 1 and c == vpp - 1:
                    sd["decoder.final_layernorm.weight"] = val("model.norm.weight")
                    if not tied or pp * vpp > 1:
                        sd["output_layer.weight"] = head[t * rows:(t + 1) * rows]
                out[(t, p, c)] = sd
    return out


def coalesced(sd: OrderedDict, bucket_size: int = 0, dp: int = 2) -> np.ndarray:
    """distrib_optim.pt's buffer for one model chunk (MEGATRON-DISTOPT.md section 4).

    Params in reverse registration order, each start 64-aligned; a bucket closes once it
    holds ``bucket_size`` elements and the next starts at a multiple of lcm(dp, 128);
    the buckets' unpadded ranges are concatenated.
    """
    pad = np.lcm(dp, 128)
    pos = start = done = 0  # buffer position, bucket start, coalesced length of closed buckets
    pieces = []
    for key in reversed(sd):
        pos = -(-pos // 64) * 64
        pieces.append((done + pos - start, sd[key].ravel()))
        pos += sd[key].size
        if bucket_size and pos - start >= bucket_size:
            done += pos - start
            start = pos = -(-pos // pad) * pad
    out = np.zeros(done + pos - start, np.float32)
    for at, flat in pieces:
        out[at:at + flat.size] = flat
    return out


# --- writing through the format ------------------------------------------------------------


def fixture_source(states=STATES, tied=False) -> Source:
    """The model unsharded, as a source of another format (Hugging Face names; tied: no lm_head)."""
    name = "hf-llama-tied" if tied else "hf-llama"
    spec = layout_spec(name)
    layout = resolve(spec, Topology(), SIZES, states={"model": states})
    return Source(format="fixture", path=Path(), spec_name=name, spec=spec, topology=Topology(),
                  sizes=dict(SIZES), layout=layout, where={})


def bf16_values(states=STATES, tied=False) -> dict:
    """conftest's position-dependent values; weights as (distinct) bf16 bit patterns."""
    values = logical_values(fixture_source(states, tied).layout, states)
    for key, arr in values.items():
        if key[1] == "param":
            values[key] = (arr.astype(np.int64) % 65521).astype(np.uint16)
    return values


def write(tmp_path: Path, topo: str, *, tied=False, states=STATES, values=None, dtypes=None):
    """Write a checkpoint through FORMAT.write with fill() reading scattered in-memory items."""
    source = fixture_source(states, tied)
    target = FORMAT.target(source, parse_topology(topo))
    values = values if values is not None else bf16_values(states, tied)
    default = {"param": "bfloat16"} | dict(dtypes or {})
    target.dtypes = {it: default.get(it.state, "float32") for it in target.layout.items}
    items = scatter(target.layout, values)

    def fill(item, lo, hi):
        return memoryview(items[item][lo:hi]).cast("B")

    files = FORMAT.write(target, tmp_path, fill)
    return target, items, values, files


def read_items(source: Source) -> dict:
    """Every located item's bytes, as arrays of its dtype's width."""
    out = {}
    for it, loc in source.where.items():
        info = source.layout.items[it]
        width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize(loc.dtype)]
        with loc.path.open("rb") as f:
            f.seek(loc.offset)
            out[it] = np.frombuffer(f.read(info.numel * itemsize(loc.dtype)), dtype=width).copy()
    return out


TOPOLOGIES = [
    ("tp=2,pp=2", False),
    ("tp=2,pp=2,vpp=2", False),
    ("tp=2,pp=2", True),
    ("tp=1,pp=1", True),
    ("tp=2,pp=2,dp=2,zero=1", False),
    ("tp=1,pp=2,vpp=2,dp=2,zero=1", True),
    ("tp=2,pp=3,stages=1+2+1", False),
]


@pytest.mark.parametrize(("topo", "tied"), TOPOLOGIES, ids=[f"{t}{'-tied' if tied else ''}" for t, tied in TOPOLOGIES])
def test_open_locates_every_written_item_byte_for_byte(tmp_path, topo, tied):
    target, items, _, _ = write(tmp_path, topo, tied=tied)
    source = FORMAT.open(tmp_path)
    assert source.topology == target.topology
    assert source.spec_name == target.spec_name
    assert set(source.where) == {it for it, info in target.layout.items.items() if info.mapped}
    got = read_items(source)
    for it, arr in got.items():
        assert arr.tobytes() == items[it].tobytes(), it


def test_spec_is_chosen_from_args(tmp_path):
    expected = {("tp=2,pp=2", False): "megatron-llama", ("tp=2,pp=2", True): "megatron-llama-tied",
                ("tp=2,pp=2,dp=2,zero=1", False): "megatron-llama-distopt-torch",
                ("tp=2,pp=2,dp=2,zero=1", True): "megatron-llama-tied-distopt-torch"}
    for (topo, tied), name in expected.items():
        out = tmp_path / f"{name}"
        out.mkdir()
        write(out, topo, tied=tied)
        assert FORMAT.open(out).spec_name == name


# --- what torch.load sees ------------------------------------------------------------------

def _torch():
    import torch

    return torch


def as_numpy(t) -> np.ndarray:
    """A tensor's raw values: bf16 as its uint16 bit patterns."""
    torch = _torch()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


@pytest.mark.parametrize(("topo", "tied"), [("tp=2,pp=2", False), ("tp=2,pp=2,vpp=2", False), ("tp=2,pp=2", True)])
def test_torch_load_sees_megatrons_state_dicts(tmp_path, topo, tied):
    torch = _torch()
    target, _, values, files = write(tmp_path, topo, tied=tied)
    t_ = parse_topology(topo)
    weights = megatron_state_dicts(values, "param", t_.tp, t_.pp, t_.vpp, tied)
    masters = megatron_state_dicts(values, "master", t_.tp, t_.pp, t_.vpp, tied)
    exp_avg = megatron_state_dicts(values, "exp_avg", t_.tp, t_.pp, t_.vpp, tied)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "0"
    for p in range(t_.pp):
        for t in range(t_.tp):
            name = f"mp_rank_{t:02d}_{p:03d}"
            sd = torch.load(tmp_path / "iter_0000000" / name / "model_optim_rng.pt", weights_only=False)
            models = ["model"] if t_.vpp == 1 else [f"model{c}" for c in range(t_.vpp)]
            assert list(sd) == ["args", "checkpoint_version", "iteration", *models, "optimizer", "opt_param_scheduler",
                                "rng_state", "num_floating_point_operations_so_far"]
            args = sd["args"]
            assert isinstance(args, argparse.Namespace)
            assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (t_.tp, t_.pp)
            assert args.padded_vocab_size == padded_vocab(t_.tp)
            assert args.untie_embeddings_and_output_weights == (not tied)
            assert args.virtual_pipeline_model_parallel_size == (t_.vpp if t_.vpp > 1 else None)
            assert sd["checkpoint_version"] == 3.0 and sd["iteration"] == 0
            params = []  # named_parameters order over the model chunks
            for c, m in enumerate(models):
                assert type(sd[m]) is OrderedDict
                want = weights[(t, p, c)]
                assert list(sd[m]) == list(want)
                for key, arr in want.items():
                    assert sd[m][key].dtype == torch.bfloat16
                    np.testing.assert_array_equal(as_numpy(sd[m][key]), arr, err_msg=key)
                    params.append((c, key))
            # Float16OptimizerWithFloat16Params.state_dict: the torch optimizer's dict, then the fp32 main params.
            opt = sd["optimizer"]
            assert list(opt) == ["optimizer", "fp32_from_fp16_params"]
            groups = opt["optimizer"]["param_groups"]
            assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
            wd = [x for x in params if weights[(t, p, x[0])][x[1]].ndim > 1]
            no_wd = [x for x in params if weights[(t, p, x[0])][x[1]].ndim == 1]
            assert groups[0]["params"] == list(range(len(wd)))
            assert groups[1]["params"] == list(range(len(wd), len(params)))
            assert list(groups[0])[-1] == "params"  # torch's packing puts 'params' last
            for g, members in enumerate((wd, no_wd)):
                for i, (c, key) in enumerate(members):
                    np.testing.assert_array_equal(opt["fp32_from_fp16_params"][g][i].numpy(), masters[(t, p, c)][key])
                    st = opt["optimizer"]["state"][groups[g]["params"][i]]
                    assert list(st) == ["step", "exp_avg", "exp_avg_sq"] and st["step"].shape == ()
                    np.testing.assert_array_equal(st["exp_avg"].numpy(), exp_avg[(t, p, c)][key], err_msg=key)
            rng = sd["rng_state"]
            assert isinstance(rng, list) and len(rng) == 1
            assert list(rng[0]) == ["random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
                                    "rng_tracker_states"]
            assert set(sd["opt_param_scheduler"]) >= {"max_lr", "num_steps", "lr_decay_style", "min_lr"}


def test_torch_load_sees_the_coalesced_distributed_optimizer_buffers(tmp_path):
    torch = _torch()
    _, _, values, files = write(tmp_path, "tp=2,pp=2,dp=2,zero=1")
    weights = megatron_state_dicts(values, "param", 2, 2)
    for name, state in (("param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        local = megatron_state_dicts(values, state, 2, 2)
        for t in range(2):
            for p in range(2):
                rank = tmp_path / "iter_0000000" / f"mp_rank_{t:02d}_{p:03d}"
                sd = torch.load(rank / "model_optim_rng.pt", weights_only=False)
                assert list(sd["model"]) == list(weights[(t, p, 0)])
                assert list(sd["optimizer"]) == ["optimizer"] and list(sd["optimizer"]["optimizer"]) == ["param_groups"]
                assert all("params" not in g and "step" in g for g in sd["optimizer"]["optimizer"]["param_groups"])
                assert sd["args"].use_distributed_optimizer and sd["args"].data_parallel_size == 2
                d = torch.load(rank / "distrib_optim.pt", weights_only=False)
                assert list(d) == ["buckets_coalesced", 0] and d["buckets_coalesced"] is True
                assert list(d[0]) == [(torch.bfloat16, torch.float32)]
                buf = d[0][(torch.bfloat16, torch.float32)]
                assert list(buf) == ["param", "exp_avg", "exp_avg_sq", "numel_unpadded"]
                want = coalesced(local[(t, p, 0)])
                assert buf["numel_unpadded"] == want.size
                np.testing.assert_array_equal(buf[name].numpy(), want)


def test_bucketed_distributed_optimizer_buckets_only_the_first_stage(tmp_path):
    # --overlap-grad-reduce: DDP buckets pp rank 0's first model chunk only; other stages are one bucket.
    # 590 elements close a bucket right after a 16-element layernorm, so the 48-element alignment gap
    # after it is bucket-end padding, which coalescing drops.
    torch = _torch()
    topo = parse_topology("tp=2,pp=2,dp=2,zero=1")
    state = write_fixture_extra(SIZES, topo)
    state.args.update(overlap_grad_reduce=True, ddp_bucket_size=590)
    source = replace(fixture_source(), format="megatron", topology=topo, extra={"megatron": state})
    target = FORMAT.target(source, topo)
    values = bf16_values()
    target.dtypes = {it: "bfloat16" if it.state == "param" else "float32" for it in target.layout.items}
    items = scatter(target.layout, values)
    FORMAT.write(target, tmp_path, lambda it, lo, hi: memoryview(items[it][lo:hi]).cast("B"))
    local = megatron_state_dicts(values, "exp_avg", 2, 2)
    for t in range(2):
        for p in range(2):
            rank = tmp_path / "iter_0000000" / f"mp_rank_{t:02d}_{p:03d}"
            d = torch.load(rank / "distrib_optim.pt", weights_only=False)
            got = d[0][(torch.bfloat16, torch.float32)]["exp_avg"].numpy()
            want = coalesced(local[(t, p, 0)], bucket_size=590 if p == 0 else 0)
            np.testing.assert_array_equal(got, want)
            assert p != 0 or got.size < coalesced(local[(t, p, 0)]).size  # bucket boundaries dropped alignment gaps
    reopened = FORMAT.open(tmp_path)
    assert reopened.sizes["bucket_size"] == 590
    for it, arr in read_items(reopened).items():
        assert arr.tobytes() == items[it].tobytes(), it


def test_args_describe_the_target_pipeline(tmp_path):
    sizes = dict(SIZES)
    a = megatron_args(sizes, parse_topology("tp=2,pp=2,vpp=2,dp=3"))
    assert (a["virtual_pipeline_model_parallel_size"], a["num_layers_per_virtual_pipeline_stage"]) == (2, 1)
    assert (a["world_size"], a["data_parallel_size"], a["padded_vocab_size"]) == (12, 3, 112)
    a = megatron_args(sizes, parse_topology("tp=1,pp=3,stages=1+2+1"))
    assert (a["decoder_first_pipeline_num_layers"], a["decoder_last_pipeline_num_layers"]) == (1, 1)
    assert a["padded_vocab_size"] == 104 and a["virtual_pipeline_model_parallel_size"] is None
    a = megatron_args(sizes, parse_topology("pp=2,vpp=2,stages=0+2+1+1"))
    assert a["pipeline_model_parallel_layout"] == "E|tt|t|tL"
    assert parse_topology("pp=2,layout=" + a["pipeline_model_parallel_layout"]).stages == (0, 2, 1, 1)


def test_fixture_extra_is_a_fresh_run_of_megatron(tmp_path):
    torch = _torch()
    state = write_fixture_extra(SIZES, Topology(tp=2, pp=2), iteration=7)
    assert state.args["padded_vocab_size"] == 112 and state.iteration == 7
    rng = state.rng_state[(1, 1, 0)][0]
    seed = 1234 + 100  # _set_random_seed: seed + 100 * pp_rank
    assert rng["random_rng_state"] == random.Random(seed).getstate()
    np.testing.assert_array_equal(rng["np_rng_state"][1], np.random.RandomState(seed).get_state()[1])
    assert rng["torch_rng_state"].data == torch.Generator().manual_seed(seed).get_state().numpy().tobytes()
    tracker = rng["rng_tracker_states"]["model-parallel-rng"]
    assert np.frombuffer(tracker.data, np.uint64)[0] == seed + 2718 + 1  # model_parallel_cuda_manual_seed
    assert [g["wd_mult"] for g in state.optimizer.param_groups] == [1.0, 0.0]


# --- checkpoints written by torch.save, read by open -----------------------------------------


def save_megatron(root: Path, values: dict, *, tp: int, iteration: int = 20, distopt: bool = False) -> dict:
    """A tp-way, one-stage Megatron checkpoint made with torch.save from the numpy construction.

    The optimizer is a real torch.optim.AdamW after one step on fp32 main params, wrapped as
    Float16OptimizerWithFloat16Params.state_dict does (or, with ``distopt``, coalesced as
    DistributedOptimizer.get_parameter_state_dp_zero does). Returns, per rank, the tensors saved.
    """
    torch = _torch()
    weights = megatron_state_dicts(values, "param", tp, 1)
    masters = megatron_state_dicts(values, "master", tp, 1)
    saved = {}
    for t in range(tp):
        sd = OrderedDict()
        for key, arr in weights[(t, 0, 0)].items():
            if key.endswith("self_attention.linear_proj.weight"):  # TE's DotProductAttention: no params, an extra state
                layer = int(key.split(".")[2])
                extra = torch.tensor([layer, 2, 3], dtype=torch.uint8)
                sd[key.replace("linear_proj.weight", "core_attention._extra_state")] = extra
            sd[key] = torch.from_numpy(arr.astype(np.int16)).view(torch.bfloat16).clone()
            if key.startswith("decoder.layers.") and key.endswith("linear_fc2.weight"):
                sd[key.replace(".weight", "._extra_state")] = torch.empty(0, dtype=torch.uint8)
        sd["output_layer._extra_state"] = None
        params = [(k, torch.nn.Parameter(torch.from_numpy(masters[(t, 0, 0)][k].copy()))) for k in weights[(t, 0, 0)]]
        groups = [{"params": [p for k, p in params if p.ndim > 1], "wd_mult": 1.0, "lr_mult": 1.0},
                  {"params": [p for k, p in params if p.ndim == 1], "wd_mult": 0.0, "lr_mult": 1.0,
                   "weight_decay": 0.0}]
        adam = torch.optim.AdamW(groups, lr=1e-3)
        for k, p in params:
            p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 1000 + hash(k) % 97
        adam.step()
        args = megatron_args(SIZES, Topology(tp=tp, dp=2, zero=1 if distopt else 0), iteration=iteration)
        args = argparse.Namespace(**{k: getattr(torch, v.name) if isinstance(v, TorchDtype) else v
                                     for k, v in args.items()})
        obj = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": sd}
        state = {k: adam.state[p] for k, p in params}
        if distopt:
            inner = adam.state_dict()
            step = inner["state"][0]["step"].item()
            groups_out = [{**{k: v for k, v in g.items() if k != "params"}, "step": step}
                          for g in inner["param_groups"]]
            obj["optimizer"] = {"optimizer": {"param_groups": groups_out}}
        else:
            obj["optimizer"] = {"optimizer": adam.state_dict(),
                                "fp32_from_fp16_params": [[p.detach().clone() for p in g["params"]] for g in groups]}
        obj["opt_param_scheduler"] = {"max_lr": 1e-3, "num_steps": iteration}
        obj["rng_state"] = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                             "torch_rng_state": torch.get_rng_state(),
                             "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
                             "rng_tracker_states": {"model-parallel-rng": torch.ones(16, dtype=torch.uint8)}}]
        obj["num_floating_point_operations_so_far"] = 123
        rank = root / f"iter_{iteration:07d}" / f"mp_rank_{t:02d}"
        rank.mkdir(parents=True)
        torch.save(obj, rank / "model_optim_rng.pt")
        if distopt:
            local = OrderedDict((k, p.detach().numpy()) for k, p in params)
            buf = {"param": torch.from_numpy(coalesced(local))}
            for name in ("exp_avg", "exp_avg_sq"):
                buf[name] = torch.from_numpy(coalesced(OrderedDict((k, state[k][name].numpy()) for k, _ in params)))
            buf["numel_unpadded"] = buf["param"].numel()
            distrib = {"buckets_coalesced": True, 0: {(torch.bfloat16, torch.float32): buf}}
            torch.save(distrib, rank / "distrib_optim.pt")
        saved[t] = {"model": sd, "params": params, "state": state}
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return saved


@pytest.mark.parametrize("distopt", [False, True], ids=["fp16-optimizer", "distributed-optimizer"])
def test_open_reads_a_torch_saved_checkpoint_and_maps_adam_state_by_index(tmp_path, distopt):
    values = bf16_values()
    saved = save_megatron(tmp_path, values, tp=2, distopt=distopt)
    source = FORMAT.open(tmp_path)
    assert source.topology == Topology(tp=2, dp=2, zero=1 if distopt else 0)
    items = read_items(source)
    # The weights come back as the construction made them.
    for (name, state), arr in gather(source.layout, items).items():
        if state == "param":
            np.testing.assert_array_equal(arr, values[(name, state)], err_msg=name)
    # Each parameter's main param and Adam moments are the ones torch computed for it.
    if distopt:
        layout = resolve(layout_spec("megatron-llama"), source.topology, source.sizes, states={"model": STATES})
        by_key = {(it.key, it.state, dict(it.unit)["tp"]): it for it in layout.items}
        items = {by_key[k]: v for k, v in _per_param(source, items).items()}
    else:
        by_key = {(it.key, it.state, dict(it.unit)["tp"]): it for it in items}
    for t, rank in saved.items():
        for key, p in rank["params"]:
            for state, want in (("master", p.detach()), ("exp_avg", rank["state"][key]["exp_avg"]),
                                ("exp_avg_sq", rank["state"][key]["exp_avg_sq"])):
                got = items[by_key[(key, state, t)]].view(np.float32)
                np.testing.assert_array_equal(got, want.numpy().ravel(), err_msg=f"{key} {state}")
    state = source.extra["megatron"]
    assert state.iteration == 20 and state.other == {"num_floating_point_operations_so_far": 123}
    empty = SmallTensor("uint8", (0,), b"")
    assert state.extra_state["decoder.layers.3.mlp.linear_fc2._extra_state"] == {0: empty, 1: empty}
    assert state.extra_state["output_layer._extra_state"] == {0: None, 1: None}
    step = 1.0
    if distopt:
        assert all(g["step"] == step for g in state.optimizer.param_groups)
    else:
        assert state.optimizer.step.value() == step and state.optimizer.kind is OptimizerKind.FP16


def _per_param(source: Source, items: dict) -> dict:
    """Distributed optimizer items cut back into per-parameter arrays, keyed (key, state, tp)."""
    out = {}
    for it, arr in items.items():
        if it.section != "optim":
            continue
        t, p = dict(it.unit)["tp"], dict(it.unit)["pp"]
        params = [i for i in source.layout.order[f"model/tp={t},pp={p}/{it.chunk}"]]
        pos = 0
        for param in reversed(params):
            start = -(-pos // 64) * 64
            n = source.layout.items[param].numel
            out[(param.key, it.state, t)] = arr[start:start + n]
            pos = start + n
    return out


def convert(src_dir: Path, dst_dir: Path, topo: str) -> Source:
    """open -> target -> plan -> write through PlanFill reading the source files."""
    source = FORMAT.open(src_dir)
    target = FORMAT.target(source, parse_topology(topo))
    p = plan(source.layout, target.layout)
    p.validate()
    with ByteReader() as reader:
        fill = PlanFill(p, source.where, reader)
        target.dtypes = dict(fill.dtypes)
        FORMAT.write(target, dst_dir, fill)
    return source


@pytest.mark.parametrize(("distopt", "dst"), [(False, "tp=1,pp=2,vpp=2"), (False, "tp=1,pp=2,dp=4,zero=1"),
                                               (True, "tp=1,pp=2")])
def test_reshard_a_torch_saved_checkpoint_keeps_every_state_and_carries_extra_state(tmp_path, distopt, dst):
    torch = _torch()
    values = bf16_values()
    save_megatron(tmp_path / "a", values, tp=2, distopt=distopt)
    source = convert(tmp_path / "a", tmp_path / "b", dst)
    out = FORMAT.open(tmp_path / "b")
    a, b = gather(source.layout, read_items(source)), gather(out.layout, read_items(out))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))
    t_ = parse_topology(dst)
    last = tmp_path / "b" / "iter_0000020" / f"mp_rank_00_{t_.pp - 1:03d}" / "model_optim_rng.pt"
    sd = torch.load(last, weights_only=False)
    chunk = sd["model"] if t_.vpp == 1 else sd[f"model{t_.vpp - 1}"]
    keys = list(chunk)
    # _extra_state follows its module's parameters, as in Megatron's state dict; layers renumbered per stage.
    layer = "decoder.layers.0."
    assert keys.index(layer + "mlp.linear_fc2._extra_state") == keys.index(layer + "mlp.linear_fc2.weight") + 1
    before_proj = keys[keys.index(layer + "self_attention.linear_proj.weight") - 1]
    assert before_proj == layer + "self_attention.core_attention._extra_state"
    assert keys[-1] == "output_layer._extra_state" and chunk["output_layer._extra_state"] is None
    global_layer = next(g for g, place in layer_places(t_.pp, t_.vpp).items() if place == (t_.pp - 1, t_.vpp - 1, 0))
    assert chunk["decoder.layers.0.self_attention.core_attention._extra_state"].tolist() == [global_layer, 2, 3]
    # The topology changed: rng state is a fresh run's for this rank (seed 1234 + 100 * pp_rank).
    fresh = torch.Generator().manual_seed(1234 + 100 * (t_.pp - 1)).get_state()
    assert torch.equal(sd["rng_state"][0]["torch_rng_state"], fresh)
    assert sd["iteration"] == 20 and sd["num_floating_point_operations_so_far"] == 123
    groups = sd["optimizer"]["optimizer"]["param_groups"]
    if t_.zero:  # DistributedOptimizer.state_dict: torch Adam's common step in every group
        assert [g["step"] for g in groups] == [1.0, 1.0]
    else:  # back in each parameter's state, as torch Adam keeps it
        assert all("step" not in g for g in groups)
        assert all(st["step"].item() == 1.0 for st in sd["optimizer"]["optimizer"]["state"].values())


def test_same_topology_carries_rng_state(tmp_path):
    torch = _torch()
    save_megatron(tmp_path / "a", bf16_values(), tp=2)
    convert(tmp_path / "a", tmp_path / "b", "tp=2,dp=2")
    for t in range(2):
        rel = Path("iter_0000020") / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        a, b = (torch.load(tmp_path / d / rel, weights_only=False)["rng_state"][0] for d in "ab")
        assert torch.equal(a["torch_rng_state"], b["torch_rng_state"])
        assert a["random_rng_state"] == b["random_rng_state"]


# --- errors -----------------------------------------------------------------------------------


def test_missing_rank_file_is_named(tmp_path):
    write(tmp_path, "tp=2,pp=2")
    (tmp_path / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'iter_0000000'}: missing rank file mp_rank_01_001/model_optim_rng.pt; "
                            "args say tensor_model_parallel_size=2, pipeline_model_parallel_size=2")


def test_mixed_iterations_are_refused(tmp_path):
    torch = _torch()
    write(tmp_path, "tp=2")
    path = tmp_path / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt"
    sd = torch.load(path, weights_only=False)
    sd["iteration"] = 5
    torch.save(sd, path)
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path)
    first = tmp_path / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    assert str(e.value) == f"{path}: iteration 5, but {first} has iteration 0; the checkpoint mixes iterations"


def test_unknown_tensor_fails_closed(tmp_path):
    torch = _torch()
    write(tmp_path, "tp=1")
    path = tmp_path / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    sd = torch.load(path, weights_only=False)
    sd["model"]["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.zeros(16)
    torch.save(sd, path)
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path)
    assert str(e.value) == (f"{path}: tensor 'decoder.layers.0.self_attention.linear_qkv.bias' is not in spec "
                            "megatron-llama at tp=1,pp=1,dp=1")


def test_missing_vocab_size_asks_for_it(tmp_path):
    torch = _torch()
    write(tmp_path, "tp=2")
    for t in range(2):
        path = tmp_path / "iter_0000000" / f"mp_rank_{t:02d}" / "model_optim_rng.pt"
        sd = torch.load(path, weights_only=False)
        del sd["args"].vocab_size
        torch.save(sd, path)
    first = tmp_path / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path)
    assert str(e.value) == (f"{first}: args has padded_vocab_size=112 but not the tokenizer's vocab size; "
                            "give it as sizes={'vocab': N} (a number in [97, 112])")
    assert FORMAT.open(tmp_path, sizes={"vocab": 100}).sizes["vocab"] == 100


def no_family(tmp_path: Path, topo: str) -> tuple[Path, dict]:
    """A checkpoint whose args describe no family reshard knows (no SwiGLU, RMSNorm, rotary): rank (0, 0)'s file
    and the items written that hold data, by item."""
    target, items, _, _ = write(tmp_path, topo)
    set_swiglu(tmp_path, False)
    first = next(tmp_path.glob("iter_0000000/mp_rank_00*/model_optim_rng.pt"))
    return first, {it: arr for it, arr in items.items() if target.layout.items[it].mapped}


def set_swiglu(root: Path, value: bool) -> None:
    torch = _torch()
    for path in sorted(root.glob("iter_0000000/mp_rank_*/model_optim_rng.pt")):
        sd = torch.load(path, weights_only=False)
        sd["args"].swiglu = value
        torch.save(sd, path)


@pytest.mark.parametrize("topo", ["tp=2", "tp=1"])
def test_a_model_no_family_describes_names_its_first_ambiguous_tensor_and_what_to_pass(tmp_path, topo):
    first, _ = no_family(tmp_path, topo)
    tp = int(topo[3])
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path)
    assert str(e.value) == (
        f"{first}: the args describe no model family reshard knows (swiglu=False, normalization=RMSNorm, "
        "position_embedding_type=rope, num_experts=None), and Megatron's torch format stores tensor-parallel shards "
        "without their split dimensions: which dimension of 'embedding.word_embeddings.weight' "
        f"([{padded_vocab(tp) // tp}, 16] in this file, at tensor_model_parallel_size={tp}) the tensor-parallel "
        "ranks split, if any, is recorded nowhere. Pass --spec <file> with this model's layout, or put the model's "
        f"Hugging Face config.json of a known family ({', '.join(FAMILIES)}) beside the checkpoint")


def test_a_config_json_of_a_known_family_says_what_the_args_do_not(tmp_path):
    import json

    from reshard.models.llama import FAMILY as LLAMA

    first, items = no_family(tmp_path, "tp=2")
    config = LLAMA.config_from_sizes(SIZES, ["bfloat16"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = FORMAT.open(tmp_path)
    assert source.spec_name == "megatron-llama" and source.model.config == config
    got = read_items(source)  # every byte where the llama layout put it
    assert got.keys() == items.keys()
    for it, arr in got.items():
        assert arr.tobytes() == items[it].tobytes(), it
    set_swiglu(tmp_path, True)  # the args of a llama, beside a config of another family
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'config.json'}: model_type 'mixtral' names the mixtral family, but the args in {first} describe "
        "a llama model (swiglu=True, normalization=RMSNorm, position_embedding_type=rope, num_experts=None); which "
        "one this checkpoint holds is not reshard's guess to make: remove the config.json of the other model, or "
        "give a spec")


def test_release_checkpoint_is_read_and_written_as_release(tmp_path):
    write(tmp_path / "a", "tp=2")
    (tmp_path / "a" / "iter_0000000").rename(tmp_path / "a" / "release")
    (tmp_path / "a" / "latest_checkpointed_iteration.txt").write_text("release")
    source = convert(tmp_path / "a", tmp_path / "b", "tp=1")
    assert source.extra["megatron"].release and source.extra["megatron"].iteration is None
    assert (tmp_path / "b" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (tmp_path / "b" / "release" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_extra_state_that_differs_between_tp_ranks_cannot_change_tp(tmp_path):
    torch = _torch()
    save_megatron(tmp_path, bf16_values(), tp=2)
    path = tmp_path / "iter_0000020" / "mp_rank_01" / "model_optim_rng.pt"
    sd = torch.load(path, weights_only=False)
    sd["model"]["decoder.layers.1.mlp.linear_fc2._extra_state"] = torch.tensor([9], dtype=torch.uint8)
    torch.save(sd, path)
    source = FORMAT.open(tmp_path)
    assert FORMAT.target(source, parse_topology("tp=2,pp=2")).topology.tp == 2  # same tp: each rank keeps its own
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.target(source, parse_topology("tp=1"))
    assert str(e.value) == ("decoder.layers.1.mlp.linear_fc2._extra_state: the tp ranks hold different values "
                            "(fp8 scaling state?); cannot carry it to tp=1")


def test_legacy_models_nest_their_state_dict_and_convert_with_every_state(tmp_path):
    """Megatron-LM's legacy GPTModel: 'language_model' -> 'embedding'/'encoder'/'output_layer', local layer
    numbers; weights and Adam state go there from mcore names and back unchanged."""
    import reshard
    from reshard.fixtures import make_fixture

    from reshard.io.torchfile import read_torch_file

    make_fixture(tmp_path / "mcore", format="megatron", to="tp=2,pp=2")
    reshard.convert(tmp_path / "mcore", tmp_path / "legacy", to="tp=1,pp=2", spec="megatron-legacy-llama")
    first = read_torch_file(tmp_path / "legacy" / "iter_0000000" / "mp_rank_00_000" / "model_optim_rng.pt")
    last = read_torch_file(tmp_path / "legacy" / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt")
    assert list(first["model"]) == ["language_model"]
    assert list(first["model"]["language_model"]) == ["embedding", "encoder"]
    assert list(first["model"]["language_model"]["embedding"]["word_embeddings"]) == ["weight"]
    assert list(last["model"]["language_model"]) == ["encoder", "output_layer"]
    encoder = list(last["model"]["language_model"]["encoder"])
    assert encoder[:6] == [f"layers.0.{k}" for k in ("input_norm.weight", "self_attention.query_key_value.weight",
                                                      "self_attention.dense.weight", "post_attention_norm.weight",
                                                      "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight")]
    assert encoder[-1] == "final_norm.weight"
    args = first["args"] if isinstance(first["args"], dict) else vars(first["args"])
    assert (args["use_legacy_models"], args["use_mcore_models"]) == (True, False)
    legacy = reshard.open_checkpoint(tmp_path / "legacy")
    assert legacy.spec_name == "megatron-legacy-llama" and set(legacy.layout.states) >= {"param", "exp_avg"}
    reshard.convert(tmp_path / "legacy", tmp_path / "legacy-tp2", to="tp=2,pp=1")
    assert reshard.open_checkpoint(tmp_path / "legacy-tp2").spec_name == "megatron-legacy-llama"
    reshard.convert(tmp_path / "legacy-tp2", tmp_path / "back", to="tp=2,pp=2", spec="megatron-llama")
    result = reshard.verify(tmp_path / "mcore", tmp_path / "back")
    assert result and result.compared > 0, result.differences
    with pytest.raises(CheckpointFormatError, match="has no distributed optimizer"):
        reshard.convert(tmp_path / "legacy", tmp_path / "x", to="tp=1,pp=2,zero=1")


@pytest.mark.parametrize("workers", [1, 2])
def test_vocab_padding_rows_are_zeros_or_copies_of_the_last_row(tmp_path, workers):
    import reshard
    from reshard.fixtures import make_fixture

    from reshard.errors import ReshardError
    from reshard.io.torchfile import read_torch_file

    make_fixture(tmp_path / "hf", format="hf")
    vocab, h = (reshard.open_checkpoint(tmp_path / "hf").sizes[k] for k in ("vocab", "h"))
    rows = {}
    for pad in ("zero", "last"):
        out = tmp_path / pad
        reshard.convert(tmp_path / "hf", out, format="megatron", to="tp=2", vocab_pad=pad, workers=workers)
        args = reshard.open_checkpoint(out).extra["megatron"].args
        padded = (args if isinstance(args, dict) else vars(args))["padded_vocab_size"]
        assert padded > vocab
        ref = read_torch_file(out / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt")["model"][
            "embedding.word_embeddings.weight"]
        dtype = np.uint16 if ref.dtype == "bfloat16" else np.float32
        shard = np.fromfile(ref.path, dtype, ref.numel, offset=ref.data_offset).reshape(ref.shape)
        real = vocab - padded // 2  # rows of the last tp rank that hold real tokens
        rows[pad] = shard[real:]
        assert shard.shape[0] - real == padded - vocab
        if pad == "last":
            assert (rows[pad] == shard[real - 1]).all() and shard[real - 1].any()
        else:
            assert not rows[pad].any()
        assert reshard.verify(tmp_path / "hf", out, states=("param",))  # padding is never read back
    with pytest.raises(ReshardError, match="vocab_pad applies to the megatron format"):
        reshard.convert(tmp_path / "hf", tmp_path / "x", format="dcp", vocab_pad="last")


def test_without_vocab_pad_a_specs_own_pad_policy_stands(tmp_path):
    import reshard
    from reshard.fixtures import make_fixture

    from reshard.formats.specs import spec_text
    from reshard.io.torchfile import read_torch_file

    make_fixture(tmp_path / "hf", format="hf")
    vocab = reshard.open_checkpoint(tmp_path / "hf").sizes["vocab"]
    text = spec_text("megatron-llama").replace("(vocab~(vocab_div*tp))", "(vocab~(vocab_div*tp):last)")
    (tmp_path / "last.spec").write_text(text)
    reshard.convert(tmp_path / "hf", tmp_path / "out", format="megatron", to="tp=2", spec=str(tmp_path / "last.spec"))
    ref = read_torch_file(tmp_path / "out" / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt")["model"][
        "embedding.word_embeddings.weight"]
    shard = np.fromfile(ref.path, np.uint16 if ref.dtype == "bfloat16" else np.float32, ref.numel,
                        offset=ref.data_offset).reshape(ref.shape)
    real = vocab - ref.shape[0]  # the last tp rank's real rows
    assert real < ref.shape[0] and (shard[real:] == shard[real - 1]).all() and shard[real - 1].any()


@pytest.mark.parametrize("seed", [0, 1234, 1334, 2**31 + 5, 2**40 + 7])
def test_cpu_rng_state_is_torchs_without_torch(seed):
    torch = _torch()
    from reshard.formats.megatron import torch_cpu_rng_state

    assert torch_cpu_rng_state(seed) == torch.Generator().manual_seed(seed).get_state().numpy().tobytes()
