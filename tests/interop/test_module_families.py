"""Families whose transformers module holds tensors its files do not: Phi-3's and GPT-OSS's fused ones (fused in the
files too), and transformers 5's fused experts of Mixtral, Qwen3-MoE and DeepSeek-V3 (``mlp.experts.gate_up_proj``,
per expert in the files); or holds some otherwise: GPT-2's Conv1D weights ``[in, out]``, a tied model's
``lm_head.weight`` beside the embedding. A DCP or DeepSpeed checkpoint names them as the module does, so that real
jobs load it:

- Hugging Face -> DCP: a real FSDP2 job (``dcp_jobs.load_model``, 3 ranks, DCP resharding at load) loads it into
  the family's transformers model and holds exactly what ``from_pretrained`` makes of the files (transformers' own
  fusion is the oracle), key for key;
- Hugging Face -> DeepSpeed ZeRO-2: ``deepspeed.initialize`` of the same model and ``load_checkpoint`` hold it too
  (GPT-OSS's ``gate_up_proj`` interleaves gate and up: its flat-buffer param is contiguous, its parts are not);
- back from either, and from DCP and DeepSpeed checkpoints of those module names resharded again, the
  safetensors are the original's byte for byte, under the files' names.
"""

from __future__ import annotations

import math

import dcp_jobs
import ds_jobs
import numpy as np
import pytest
import torch
from conftest import require
from interop.test_families_real import _save_tiny

import reshard
from reshard.models import FAMILIES, get_family

pytestmark = [pytest.mark.interop, pytest.mark.slow]

MODULE_FAMILIES = [n for n in FAMILIES if get_family(n).module_names() and n != "deepseek_v3_noqlora"]
"""DeepSeek-V3 without the queries' compression has DeepSeek-V3's experts: one of the two is enough here."""


def _module_state(model_class, hf) -> dict[str, torch.Tensor]:
    """What transformers makes of the files: its module's state dict."""
    model = model_class.from_pretrained(hf)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_files(a, b) -> None:
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert list(x) == list(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


def test_the_module_families_are_the_ones_transformers_fuses():
    assert MODULE_FAMILIES == ["phi3", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]


@pytest.mark.parametrize("name", [*MODULE_FAMILIES, "gpt2", "llama"])
def test_hugging_face_to_dcp_loads_in_a_real_fsdp2_job_as_transformers_holds_it_and_comes_back(tmp_path, name):
    """Fused tensors; and GPT-2's module holds its Conv1D weights ``[in, out]`` (the logical ones are ``[out, in]``;
    ``c_proj`` is square, so a wrong orientation would load without a word), and a tied model's state dict holds
    ``lm_head.weight`` beside the embedding (GPT-2 always, this Llama by its config; every tied family in
    ``tests/formats/test_module_view.py``): a real FSDP2 job loads the DCP checkpoint strictly, key for key as
    ``from_pretrained``, and it comes back to the files."""
    require("transformers")
    model_class = _save_tiny(name, tmp_path / "hf")
    want = _module_state(model_class, tmp_path / "hf")
    fused = [k for k in want if k.endswith(("gate_up_proj", "qkv_proj.weight", "gate_up_proj.weight"))]
    assert fused if name in MODULE_FAMILIES else "lm_head.weight" in want  # what the conversion must make

    reshard.convert(tmp_path / "hf", tmp_path / "dcp", format="dcp", to="dp=2")
    dcp_jobs.load_model(tmp_path / "dcp", tmp_path / "hf", 3, tmp_path / "dump.pt")
    got = torch.load(tmp_path / "dump.pt", weights_only=True)
    assert sorted(got) == sorted(f"model.{k}" for k in want)
    for k, v in want.items():
        assert got[f"model.{k}"].dtype == v.dtype and torch.equal(got[f"model.{k}"], v), k

    reshard.convert(tmp_path / "dcp", tmp_path / "dcp3", format="dcp", to="dp=3")
    reshard.convert(tmp_path / "dcp3", tmp_path / "back", format="hf")
    _same_files(tmp_path / "hf", tmp_path / "back")


def test_a_real_fsdp2_checkpoint_of_gpt2_goes_to_hugging_face_and_to_another_mesh_with_its_optimizer(tmp_path):
    """A real FSDP2 job's GPT-2 (3 ranks, two Adam steps): its Conv1D weights as the module holds them and the tied
    ``lm_head.weight`` beside the embedding. To Hugging Face: the job's own weights (torch's own consolidation of
    the checkpoint is the oracle); to DCP at 2 ranks: a real job loads model and optimizer state as they were, and
    trains on."""
    require("transformers")
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _save_tiny("gpt2", tmp_path / "hf")
    dcp_jobs.save(tmp_path / "real", "fsdp", 3, hf=tmp_path / "hf")
    (tmp_path / "real" / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    dcp_to_torch_save(tmp_path / "real", tmp_path / "real.pt")
    want = dcp_jobs.flatten(torch.load(tmp_path / "real.pt", weights_only=True))
    assert want["model.transformer.h.0.attn.c_attn.weight"].shape == (64, 192) and "model.lm_head.weight" in want

    reshard.convert(tmp_path / "real", tmp_path / "back", format="hf")
    files = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(f"model.{k}" for k in files) == sorted(k for k in want if k.startswith("model.")
                                                          and k != "model.lm_head.weight")
    for k, v in files.items():
        assert torch.equal(v, want[f"model.{k}"]), k

    reshard.convert(tmp_path / "real", tmp_path / "dcp2", format="dcp", to="dp=2")
    dcp_jobs.load(tmp_path / "dcp2", "fsdp", 2, tmp_path / "got.pt", hf=tmp_path / "hf")
    got = torch.load(tmp_path / "got.pt", weights_only=True)
    assert math.isfinite(got.pop("loss_after_step")) and got.keys() == want.keys()
    for k, v in want.items():
        assert (torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v), k


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_hugging_face_to_deepspeed_loads_in_deepspeed_as_transformers_fuses_it_and_comes_back(tmp_path, name):
    require("deepspeed")
    model_class = _save_tiny(name, tmp_path / "hf")
    want = _module_state(model_class, tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "ds", format="deepspeed", to="dp=2")
    ds_jobs.run(tmp_path, 2, "load", tmp_path / "ds", tmp_path / "dump.npz", frozen=False, buffers=False,
                hf=tmp_path / "hf")
    dump = dict(np.load(tmp_path / "dump.npz"))
    params = dict(model_class.from_pretrained(tmp_path / "hf").named_parameters())
    assert {k.split(":")[1] for k in dump if k.startswith("state:") and k.endswith(":master")} == set(params)
    for key, value in want.items():
        for state in ("param", "master") if key in params else ("param",):
            assert np.array_equal(dump[f"state:{key}:{state}"], value.numpy()), (key, state)

    reshard.convert(tmp_path / "ds", tmp_path / "ds3", format="deepspeed", to="dp=3")
    reshard.convert(tmp_path / "ds3", tmp_path / "dcp", format="dcp", to="dp=2")
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    _same_files(tmp_path / "hf", tmp_path / "back")


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt2"])
def test_load_into_fills_transformers_fused_experts_from_the_files_per_expert_tensors(tmp_path, name):
    """``load_into`` a real FSDP2 job's transformers model (2 ranks) straight from the Hugging Face files: each rank
    holds what ``dcp.load`` of the same checkpoint converted to DCP gives (whose fused and turned tensors are
    transformers' own, above), and so after a step."""
    import load_into_jobs

    require("transformers")
    _save_tiny(name, tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "hf-dcp", format="dcp", to="dp=2")
    out = tmp_path / "out"
    out.mkdir()
    load_into_jobs.run(2, out, load_into_jobs.load("hf", "fsdp", tmp_path / "hf", tmp_path / "hf-dcp",
                                                   optimizer=False), hf=tmp_path / "hf")
    for rank, r in enumerate(load_into_jobs.results(out, "hf", 2)):
        assert r["loaded"] == [] and r["stepped"] == [] and r["losses"][0] == r["losses"][1], (rank, r)
        assert r["share"] == r["expected_share"] <= r["bytes_read"], (rank, r)


def test_load_into_fills_fused_experts_and_their_adam_state_from_deepspeed(tmp_path):
    """A DeepSpeed ZeRO-2 Mixtral (module names, fp32 masters, Adam moments) into a real FSDP2 job at 3 ranks: as
    ``dcp.load`` of its DCP conversion gives, optimizer included, and so after a step."""
    import load_into_jobs

    require("transformers")
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "ds", format="deepspeed", to="dp=2", model="tiny-mixtral")
    reshard.convert(tmp_path / "ds", tmp_path / "hf", format="hf")  # the model's config.json, for the job
    reshard.convert(tmp_path / "ds", tmp_path / "dcp", format="dcp", to="dp=2")
    out = tmp_path / "out"
    out.mkdir()
    load_into_jobs.run(3, out, load_into_jobs.load("ds", "fsdp", tmp_path / "ds", tmp_path / "dcp"), hf=tmp_path / "hf")
    for rank, r in enumerate(load_into_jobs.results(out, "ds", 3)):
        assert r["loaded"] == [] and r["stepped"] == [] and r["losses"][0] == r["losses"][1], (rank, r)
        assert r["states"] == ["master", "exp_avg", "exp_avg_sq"] and r["zeros"] == [], (rank, r)
