"""torch_dist checkpoints whose distributed-optimizer state is ``dp_reshardable`` (bucket space).

The oracle lays the buffers out by hand, from MEGATRON-DISTOPT.md §2 (``place``: params
in reverse registration order, each at a multiple of 64 elements, a bucket closed once
it holds ``bucket_size`` elements, the next one starting at a multiple of
``lcm(dp, 128)``), writes each bucket's unpadded tensor with NaN in every gap, and
reads back the coalesced ``distrib_optim.pt`` reshard writes with ``torch.load``. The
real-framework test trains megatron-core itself (``mcore_moe_jobs.py``'s dense bf16
options) and resumes the converted checkpoint in megatron-core.
"""

from __future__ import annotations

import argparse
import json
import math
import re

import mcore_jobs
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import releases, require
from mcore_releases import NEWEST
from torch.distributed.checkpoint import DefaultSavePlanner

import reshard
from reshard.errors import CheckpointFormatError

S = mcore_jobs.SIZES
BUCKET_SIZE = 20000
DTYPES = (torch.float32, torch.float32)
GROUP = "optimizer.distributed.dp_group_idx_0"
STATES = ("param", "exp_avg", "exp_avg_sq")


def registered(vpad: int) -> list[tuple[str, tuple[int, ...]]]:
    """Megatron-core's Llama GPTModel (Transformer Engine layers) at tp 1: its parameters in registration order."""
    h, f, attn = S["h"], S["f"], S["heads"] * S["hd"]
    qkv = S["g"] * (S["heads"] // S["g"] + 2) * S["hd"]
    out = [("embedding.word_embeddings.weight", (vpad, h))]
    for i in range(S["layers"]):
        p = f"decoder.layers.{i}."
        out += [(p + "self_attention.linear_proj.weight", (h, attn)),
                (p + "self_attention.linear_qkv.layer_norm_weight", (h,)), (p + "self_attention.linear_qkv.weight", (qkv, h)),
                (p + "mlp.linear_fc1.layer_norm_weight", (h,)), (p + "mlp.linear_fc1.weight", (2 * f, h)),
                (p + "mlp.linear_fc2.weight", (h, f))]
    return out + [("decoder.final_layernorm.weight", (h,)), ("output_layer.weight", (vpad, h))]


def place(numels: list[int], bucket_size: int, dp: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """The buckets of one buffer: (start, unpadded end, [(param index, start, end)]), in buffer elements."""
    pad = math.lcm(dp, 128)
    buckets, members, start, pos = [], [], 0, 0
    for k in reversed(range(len(numels))):
        pos = -(-pos // 64) * 64
        members.append((k, pos, pos + numels[k]))
        pos += numels[k]
        if bucket_size and pos - start >= bucket_size:
            buckets.append((start, pos, members))
            start = pos = -(-pos // pad) * pad
            members = []
    if members:
        buckets.append((start, pos, members))
    return buckets


def write_dp_reshardable(path, *, unpadded: list[int] | None = None) -> dict[str, list[torch.Tensor]]:
    """A one-group torch_dist checkpoint (tp 1, written at dp 2) with several buckets; returns each state's
    per-parameter values in registration order. ``unpadded`` overrides the stored per_bucket_numel_unpadded."""
    vpad = mcore_jobs.padded_vocab(1)
    params = registered(vpad)
    gen = torch.Generator().manual_seed(5)
    values = {s: [torch.randn(shape, generator=gen) for _, shape in params] for s in ("weight", *STATES)}
    state: dict[str, object] = {}
    by_name = dict(zip((n for n, _ in params), values["weight"]))
    for name, _ in params:
        m = re.fullmatch(r"decoder\.layers\.0\.(.*)", name)
        if m:
            state[f"decoder.layers.{m.group(1)}"] = torch.stack(
                [by_name[f"decoder.layers.{i}.{m.group(1)}"] for i in range(S["layers"])])
        elif not name.startswith("decoder.layers."):
            state[name] = by_name[name]
    buckets = place([math.prod(s) for _, s in params], BUCKET_SIZE, 2)
    assert len(buckets) >= 4
    for b, (start, end, members) in enumerate(buckets):
        for s in STATES:
            t = torch.full((end - start,), float("nan"))  # the gaps: whatever memory held
            for k, lo, hi in members:
                t[lo - start:hi - start] = values[s][k].flatten()
            state[f"{GROUP}.gbuf_idx_0.dtype_{DTYPES}.bucket_idx_{b}.{s}"] = t
    counts = unpadded or [end - start for start, end, _ in buckets]
    state[f"{GROUP}.per_bucket_numel_unpadded/shard_0_1"] = [[{DTYPES: counts}]]
    state[f"{GROUP}.per_bucket_numel/shard_0_1"] = [[{DTYPES: [-(-n // 128) * 128 for n in counts]}]]
    state[f"{GROUP}.optimizer/shard_0_1"] = [{"param_groups": [{"wd_mult": 1.0, "lr": 1e-3, "step": 3.0},
                                                               {"wd_mult": 0.0, "lr": 1e-3, "step": 3.0}]}]
    dcp.save(state, checkpoint_id=path, planner=DefaultSavePlanner(flatten_state_dict=False))
    args = vars(mcore_jobs._args(1, 1)) | {"overlap_grad_reduce": True, "ddp_bucket_size": BUCKET_SIZE,
                                           "data_parallel_size": 2, "use_distributed_optimizer": True}
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    torch.save({"args": argparse.Namespace(**args), "iteration": 10, "content_metadata": metadata,
                "optimizer": {"param_state_sharding_type": "dp_reshardable"}}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return values


def check_one_coalesced_buffer(tmp_path, values: dict) -> None:
    """``tmp_path / "src"`` (step 3, two param groups) converted to the torch format at tp 1, dp 1: each
    parameter's main param and Adam moments (``values``) where the hand layout puts them in the one coalesced
    buffer, zeros between; the step and param groups carried."""
    src = reshard.open_checkpoint(tmp_path / "src")
    assert src.layout.states == ("exp_avg", "exp_avg_sq", "master", "param") and src.progress.step == 3
    reshard.convert(tmp_path / "src", tmp_path / "out", format="megatron", to="tp=1,dp=1,zero=1")
    rank = tmp_path / "out" / "iter_0000010" / "mp_rank_00"
    (buffer,) = torch.load(rank / "distrib_optim.pt", weights_only=True)[0].values()
    params = registered(mcore_jobs.padded_vocab(1))
    ((start, end, members),) = place([math.prod(shape) for _, shape in params], 0, 1)
    for s in STATES:
        want = torch.zeros(end)
        for k, lo, hi in members:
            value = values[s][k].clone()
            if params[k][0] in ("embedding.word_embeddings.weight", "output_layer.weight"):
                value[S["vocab"]:] = 0  # rows that pad the vocabulary: not the model's, written as zeros
            want[lo:hi] = value.flatten()
        assert torch.equal(buffer[s], want), s
    groups = torch.load(rank / "model_optim_rng.pt", weights_only=False)["optimizer"]["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["step"]) for g in groups] == [(1.0, 3.0), (0.0, 3.0)]


def test_bucket_space_decodes_per_parameter_and_rewrites_as_one_coalesced_buffer(tmp_path):
    """Several buckets at dp 2, NaN in every gap -> the torch format at tp 1, dp 1 with one bucket: each
    parameter's main param and Adam moments where the hand layout puts them, zeros between; the step and
    param groups carried."""
    values = write_dp_reshardable(tmp_path / "src")
    check_one_coalesced_buffer(tmp_path, values)


def test_bucket_space_is_written_back_as_megatron_core_chunks_it_and_reads_as_before(tmp_path):
    """dp_reshardable at tp 1, dp 2 (several buckets) -> torch_dist at the same layout with zero=1: every bucket
    tensor under its key, length and dp ranks' chunks (one per parameter piece, one per gap) as stored, the
    bucket counts and param groups (step in each) carried, common.pt's sharding type; read back, each
    parameter's main param and moments equal the first checkpoint's."""
    write_dp_reshardable(tmp_path / "src")
    reshard.convert(tmp_path / "src", tmp_path / "out", format="mcore-dist", to="tp=1,dp=2,zero=1")
    have, want = (dcp.FileSystemReader(tmp_path / d).read_metadata().state_dict_metadata for d in ("out", "src"))
    assert {k for k in have if k.startswith(GROUP)} == {k for k in want if k.startswith(GROUP)}
    buckets = place([math.prod(s) for _, s in registered(mcore_jobs.padded_vocab(1))], BUCKET_SIZE, 2)
    for b, (start, end, members) in enumerate(buckets):
        shard = -(-(end - start) // 128) * 128 // 2  # each dp rank's half of the padded bucket
        starts = {lo - start for _, lo, _ in members} | {shard}
        cuts = sorted({x - start for _, lo, hi in members for x in (lo, hi)} | {0, shard} - {end - start})
        for s in STATES:
            t = have[f"{GROUP}.gbuf_idx_0.dtype_{DTYPES}.bucket_idx_{b}.{s}"]
            chunks = sorted((c.offsets[0], c.sizes[0]) for c in t.chunks)
            assert t.size == (end - start,) and [o for o, _ in chunks] == [x for x in cuts if x < end - start]
            assert starts <= {o for o, _ in chunks} and sum(n for _, n in chunks) == end - start
    common = torch.load(tmp_path / "out" / "common.pt", weights_only=False)
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    assert common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    again, first = reshard.open_checkpoint(tmp_path / "out"), reshard.open_checkpoint(tmp_path / "src")
    assert again.progress.step == 3 and again.layout.states == first.layout.states
    for d in ("src", "out"):
        reshard.convert(tmp_path / d, tmp_path / f"torch-{d}", format="megatron", to="tp=1,dp=1,zero=1")
    # and from the torch format's distrib_optim.pt (its param groups and step) to torch_dist at tp 2, and back
    reshard.convert(tmp_path / "torch-src", tmp_path / "tp2", format="mcore-dist", to="tp=2,dp=1,zero=1")
    assert reshard.open_checkpoint(tmp_path / "tp2").progress.step == 3
    reshard.convert(tmp_path / "tp2", tmp_path / "torch-tp2", format="megatron", to="tp=1,dp=1,zero=1")
    a, b, c = (torch.load(tmp_path / f"torch-{d}" / "iter_0000010" / "mp_rank_00" / "distrib_optim.pt",
                          weights_only=True)[0] for d in ("src", "out", "tp2"))
    (x,), (y,), (z,) = a.values(), b.values(), c.values()
    assert all(torch.equal(x[s], y[s]) and torch.equal(x[s], z[s]) for s in STATES)


def test_a_dp_rank_without_a_parameter_in_a_bucket_is_refused_naming_it(tmp_path):
    write_dp_reshardable(tmp_path / "src")
    with pytest.raises(CheckpointFormatError, match=r"bucket_idx_\d+: dp rank \d+ of 512 owns no parameter of bucket"):
        reshard.convert(tmp_path / "src", tmp_path / "out", format="mcore-dist", to="tp=1,dp=512,zero=1")


def test_a_per_bucket_numel_unpadded_the_layout_does_not_give_is_refused_naming_the_bucket(tmp_path):
    numels = [math.prod(s) for _, s in registered(mcore_jobs.padded_vocab(1))]
    counts = [end - start for start, end, _ in place(numels, BUCKET_SIZE, 2)]
    wrong = counts[:2] + [counts[2] + 64] + counts[3:]
    write_dp_reshardable(tmp_path / "src", unpadded=wrong)
    with pytest.raises(CheckpointFormatError, match=rf"dp_group_idx_0 \(tp=0, pp=0\) bucket 2: per_bucket_numel_unpadded "
                                                   rf"says {counts[2] + 64} elements, the layout \(.*\) gives {counts[2]}"):
        reshard.open_checkpoint(tmp_path / "src")


_TP_SPLIT = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "linear_proj.weight",
             "linear_fc2.weight", "word_embeddings.weight", "output_layer.weight")


def gathered(dump_dir, pp: int, sizes: dict, gated: bool = True,
             experts: tuple[int, int] | None = None) -> dict[tuple[str, str], torch.Tensor]:
    """(global name, ``value`` or optimizer state) -> the whole tensor, from every rank's dump of megatron-core's
    own parameters and distributed-optimizer shards: dp pieces joined, tp shards stitched as the layers split
    them (fc1 per half when ``gated``), the vocabulary's padding rows dropped; replicas must agree, every
    element be held. ``experts``: (etp, local experts) of an MoE run at pp 1, whose experts are renumbered
    globally and stitched over their own etp ranks (rank ``r``'s is ``r % etp``)."""
    held: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor, torch.Size]] = {}
    for f in sorted(dump_dir.glob("rank*.pt")):
        d = torch.load(f, weights_only=False)
        c, per_stage = d["coords"], sizes["layers"] // pp
        for n, v in d["params"].items():
            name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{c['pp'] * per_stage + int(m.group(1))}.", n)
            shard = c["tp"]
            if experts is not None and ".local_experts." in name:
                etp, local = experts
                name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{c['ep'] * local + int(m.group(1))}.",
                              name)
                shard = int(f.stem.removeprefix("rank")) % etp
            pieces = [("value", 0, v.flatten())] + [(k, a, t.reshape(-1)) for k, (a, z, t) in d["states"].get(n, {}).items()]
            for state, start, data in pieces:
                numel = 1 if state == "step" else v.numel()
                have, seen, _ = held.setdefault((name, state, shard), (torch.empty(numel, dtype=data.dtype),
                                                                         torch.zeros(numel, dtype=torch.bool), v.shape))
                end = start + data.numel()
                assert torch.equal(have[start:end][seen[start:end]], data[seen[start:end]]), (name, state)
                have[start:end], seen[start:end] = data, True
    assert all(seen.all() for _, seen, _ in held.values())
    out: dict[tuple[str, str], torch.Tensor] = {}
    for name, state in sorted({(n, s) for n, s, _ in held}):
        shards = [held[(name, state, t)] for t in range(len({t for n, s, t in held if (n, s) == (name, state)}))]
        if state == "step" or not name.endswith(_TP_SPLIT):  # replicated over tp
            assert all(torch.equal(h[0], shards[0][0]) for h in shards), (name, state)
            out[(name, state)] = shards[0][0]
            continue
        local = [h.view(shape) for h, _, shape in shards]
        if gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
            halves = [x.chunk(2) for x in local]
            whole = torch.cat([g for g, _ in halves] + [u for _, u in halves])
        else:
            whole = torch.cat(local, dim=1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            whole = whole[:sizes["vocab"]]
        out[(name, state)] = whole
    return out


def assert_resumed(root, run: str, resumed: str, pp: int = 1) -> None:
    """What a run held (dump ``run``) and what megatron-core resumed from reshard's conversion of its checkpoint
    held (dump ``resumed``, at ``pp`` stages) are equal, every weight, main param, Adam moment and step, and so are
    the two next steps' (``next``)."""
    import mcore_moe_jobs as jobs

    for now, then in ((run, resumed), (f"{run}/next", f"{resumed}/next")):
        have, wanted = gathered(root / then, pp, jobs.SIZES), gathered(root / now, 1, jobs.SIZES)
        assert have.keys() == wanted.keys()
        for key, value in wanted.items():
            assert have[key].dtype == value.dtype and torch.equal(have[key], value), (then, key)


def hf_of(weights: dict[str, torch.Tensor], sizes: dict) -> dict[str, torch.Tensor]:
    """Hugging Face Llama tensors from megatron-core's (local layers) whole weights, de-fused here by hand."""
    g, qpg, hd, h = sizes["g"], sizes["heads"] // sizes["g"], sizes["hd"], sizes["h"]
    out = {"model.embed_tokens.weight": weights["embedding.word_embeddings.weight"],
           "lm_head.weight": weights["output_layer.weight"], "model.norm.weight": weights["decoder.final_layernorm.weight"]}
    for i in range(sizes["layers"]):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = weights[m + "self_attention.linear_qkv.weight"].view(g, qpg + 2, hd, h)
        gate, up = weights[m + "mlp.linear_fc1.weight"].chunk(2)
        out |= {p + "self_attn.q_proj.weight": qkv[:, :qpg].reshape(-1, h), p + "self_attn.k_proj.weight":
                qkv[:, qpg].reshape(-1, h), p + "self_attn.v_proj.weight": qkv[:, qpg + 1].reshape(-1, h),
                p + "self_attn.o_proj.weight": weights[m + "self_attention.linear_proj.weight"],
                p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": weights[m + "mlp.linear_fc2.weight"],
                p + "input_layernorm.weight": weights[m + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": weights[m + "pre_mlp_layernorm.weight"]}
    return out


@pytest.mark.interop
@pytest.mark.parametrize("tp,dp,to", [(1, 2, (2, 1, 1)), (2, 2, (1, 2, 1))], ids=["tp1-dp2->tp2-dp1", "tp2-dp2->pp2-dp1"])
@releases(NEWEST)
def test_real_megatron_core_dp_reshardable_checkpoint_resumes_in_megatron_core_at_a_new_layout(tmp_path, tp, dp, to,
                                                                                              mcore):
    """megatron-core (the installed 0.16.1, and 0.19.2, which keeps the common state inside the DCP files)
    trains one step (bf16 weights, fp32 main params, buckets of 4000 elements) and saves
    torch_dist with its default dp_reshardable optimizer state -> the torch format at another tp/pp/dp, which
    megatron-core loads (one bucket there): every weight, main param, Adam moment and step equal to what the
    run held, and the step after equal too; from tp 1, dp 2 also -> torch_dist at tp 2, dp 1 with
    dp_reshardable state in the run's buckets, resumed by megatron-core's dist_checkpointing.load the same
    way; -> Hugging Face: every weight bit-exact."""
    require("megatron.core")
    from safetensors.torch import load_file

    import mcore_moe_jobs as jobs

    sizes = jobs.SIZES
    run = {"dense": True, "bf16": True, "next": True}
    jobs.save(tmp_path / "src", tmp_path / "dump-src", tp=tp, pp=1, ep=1, dp=dp, distopt=True, bucket_size=4000,
              torch_dist=True, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    src = reshard.open_checkpoint(ckpt)
    assert src.spec_name == "mcore-dist-llama" and src.progress.step == 1
    assert sum(k.endswith(".bucket_idx_3.param") for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    assert (ckpt / "common.pt").is_file() == (mcore != NEWEST)  # 0.19: the common_state entry instead
    want = gathered(tmp_path / "dump-src", 1, sizes)
    assert {s for _, s in want} == {"value", "param", "exp_avg", "exp_avg_sq", "step"}
    t_tp, t_pp, t_dp = to
    reshard.convert(ckpt, tmp_path / "out", format="megatron", to=f"tp={t_tp},pp={t_pp},dp={t_dp},zero=1",
                    spec="megatron-llama-local-distopt-torch")  # the run's layers: megatron-core's local ones
    jobs.load(tmp_path / "out", tmp_path / "dump-out", tp=t_tp, pp=t_pp, ep=1, dp=t_dp, distopt=True, **run)
    assert_resumed(tmp_path, "dump-src", "dump-out", t_pp)
    if tp == 1:  # -> torch_dist at tp 2, dp 1 (dp_reshardable), loaded by megatron-core's dist_checkpointing.load
        reshard.convert(ckpt, tmp_path / "dist", format="mcore-dist", to="tp=2,dp=1,zero=1")
        jobs.load(tmp_path / "dist", tmp_path / "dump-dist", tp=2, pp=1, ep=1, dp=1, distopt=True, bucket_size=4000,
                  torch_dist=True, **run)
        assert_resumed(tmp_path, "dump-src", "dump-dist")
    reshard.convert(ckpt, tmp_path / "hf", format="hf")
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf |= load_file(f)
    expected = hf_of({n: v for (n, s), v in want.items() if s == "value"}, sizes)
    assert hf.keys() == expected.keys()
    for name, value in expected.items():
        assert hf[name].dtype == value.dtype and torch.equal(hf[name], value), name
