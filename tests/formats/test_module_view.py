"""A module's state dict whose names are not its family's files' names (``reshard.formats.module_view``), without
a framework job: transformers 5's fused experts of a Mixtral.

- Hugging Face -> DCP names each layer's experts as the module holds them (``mlp.experts.gate_up_proj``
  ``[experts, 2f, h]`` = each expert's gate rows then up rows, ``down_proj`` ``[experts, h, f]``), chunked over dp
  as FSDP2 chunks them, and torch's own consolidation of it equals the files' tensors stacked so;
- such a DCP (and a DeepSpeed checkpoint of those names) is read in the family's per-expert tensors: back to Hugging
  Face bit-exact, and through DeepSpeed with its Adam state;
- a DCP written with the files' names (a transformers 4 job's) keeps them when resharded.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from test_format_dcp import consolidated

import reshard
from reshard.fixtures import MODELS, make_fixture

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
