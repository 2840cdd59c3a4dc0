"""Universal checkpoints (DeepSpeed's UCP folder) written by reshard and read back.

The sources are reshard-written DeepSpeed ZeRO checkpoints of the tiny Llama of
``test_format_deepspeed`` with distinct values per tensor and state, so a tensor
or state landing in the wrong file shows. Real DeepSpeed reads these folders in
``test_format_deepspeed`` (load_universal, compared with ``ds_to_universal``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_format_deepspeed import SIZES, hf_order, logical_of, write_checkpoint

import reshard
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.io.torchfile import TensorRef, read_torch_file


@pytest.fixture(params=["float32", "bfloat16"])
def ds_checkpoint(request, tmp_path):
    write_checkpoint(tmp_path / "ds", "dp=2", dtype=request.param, global_steps=7)
    return tmp_path / "ds", request.param


def test_every_param_gets_a_folder_of_whole_tensors_and_the_states_come_back_bit_exactly(ds_checkpoint, tmp_path):
    src, dtype = ds_checkpoint
    result = reshard.convert(src, tmp_path / "ucp", format="ucp", sizes={"heads": 4})
    zero = tmp_path / "ucp" / "global_step7" / "zero"
    assert (tmp_path / "ucp" / "latest_universal").read_text() == "global_step7"
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(hf_order())
    for name in hf_order():
        assert sorted(p.name for p in (zero / name).iterdir()) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
        fp32 = read_torch_file(zero / name / "fp32.pt")
        assert list(fp32) == ["cat_dim", "param"] and fp32["cat_dim"] == 0
        assert fp32["param"].dtype == "float32" and fp32["param"].shape == reshard.open_checkpoint(
            src, sizes={"heads": 4}).layout.tensors[name].shape
        step = read_torch_file(zero / name / "step.pt")
        assert isinstance(step, TensorRef) and step.shape == () and step.dtype == "float32"
        assert np.fromfile(step.path, np.float32, 1, offset=step.data_offset)[0] == 7.0
    state = read_torch_file(zero / "optimizer_state.pt")
    assert "param_groups" in state and not {"base_optimizer_state", "single_partition_of_fp32_groups",
                                            "param_slice_mappings"} & set(state)
    model = read_torch_file(tmp_path / "ucp" / "global_step7" / "mp_rank_00_model_states.pt")
    assert list(model["module"]) == hf_order() and {t.dtype for t in model["module"].values()} == {dtype}
    # Every logical tensor and state reads back as the source holds it (the weights from the model file).
    before, after = logical_of(src), logical_of(tmp_path / "ucp")
    assert set(after) == set(before)
    for key, value in after.items():
        np.testing.assert_array_equal(value.reshape(-1), before[key].reshape(-1), err_msg=str(key))
    weights = {name: np.fromfile(t.path, np.float32 if dtype == "float32" else np.uint16, int(np.prod(t.shape)),
                                 offset=t.data_offset) for name, t in model["module"].items()}
    for name, value in weights.items():
        np.testing.assert_array_equal(value, before[(name, "param")].reshape(-1), err_msg=name)
    assert json.loads((tmp_path / "ucp" / "config.json").read_text())["num_attention_heads"] == SIZES["heads"]
    assert result.bytes_read <= 1.05 * result.report.needed_bytes()


def test_two_workers_write_the_same_folder(tmp_path):
    write_checkpoint(tmp_path / "ds", "dp=2", dtype="bfloat16")
    reshard.convert(tmp_path / "ds", tmp_path / "one", format="ucp", sizes={"heads": 4})
    reshard.convert(tmp_path / "ds", tmp_path / "two", format="ucp", sizes={"heads": 4}, workers=2)
    one = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert one == sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*") if p.is_file())
    for rel in one:
        if rel.name != "reshard.json":
            assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes(), rel


def test_a_universal_folder_converts_back_to_zero_at_another_dp(tmp_path):
    write_checkpoint(tmp_path / "ds", "dp=2", dtype="float32")
    reshard.convert(tmp_path / "ds", tmp_path / "ucp", format="ucp", sizes={"heads": 4})
    reshard.convert(tmp_path / "ucp", tmp_path / "dp3", format="deepspeed", to="dp=3")
    before, after = logical_of(tmp_path / "ds"), logical_of(tmp_path / "dp3")
    for key in ((n, s) for n in hf_order() for s in ("master", "exp_avg", "exp_avg_sq")):
        np.testing.assert_array_equal(after[key].reshape(-1), before[key].reshape(-1), err_msg=str(key))
    # the weights in the training dtype travel in the universal folder's model file
    np.testing.assert_array_equal(after[("lm_head.weight", "param")], before[("lm_head.weight", "param")])


def test_a_topology_is_refused_because_the_loading_job_picks_it(tmp_path):
    write_checkpoint(tmp_path / "ds", "dp=2")
    with pytest.raises(TopologyError, match="no topology"):
        reshard.convert(tmp_path / "ds", tmp_path / "ucp", format="ucp", to="dp=2", sizes={"heads": 4})
    assert not (tmp_path / "ucp").exists()


def test_bf16_weights_without_master_copies_are_refused(tmp_path):
    write_checkpoint(tmp_path / "ds", "dp=2", dtype="bfloat16")
    reshard.convert(tmp_path / "ds", tmp_path / "hf", format="hf", sizes={"heads": 4})  # weights only, bf16
    with pytest.raises(CheckpointFormatError, match="fp32 master weights"):
        reshard.convert(tmp_path / "hf", tmp_path / "ucp", format="ucp")
    assert not (tmp_path / "ucp").exists()


def test_a_zero3_source_gets_the_folder_ds_to_universal_writes_for_zero3(tmp_path):
    """Flat per-param tensors, no step.pt, a stage-3 optimizer_state.pt and a stage-3 model file."""
    write_checkpoint(tmp_path / "ds", "dp=2", dtype="bfloat16", global_steps=5)
    reshard.convert(tmp_path / "ds", tmp_path / "z3", to="dp=3,zero=3", sizes={"heads": 4})
    reshard.convert(tmp_path / "z3", tmp_path / "ucp", format="ucp")
    tag = tmp_path / "ucp" / "global_step5"
    assert not (tag / "mp_rank_00_model_states.pt").exists()
    model = read_torch_file(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert list(model["module"]) == hf_order() and all(t.shape == (0,) and t.dtype == "bfloat16"
                                                      for t in model["module"].values())
    assert list(model["param_shapes"][0]) == hf_order()
    for name in hf_order():
        assert sorted(p.name for p in (tag / "zero" / name).iterdir()) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt"]
        flat = read_torch_file(tag / "zero" / name / "fp32.pt")
        assert isinstance(flat, TensorRef) and len(flat.shape) == 1 and flat.dtype == "float32"
    state = read_torch_file(tag / "zero" / "optimizer_state.pt")
    assert state["param_groups"] == state["optimizer_state_dict"]["param_groups"]
    step = state["optimizer_state_dict"]["state"][0]["step"]
    assert np.fromfile(step.path, np.float32, 1, offset=step.data_offset)[0] == 5.0
    before, after = logical_of(tmp_path / "ds"), logical_of(tmp_path / "ucp")
    assert set(after) == {k for k in before if k[1] != "param"}
    for key, value in after.items():
        np.testing.assert_array_equal(value.reshape(-1), before[key].reshape(-1), err_msg=str(key))
    assert reshard.open_checkpoint(tmp_path / "ucp").progress.step == 5
    # zero=3 asks for the same folder from a ZeRO-1/2 source
    reshard.convert(tmp_path / "ds", tmp_path / "ucp-from-z2", format="ucp", to="zero=3", sizes={"heads": 4})
    assert (tmp_path / "ucp-from-z2" / "global_step5" / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()


def test_the_optimizer_step_travels_through_a_dcp_checkpoint_and_back(tmp_path):
    """The step a universal checkpoint records reaches DCP (Adam's per-parameter ``step``) and comes back
    as the universal folder's ``step.pt``: training progress is carried across formats, never reset."""
    write_checkpoint(tmp_path / "ds", "dp=2", dtype="bfloat16", global_steps=5)
    reshard.convert(tmp_path / "ds", tmp_path / "ucp", format="ucp", sizes={"heads": 4})
    reshard.convert(tmp_path / "ucp", tmp_path / "dcp", format="dcp", to="dp=3")
    assert reshard.open_checkpoint(tmp_path / "dcp").progress.step == 5
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="ucp")
    assert reshard.open_checkpoint(tmp_path / "back").progress.step == 5
    step = read_torch_file(next((tmp_path / "back").glob("*/zero/model.norm.weight/step.pt")))
    assert np.fromfile(step.path, np.float32, 1, offset=step.data_offset)[0] == 5.0
