"""Megatron-FSDP ``fsdp_dtensor`` checkpoints: a real one written by megatron-core 0.16 (``mcore_fsdp_jobs``, dp 2,
one Adam step), read by name and converted; and a hand-made one whose args describe no family.

The oracle of the real run is what its ranks held: every DTensor it saved, whole (``full.pt``); the Hugging Face
tensors are de-interleaved from it here by hand.
"""

from __future__ import annotations

import argparse

import mcore_fsdp_jobs
import mcore_jobs
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import require
from mcore_releases import NEWEST
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import reshard
from reshard.errors import CheckpointFormatError
from reshard.io.dcp_metadata import read_metadata

S = mcore_jobs.SIZES
MODEL, OPTIM = "model.module.", "optimizer.state.module.module."


def megatron(full: dict, state: str) -> dict[str, torch.Tensor]:
    """The run's tensors of one state (``param`` or an Adam state) by Megatron name."""
    if state == "param":
        return {k[len(MODEL):]: v for k, v in full.items() if k.startswith(MODEL)}
    return {k[len(OPTIM):-len(state) - 1]: v for k, v in full.items()
            if k.startswith(OPTIM) and k.endswith(f".{state}")}


def expected_hf(m: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF Llama tensors from Megatron's per-layer ones: QKV de-interleaved by group, SwiGLU's gate ``weight_w``
    and up ``weight_v``, the vocabulary unpadded."""
    g, qpg, hd, h, v = S["g"], S["heads"] // S["g"], S["hd"], S["h"], S["vocab"]
    out = {"model.embed_tokens.weight": m["embedding.word_embeddings.weight"][:v],
           "lm_head.weight": m["output_layer.weight"][:v], "model.norm.weight": m["decoder.final_layernorm.weight"]}
    for i in range(S["layers"]):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = m[q + "self_attention.linear_qkv.weight"].view(g, qpg + 2, hd, h)
        out |= {p + "self_attn.q_proj.weight": qkv[:, :qpg].reshape(-1, h),
                p + "self_attn.k_proj.weight": qkv[:, qpg].reshape(-1, h),
                p + "self_attn.v_proj.weight": qkv[:, qpg + 1].reshape(-1, h),
                p + "self_attn.o_proj.weight": m[q + "self_attention.linear_proj.weight"],
                p + "mlp.gate_proj.weight": m[q + "mlp.linear_fc1.weight_w"],
                p + "mlp.up_proj.weight": m[q + "mlp.linear_fc1.weight_v"],
                p + "mlp.down_proj.weight": m[q + "mlp.linear_fc2.weight"],
                p + "input_layernorm.weight": m[q + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": m[q + "pre_mlp_layernorm.weight"]}
    return out


def flat(path, tmp_path, name: str) -> dict:
    dcp_to_torch_save(path, tmp_path / f"{name}.pt")
    out: dict = {}

    def walk(d, pre):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{pre}{k}.")
            else:
                out[f"{pre}{k}"] = v
    walk(torch.load(tmp_path / f"{name}.pt", weights_only=False), "")
    return out


@pytest.mark.interop
@pytest.mark.parametrize("tp,mcore", [(1, None), (2, None), (1, NEWEST)], indirect=["mcore"],
                         ids=["tp1", "tp2", f"tp1-mcore-{NEWEST}"])
def test_a_real_megatron_fsdp_checkpoint_is_read_by_name_and_converts_bit_exact(tmp_path, tp, mcore):
    """At dp 2, and at tp 2 x dp 2 (each tensor global: tensor parallelism folded into the DTensor); at dp 2 also
    by megatron-core 0.19.2's Megatron-FSDP."""
    require("megatron.core")
    src = tmp_path / "src"
    mcore_fsdp_jobs.save(src, 2, tp)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    # On disk: plain DCP (no metadata.json, no common.pt), one uneven Shard(0) chunk per rank, SwiGLU split
    assert sorted(p.name for p in src.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(2 * tp))]
    md = read_metadata(src)
    assert {"args", "iteration", "checkpoint_version"} <= set(md.byte_entries)
    qkv = md.tensors[f"{MODEL}decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.size == (S["g"] * (S["heads"] // S["g"] + 2) * S["hd"], S["h"])
    if tp == 1:
        assert sorted(c.offsets[1] for c in qkv.chunks) == [0, 0] and len({c.sizes[0] for c in qkv.chunks}) == 2
    assert f"{MODEL}decoder.layers.0.mlp.linear_fc1.weight" not in md.tensors
    assert md.tensors[f"{OPTIM}decoder.layers.0.mlp.linear_fc1.weight_w.exp_avg"].size == (S["f"], S["h"])

    source = reshard.open_checkpoint(src)
    assert (source.format, source.spec_name, source.model.family) == ("mcore-fsdp", "mcore-dist-llama", "llama")
    assert (source.progress.iteration, source.progress.step) == (mcore_fsdp_jobs.ITERATION, 1)
    assert (source.topology.tp, source.topology.dp) == (tp, 2)
    assert set(source.layout.states) == {"param", "master", "exp_avg", "exp_avg_sq"}

    reshard.convert(src, tmp_path / "hf", format="hf")
    got, want = load_file(tmp_path / "hf" / "model.safetensors"), expected_hf(megatron(full, "param"))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k

    reshard.convert(src, tmp_path / "dcp", format="dcp", to="dp=3")  # FSDP2 of the HF model, Adam's state too
    got = flat(tmp_path / "dcp", tmp_path, "dcp")
    for state in ("param", "exp_avg", "exp_avg_sq"):
        for k, v in expected_hf(megatron(full, state)).items():
            key = f"model.{k}" if state == "param" else f"optim.state.{k}.{state}"
            assert torch.equal(got[key], v), key
    assert all(got[f"optim.state.{k}.step"] == 1 for k in want)

    reshard.convert(src, tmp_path / "dist", format="mcore-dist", to="tp=2")  # torch_dist: layers stacked
    got, m = flat(tmp_path / "dist", tmp_path, "dist"), megatron(full, "param")
    for i in range(S["layers"]):
        q = f"decoder.layers.{i}."
        assert torch.equal(got["decoder.layers.mlp.linear_fc1.weight"][i],
                           torch.cat([m[q + "mlp.linear_fc1.weight_w"], m[q + "mlp.linear_fc1.weight_v"]]))
        qkv = "decoder.layers.self_attention.linear_qkv.weight"
        norm = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
        assert torch.equal(got[qkv][i], m[q + "self_attention.linear_qkv.weight"])
        assert torch.equal(got[norm][i], m[q + "input_layernorm.weight"])
    v = S["vocab"]  # padded again for tp 2: the rows past the vocabulary are padding
    assert torch.equal(got["embedding.word_embeddings.weight"][:v], m["embedding.word_embeddings.weight"][:v])

    # The distributed optimizer's buckets at tp 2 (the weights are its fp32 main params), and back to DCP by name
    reshard.convert(src, tmp_path / "zero", format="mcore-dist", to="tp=2,dp=1,zero=1")
    reshard.convert(tmp_path / "zero", tmp_path / "back", format="dcp", to="dp=1")
    got = flat(tmp_path / "back", tmp_path, "back")
    for state in ("exp_avg", "exp_avg_sq"):
        for k, v in expected_hf(megatron(full, state)).items():
            assert torch.equal(got[f"optim.state.{k}.{state}"], v), (k, state)


def by_global_name(full: dict) -> dict[tuple[str, str], torch.Tensor]:
    """``full.pt`` of an MoE run as ``test_megatron_moe.collect`` gives megatron-core's own dumps: (Megatron name
    under global layer and expert numbers, ``value`` or an optimizer state) -> the flat tensor; SwiGLU's halves
    joined again, the weights doubling as the fp32 main params (``param``)."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    for state in ("param", "exp_avg", "exp_avg_sq", "step"):
        named = megatron(full, state)
        for name, t in named.items():
            if name.endswith(".weight_v"):
                continue
            if name.endswith(".weight_w"):
                name, t = name[:-2], t if state == "step" else torch.cat([t, named[f"{name[:-2]}_v"]])
            t = t.reshape(1) if state == "step" else t.flatten()
            out[name, state] = t
            if state == "param":
                out[name, "value"] = t
    return out


@pytest.mark.interop
def test_a_real_megatron_fsdp_mixture_of_experts_converts_and_megatron_core_resumes_it(tmp_path):
    """Megatron-FSDP trains a Mixtral-style model (SequentialMLP experts) one Adam step at ep 2, dp 2 (the dense
    weights sharded over dp, each expert keyed by its global number) -> Hugging Face, every weight
    bit-exact; -> torch_dist at ep 2, dp 2 with dp_reshardable state (a dense and an expert optimizer), which
    megatron-core's DistributedOptimizer resumes with every weight, fp32 main param, Adam moment and step equal
    to what the Megatron-FSDP run saved."""
    require("megatron.core")
    import mcore_moe_jobs
    from test_mcore_dist_moe import assert_same_values, hf_of
    from test_mcore_dist_moe_optim import assert_same_but_padding
    from test_megatron_moe import collect

    src = tmp_path / "src"
    mcore_fsdp_jobs.save(src, 2, 1, ep=2)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    md = read_metadata(src)
    assert {f"{MODEL}decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight_w" for e in range(4)} \
        <= set(md.tensors)
    want = by_global_name(full)
    source = reshard.open_checkpoint(src)
    assert (source.spec_name, source.model.family, source.progress.step) == ("mcore-dist-mixtral-local", "mixtral", 1)

    reshard.convert(src, tmp_path / "hf", format="hf")
    assert_same_values(load_file(tmp_path / "hf" / "model.safetensors"), hf_of(want, "mixtral"), "hf")

    reshard.convert(src, tmp_path / "dist", format="mcore-dist", to="tp=1,dp=2,ep=2,zero=1")
    assert any(k.startswith("chained_1.") for k in read_metadata(tmp_path / "dist").tensors)
    mcore_moe_jobs.load(tmp_path / "dist", tmp_path / "resumed", tp=1, pp=1, ep=2, dp=2, distopt=True,
                        torch_dist=True)
    got = collect(tmp_path / "resumed", 1, 2, mcore_moe_jobs.SIZES)
    steps = {k for k in got if k[1] == "step"}
    assert steps and all(got[k].item() == 1 for k in steps)
    assert_same_but_padding({k: v for k, v in got.items() if k[1] != "step"},
                            {k: v for k, v in want.items() if k[1] != "step"}, "resumed")


def test_a_checkpoint_whose_args_say_pipeline_parallel_is_refused(tmp_path):
    """Megatron-FSDP builds its device meshes over dp, ep and tp alone: no run of it saves pipeline stages."""
    no_family_checkpoint(tmp_path / "src", pp=2)
    with pytest.raises(CheckpointFormatError, match=r"pipeline_model_parallel_size is 2: Megatron-FSDP"):
        reshard.open_checkpoint(tmp_path / "src")


def no_family_checkpoint(path, pp: int = 1) -> dict:
    """An fsdp_dtensor checkpoint as Megatron-FSDP lays one out (weights under ``model.module.``, Adam's state under
    ``optimizer.state.module.module.``, a 0-d step per parameter, ``args``/``iteration``/``checkpoint_version``),
    written by ``dcp.save`` in one process, whose args describe no family (no SwiGLU); the weights and states by
    Megatron name."""
    gen = torch.Generator().manual_seed(3)
    shapes = {"embedding.word_embeddings.weight": (12, 8), "decoder.layers.0.self_attention.linear_qkv.weight": (24, 8),
              "decoder.layers.0.mlp.linear_fc1.weight": (16, 8), "decoder.final_layernorm.weight": (8,)}
    named = {s: {k: torch.randn(v, generator=gen) for k, v in shapes.items()} for s in ("param", "exp_avg")}
    args = mcore_jobs._args(1, pp)
    args.swiglu = False
    dcp.save({"model": {f"module.{k}": v for k, v in named["param"].items()},
              "optimizer": {"state": {f"module.module.{k}": {"exp_avg": v, "step": torch.tensor(4.0)}
                                      for k, v in named["exp_avg"].items()}},
              "args": args, "iteration": 4, "checkpoint_version": 3.0}, checkpoint_id=path)
    return named


def test_without_a_family_every_tensor_is_read_under_its_megatron_name(tmp_path):
    named = no_family_checkpoint(tmp_path / "src")
    source = reshard.open_checkpoint(tmp_path / "src")
    assert (source.format, source.spec_name, source.progress.iteration, source.progress.step) == \
        ("mcore-fsdp", "mcore-fsdp-derived", 4, 4)
    assert set(source.layout.tensors) == set(named["param"])
    reshard.convert(tmp_path / "src", tmp_path / "dcp", format="dcp", to="dp=2")
    got = flat(tmp_path / "dcp", tmp_path, "dcp")
    for k, v in named["param"].items():
        assert torch.equal(got[f"model.{k}"], v), k
        assert torch.equal(got[f"optim.state.{k}.exp_avg"], named["exp_avg"][k]), k
    with pytest.raises(CheckpointFormatError, match=r"which model this is is recorded nowhere .*: put the model's "
                                                     "config.json beside the source, or give a spec"):
        reshard.convert(tmp_path / "src", tmp_path / "meg", format="megatron", to="tp=1")
    with pytest.raises(CheckpointFormatError, match=r"recorded nowhere .*a Hugging Face checkpoint needs its config"):
        reshard.convert(tmp_path / "src", tmp_path / "hf", format="hf")


def test_a_plain_dcp_checkpoint_with_model_module_keys_stays_dcp(tmp_path):
    """Without Megatron's trainer entries (``args``, ``iteration``, ``checkpoint_version``), not Megatron-FSDP's."""
    dcp.save({"model": {"module.w": torch.ones(4)}, "args": argparse.Namespace(a=1)}, checkpoint_id=tmp_path)
    assert reshard.open_checkpoint(tmp_path).format == "dcp"
