"""Megatron-core torch_dist of DeepSeek-V3: every layer keyed by its global number (``decoder.layers.{n}.``, the
dense layers then the MoE layers), experts stacked on a leading dim, the MTP block as ``mtp.layers.{k}.``.

The reference layout is written out by hand from megatron-core 0.16's own save (``tests/interop/
test_mcore_dist_deepseek_real.py`` checks it against one); the checkpoints are the family's Hugging Face layout with
deterministic random fp32 tensors (``test_deepseek_mtp._save``), every tensor compared bit for bit.
"""

from __future__ import annotations

import pytest
import test_deepseek_mtp
from test_deepseek_mtp import SIZES, _assert_same, _save, _tensors

import reshard
from reshard.errors import SpecError
from reshard.formats.specs import spec_text
from reshard.io.dcp_metadata import read_metadata

LOCAL = """\
embedding.word_embeddings.weight -> embed = (vocab~vpad) h
decoder.layers.{d}.input_layernorm.weight -> ln1 = h
decoder.layers.{d}.self_attention.linear_proj.weight -> o = h (heads vd)
decoder.layers.{d}.self_attention.linear_q_down_proj.weight -> q_a = ql h
decoder.layers.{d}.self_attention.linear_q_up_proj.weight -> q_b = (heads qhd) ql
decoder.layers.{d}.self_attention.linear_kv_down_proj.weight -> kv_a = kva h
decoder.layers.{d}.self_attention.linear_kv_up_proj.weight -> kv_b = (heads kvhd) kvl
decoder.layers.{d}.self_attention.q_layernorm.weight -> q_a_norm = ql
decoder.layers.{d}.self_attention.kv_layernorm.weight -> kv_a_norm = kvl
decoder.layers.{d}.pre_mlp_layernorm.weight -> ln2 = h
decoder.layers.{d}.mlp.linear_fc1.weight = [gate: f | up: f] h
decoder.layers.{d}.mlp.linear_fc2.weight -> down = h f
decoder.layers.{m}.input_layernorm.weight -> ln1 = h
decoder.layers.{m}.self_attention.linear_proj.weight -> o = h (heads vd)
decoder.layers.{m}.self_attention.linear_q_down_proj.weight -> q_a = ql h
decoder.layers.{m}.self_attention.linear_q_up_proj.weight -> q_b = (heads qhd) ql
decoder.layers.{m}.self_attention.linear_kv_down_proj.weight -> kv_a = kva h
decoder.layers.{m}.self_attention.linear_kv_up_proj.weight -> kv_b = (heads kvhd) kvl
decoder.layers.{m}.self_attention.q_layernorm.weight -> q_a_norm = ql
decoder.layers.{m}.self_attention.kv_layernorm.weight -> kv_a_norm = kvl
decoder.layers.{m}.pre_mlp_layernorm.weight -> ln2 = h
decoder.layers.{m}.mlp.router.weight -> router = experts h
decoder.layers.{m}.mlp.router.expert_bias -> router_bias = experts
decoder.layers.{m}.mlp.experts.experts.linear_fc1.weight = {e} [egate: fe | eup: fe] h
decoder.layers.{m}.mlp.experts.experts.linear_fc2.weight -> edown = {e} h fe
decoder.layers.{m}.mlp.shared_experts.linear_fc1.weight = [sgate: fs | sup: fs] h
decoder.layers.{m}.mlp.shared_experts.linear_fc2.weight -> sdown = h fs
decoder.final_layernorm.weight -> norm = h
output_layer.weight -> head = (vocab~vpad) h
"""
"""DeepSeek-V3's torch_dist layout in megatron-core's local layers, written out by hand: MLA's local layers map no
key, so every norm keeps its module's name."""


def rules(spec: str) -> list[str]:
    text = spec_text(spec)
    return text[text.index("section model\n") + len("section model\n"):].splitlines()


def test_deepseek_v3_torch_dist_keys_each_layer_by_its_global_number_as_megatron_core_saves_it():
    assert rules("mcore-dist-deepseek_v3-local") == LOCAL.splitlines()
    te = rules("mcore-dist-deepseek_v3")  # Transformer Engine's layers: the norms fused into the next linear
    assert {"decoder.layers.{d}.mlp.linear_fc1.layer_norm_weight -> ln2 = h",
            "decoder.layers.{m}.self_attention.linear_q_up_proj.layer_norm_weight -> q_a_norm = ql",
            "decoder.layers.{m}.self_attention.linear_kv_up_proj.layer_norm_weight -> kv_a_norm = kvl",
            "decoder.layers.{m}.pre_mlp_layernorm.weight -> ln2 = h"} <= set(te)
    assert not any("layernorm.weight" in r and ("q_layernorm" in r or "kv_layernorm" in r) for r in te)
    mtp = rules("mcore-dist-deepseek_v3-local-mtp")
    base = LOCAL.splitlines()  # the MTP block's rules before the output layer's
    assert mtp[:len(base) - 1] == base[:-1] and mtp[-1] == base[-1] and len(mtp) == len(base) + 19
    assert "mtp.layers.{t+0-layers}.transformer_layer.mlp.experts.experts.linear_fc1.weight = {e} [mtp_egate: fe | " \
        "mtp_eup: fe] h" in mtp and "mtp.layers.{t+0-layers}.eh_proj.weight -> mtp_eh_proj = h h2" in mtp
    assert "decoder.layers.{m}.self_attention.linear_q_proj.weight -> q = (heads qhd) h" in \
        rules("mcore-dist-deepseek_v3_noqlora-local")
    with pytest.raises(SpecError, match=r"^mcore-dist-mixtral: unknown option 'mtp'"):
        spec_text("mcore-dist-mixtral-mtp")


@pytest.mark.parametrize(("q_lora", "local"), [(True, True), (False, False)], ids=["q_lora-local", "no-q_lora-te"])
def test_deepseek_v3_with_mtp_round_trips_through_torch_dist_at_tp2_pp2_bit_exactly(tmp_path, monkeypatch, q_lora,
                                                                                   local):
    monkeypatch.setitem(test_deepseek_mtp.SIZES, "vocab", 300)  # each tp rank holds rows of the real vocabulary
    want = _save(tmp_path / "hf", q_lora=q_lora)
    family = "deepseek_v3" if q_lora else "deepseek_v3_noqlora"
    spec = f"mcore-dist-{family}{'-local' if local else ''}-mtp"
    reshard.convert(tmp_path / "hf", tmp_path / "dist", format="mcore-dist", to="tp=2,pp=2", spec=spec)
    md = read_metadata(tmp_path / "dist")
    layers, experts, h = SIZES["layers"], SIZES["experts"], SIZES["h"]
    assert not any(k.startswith("decoder.layers.") and not k.split(".")[2].isdigit() for k in md.tensors)
    fc1 = md.tensors["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"]
    assert list(fc1.size) == [experts, 2 * SIZES["fe"], h]  # experts, [gate; up], h
    half = SIZES["fe"] // 2  # one chunk per (expert, half, tp rank)
    assert sorted(c.offsets for c in fc1.chunks) == sorted(
        (e, g * SIZES["fe"] + r * half, 0) for e in range(experts) for g in range(2) for r in range(2))
    kv_down = md.tensors["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
    assert len(kv_down.chunks) == (2 if local else 1)  # column-parallel in local layers, duplicated in TE's
    assert list(md.tensors["mtp.layers.0.eh_proj.weight"].size) == [h, 2 * h]
    assert f"decoder.layers.{layers - 1}.mlp.router.expert_bias" in md.tensors
    entries = [k for k in md.byte_entries if k.startswith("decoder.layers.1.mlp.experts.experts.linear_fc2.")]
    assert sorted(entries) == [f"decoder.layers.1.mlp.experts.experts.linear_fc2._extra_state/shard_{e}_{experts}"
                               for e in range(experts)]
    source = reshard.open_checkpoint(tmp_path / "dist")
    assert source.spec_name == spec and source.sizes["hf_layers"] == layers + 1
    reshard.convert(tmp_path / "dist", tmp_path / "back", format="hf")
    _assert_same(_tensors(tmp_path / "back"), want)
