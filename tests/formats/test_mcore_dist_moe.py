"""Megatron-core torch_dist of mixtures of experts (SequentialMLP experts): Mixtral and Qwen3-MoE.

``mcore-dist-<family>`` is the family's Megatron layout with each tensor whole, experts stacked on a second
leading dim (``reshard.formats.specs``). The references here are independent: the layout megatron-core 0.16
saves, written out by hand, and for real checkpoints megatron-core's own ranks at ep 2
(``mcore_moe_jobs``, weights only), their weights put under global layer and expert numbers and split by
hand in torch.
"""

from __future__ import annotations

import re

import mcore_moe_jobs as jobs
import pytest
import torch
from conftest import require
from safetensors.torch import load_file
from test_megatron_moe import collect, rank_file, reshard_tensor

import reshard
from reshard.errors import CheckpointFormatError, SpecError
from reshard.formats.specs import spec_text
from reshard.io.dcp_metadata import read_metadata

S = jobs.SIZES

MIXTRAL = """\
embedding.word_embeddings.weight -> embed = (vocab~vpad) h
decoder.layers.self_attention.linear_proj.weight -> o = {i} h (g qpg hd)
decoder.layers.self_attention.linear_qkv.layer_norm_weight -> ln1 = {i} h
decoder.layers.self_attention.linear_qkv.weight = {i} (g [q: qpg hd | k: hd | v: hd]) h
decoder.layers.pre_mlp_layernorm.weight -> ln2 = {i} h
decoder.layers.mlp.router.weight -> router = {i} experts h
decoder.layers.mlp.experts.experts.linear_fc1.weight = {i} {e} [gate: f | up: f] h
decoder.layers.mlp.experts.experts.linear_fc2.weight -> down = {i} {e} h f
decoder.final_layernorm.weight -> norm = h
output_layer.weight -> head = (vocab~vpad) h
"""
"""Mixtral's torch_dist layout in Transformer Engine's layers, written out by hand (megatron-core 0.16's keys
and global shapes: layers, then experts numbered globally)."""


def rules(spec: str) -> set[str]:
    text = spec_text(spec)
    return set(text[text.index("section model\n") + len("section model\n"):].splitlines())


def test_moe_torch_dist_layouts_stack_experts_after_layers_and_key_local_norms_as_megatron_core_does():
    te = set(MIXTRAL.splitlines())
    assert rules("mcore-dist-mixtral") == te
    # megatron-core's local layers key their norms as the next linear's layer_norm_weight, also in MoE layers
    local = te - {"decoder.layers.pre_mlp_layernorm.weight -> ln2 = {i} h"} | {
        "decoder.layers.mlp.linear_fc1.layer_norm_weight -> ln2 = {i} h"}
    assert rules("mcore-dist-mixtral-local") == local
    assert rules("mcore-dist-qwen3_moe-local") == local | {
        "decoder.layers.self_attention.q_layernorm.weight -> q_norm = {i} hd",
        "decoder.layers.self_attention.k_layernorm.weight -> k_norm = {i} hd"}
    assert rules("mcore-dist-llama-local") == rules("mcore-dist-llama")  # dense: one layout for both
    assert {"decoder.layers.mlp.router.bias -> router_bias = {i} experts",
            "decoder.layers.mlp.experts.experts.linear_fc1.bias = {i} {e} [gate_bias: f | up_bias: f]",
            "decoder.layers.mlp.experts.experts.linear_fc2.bias -> down_bias = {i} {e} h",
            "decoder.layers.self_attention.core_attention.softmax_offset -> sinks = {i} (g qpg)"} <= \
        rules("mcore-dist-gpt_oss")
    with pytest.raises(SpecError, match=r"^mcore-dist-mixtral-tied: no torch_dist layout for mixtral tied"):
        spec_text("mcore-dist-mixtral-tied")


def test_a_mixture_of_experts_round_trips_through_torch_dist_at_tp2_pp2_and_to_megatron_at_ep2(tmp_path):
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "hf", format="hf", model="tiny-mixtral")
    make_fixture(tmp_path / "dist", format="mcore-dist", to="tp=2,pp=2", model="tiny-mixtral")
    md = read_metadata(tmp_path / "dist")
    fc1 = md.tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert list(fc1.size) == [4, 4, 2 * 48, 64]  # layers, experts, [gate; up], h
    # one chunk per (layer, expert, half, tp rank), as megatron-core's SwiGLU factory writes it
    assert sorted(c.offsets for c in fc1.chunks) == sorted(
        (i, e, half * 48 + r * 24, 0) for i in range(4) for e in range(4) for half in range(2) for r in range(2))
    assert sum("experts.experts.linear_fc2._extra_state/shard_" in k for k in md.byte_entries) == 16
    source = reshard.open_checkpoint(tmp_path / "dist")
    assert source.spec_name == "mcore-dist-mixtral" and source.model.hints["num_experts_per_tok"] == 2
    check = reshard.verify(tmp_path / "hf", tmp_path / "dist", states=("param",))
    assert check.identical and check.compared == len(source.layout.tensors) == 79, check.differences
    reshard.convert(tmp_path / "dist", tmp_path / "meg", format="megatron", to="tp=1,pp=1,dp=2,ep=2")
    check = reshard.verify(tmp_path / "hf", tmp_path / "meg", states=("param",))
    assert check.identical and check.compared == 79, check.differences
    with pytest.raises(CheckpointFormatError, match=r"ep\(2\) is not supported yet .*write it at ep=1"):
        reshard.convert(tmp_path / "hf", tmp_path / "ep2", format="mcore-dist", to="tp=1,dp=2,ep=2")
    assert not (tmp_path / "ep2").exists()


# --- real megatron-core ----------------------------------------------------------------------------------------

def hf_of(values: dict, family: str) -> dict:
    """The Hugging Face tensors of megatron-core's weights under global names (``collect``'s flat values)."""
    L, E, heads, g, hd, h, f, v = S["layers"], S["experts"], S["heads"], S["g"], S["hd"], S["h"], S["f"], S["vocab"]
    qpg = heads // g
    w = {n: t for (n, state), t in values.items() if state == "value"}
    out = {"model.embed_tokens.weight": w["embedding.word_embeddings.weight"].view(-1, h)[:v],
           "lm_head.weight": w["output_layer.weight"].view(-1, h)[:v], "model.norm.weight": w["decoder.final_layernorm.weight"]}
    moe, router, names = (("block_sparse_moe", "gate", ("w1", "w3", "w2")) if family == "mixtral" else
                          ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")))
    for i in range(L):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = w[m + "self_attention.linear_qkv.weight"].view(g, qpg + 2, hd, h)
        out |= {p + "self_attn.q_proj.weight": qkv[:, :qpg].reshape(-1, h),
                p + "self_attn.k_proj.weight": qkv[:, qpg].reshape(-1, h),
                p + "self_attn.v_proj.weight": qkv[:, qpg + 1].reshape(-1, h),
                p + "self_attn.o_proj.weight": w[m + "self_attention.linear_proj.weight"].view(h, -1),
                p + "input_layernorm.weight": w[m + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": w[m + "pre_mlp_layernorm.weight"],
                p + f"{moe}.{router}.weight": w[m + "mlp.router.weight"].view(E, h)}
        if family == "qwen3_moe":
            out |= {p + "self_attn.q_norm.weight": w[m + "self_attention.q_layernorm.weight"],
                    p + "self_attn.k_norm.weight": w[m + "self_attention.k_layernorm.weight"]}
        for e in range(E):
            x = f"{m}mlp.experts.local_experts.{e}."
            fc1 = w[x + "linear_fc1.weight"].view(2 * f, h)
            gate, up, down = names
            out |= {p + f"{moe}.experts.{e}.{gate}.weight": fc1[:f], p + f"{moe}.experts.{e}.{up}.weight": fc1[f:],
                    p + f"{moe}.experts.{e}.{down}.weight": w[x + "linear_fc2.weight"].view(h, f)}
    return out


def assert_same_values(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), (where, key)


@pytest.mark.interop
def test_real_mixtral_torch_dist_at_ep2_converts_to_hf_megatron_at_ep4_and_back_for_megatron_core_at_ep2(tmp_path):
    """megatron-core saves a Mixtral-style model (local layers, SequentialMLP, weights only) at ep 2, dp 2 ->
    reshard reads it -> safetensors bit-exact against megatron-core's weights; reshard's own rewrite at tp 1,
    ep 1 is the real checkpoint chunk for chunk and entry for entry; -> the Megatron torch format at ep 4: each
    rank file's experts are the run's global experts; -> torch_dist from Hugging Face, which megatron-core
    loads strictly (StrictHandling.RAISE_ALL) at ep 2 with every weight equal."""
    require("megatron.core")
    jobs.save(tmp_path / "src", tmp_path / "dump", tp=1, pp=1, ep=2, dp=2, torch_dist=True, weights_only=True)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    want = collect(tmp_path / "dump", 1, 2, S)
    assert reshard.open_checkpoint(ckpt).spec_name == "mcore-dist-mixtral-local"
    reshard.convert(ckpt, tmp_path / "hf", format="hf")
    assert_same_values(load_file(tmp_path / "hf" / "model.safetensors"), hf_of(want, "mixtral"), "hf")
    reshard.convert(ckpt, tmp_path / "same", to="tp=1")
    real, ours = read_metadata(ckpt), read_metadata(tmp_path / "same")
    assert ours.tensors.keys() == real.tensors.keys() and sorted(ours.byte_entries) == sorted(real.byte_entries)
    for key, t in real.tensors.items():
        assert sorted((c.offsets, c.sizes) for c in ours.tensors[key].chunks) == \
            sorted((c.offsets, c.sizes) for c in t.chunks), key
    reshard.convert(ckpt, tmp_path / "meg", format="megatron", to="tp=1,pp=1,dp=4,ep=4",
                    spec="megatron-mixtral-local")
    for e in range(4):  # rank file e holds global expert e as local_experts.0
        model = rank_file(tmp_path / "meg", f"mp_rank_00_{e:03d}")["model"]
        for i in range(S["layers"]):
            for lin in ("linear_fc1", "linear_fc2"):
                got = torch.from_numpy(reshard_tensor(model, f"decoder.layers.{i}.mlp.experts.local_experts.0.{lin}"
                                                             ".weight").copy()).flatten()
                assert torch.equal(got, want[(f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{lin}.weight",
                                              "value")]), (e, i, lin)
    reshard.convert(tmp_path / "hf", tmp_path / "dist", format="mcore-dist", to="tp=1",
                    spec="mcore-dist-mixtral-local")
    jobs.load(tmp_path / "dist", tmp_path / "loaded", tp=1, pp=1, ep=2, dp=2, torch_dist=True, weights_only=True)
    got = {n: v for (n, s), v in collect(tmp_path / "loaded", 1, 2, S).items() if s == "value"}
    rows = S["vocab"] * S["h"]  # Hugging Face has no rows past the vocabulary: the padding is zeros
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert not got[name][rows:].any()
        got[name] = got[name][:rows]
    assert_same_values(got, {n: v[:rows] if n in ("embedding.word_embeddings.weight", "output_layer.weight") else v
                             for (n, s), v in want.items() if s == "value"}, "loaded")


@pytest.mark.interop
def test_real_qwen3_moe_torch_dist_at_ep2_converts_to_tp2_ep1_which_megatron_core_loads_strictly(tmp_path):
    """megatron-core saves a Qwen3-MoE-style model (q/k norms) at ep 2, dp 2 -> Hugging Face bit-exact ->
    torch_dist at tp 2, ep 1 -> megatron-core built at tp 2 loads it strictly: each tp rank holds exactly its
    share of every weight (the vocabulary re-padded with zero rows, fc1's gate and up halves each split)."""
    require("megatron.core")
    jobs.save(tmp_path / "src", tmp_path / "dump", tp=1, pp=1, ep=2, dp=2, torch_dist=True, weights_only=True,
              qk_norm=True)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    want = {n: v for (n, s), v in collect(tmp_path / "dump", 1, 2, S).items() if s == "value"}
    source = reshard.open_checkpoint(ckpt)
    assert source.spec_name == "mcore-dist-qwen3_moe-local"
    reshard.convert(ckpt, tmp_path / "hf", format="hf")
    assert_same_values(load_file(tmp_path / "hf" / "model.safetensors"),
                       hf_of({(n, "value"): v for n, v in want.items()}, "qwen3_moe"), "hf")
    reshard.convert(ckpt, tmp_path / "dist", to="tp=2")
    jobs.load(tmp_path / "dist", tmp_path / "loaded", tp=2, pp=1, ep=1, dp=1, torch_dist=True, weights_only=True,
              qk_norm=True)
    shapes = {n: tuple(p.shape) for n, p in torch.load(tmp_path / "dump" / "rank0.pt")["params"].items()}
    for r in range(2):
        got = torch.load(tmp_path / "loaded" / f"rank{r}.pt")["params"]
        assert got.keys() == want.keys()  # at ep 1 local expert numbers are the global ones
        for name, t in got.items():
            full = want[name].view(*shapes[re.sub(r"local_experts\.\d+\.", "local_experts.0.", name)])
            assert torch.equal(t, tp_share(name, full, r)), (r, name)


def tp_share(name: str, t: torch.Tensor, r: int) -> torch.Tensor:
    """What megatron-core's tp rank ``r`` of 2 holds of the one-rank tensor ``t``."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        padded = torch.zeros(jobs.padded_vocab(2), t.shape[1], dtype=t.dtype)
        padded[:S["vocab"]] = t[:S["vocab"]]
        return padded.chunk(2)[r]
    if name.endswith("linear_fc1.weight"):
        return torch.cat([half.chunk(2)[r] for half in t.chunk(2)])
    if name.endswith("linear_qkv.weight"):
        return t.chunk(2)[r]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return t.chunk(2, dim=1)[r]
    return t  # replicated: norms, the router

