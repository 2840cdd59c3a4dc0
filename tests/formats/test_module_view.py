"""A module's state dict whose names are not its family's files' names (``reshard.formats.module_view``), without
a framework job: transformers 5's fused experts of a Mixtral, GPT-2's turned weights and tied output projections.

- Hugging Face -> DCP names each layer's experts as the module holds them (``mlp.experts.gate_up_proj``
  ``[experts, 2f, h]`` = each expert's gate rows then up rows, ``down_proj`` ``[experts, h, f]``), chunked over dp
  as FSDP2 chunks them, and torch's own consolidation of it equals the files' tensors stacked so;
- such a DCP (and a DeepSpeed checkpoint of those names) is read in the family's per-expert tensors: back to Hugging
  Face bit-exact, and through DeepSpeed with its Adam state;
- a DCP written with the files' names (a transformers 4 job's) keeps them when resharded;
- GPT-2's Conv1D weights are held ``[in, out]`` in a DCP, as the module holds them, at tp too; a DCP of them in the
  logical dims (as reshard wrote GPT-2 before) is read as it is, one of both dims is refused;
- a tied model's DCP holds ``lm_head.weight`` beside the embedding, as FSDP2's state dict does.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_deepspeed_tied_families import TIED, save_hf
from test_format_dcp import consolidated

import reshard
from reshard.fixtures import MODELS, make_fixture
from reshard.formats.specs import tied_head
from reshard.models import get_family

E, LAYERS = MODELS["tiny-mixtral"].sizes["experts"], MODELS["tiny-mixtral"].sizes["layers"]


@pytest.fixture
def hf(tmp_path):
    make_fixture(tmp_path / "hf", format="hf", model="tiny-mixtral")
    return tmp_path / "hf", load_file(tmp_path / "hf" / "model.safetensors")


def _fused(files: dict[str, torch.Tensor], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    at = f"model.layers.{i}.block_sparse_moe.experts."
    gate_up = torch.stack([torch.cat([files[f"{at}{e}.w1.weight"], files[f"{at}{e}.w3.weight"]]) for e in range(E)])
    return gate_up, torch.stack([files[f"{at}{e}.w2.weight"] for e in range(E)])


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_dcp_holds_the_experts_fused_as_transformers_5s_module_and_comes_back(hf, tmp_path):
    src, files = hf
    reshard.convert(src, tmp_path / "dcp", format="dcp", to="dp=3")
    model = consolidated(tmp_path / "dcp", tmp_path)["model"]
    assert not any(".block_sparse_moe." in k for k in model)
    for i in range(LAYERS):
        gate_up, down = _fused(files, i)
        at = f"model.layers.{i}.mlp."
        assert torch.equal(model[at + "experts.gate_up_proj"], gate_up)
        assert torch.equal(model[at + "experts.down_proj"], down)
        assert torch.equal(model[at + "gate.weight"], files[f"model.layers.{i}.block_sparse_moe.gate.weight"])
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    _same(load_file(tmp_path / "back" / "model.safetensors"), files)


def test_module_names_with_adam_state_go_through_deepspeed_and_back(tmp_path):
    """A DCP of fp32 masters and Adam moments under the module's names: to DeepSpeed (the same names in its flat
    buffers) and back to DCP at another dp, every entry equal to the original's."""
    make_fixture(tmp_path / "dcp", format="dcp", to="dp=2", model="tiny-mixtral")
    want = consolidated(tmp_path / "dcp", tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj" in want["model"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in want["optim"]["state"]
    reshard.convert(tmp_path / "dcp", tmp_path / "ds", format="deepspeed", to="dp=3")
    tree = torch.load(next((tmp_path / "ds").glob("*/mp_rank_00_model_states.pt")), weights_only=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in tree["param_shapes"][0]
    reshard.convert(tmp_path / "ds", tmp_path / "back", format="dcp", to="dp=3")
    got = consolidated(tmp_path / "back", tmp_path)
    _same(dict(sorted(got["model"].items())), dict(sorted(want["model"].items())))
    for key, states in want["optim"]["state"].items():
        for state, value in states.items():
            assert torch.equal(got["optim"]["state"][key][state], value), (key, state)


def test_a_dcp_of_the_files_names_keeps_them(hf, tmp_path):
    src, files = hf
    dcp.save({"model": dict(files)}, checkpoint_id=tmp_path / "v4")
    (tmp_path / "v4" / "config.json").write_text((src / "config.json").read_text())
    reshard.convert(tmp_path / "v4", tmp_path / "dcp", format="dcp", to="dp=2")
    _same(consolidated(tmp_path / "dcp", tmp_path)["model"], dict(files))
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    _same(load_file(tmp_path / "back" / "model.safetensors"), files)


def test_a_tensor_parallel_dcp_of_fused_experts_is_refused(hf, tmp_path):
    with pytest.raises(reshard.errors.TopologyError, match=r"packed_colwise"):
        reshard.convert(hf[0], tmp_path / "dcp", format="dcp", to="dp=2,tp=2")
    assert not (tmp_path / "dcp").exists()
    assert json.loads((hf[0] / "config.json").read_text())["model_type"] == "mixtral"


# -- GPT-2: Conv1D weights held [in, out], and the tied output projection beside the embedding ----------------------

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@pytest.fixture
def gpt2(tmp_path):
    make_fixture(tmp_path / "gpt2", format="hf", model="tiny-gpt2")
    return tmp_path / "gpt2", load_file(tmp_path / "gpt2" / "model.safetensors")


@pytest.mark.parametrize("to", ["dp=3", "tp=2,dp=2"])
def test_gpt2_dcp_holds_conv1d_weights_and_the_tied_head_as_the_module_does(gpt2, tmp_path, to):
    """GPT2LMHeadModel's state dict: its files' tensors as they are (``c_attn.weight`` ``[h, 3h]``) and
    ``lm_head.weight``, the embedding; at tp 2 too. Back to the files bit-exact."""
    src, files = gpt2
    reshard.convert(src, tmp_path / "dcp", format="dcp", to=to)
    model = consolidated(tmp_path / "dcp", tmp_path)["model"]
    assert sorted(model) == sorted([*files, "lm_head.weight"])
    _same({k: model[k] for k in files}, files)
    assert torch.equal(model["lm_head.weight"], files["transformer.wte.weight"])
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    _same(load_file(tmp_path / "back" / "model.safetensors"), files)


@pytest.mark.parametrize("held", ["module", "logical"])
def test_a_gpt2_dcp_is_read_in_the_dims_its_conv1d_weights_are_held_in(gpt2, tmp_path, held):
    """A job's DCP holds the Conv1D weights as the module does, with ``lm_head.weight``; one reshard wrote before
    holds them in the logical dims ``[out, in]``, without it (``c_proj`` is square: ``c_attn`` tells). Either goes
    back to the files bit-exact, and to a DCP as the module holds it."""
    src, files = gpt2
    state = {k: v.t().contiguous() if held == "logical" and k.endswith(_CONV1D) else v for k, v in files.items()}
    if held == "module":
        state["lm_head.weight"] = files["transformer.wte.weight"]
    dcp.save({"model": state}, checkpoint_id=tmp_path / "job")
    (tmp_path / "job" / "config.json").write_text((src / "config.json").read_text())
    reshard.convert(tmp_path / "job", tmp_path / "back", format="hf")
    _same(load_file(tmp_path / "back" / "model.safetensors"), files)
    reshard.convert(tmp_path / "job", tmp_path / "dcp", format="dcp", to="dp=2")
    model = consolidated(tmp_path / "dcp", tmp_path)["model"]
    _same({k: model[k] for k in files}, files)
    assert torch.equal(model["lm_head.weight"], files["transformer.wte.weight"])


def test_a_gpt2_dcp_with_conv1d_weights_in_both_dims_is_refused(gpt2, tmp_path):
    src, files = gpt2
    state = {k: v.t().contiguous() if k.endswith("mlp.c_fc.weight") else v for k, v in files.items()}
    dcp.save({"model": state}, checkpoint_id=tmp_path / "job")
    (tmp_path / "job" / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(reshard.errors.CheckpointFormatError, match=r"c_attn.weight' is as the module holds it, "
                                                                   r"'transformer.h.0.mlp.c_fc.weight' as its logical"):
        reshard.convert(tmp_path / "job", tmp_path / "back", format="hf")
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("name", TIED)
def test_a_tied_model_s_dcp_holds_its_output_projection_beside_the_embedding(tmp_path, name):
    """As FSDP2's ``get_state_dict`` of the transformers model holds it (a real job loads it: the interop tests), with
    no optimizer state of its own; the files come back without it."""
    files = save_hf(name, tmp_path / "hf")
    embed = tied_head(get_family(name), True)[1].name
    reshard.convert(tmp_path / "hf", tmp_path / "dcp", format="dcp", to="dp=3")
    model = consolidated(tmp_path / "dcp", tmp_path)["model"]
    assert sorted(model) == sorted([*files, "lm_head.weight"])
    assert all(np.array_equal(model[k].numpy(), v) for k, v in files.items())
    assert np.array_equal(model["lm_head.weight"].numpy(), files[embed])
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(files) and all(np.array_equal(back[k].numpy(), v) for k, v in files.items())
