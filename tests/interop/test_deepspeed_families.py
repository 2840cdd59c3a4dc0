"""A Hugging Face model whose output projection is always tied (Gemma), converted to DeepSpeed ZeRO-2 by its
family's layout and judged by DeepSpeed itself: ``deepspeed.initialize`` of the same transformers model and
``load_checkpoint`` hold exactly the Hugging Face weights, and back to Hugging Face the safetensors are the
original's bit for bit, with identical logits.
"""

from __future__ import annotations

import ds_jobs
import numpy as np
import pytest
from conftest import require
from interop.test_families_real import _logits, _save_tiny

import reshard

pytestmark = [pytest.mark.interop, pytest.mark.slow]


def test_a_tied_gemma_goes_to_deepspeed_loads_there_with_its_weights_and_comes_back_bit_exactly(tmp_path):
    require("deepspeed")
    import torch
    from safetensors.torch import load_file

    model_class = _save_tiny("gemma", tmp_path / "hf")
    result = reshard.convert(tmp_path / "hf", tmp_path / "ds", format="deepspeed", to="dp=2")
    assert result.report.target.spec_name == "deepspeed-gemma"
    tag = (tmp_path / "ds" / "latest").read_text().strip()
    tree = torch.load(tmp_path / "ds" / tag / "mp_rank_00_model_states.pt", weights_only=False)
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    # As DeepSpeed saves a tied model: the embedding once in the flat buffer, both keys in the module.
    assert tree["shared_params"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in tree["param_shapes"][0] and len(tree["param_shapes"][0]) == len(hf)
    assert set(tree["module"]) == set(hf) | {"lm_head.weight"}

    ds_jobs.run(tmp_path, 2, "load", tmp_path / "ds", tmp_path / "dump.npz", frozen=False, buffers=False,
                hf=tmp_path / "hf")
    dump = dict(np.load(tmp_path / "dump.npz"))
    held = {k.split(":")[1] for k in dump if k.startswith("state:")}
    assert held == set(hf)  # named_parameters() lists the tied head once, as the embedding
    for name, value in hf.items():
        for state in ("param", "master"):
            assert np.array_equal(dump[f"state:{name}:{state}"], value.numpy()), (name, state)
    assert np.isfinite(dump["loss"])

    reshard.convert(tmp_path / "ds", tmp_path / "back", format="hf")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert list(back) == list(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    ids = torch.arange(12).reshape(2, 6)
    (cls_a, a), (cls_b, b) = _logits(model_class, tmp_path / "hf", ids), _logits(model_class, tmp_path / "back", ids)
    assert cls_a is cls_b and torch.equal(a, b)
