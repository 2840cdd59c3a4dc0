"""A family with persistent buffers (DeepSeek-V3's expert-choice bias ``e_score_correction_bias``, in its MTP
layer too), from Hugging Face to DeepSpeed by the family's layout and back, without a framework: the buffers are
in the module's state dict and named in ``buffer_names`` (ZeRO-3: whole in every rank's model file), in no
``param_shapes`` and no flat buffer; the decoder's routed experts are fused as transformers 5's module holds them
(the MTP layer's, which no module holds, keep the files' names); everything comes back to the original
safetensors bit for bit.
``tests/interop/test_deepspeed_families.py`` loads such a checkpoint into DeepSpeed itself.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_deepseek_mtp import _assert_same, _save, _tensors

import reshard

BIASES = [f"model.layers.{k}.mlp.gate.e_score_correction_bias" for k in (1, 2, 3, 4)]  # MoE layers, then MTP


def _module_keys(files) -> set[str]:
    """The files' names as transformers 5's module holds them: each decoder MoE layer's (1-3) experts fused."""
    out = set()
    for k in files:
        m = re.fullmatch(r"model\.layers\.([123])\.mlp\.experts\.[0-9]+\.(gate|up|down)_proj\.weight", k)
        out.add(k if m is None else f"model.layers.{m[1]}.mlp.experts.{'down' if m[2] == 'down' else 'gate_up'}_proj")
    return out


@pytest.mark.parametrize("zero", [2, 3])
def test_deepseek_v3_buffers_go_to_deepspeed_in_buffer_names_and_back_bit_exactly(tmp_path, zero):
    want = _save(tmp_path / "hf")
    assert set(BIASES) <= set(want)
    result = reshard.convert(tmp_path / "hf", tmp_path / "ds", format="deepspeed", to=f"dp=2,zero={zero}")
    assert result.report.target.spec_name == "deepspeed-deepseek_v3" + ("-zero3" if zero == 3 else "")
    tag = (tmp_path / "ds" / "latest").read_text().strip()
    files = (["mp_rank_00_model_states.pt"] if zero == 2 else
             [f"zero_pp_rank_{d}_mp_rank_00_model_states.pt" for d in range(2)])
    for name in files:
        tree = torch.load(tmp_path / "ds" / tag / name, weights_only=False)
        assert tree["buffer_names"] == BIASES
        flat = {k for group in tree["param_shapes"] for k in group}
        assert not flat & set(BIASES) and flat | set(BIASES) == _module_keys(want)
        assert set(tree["module"]) == _module_keys(want)
        if zero == 2:  # ZeRO-3's module holds placeholders
            assert tree["module"]["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 12, 16)  # [experts, 2fe, h]
        for key in BIASES:  # whole, in the training dtype (ZeRO-3: in every rank's file, params are placeholders)
            assert torch.equal(tree["module"][key], torch.from_numpy(want[key])), (name, key)

    reshard.convert(tmp_path / "ds", tmp_path / "back", format="hf")
    _assert_same(_tensors(tmp_path / "back"), want)
