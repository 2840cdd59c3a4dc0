"""The GPT-2-like family: Megatron's per-head QKV against Hugging Face's transposed Conv1D thirds."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require

import reshard
from reshard.fixtures import MODELS, make_fixture, model_values
from reshard.formats.specs import layout_spec
from reshard.core.resolve import resolve
from reshard.core.topology import Topology


def item_bytes(source, key, **unit):
    """The stored bytes of one item of an opened checkpoint, as an array of its dtype's width."""
    want = tuple(sorted(unit.items()))
    item = next(it for it in source.where if it.key == key and it.state == "param"
                and tuple(sorted((a, c) for a, c in it.unit if a in unit)) == want)
    loc, info = source.where[item], source.layout.items[item]
    width = reshard.formats.base.itemsize(loc.dtype)
    with loc.path.open("rb") as f:
        f.seek(loc.offset)
        raw = f.read(info.numel * width)
    return np.frombuffer(raw, dtype=f"u{width}").reshape(info.shape)


def test_megatron_qkv_interleaves_each_heads_q_k_v_from_hf_c_attn_thirds(tmp_path):
    make_fixture(tmp_path / "meg", format="megatron", to="tp=2", model="tiny-gpt2")
    make_fixture(tmp_path / "hf", format="hf", model="tiny-gpt2")
    meg, hf = reshard.open_checkpoint(tmp_path / "meg"), reshard.open_checkpoint(tmp_path / "hf")
    h, heads, hd = 64, 4, 16
    c_attn = item_bytes(hf, "transformer.h.2.attn.c_attn.weight")  # Conv1D: [in, out], out = (q | k | v)
    assert c_attn.shape == (h, 3 * h)
    qkv = c_attn.T.reshape(3, heads, hd, h)                         # (three, heads, hd, in)
    per_head = qkv.transpose(1, 0, 2, 3).reshape(heads * 3 * hd, h)  # Megatron: per head, q then k then v
    for t in range(2):
        got = item_bytes(meg, "decoder.layers.2.self_attention.linear_qkv.weight", tp=t)
        np.testing.assert_array_equal(got, per_head[t * 96 : (t + 1) * 96])
    bias = item_bytes(hf, "transformer.h.2.attn.c_attn.bias").reshape(3, heads, hd).transpose(1, 0, 2).reshape(-1)
    np.testing.assert_array_equal(item_bytes(meg, "decoder.layers.2.self_attention.linear_qkv.bias", tp=1), bias[96:])


@pytest.mark.interop
def test_transformers_loads_the_converted_gpt2_with_the_fixture_values_and_same_logits(tmp_path):
    transformers = require("transformers")
    import torch
    src, hf, back, hf2 = (tmp_path / n for n in ("src", "hf", "back", "hf2"))
    make_fixture(src, format="megatron", to="tp=2,pp=2", model="tiny-gpt2")
    reshard.convert(src, hf, format="hf")
    model = transformers.GPT2LMHeadModel.from_pretrained(hf, dtype=torch.bfloat16)
    layout = resolve(layout_spec("hf-gpt2"), Topology(), MODELS["tiny-gpt2"].sizes)
    values = model_values(layout, ("param",))
    state = model.state_dict()
    for (name, _), bits in values.items():
        stored = state[name].view(torch.uint16).numpy()
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            stored = stored.T  # Conv1D stores [in, out]; the logical tensor is [out, in]
        np.testing.assert_array_equal(stored, bits, err_msg=name)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # tied
    reshard.convert(hf, back, format="megatron", to="tp=4,pp=1")
    reshard.convert(back, hf2, format="hf")
    again = transformers.GPT2LMHeadModel.from_pretrained(hf2, dtype=torch.bfloat16)
    tokens = torch.arange(24).reshape(2, 12) % 1100
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, again(tokens).logits)


def test_megatron_gpt2_to_hf_equals_an_hf_fixture_written_directly(tmp_path):
    from conftest import stored_bytes

    src, hf, direct = tmp_path / "src", tmp_path / "hf", tmp_path / "direct"
    make_fixture(src, format="megatron", to="tp=2,pp=2", model="tiny-gpt2")
    reshard.convert(src, hf, format="hf")
    check = reshard.verify(src, hf, states=("param",))
    assert check.identical, check.differences
    assert check.compared == 52  # 4 embedding/final-norm tensors + 12 per layer * 4, no lm_head (tied)
    make_fixture(direct, format="hf", model="tiny-gpt2", states=("param",))
    assert stored_bytes(hf) == stored_bytes(direct)


def test_distributed_optimizer_gpt2_changes_tp_pp_and_dp(tmp_path):
    from conftest import stored_bytes

    src, dst, direct = tmp_path / "src", tmp_path / "dst", tmp_path / "direct"
    make_fixture(src, format="megatron", to="tp=2,pp=2,dp=2,zero=1", model="tiny-gpt2")
    assert reshard.open_checkpoint(src).spec_name == "megatron-gpt2-distopt-torch"
    reshard.convert(src, dst, to="tp=1,pp=4,dp=3,zero=1")
    check = reshard.verify(src, dst)
    assert check.identical, check.differences
    make_fixture(direct, format="megatron", to="tp=1,pp=4,dp=3,zero=1", model="tiny-gpt2")
    assert stored_bytes(dst) == stored_bytes(direct)


@pytest.mark.interop
def test_a_gpt2_saved_by_transformers_survives_megatron_and_back(tmp_path):
    transformers = require("transformers")
    import torch
    config = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=3, n_positions=32, vocab_size=300, n_inner=192)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    real, meg, back = tmp_path / "real", tmp_path / "meg", tmp_path / "back"
    model.save_pretrained(real)
    reshard.convert(real, meg, format="megatron", to="tp=2,pp=3")
    reshard.convert(meg, back, format="hf")
    check = reshard.verify(real, back)
    assert check.identical, check.differences
    again = transformers.GPT2LMHeadModel.from_pretrained(back).eval()
    tokens = torch.arange(40).reshape(2, 20) * 7 % 300
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, again(tokens).logits)


def test_a_gpt2_in_deepspeed_holds_its_tied_head_as_deepspeed_saves_it(tmp_path):
    """The head is a copy of wte in the module's state dict, named in shared_params, in no flat buffer."""
    make_fixture(tmp_path / "ds", format="deepspeed", to="dp=2", model="tiny-gpt2")
    source = reshard.open_checkpoint(tmp_path / "ds")
    model = source.extra["ds_model"]
    assert model.shared == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in model.groups[0] and model.groups[0][0] == "transformer.wte.weight"


def test_gpt2s_gelu_and_epsilon_travel_to_megatron_args_and_back() -> None:
    """transformers' GPT-2 runs tanh GELU (``gelu_new``), Megatron exact GELU unless ``--openai-gelu``: the
    activation and ``layer_norm_epsilon`` become the args that reproduce them, the args give them back, and what
    Megatron's GPT cannot compute is refused naming the field."""
    from reshard.errors import CheckpointFormatError
    from reshard.models.gpt2 import FAMILY

    args = FAMILY.args_from_config({"activation_function": "gelu_new", "layer_norm_epsilon": 1e-6})
    assert args == {"openai_gelu": True, "norm_epsilon": 1e-6, "layernorm_epsilon": 1e-6}
    assert FAMILY.config_hints(args) == {"tie_word_embeddings": True, "activation_function": "gelu_new",
                                         "layer_norm_epsilon": 1e-6}
    assert FAMILY.args_from_config({"activation_function": "gelu"})["openai_gelu"] is False
    assert FAMILY.config_hints({"openai_gelu": False})["activation_function"] == "gelu"
    assert FAMILY.megatron_args({"h": 8, "heads": 2, "hd": 4, "f": 32, "vocab": 10, "layers": 1, "positions": 4},
                                True)["openai_gelu"] is True
    for config, field in (({"activation_function": "relu"}, "activation_function = 'relu'"),
                          ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx = True"),
                          ({"scale_attn_weights": False}, "scale_attn_weights = False")):
        with pytest.raises(CheckpointFormatError, match=field):
            FAMILY.args_from_config(config)
