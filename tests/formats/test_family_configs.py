"""What each Llama-style family's config says to Megatron and back: RoPE in both spellings, windows, and
the refusals of what Megatron's args cannot express, each naming the field and its value; which family a
Megatron checkpoint is, from its args and a carried config.json.
"""

from __future__ import annotations

import json

import pytest

import reshard
from fixtures import make_fixture
from reshard.errors import CheckpointFormatError
from reshard.models import family_for_megatron_args, get_family

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("config", [
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}},  # transformers 4.x
    {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}},  # 4.x, older key
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}},  # transformers 5.x
], ids=["4.x", "4.x-type", "5.x"])
def test_llama3_scaling_in_either_spelling_is_megatrons_rope_scaling_and_comes_back(config):
    llama = get_family("llama")
    args = llama.args_from_config(config)
    assert args == {"use_rope_scaling": True, "rope_scaling_factor": 8.0, "rotary_base": 500000.0}
    hints = llama.config_hints(args)
    assert hints["rope_scaling"] == {"rope_type": "llama3", **LLAMA3} and hints["rope_theta"] == 500000.0
    assert llama.args_from_config(hints) == args


@pytest.mark.parametrize(("config", "message"), [
    ({"rope_scaling": {"rope_type": "llama3", **LLAMA3, "low_freq_factor": 2.0}},
     "rope_scaling: llama3 scaling with low_freq_factor = 2.0; megatron-core fixes low_freq_factor 1, "
     "high_freq_factor 4, original_max_position_embeddings 8192 (only the factor is an arg), so the model would "
     "change"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3,
                          "original_max_position_embeddings": 4096}},
     "rope_parameters: llama3 scaling with original_max_position_embeddings = 4096; megatron-core fixes"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     'rope_parameters.rope_type = "yarn": Megatron\'s args express RoPE unscaled or llama3-scaled only'),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
     'rope_scaling.rope_type = "longrope": Megatron\'s args express RoPE'),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}}, 'rope_scaling.rope_type = "su"'),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 'rope_scaling.rope_type = "linear"'),
    ({"partial_rotary_factor": 0.75, "rope_scaling": None}, "partial_rotary_factor = 0.75: reshard writes"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor = 0.5"),
], ids=["llama3-low", "llama3-original", "yarn", "longrope", "su", "linear", "partial-4.x", "partial-5.x"])
def test_rope_megatron_cannot_express_is_refused_naming_the_field_and_value(config, message):
    for name in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
        with pytest.raises(CheckpointFormatError) as e:
            get_family(name).args_from_config(config)
        assert str(e.value).startswith(message), (name, str(e.value))


def test_a_sliding_window_is_megatrons_inclusive_window_and_comes_back():
    mistral = get_family("mistral")
    assert mistral.args_from_config({"sliding_window": 4096})["window_size"] == (4095, 0)
    assert mistral.args_from_config({"sliding_window": None}).get("window_size") is None
    assert mistral.config_hints({"window_size": (4095, 0)})["sliding_window"] == 4096
    assert mistral.config_hints({"window_size": None})["sliding_window"] is None  # not MistralConfig's 4096
    assert get_family("phi3").args_from_config({"sliding_window": 2047})["window_size"] == (2046, 0)


@pytest.mark.parametrize(("config", "message"), [
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2, "num_hidden_layers": 4},
     "use_sliding_window = true, sliding_window = 4096, max_window_layers = 2: a sliding window on some layers only"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
     "sliding_window = 8: a sliding window on some layers only"),
])
def test_a_qwen_window_on_some_layers_is_refused(config, message):
    for name in ("qwen2", "qwen3"):
        with pytest.raises(CheckpointFormatError, match="^" + message):
            get_family(name).args_from_config(config)
    # switched on but reaching no layer: nothing to refuse
    assert "window_size" not in get_family("qwen2").args_from_config(
        {"use_sliding_window": True, "max_window_layers": 4, "num_hidden_layers": 4})


def test_each_megatron_flag_names_one_family_and_a_mix_names_none():
    base = get_family("llama").megatron_args({"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 8, "vocab": 10,
                                              "layers": 2}, False)
    cases = {(): "llama", (("add_qkv_bias", True),): "qwen2", (("qk_layernorm", True),): "qwen3",
             (("window_size", (5, 0)),): "mistral", (("add_qkv_bias", True), ("qk_layernorm", True)): None,
             (("window_size", (5, 3)),): None, (("add_qkv_bias", True), ("window_size", (5, 0))): None}
    for extra, want in cases.items():
        found = family_for_megatron_args(base | dict(extra))
        assert (found.name if found else None) == want, extra


def _megatron_llama(tmp_path):
    make_fixture(tmp_path / "m", format="megatron", to="tp=2", model="tiny-llama", states=("param",))
    return tmp_path / "m"


SIZES = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
         "intermediate_size": 160, "vocab_size": 1100, "num_hidden_layers": 4}


def test_a_carried_config_decides_between_families_whose_megatron_args_are_the_same(tmp_path):
    path = _megatron_llama(tmp_path)
    phi3 = get_family("phi3").config_from_sizes({"h": 64, "heads": 8, "g": 4, "hd": 8, "f": 160, "vocab": 1100,
                                                 "layers": 4})
    (path / "config.json").write_text(json.dumps(phi3))
    source = reshard.open_checkpoint(path)
    assert source.spec_name == "megatron-phi3" and source.model.family == "phi3"
    reshard.convert(path, tmp_path / "hf", format="hf")
    back = reshard.open_checkpoint(tmp_path / "hf")
    assert back.spec_name == "hf-phi3" and "model.layers.0.self_attn.qkv_proj.weight" in {
        it.key for it in back.layout.items}
    mistral = {**SIZES, "model_type": "mistral", "sliding_window": 6}  # a window Megatron's args do not have
    (path / "config.json").write_text(json.dumps(mistral))
    with pytest.raises(CheckpointFormatError, match="model_type 'mistral' names the mistral family, but the args"):
        reshard.open_checkpoint(path)
    (path / "config.json").write_text(json.dumps({**SIZES, "model_type": "qwen2"}))  # biases the args lack
    with pytest.raises(CheckpointFormatError, match="model_type 'qwen2' names the qwen2 family, but the args"):
        reshard.open_checkpoint(path)


def test_a_config_megatron_cannot_express_is_refused_with_its_file(tmp_path):
    make_fixture(tmp_path / "hf", format="hf", model="tiny-llama", states=("param",))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", **LLAMA3, "high_freq_factor": 2.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError) as e:
        reshard.convert(tmp_path / "hf", tmp_path / "m", format="megatron", to="tp=2")
    assert str(e.value).startswith(f"{tmp_path / 'hf'}: config.json: rope_scaling: llama3 scaling with "
                                   "high_freq_factor = 2.0; megatron-core fixes")
    assert not (tmp_path / "m").exists()
