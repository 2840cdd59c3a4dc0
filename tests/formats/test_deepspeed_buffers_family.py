"""A family with persistent buffers (DeepSeek-V3's expert-choice bias ``e_score_correction_bias``, in its MTP
layer too), from Hugging Face to DeepSpeed by the family's layout and back, without a framework: the buffers are
in the module's state dict and named in ``buffer_names`` (ZeRO-3: whole in every rank's model file), in no
``param_shapes`` and no flat buffer, and everything comes back to the original safetensors bit for bit.
``tests/interop/test_deepspeed_families.py`` loads such a checkpoint into DeepSpeed itself.
"""

from __future__ import annotations

import pytest
import torch
from test_deepseek_mtp import _assert_same, _save, _tensors

import reshard

BIASES = [f"model.layers.{k}.mlp.gate.e_score_correction_bias" for k in (1, 2, 3, 4)]  # MoE layers, then MTP


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
        assert not flat & set(BIASES) and flat | set(BIASES) == set(want)
        assert set(tree["module"]) == set(want)
        for key in BIASES:  # whole, in the training dtype (ZeRO-3: in every rank's file, params are placeholders)
            assert torch.equal(tree["module"][key], torch.from_numpy(want[key])), (name, key)

    reshard.convert(tmp_path / "ds", tmp_path / "back", format="hf")
    _assert_same(_tensors(tmp_path / "back"), want)
