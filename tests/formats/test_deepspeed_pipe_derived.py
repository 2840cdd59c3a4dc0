"""DeepSpeed pipeline-engine checkpoints of a model no family describes: layouts derived from what they record.

The model is a custom ``PipelineModule`` layer list, no Llama: an embedding (layer 0), a Linear with a bias
(1), a parameterless activation module (2, whose layer file is empty), a frozen Linear (3), a norm with a
persistent buffer inside a submodule (4) and a head (5); two param groups (weight decay on weights, none on
biases and norms), pp=2 with layers 0-2 on stage 0. Its files are written by reshard's writer from
in-memory values and checked against an independent numpy construction of each stage's flat partitions;
then read back without a config.json or a spec, resharded and converted, every value compared.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict

import numpy as np
import pytest
from conftest import logical_values
from safetensors.numpy import load_file

import reshard
from reshard.core.layout import PARAM
from reshard.errors import CheckpointFormatError
from reshard.execution.arrays import gather, scatter
from reshard.formats.base import Source
from reshard.formats.deepspeed import FORMAT
from reshard.formats.deepspeed.derive import DsModel
from reshard.formats.derived import Recorded
from reshard.io.torchfile import TensorRef, TorchSize, read_torch_file, write_torch_file

TENSORS = (Recorded("0.weight", (40, 8)), Recorded("1.weight", (12, 8)), Recorded("1.bias", (12,)),
           Recorded("3.weight", (12, 12)), Recorded("3.bias", (12,)), Recorded("4.norm.weight", (12,)),
           Recorded("4.norm.bias", (12,)), Recorded("4.scale", (12,)), Recorded("5.weight", (40, 12)))
STAGE0 = (("0.weight", "1.weight"), ("1.bias",))
STAGE1 = (("5.weight",), ("4.norm.weight", "4.norm.bias"))
PIPE = DsModel(tensors=TENSORS, groups=(STAGE0[0] + STAGE1[0], STAGE0[1] + STAGE1[1]),
               module=tuple((t.name, t.name) for t in TENSORS), frozen=("3.weight", "3.bias"), buffers=("4.scale",),
               stages=tuple((t.name, 1 if int(t.name.split(".")[0]) >= 3 else 0) for t in TENSORS))
STATES = ("param", "master", "exp_avg", "exp_avg_sq")
TRAINED = {n for g in PIPE.groups for n in g}
TAG = "global_step1"
CONFIG = {"model_type": "my-pipeline-net", "architectures": ["MyPipelineNet"]}


def write_pipe(out, topology: str = "pp=2,dp=2") -> dict:
    """A pipeline checkpoint of the custom model, as the pipeline engine lays it out; its values."""
    target = FORMAT.new_target(topology, {}, model=PIPE, dtype="float32", zero_stage=1, weight_decay=(0.1, 0.0))
    target.extra["deepspeed"] = dataclasses.replace(target.extra["deepspeed"], empty_layers=(2,))
    values = {k: v for k, v in logical_values(target.layout, STATES).items() if k[1] == PARAM or k[0] in TRAINED}
    items = scatter(target.layout, values, dtype=dict.fromkeys(STATES, np.float32))
    FORMAT.write(target, out, lambda item, lo, hi: memoryview(items[item][lo:hi]).cast("B"))
    return values


def read(ref, count=None) -> np.ndarray:
    offset = ref.data_offset if isinstance(ref, TensorRef) else ref.offset
    return np.fromfile(ref.path, dtype=np.float32, count=ref.numel if count is None else count, offset=offset)


def logical_read(src: Source) -> dict:
    return gather(src.layout, {item: read(loc, src.layout.items[item].numel) for item, loc in src.where.items()})


def partitions(values, state, names, dp):
    """DeepSpeed's flat partitions of one stage's param group: concatenated, zero-padded to 2 * dp, split."""
    flat = np.concatenate([values[(n, state)].ravel() for n in names])
    padded = -(-flat.size // (2 * dp)) * 2 * dp
    return np.split(np.concatenate([flat, np.zeros(padded - flat.size, flat.dtype)]), dp)


def assert_files_hold(path, values, dp: int) -> None:
    """Each stage's model and optimizer files and every layer file hold what the pipeline engine writes."""
    tag = path / TAG
    for p, (stage, buffers) in enumerate(((STAGE0, []), (STAGE1, ["4.scale"]))):
        sd = read_torch_file(tag / f"mp_rank_{p:02d}_model_states.pt")
        assert sd["module"] is None and sd["mp_world_size"] == 2 and sd["dp_world_size"] == dp
        assert [list(g) for g in sd["param_shapes"]] == [list(g) for g in stage]
        assert sd["buffer_names"] == buffers
        for d in range(dp):
            osd = read_torch_file(tag / f"zero_pp_rank_{d}_mp_rank_{p:02d}_optim_states.pt")["optimizer_state_dict"]
            for g, names in enumerate(stage):
                for state in ("exp_avg", "exp_avg_sq"):
                    np.testing.assert_array_equal(read(osd["base_optimizer_state"]["state"][g][state]),
                                                  partitions(values, state, names, dp)[d])
                master = osd["single_partition_of_fp32_groups"][g]
                np.testing.assert_array_equal(read(master), partitions(values, "master", names, dp)[d][:master.numel])
    layers = sorted(p.name for p in tag.glob("layer_*"))
    assert layers == [f"layer_{i:02d}-model_00-model_states.pt" for i in range(6)]
    assert read_torch_file(tag / layers[2]) == {}  # the activation's
    layer4 = read_torch_file(tag / layers[4])
    assert sorted(layer4) == ["norm.bias", "norm.weight", "scale"]
    for local, ref in layer4.items():
        np.testing.assert_array_equal(read(ref), values[(f"4.{local}", PARAM)].ravel())


def test_the_files_hold_what_the_pipeline_engine_writes(tmp_path):
    values = write_pipe(tmp_path)
    assert_files_hold(tmp_path, values, 2)
    assert not (tmp_path / "config.json").exists()


def test_open_derives_each_stage_from_its_model_file_and_the_layer_files(tmp_path):
    values = write_pipe(tmp_path)
    src = reshard.open_checkpoint(tmp_path)  # no config.json, no spec, no sizes
    assert src.spec_name == "deepspeed-pipe-derived" and str(src.topology) == "tp=1,pp=2,dp=2,zero=1"
    assert list(src.layout.tensors) == [t.name for t in TENSORS]  # every tensor under its recorded name
    stage_of = {f.tensor: dict(f.item.unit)["pp"] for f in src.layout.fragments if f.item.section != "optim"}
    # the frozen layer 3 no model file names sits with the told layer before it; nothing written depends on it
    assert stage_of == {**dict(PIPE.stages), "3.weight": 0, "3.bias": 0}
    assert src.extra["deepspeed"].empty_layers == (2,)
    assert "5.weight @stage(1) = d0_40 d1_12" in src.spec.lines
    got = logical_read(src)
    assert got.keys() == values.keys()
    for key, value in values.items():
        np.testing.assert_array_equal(got[key].reshape(value.shape), value, err_msg=str(key))


@pytest.mark.parametrize("to,dp", [("pp=2,dp=3", 3), ("pp=2,dp=1", 1)])
def test_a_new_dp_at_the_same_pp_rebuilds_each_stages_partitions(tmp_path, to, dp):
    values = write_pipe(tmp_path / "src")
    result = reshard.convert(tmp_path / "src", tmp_path / "out", to=to)
    assert result.report.target.spec_name == "deepspeed-pipe-derived"
    assert_files_hold(tmp_path / "out", values, dp)
    src = reshard.open_checkpoint(tmp_path / "out")
    got = logical_read(src)
    assert src.spec_name == "deepspeed-pipe-derived" and got.keys() == values.keys()
    for key, value in values.items():
        np.testing.assert_array_equal(got[key].reshape(value.shape), value, err_msg=str(key))
    if dp == 3:  # workers write the same files, the empty layer's by the call that writes the item-less ones
        reshard.convert(tmp_path / "src", tmp_path / "workers", to=to, workers=2)
        for f in (tmp_path / "out" / TAG).iterdir():
            assert f.read_bytes() == (tmp_path / "workers" / TAG / f.name).read_bytes(), f.name


def test_to_safetensors_and_dcp_every_tensor_keeps_its_recorded_name(tmp_path):
    values = write_pipe(tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text(json.dumps(CONFIG))  # Hugging Face needs the model's config
    reshard.convert(tmp_path / "src", tmp_path / "hf", format="hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == CONFIG
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(hf) == sorted(t.name for t in TENSORS)
    for name, array in hf.items():
        assert array.dtype == np.float32 and array.tobytes() == values[(name, PARAM)].tobytes(), name
    reshard.convert(tmp_path / "src", tmp_path / "dcp", format="dcp", to="dp=2")
    dcp = reshard.open_checkpoint(tmp_path / "dcp")
    got = logical_read(dcp)
    for (name, state), value in got.items():  # FSDP2 trains in fp32: its weights are the fp32 masters
        name = name.removeprefix("model.")
        want = values[(name, "master" if state == PARAM and name in TRAINED else state)]
        assert value.tobytes() == want.tobytes(), (name, state)
    assert {n.removeprefix("model.") for n, s in got if s == PARAM} == {t.name for t in TENSORS}
    assert {n.removeprefix("optim.state.") for n, s in got if s == "exp_avg"} == TRAINED


@pytest.mark.parametrize("to,why", [
    ("pp=1,dp=2", "which stage holds '4.norm.weight' (on stage 1 of 2) at pp=1 is the model's PipelineModule "
                  "partitioning"),
    ("pp=2,tp=2,dp=1", "how tensor parallelism splits '4.norm.weight' at tp=2 is the model's code"),
])
def test_another_pp_or_tp_is_refused_naming_the_tensor_and_what_to_pass(tmp_path, to, why):
    write_pipe(tmp_path / "src")
    with pytest.raises(CheckpointFormatError) as e:
        reshard.convert(tmp_path / "src", tmp_path / "out", to=to)
    assert str(e.value) == (
        f"{tmp_path / 'src'}: a pipeline-engine checkpoint of a model no family describes, at pp=2: {why}, which "
        "DeepSpeed does not record; convert it at pp=2 and tp=1, or put the model's config.json naming a family "
        "reshard knows beside it (or give a spec, deepspeed-pipe-<family>)")
    assert not (tmp_path / "out").exists()


def test_tied_pipeline_modules_are_refused(tmp_path):
    write_pipe(tmp_path)
    model = tmp_path / TAG / "mp_rank_01_model_states.pt"
    tree = read_torch_file(model)
    tree["param_shapes"][0] = OrderedDict([("tied_modules.embed.weight", TorchSize((40, 8))),
                                           *tree["param_shapes"][0].items()])
    write_torch_file(model, tree, {})
    with pytest.raises(CheckpointFormatError) as e:
        reshard.open_checkpoint(tmp_path)
    assert str(e.value) == (f"{model}: param_shapes[0] names 'tied_modules.embed.weight': tied pipeline modules "
                            "(tied_modules.*) are not supported")


def test_a_plain_engine_checkpoint_of_an_nn_sequential_is_no_pipeline(tmp_path):
    """An ``nn.Sequential``'s params are named '<index>.<name>' as a pipeline's are; the model files say which."""
    plain = DsModel(tensors=TENSORS[:3], groups=(("0.weight", "1.weight", "1.bias"),),
                    module=tuple((t.name, t.name) for t in TENSORS[:3]))
    target = FORMAT.new_target("dp=2", {}, model=plain, dtype="float32", zero_stage=1)
    values = logical_values(target.layout, STATES)
    items = scatter(target.layout, values, dtype=dict.fromkeys(STATES, np.float32))
    FORMAT.write(target, tmp_path, lambda item, lo, hi: memoryview(items[item][lo:hi]).cast("B"))
    assert not list((tmp_path / TAG).glob("layer_*"))
    assert list(read_torch_file(tmp_path / TAG / "mp_rank_00_model_states.pt")["module"]) == [
        "0.weight", "1.weight", "1.bias"]
    src = reshard.open_checkpoint(tmp_path)
    assert src.spec_name == "deepspeed-derived" and src.topology.pp == 1
    got = logical_read(src)
    for key, value in values.items():
        np.testing.assert_array_equal(got[key].reshape(value.shape), value, err_msg=str(key))
