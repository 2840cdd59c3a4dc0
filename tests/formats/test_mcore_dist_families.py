"""Megatron-core torch_dist of the dense families beyond Llama: GPT-2 style, Qwen2, Qwen3, Mistral, Phi-3.

``mcore-dist-<family>`` is the family's Megatron layout with each tensor whole (``reshard.formats.specs``). The
references here are independent: Llama's torch_dist layout written out by hand, and for real checkpoints
megatron-core's own ranks (``mcore_jobs.save_families`` / ``load_families``), their weights split and
de-interleaved by hand in torch.
"""

from __future__ import annotations

import json

import mcore_jobs
import numpy as np
import pytest
import torch
from conftest import require
from safetensors.torch import load_file

import reshard
from reshard.fixtures import make_fixture
from reshard.formats.specs import spec_text
from reshard.io.dcp_metadata import read_metadata

S = mcore_jobs.SIZES

LLAMA = """\
embedding.word_embeddings.weight -> embed = (vocab~vpad) h
decoder.layers.self_attention.linear_qkv.layer_norm_weight -> ln1 = {i} h
decoder.layers.self_attention.linear_qkv.weight = {i} (g [q: qpg hd | k: hd | v: hd]) h
decoder.layers.self_attention.linear_proj.weight -> o = {i} h (g qpg hd)
decoder.layers.mlp.linear_fc1.layer_norm_weight -> ln2 = {i} h
decoder.layers.mlp.linear_fc1.weight = {i} [gate: f | up: f] h
decoder.layers.mlp.linear_fc2.weight -> down = {i} h f
decoder.final_layernorm.weight -> norm = h
output_layer.weight -> head = (vocab~vpad) h
"""
"""Llama's torch_dist layout, written out by hand (the keys and shapes megatron-core 0.16 saves)."""


def rules(spec: str) -> set[str]:
    text = spec_text(spec)
    return set(text[text.index("section model\n") + len("section model\n"):].splitlines())


def test_the_torch_dist_layouts_are_the_megatron_layouts_whole():
    llama = set(LLAMA.splitlines())
    assert rules("mcore-dist-llama") == llama == rules("mcore-dist-mistral") == rules("mcore-dist-phi3")
    tied = llama - {"output_layer.weight -> head = (vocab~vpad) h"}  # the output layer is the embedding's key
    assert rules("mcore-dist-llama-tied") == tied
    assert rules("mcore-dist-qwen2-tied") == tied | {
        "decoder.layers.self_attention.linear_qkv.bias = {i} (g [q_bias: qpg hd | k_bias: hd | v_bias: hd])"}
    assert rules("mcore-dist-qwen3") == llama | {"decoder.layers.self_attention.q_layernorm.weight -> q_norm = {i} hd",
                                                 "decoder.layers.self_attention.k_layernorm.weight -> k_norm = {i} hd"}
    gpt2 = rules("mcore-dist-gpt2")
    assert {"embedding.position_embeddings.weight -> wpe = positions h",
            "decoder.layers.self_attention.linear_qkv.weight -> qkv = {i} (heads three hd) h",
            "decoder.layers.self_attention.linear_qkv.layer_norm_bias -> ln1_bias = {i} h",
            "decoder.layers.mlp.linear_fc1.weight -> fc = {i} f h"} <= gpt2
    assert not any(r.startswith("output_layer") for r in gpt2) and len(gpt2) == 16


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama-tied"])
def test_a_tied_model_round_trips_through_torch_dist_without_an_output_layer(tmp_path, model):
    make_fixture(tmp_path / "hf", format="hf", model=model)
    make_fixture(tmp_path / "dist", format="mcore-dist", to="tp=2,pp=2", model=model)
    md = read_metadata(tmp_path / "dist")
    assert "embedding.word_embeddings.weight" in md.tensors and "output_layer.weight" not in md.tensors
    source = reshard.open_checkpoint(tmp_path / "dist")
    assert source.spec_name == {"tiny-gpt2": "mcore-dist-gpt2", "tiny-llama-tied": "mcore-dist-llama-tied"}[model]
    check = reshard.verify(tmp_path / "hf", tmp_path / "dist", states=("param",))
    assert check.identical and check.compared == len(source.layout.tensors), check.differences


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_families_go_through_torch_dist_in_megatron_bridges_layout_and_back_bit_exactly(tmp_path, name):
    """Megatron-Bridge's layout of the Gemma families, each tensor whole as torch_dist holds it (layers stacked, the
    tied output layer the embedding's key), at pp 2: back to Hugging Face bit for bit, the model named by the
    carried config.json; without it, the checkpoint is refused, never read as another family."""
    from test_deepspeed_tied_families import save_hf

    files = save_hf(name, tmp_path / "hf")
    assert rules(f"mcore-dist-{name}") >= {"embedding.word_embeddings.weight -> embed = (vocab~vpad) h"}
    assert not any(r.startswith("output_layer") for r in rules(f"mcore-dist-{name}"))
    reshard.convert(tmp_path / "hf", tmp_path / "dist", format="mcore-dist", to="pp=2")
    assert reshard.open_checkpoint(tmp_path / "dist").spec_name == f"mcore-dist-{name}"
    reshard.convert(tmp_path / "dist", tmp_path / "back", format="hf")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(files) and all(np.array_equal(back[k].numpy(), v) for k, v in files.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == name
    (tmp_path / "dist" / "config.json").unlink()
    with pytest.raises(reshard.errors.CheckpointFormatError, match="recorded nowhere"):
        reshard.convert(tmp_path / "dist", tmp_path / "nameless", format="hf")


# --- real megatron-core ----------------------------------------------------------------------------------------

FAMILIES = ("gpt2", "qwen2", "qwen3")


def hf_of(family: str, d: dict) -> dict:
    """The Hugging Face tensors of a one-rank megatron-core state dict (local layers), de-interleaved by hand."""
    L, heads, g, hd, h, f, v = S["layers"], S["heads"], S["g"], S["hd"], S["h"], S["f"], S["vocab"]
    m = "decoder.layers.{}."
    if family == "gpt2":  # per head [q k v]; Conv1D weights stored [in, out]
        out = {"transformer.wte.weight": d["embedding.word_embeddings.weight"][:v],
               "transformer.wpe.weight": d["embedding.position_embeddings.weight"],
               "transformer.ln_f.weight": d["decoder.final_layernorm.weight"],
               "transformer.ln_f.bias": d["decoder.final_layernorm.bias"]}
        for i in range(L):
            p, at = f"transformer.h.{i}.", m.format(i)
            qkv = d[at + "self_attention.linear_qkv.weight"].view(heads, 3, hd, h).transpose(0, 1).reshape(-1, h)
            out |= {p + "attn.c_attn.weight": qkv.T,
                    p + "attn.c_attn.bias": d[at + "self_attention.linear_qkv.bias"].view(heads, 3, hd).transpose(
                        0, 1).reshape(-1),
                    p + "attn.c_proj.weight": d[at + "self_attention.linear_proj.weight"].T,
                    p + "attn.c_proj.bias": d[at + "self_attention.linear_proj.bias"],
                    p + "mlp.c_fc.weight": d[at + "mlp.linear_fc1.weight"].T,
                    p + "mlp.c_fc.bias": d[at + "mlp.linear_fc1.bias"],
                    p + "mlp.c_proj.weight": d[at + "mlp.linear_fc2.weight"].T,
                    p + "mlp.c_proj.bias": d[at + "mlp.linear_fc2.bias"]}
            for n, ln in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                out |= {p + f"{n}.{w}": d[at + f"{ln}.{w}"] for w in ("weight", "bias")}
        return out
    qpg = heads // g
    out = {"model.embed_tokens.weight": d["embedding.word_embeddings.weight"][:v],
           "model.norm.weight": d["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in d:
        out["lm_head.weight"] = d["output_layer.weight"][:v]
    for i in range(L):
        p, at = f"model.layers.{i}.", m.format(i)
        qkv = d[at + "self_attention.linear_qkv.weight"].view(g, qpg + 2, hd, h)
        fc1 = d[at + "mlp.linear_fc1.weight"]
        out |= {p + "self_attn.q_proj.weight": qkv[:, :qpg].reshape(-1, h),
                p + "self_attn.k_proj.weight": qkv[:, qpg].reshape(-1, h),
                p + "self_attn.v_proj.weight": qkv[:, qpg + 1].reshape(-1, h),
                p + "self_attn.o_proj.weight": d[at + "self_attention.linear_proj.weight"],
                p + "mlp.gate_proj.weight": fc1[:f], p + "mlp.up_proj.weight": fc1[f:],
                p + "mlp.down_proj.weight": d[at + "mlp.linear_fc2.weight"],
                p + "input_layernorm.weight": d[at + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": d[at + "pre_mlp_layernorm.weight"]}
        if family == "qwen2":
            bias = d[at + "self_attention.linear_qkv.bias"].view(g, qpg + 2, hd)
            out |= {p + "self_attn.q_proj.bias": bias[:, :qpg].reshape(-1),
                    p + "self_attn.k_proj.bias": bias[:, qpg].reshape(-1),
                    p + "self_attn.v_proj.bias": bias[:, qpg + 1].reshape(-1)}
        if family == "qwen3":
            out |= {p + "self_attn.q_norm.weight": d[at + "self_attention.q_layernorm.weight"],
                    p + "self_attn.k_norm.weight": d[at + "self_attention.k_layernorm.weight"]}
    return out


def tp_rank(name: str, t: torch.Tensor, r: int, tp: int, swiglu: bool) -> torch.Tensor:
    """What megatron-core's tp rank ``r`` holds of the one-rank tensor ``t``: the vocabulary re-padded for tp
    (zero rows), column-parallel rows (fc1 of SwiGLU: its gate and up halves each), row-parallel columns."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        padded = torch.zeros(mcore_jobs.padded_vocab(tp), t.shape[1], dtype=t.dtype)
        padded[:S["vocab"]] = t[:S["vocab"]]
        return padded.chunk(tp)[r]
    if name.endswith("mlp.linear_fc1.weight") and swiglu:
        return torch.cat([half.chunk(tp)[r] for half in t.chunk(2)])
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias")):
        return t.chunk(tp)[r]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return t.chunk(tp, dim=1)[r]
    return t  # replicated: norms, the row-parallel layers' biases, positions


@pytest.mark.interop
def test_real_torch_dist_of_gpt2_qwen2_and_qwen3_converts_to_hf_and_back_at_tp2_for_megatron_core(tmp_path):
    """megatron-core saves each at tp 1 -> reshard reads it -> safetensors bit-exact against megatron-core's weights;
    reshard's tp=1 rewrite is the real checkpoint chunk for chunk; Hugging Face -> torch_dist at tp 2 -> megatron-core
    loads it strictly, each rank holding exactly its share."""
    require("megatron.core")
    mcore_jobs.save_families(tmp_path, list(FAMILIES), 1, 1)
    for family in FAMILIES:
        at = tmp_path / family
        held = torch.load(at / "dump" / "rank0.pt", weights_only=True)
        reshard.convert(at / "src", at / "hf", format="hf")
        got, want = load_file(at / "hf" / "model.safetensors"), hf_of(family, held)
        assert got.keys() == want.keys(), family
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), (family, k)
        reshard.convert(at / "src", at / "same", format="mcore-dist", to="tp=1")
        real, ours = read_metadata(at / "src"), read_metadata(at / "same")
        assert ours.tensors.keys() == real.tensors.keys() and sorted(ours.byte_entries) == sorted(real.byte_entries)
        for key, t in real.tensors.items():
            assert sorted((c.offsets, c.sizes) for c in ours.tensors[key].chunks) == \
                sorted((c.offsets, c.sizes) for c in t.chunks), (family, key)
        reshard.convert(at / "hf", at / "dist", format="mcore-dist", to="tp=2")
    mcore_jobs.load_families(tmp_path, list(FAMILIES), 2, 1)
    for family in FAMILIES:
        held = torch.load(tmp_path / family / "dump" / "rank0.pt", weights_only=True)
        swiglu = mcore_jobs._args(1, 1, family).swiglu
        for r in range(2):
            got = torch.load(tmp_path / family / "loaded" / f"rank{r}.pt", weights_only=True)
            assert got.keys() == held.keys(), family
            for k, v in held.items():
                assert torch.equal(got[k], tp_rank(k, v, r, 2, swiglu)), (family, r, k)
