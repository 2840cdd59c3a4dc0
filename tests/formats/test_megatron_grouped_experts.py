"""Megatron experts stored as megatron-core's three expert modules (``reshard.models.moe_experts``): SequentialMLP,
the legacy GroupedMLP (``weight1``/``weight2``) and TEGroupedMLP (``linear_fc1.weight{e}``), converted into each
other and to Hugging Face bit-exactly; the layout chosen from the args a checkpoint records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_megatron_moe import reshard_tensor

import reshard
from reshard.errors import SpecError
from reshard.formats.specs import spec_text
from reshard.io.torchfile import read_torch_file
from reshard.models.moe_experts import impl_from_args


def _model(ckpt: Path, rank: str) -> dict:
    return read_torch_file(next(ckpt.glob(f"iter_*/{rank}/model_optim_rng.pt")))["model"]


def _same(a: Path, b: Path) -> None:
    result = reshard.verify(a, b)
    assert result and result.compared > 0, result.differences


def test_grouped_and_te_grouped_experts_round_trip_through_sequential_and_hugging_face(tmp_path):
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "seq", to="tp=2,dp=2,ep=2", model="tiny-mixtral")
    reshard.convert(tmp_path / "seq", tmp_path / "hf", format="hf")
    reshard.convert(tmp_path / "hf", tmp_path / "grouped", format="megatron", to="tp=2,dp=2,ep=2",
                    spec="megatron-mixtral-grouped")
    grouped = reshard.open_checkpoint(tmp_path / "grouped")
    assert grouped.spec_name == "megatron-mixtral-grouped"  # from the args it wrote
    sizes = grouped.sizes
    h, f, local = sizes["h"], sizes["f"], sizes["experts"] // 2
    # ep rank 1, tp rank 1: weight1 [h, E/ep * 2f/tp] is [E/ep][h][gate f/tp | up f/tp] in memory
    seq, grp = _model(tmp_path / "seq", "mp_rank_01_001"), _model(tmp_path / "grouped", "mp_rank_01_001")
    w1, w2 = (reshard_tensor(grp, f"decoder.layers.0.mlp.experts.weight{k}") for k in (1, 2))
    assert w1.shape == (h, local * f) and w2.shape == (local * f // 2, h)
    for j in range(local):
        fc1 = reshard_tensor(seq, f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc1.weight")
        fc2 = reshard_tensor(seq, f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc2.weight")
        assert np.array_equal(w1.reshape(local, h, f)[j], fc1.T)
        assert np.array_equal(w2.reshape(local, f // 2, h)[j], fc2.T)
    assert not any(".local_experts." in k for k in grp)
    _same(tmp_path / "hf", tmp_path / "grouped")
    reshard.convert(tmp_path / "grouped", tmp_path / "one", to="tp=1,dp=1,ep=1", spec="megatron-mixtral")
    assert reshard.open_checkpoint(tmp_path / "one").spec_name == "megatron-mixtral"
    reshard.convert(tmp_path / "one", tmp_path / "back", format="hf")
    _same(tmp_path / "hf", tmp_path / "back")
    for f_ in (tmp_path / "hf").glob("*.safetensors"):  # HF -> grouped -> sequential -> HF: the same bytes
        assert f_.read_bytes() == (tmp_path / "back" / f_.name).read_bytes(), f_
    reshard.convert(tmp_path / "grouped", tmp_path / "te", spec="megatron-mixtral-tegrouped")
    te = reshard.open_checkpoint(tmp_path / "te")
    assert te.spec_name == "megatron-mixtral-tegrouped"
    model = _model(tmp_path / "te", "mp_rank_01_001")
    fc1 = reshard_tensor(model, f"decoder.layers.0.mlp.experts.linear_fc1.weight{local - 1}")
    assert np.array_equal(fc1, w1.reshape(local, h, f)[local - 1].T)
    _same(tmp_path / "grouped", tmp_path / "te")
    reshard.convert(tmp_path / "te", tmp_path / "again", spec="megatron-mixtral-grouped")
    for f_ in (tmp_path / "grouped").rglob("model_optim_rng.pt"):  # grouped -> TE-grouped -> grouped
        again = read_torch_file(tmp_path / "again" / f_.relative_to(tmp_path / "grouped"))["model"]
        model = read_torch_file(f_)["model"]
        for k in model:
            if not k.endswith("_extra_state"):
                assert np.array_equal(reshard_tensor(model, k), reshard_tensor(again, k)), k


def test_the_expert_layout_follows_the_args_and_is_refused_where_megatron_has_none():
    assert impl_from_args({}) == "sequential"
    assert impl_from_args({"moe_grouped_gemm": True, "moe_use_legacy_grouped_gemm": True}) == "grouped"
    assert impl_from_args({"moe_grouped_gemm": True, "transformer_impl": "local"}) == "grouped"
    assert impl_from_args({"moe_grouped_gemm": True, "transformer_impl": "transformer_engine"}) == "tegrouped"
    assert "mlp.experts.weight1 = {e}/ep h [egate: fe/tp | eup: fe/tp]" in spec_text("megatron-deepseek_v3-grouped")
    assert "mlp.experts.linear_fc2.weight{e/ep} -> edown" in spec_text("megatron-deepseek_v3-tegrouped")
    with pytest.raises(SpecError, match="gpt_oss with grouped experts"):  # GroupedMLP holds no biases
        spec_text("megatron-gpt_oss-grouped")
    with pytest.raises(SpecError, match="no -distopt with -tegrouped"):
        spec_text("megatron-qwen3_moe-tegrouped-distopt")
    with pytest.raises(SpecError, match="exclude each other"):
        spec_text("megatron-mixtral-grouped-tegrouped")


def test_sequential_experts_extra_state_is_not_carried_into_grouped_experts(tmp_path):
    """A SequentialMLP checkpoint holds an ``_extra_state`` per expert linear; its TEGroupedMLP conversion has no
    such modules, so none of those entries reaches it (a strict load would find them unexpected)."""
    from reshard.fixtures import make_fixture

    import torch

    make_fixture(tmp_path / "seq", to="tp=2,dp=2,ep=2", model="tiny-mixtral")
    for f in (tmp_path / "seq").rglob("model_optim_rng.pt"):  # Transformer Engine's linears: one extra state each
        saved = torch.load(f, weights_only=False)  # the fixture this test just wrote
        model = saved["model"]
        for k in [k for k in model if k.endswith(("linear_fc1.weight", "linear_fc2.weight", "linear_qkv.weight"))]:
            model[k[:-len("weight")] + "_extra_state"] = None
        torch.save(saved, f)
    reshard.convert(tmp_path / "seq", tmp_path / "te", spec="megatron-mixtral-tegrouped")
    for f in (tmp_path / "te").rglob("model_optim_rng.pt"):
        model = read_torch_file(f)["model"]
        assert not any(".local_experts." in k for k in model), f
        assert any(k.endswith("mlp.experts.linear_fc1.weight0") for k in model), f
        assert any(k.endswith("self_attention.linear_qkv._extra_state") for k in model), f  # other modules' kept
