"""DeepSpeed checkpoints of a model no family describes: layouts derived from what the files record.

The model is small and custom: two param groups (weight decay on weights, none on biases), a frozen
weight, a persistent buffer that comes first in the module (as a root module's buffer does), and a head
tied to the embedding. Its files are written by reshard's writer from in-memory values and checked
against an independent numpy construction of DeepSpeed's flat partitions; then read back, resharded and
read again, every logical tensor and state compared element for element.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
from conftest import logical_values

import reshard
from reshard.core.planner import plan
from reshard.core.topology import parse_topology
from reshard.errors import CheckpointFormatError
from reshard.execution.arrays import gather, scatter
from reshard.execution.executor import ByteReader, PlanFill
from reshard.formats.base import Source
from reshard.formats.deepspeed import FORMAT
from reshard.formats.deepspeed.derive import DsModel, recorded_model
from reshard.formats.derived import Recorded
from reshard.io.torchfile import TensorRef, TorchSize, read_torch_file

TENSORS = (Recorded("scale", (12,)), Recorded("embed.weight", (40, 8)), Recorded("proj.weight", (12, 8)),
           Recorded("proj.bias", (12,)), Recorded("frozen.weight", (12, 12)), Recorded("out.weight", (8, 12)),
           Recorded("out.bias", (8,)))
DECAY, NO_DECAY = ("embed.weight", "proj.weight", "out.weight"), ("proj.bias", "out.bias")
CUSTOM = DsModel(tensors=TENSORS, groups=(DECAY, NO_DECAY),
                 module=(*((t.name, t.name) for t in TENSORS), ("head.weight", "embed.weight")),
                 frozen=("frozen.weight",), buffers=("scale",))
STATES = ("param", "master", "exp_avg", "exp_avg_sq")
TRAINED = DECAY + NO_DECAY
CONFIG = {"model_type": "my-custom-net", "architectures": ["MyNet"], "hidden": 8}


def write_custom(out, topology="dp=2", *, zero_stage=2, model=CUSTOM):
    target = FORMAT.new_target(topology, {}, model=model, dtype="float32", zero_stage=zero_stage,
                               weight_decay=(0.1, 0.0))
    target.model.config = dict(CONFIG)
    values = {k: v for k, v in logical_values(target.layout, STATES).items()
              if k[1] == "param" or k[0] in TRAINED}
    items = scatter(target.layout, values, dtype=dict.fromkeys(STATES, np.float32))

    def fill(item, lo, hi):
        return memoryview(items[item][lo:hi]).cast("B")

    FORMAT.write(target, out, fill)
    return values


def read(ref, count=None) -> np.ndarray:
    offset = ref.data_offset if isinstance(ref, TensorRef) else ref.offset
    n = ref.numel if count is None else count
    return np.fromfile(ref.path, dtype=np.float32, count=n, offset=offset)


def logical_read(src: Source) -> dict:
    items = {item: read(loc, src.layout.items[item].numel) for item, loc in src.where.items()}
    return gather(src.layout, items)


def assert_values(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key].reshape(value.shape), value, err_msg=str(key))


def reshard_to(src: Source, topology: str, out, spec=None):
    dst = FORMAT.target(src, parse_topology(topology), spec=spec)
    p = plan(src.layout, dst.layout)
    p.validate()
    with ByteReader() as reader:
        fill = PlanFill(p, src.where, reader)
        dst.dtypes = dict(fill.dtypes)
        FORMAT.write(dst, out, fill)
    return dst


def partitions(values, state, names, dp):
    flat = np.concatenate([values[(n, state)].ravel() for n in names])
    padded = -(-flat.size // (2 * dp)) * 2 * dp
    return np.split(np.concatenate([flat, np.zeros(padded - flat.size, flat.dtype)]), dp)


def test_the_files_hold_what_deepspeed_writes_for_groups_frozen_params_buffers_and_ties(tmp_path):
    values = write_custom(tmp_path, "dp=2")
    sd = read_torch_file(tmp_path / "global_step1/mp_rank_00_model_states.pt")
    assert list(sd["module"]) == [*(t.name for t in TENSORS), "head.weight"]
    assert [list(g) for g in sd["param_shapes"]] == [list(DECAY), list(NO_DECAY)]
    assert sd["param_shapes"][0]["embed.weight"] == TorchSize((40, 8))
    assert sd["buffer_names"] == ["scale"] and sd["shared_params"] == {"head.weight": "embed.weight"}
    assert sd["frozen_param_shapes"] == OrderedDict([("frozen.weight", TorchSize((12, 12)))])
    assert list(sd["frozen_param_fragments"]) == ["frozen.weight"]
    np.testing.assert_array_equal(read(sd["frozen_param_fragments"]["frozen.weight"]),
                                  values[("frozen.weight", "param")].ravel())
    np.testing.assert_array_equal(read(sd["module"]["head.weight"]), values[("embed.weight", "param")].ravel())
    np.testing.assert_array_equal(read(sd["module"]["scale"]), values[("scale", "param")])
    for d in range(2):
        osd = read_torch_file(tmp_path / f"global_step1/zero_pp_rank_{d}_mp_rank_00_optim_states.pt")
        osd = osd["optimizer_state_dict"]
        assert osd["partition_count"] == [2, 2]
        groups = osd["base_optimizer_state"]["param_groups"]
        assert [(g["weight_decay"], g["params"]) for g in groups] == [(0.1, [0]), (0.0, [1])]
        for g, names in enumerate((DECAY, NO_DECAY)):
            for state in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(read(osd["base_optimizer_state"]["state"][g][state]),
                                              partitions(values, state, names, 2)[d])
            master = osd["single_partition_of_fp32_groups"][g]
            np.testing.assert_array_equal(read(master), partitions(values, "master", names, 2)[d][:master.numel])
    assert json.loads((tmp_path / "config.json").read_text()) == CONFIG


def test_open_derives_groups_frozen_params_buffers_and_ties_from_the_files(tmp_path):
    values = write_custom(tmp_path, "dp=2")
    src = FORMAT.open(tmp_path)
    assert src.spec_name == "deepspeed-derived" and src.sizes == {}
    assert src.extra["ds_model"] == CUSTOM
    assert src.model.config == CONFIG  # the identity, carried whatever the model
    assert_values(logical_read(src), values)
    # the tied copy is a second place of the embedding, never a tensor of its own
    assert "head.weight" not in src.layout.tensors
    assert {it.key for it in src.where if it.state == "param" and "embed.weight" in
            {f.tensor for f in src.layout.fragments if f.item == it}} == {"embed.weight", "head.weight"}
    assert "section frozen_param_fragments per tp pp\nfrozen.weight = d0_12 d1_12" in "\n".join(src.spec.lines)


@pytest.mark.parametrize("to", ["dp=3", "dp=4,zero=1", "dp=1"])
def test_derived_checkpoints_reshard_to_any_dp_and_stage_bit_exactly(tmp_path, to):
    values = write_custom(tmp_path / "a", "dp=2")
    src = FORMAT.open(tmp_path / "a")
    dst = reshard_to(src, to, tmp_path / "b")
    back = FORMAT.open(tmp_path / "b")
    assert back.topology.dp == dst.topology.dp and back.extra["ds_model"] == CUSTOM
    assert back.topology.zero == (dst.topology.zero or 2)  # the source's stage unless another is named
    assert_values(logical_read(back), values)
    sd = read_torch_file(tmp_path / "b/global_step1/mp_rank_00_model_states.pt")
    assert sd["buffer_names"] == ["scale"] and sd["shared_params"] == {"head.weight": "embed.weight"}
    stage1 = back.topology.zero == 1
    assert (sd["frozen_param_shapes"] is None) == stage1 and (sd["frozen_param_fragments"] is None) == stage1
    dp = dst.topology.dp
    osd = read_torch_file(tmp_path / f"b/global_step1/zero_pp_rank_{dp - 1}_mp_rank_00_optim_states.pt")
    for g, names in enumerate((DECAY, NO_DECAY)):
        np.testing.assert_array_equal(read(osd["optimizer_state_dict"]["base_optimizer_state"]["state"][g]["exp_avg"]),
                                      partitions(values, "exp_avg", names, dp)[dp - 1])
    if stage1:  # and back to ZeRO-2: the frozen params' fragments come back from the module
        reshard_to(back, "dp=2,zero=2", tmp_path / "c")
        again = FORMAT.open(tmp_path / "c")
        assert again.extra["ds_model"] == CUSTOM and again.topology.zero == 2
        assert_values(logical_read(again), values)


def test_a_model_file_whose_records_disagree_is_refused_naming_the_entry(tmp_path):
    write_custom(tmp_path, "dp=2")
    sd = read_torch_file(tmp_path / "global_step1/mp_rank_00_model_states.pt")
    path = tmp_path / "model.pt"
    groups = [[(k, tuple(v)) for k, v in g.items()] for g in sd["param_shapes"]]
    assert recorded_model(sd, path, groups) == CUSTOM
    with pytest.raises(CheckpointFormatError) as e:
        recorded_model({**sd, "frozen_param_shapes": OrderedDict()}, path, groups)
    assert str(e.value) == (f"{path}: frozen_param_shapes lacks 'frozen.weight', but module keeps it as a parameter "
                            "outside param_shapes, buffer_names and shared_params")
    with pytest.raises(CheckpointFormatError, match=r"shared_params ties 'lm_head.weight' to 'embed.weight', but "
                                                    r"module has no 'lm_head.weight'"):
        recorded_model({**sd, "shared_params": {"lm_head.weight": "embed.weight"}}, path, groups)
    with pytest.raises(CheckpointFormatError, match=r"param_shapes\[1\] lists 'embed.weight', which an earlier"):
        recorded_model(sd, path, [groups[0], [("embed.weight", (40, 8))]])
    with pytest.raises(CheckpointFormatError, match=r"buffer_names lists 'nothing', which module does not hold"):
        recorded_model({**sd, "buffer_names": ["scale", "nothing"]}, path, groups)


def test_any_source_without_a_family_becomes_a_deepspeed_checkpoint(tmp_path):
    """A Hugging Face checkpoint of a model no family describes (fp32: its weights are the master copy)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {"encoder.weight": rng.standard_normal((6, 4), dtype=np.float32),
               "encoder.bias": rng.standard_normal(6, dtype=np.float32),
               "decoder.weight": rng.standard_normal((4, 6), dtype=np.float32)}
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0"}')
    reshard.convert(tmp_path / "hf", tmp_path / "ds", format="deepspeed", to="dp=3")
    src = FORMAT.open(tmp_path / "ds")
    model = src.extra["ds_model"]
    recorded = reshard.open_checkpoint(tmp_path / "hf").layout.tensors
    assert [t.name for t in model.tensors] == list(recorded)  # the order the source records
    assert model.groups == (tuple(recorded),) and model.frozen == ()
    logical = logical_read(src)
    for name, value in tensors.items():
        for state in ("param", "master"):
            np.testing.assert_array_equal(logical[(name, state)].reshape(value.shape), value, err_msg=name)
    assert src.model.config == CONFIG and src.model.files == {"tokenizer.json": b'{"version": "1.0"}'}
    # and back: the same safetensors, config and tokenizer
    reshard.convert(tmp_path / "ds", tmp_path / "back", format="hf")
    assert reshard.verify(tmp_path / "hf", tmp_path / "back").identical
    assert (tmp_path / "back" / "tokenizer.json").read_text() == '{"version": "1.0"}'


# --- ZeRO stage 3 ----------------------------------------------------------------------------------


TIED = DsModel(tensors=tuple(t for t in TENSORS if t.name not in ("scale", "frozen.weight")),
               groups=(DECAY, NO_DECAY),
               module=(*((t.name, t.name) for t in TENSORS if t.name not in ("scale", "frozen.weight")),
                       ("head.weight", "embed.weight")))


def zero3_partitions(values, state, names, dp):
    """ZeRO-3's flat partitions of one group: each param padded to a multiple of dp and split on its own."""
    pieces = []
    for n in names:
        flat = values[(n, state)].ravel()
        share = -(-flat.size // dp)
        pieces.append(np.split(np.concatenate([flat, np.zeros(share * dp - flat.size, flat.dtype)]), dp))
    return [np.concatenate([p[r] for p in pieces]) for r in range(dp)]


def test_zero3_targets_keep_groups_and_ties_and_read_back_bit_exactly(tmp_path):
    values = {k: v for k, v in write_custom(tmp_path / "a", "dp=2", model=TIED).items()}
    src = FORMAT.open(tmp_path / "a")
    reshard_to(src, "dp=3,zero=3", tmp_path / "b")
    tag = tmp_path / "b/global_step1"
    for d in range(3):
        sd = read_torch_file(tag / f"zero_pp_rank_{d}_mp_rank_00_model_states.pt")
        assert list(sd["module"]) == [k for k, _ in TIED.module]
        assert all(t.shape == (0,) for t in sd["module"].values())  # placeholders: ZeRO-3 keeps no weights there
        assert [list(g) for g in sd["param_shapes"]] == [list(DECAY), list(NO_DECAY)]
        assert sd["shared_params"] == ({"head.weight": "embed.weight"} if d == 0 else {})  # rank 0's, as DeepSpeed
        assert sd["frozen_param_shapes"] == OrderedDict() and sd["dp_world_size"] == 3
        osd = read_torch_file(tag / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        assert osd["partition_count"] == 3 and osd["zero_stage"].args == (3,)
        inner = osd["optimizer_state_dict"]
        assert [(g["weight_decay"], g["params"]) for g in inner["param_groups"]] == [(0.1, [0]), (0.0, [1])]
        for g, names in enumerate((DECAY, NO_DECAY)):
            flat = osd["fp32_flat_groups"][g]
            assert dict(flat.attrs)["ds_id"] == ("0_3" if g == 0 else "2_4")  # its first and last param
            np.testing.assert_array_equal(read(flat), zero3_partitions(values, "master", names, 3)[d])
            np.testing.assert_array_equal(read(inner["state"][g]["exp_avg_sq"]),
                                          zero3_partitions(values, "exp_avg_sq", names, 3)[d])
            assert inner["state"][g]["step"].shape == ()
    back = FORMAT.open(tmp_path / "b")
    assert back.spec_name == "deepspeed-derived" and back.extra["ds_model"] == TIED
    logical = logical_read(back)
    for key, value in values.items():
        if key[1] != "param":  # ZeRO-3 stores the fp32 masters, not the weights
            np.testing.assert_array_equal(logical[key].reshape(value.shape), value, err_msg=str(key))
    reshard.convert(tmp_path / "b", tmp_path / "c", to="dp=2,zero=2")  # and back: the masters are the fp32 weights
    again = FORMAT.open(tmp_path / "c")
    assert again.extra["ds_model"] == TIED
    assert_values(logical_read(again), {(n, s): values[(n, "master" if s == "param" else s)] for n, s in values})


def test_zero3_and_zero12_of_a_model_with_frozen_params_and_buffers_convert_both_ways(tmp_path):
    """ZeRO-3 keeps a trained param only as its fp32 master, a frozen param and a buffer as their weights:
    going there drops the trained params' weights (ZeRO-3 makes them from the masters), coming back makes
    them from the masters, and everything else arrives as it was."""
    values = write_custom(tmp_path / "a", "dp=2")
    reshard.convert(tmp_path / "a", tmp_path / "z3", to="dp=3,zero=3")
    z3 = FORMAT.open(tmp_path / "z3")
    assert z3.topology.zero == 3 and z3.topology.dp == 3
    got = logical_read(z3)
    kept = {k: v for k, v in values.items() if not (k[1] == "param" and k[0] in TRAINED)}
    assert_values({k: v for k, v in got.items() if k in kept}, kept)
    assert not {k for k in got if k[1] == "param" and k[0] in TRAINED} - {("head.weight", "param")}
    reshard.convert(tmp_path / "z3", tmp_path / "z2", to="dp=2,zero=2")
    back = FORMAT.open(tmp_path / "z2")
    assert back.topology.zero == 2 and back.extra["ds_model"] == CUSTOM
    want = {**kept, **{(n, "param"): values[(n, "master")] for n in TRAINED}}  # fp32 training: weights = masters
    assert_values(logical_read(back), want)


def test_parallel_workers_write_the_same_files(tmp_path):
    """Model files hold items of a derived layout (buffers, frozen fragments): workers write them as one does."""
    write_custom(tmp_path / "a", "dp=2")
    reshard.convert(tmp_path / "a", tmp_path / "one", to="dp=3")
    reshard.convert(tmp_path / "a", tmp_path / "two", to="dp=3", workers=2)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*") if p.is_file())
    for rel in files:
        if rel.name != "reshard.json":  # the manifest records its creation time
            assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes(), rel


def test_a_universal_folder_keeps_frozen_params_buffers_and_ties_and_reads_them_back(tmp_path):
    """As ds_to_universal writes it: a folder of states per trained param, the model file copied whole (frozen
    params in module and frozen_param_fragments, buffers, the tied copy), and for each module tensor outside the
    param groups an fp32.pt of its float32 copy. Read back, the model file gives the frozen params, buffers and
    ties again (not those copies), so every tensor and state survives DeepSpeed -> UCP -> DeepSpeed at dp=3."""
    values = write_custom(tmp_path / "a", "dp=2")
    reshard.convert(tmp_path / "a", tmp_path / "ucp", format="ucp")
    folder = tmp_path / "ucp" / "global_step1"
    keys = [k for k, _ in CUSTOM.module]
    assert sorted(p.name for p in (folder / "zero").iterdir() if p.is_dir()) == sorted(keys)
    for key, name in CUSTOM.module:
        if name not in TRAINED or key != name:
            copy = read_torch_file(folder / "zero" / key / "fp32.pt")
            assert list(copy) == ["param"] and copy["param"].dtype == "float32", key
            np.testing.assert_array_equal(read(copy["param"]), values[(name, "param")].ravel(), err_msg=key)
    model = read_torch_file(folder / "mp_rank_00_model_states.pt")
    assert list(model["module"]) == keys
    np.testing.assert_array_equal(read(model["module"]["head.weight"]), values[("embed.weight", "param")].ravel())
    assert model["buffer_names"] == ["scale"] and model["shared_params"] == {"head.weight": "embed.weight"}
    assert model["frozen_param_shapes"] == OrderedDict([("frozen.weight", TorchSize((12, 12)))])
    np.testing.assert_array_equal(read(model["frozen_param_fragments"]["frozen.weight"]),
                                  values[("frozen.weight", "param")].ravel())
    ucp = reshard.open_checkpoint(tmp_path / "ucp")
    assert ucp.extra["ds_model"] == CUSTOM
    assert_values(logical_read(ucp), values)
    reshard.convert(tmp_path / "ucp", tmp_path / "b", format="deepspeed", to="dp=3")
    back = FORMAT.open(tmp_path / "b")
    assert back.extra["ds_model"] == CUSTOM
    assert_values(logical_read(back), values)


def test_a_model_no_family_describes_goes_to_hugging_face_with_its_config(tmp_path):
    """What zero_to_fp32 does, for any module: every weight, frozen params and buffers too, under its own name,
    and the config the Trainer left beside the checkpoint."""
    from safetensors.numpy import load_file

    values = write_custom(tmp_path / "a", "dp=2")
    reshard.convert(tmp_path / "a", tmp_path / "hf", format="hf")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(got) == {t.name for t in TENSORS}
    for name, array in got.items():
        np.testing.assert_array_equal(array, values[(name, "param")].reshape(array.shape), err_msg=name)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == CONFIG
    (tmp_path / "a" / "config.json").unlink()  # no config: the model is recorded nowhere, nothing written
    with pytest.raises(CheckpointFormatError, match="which model this is is recorded nowhere"):
        reshard.convert(tmp_path / "a", tmp_path / "hf2", format="hf")
    assert not (tmp_path / "hf2").exists()


def test_zero3_from_dcp_refuses_to_guess_which_untrained_tensors_are_buffers(tmp_path):
    """DCP records no optimizer state for a frozen param or a buffer alike; ZeRO-3 partitions one and keeps the
    other whole, so DeepSpeed would refuse either guess. ZeRO-1/2 hold both alike and take it bit-exactly."""
    values = write_custom(tmp_path / "a", "dp=2")
    reshard.convert(tmp_path / "a", tmp_path / "dcp", format="dcp", to="dp=2")
    with pytest.raises(CheckpointFormatError) as e:
        reshard.convert(tmp_path / "dcp", tmp_path / "z3", format="deepspeed", to="dp=2,zero=3")
    assert str(e.value) == (f"{tmp_path / 'dcp'}: 'scale' has no optimizer state, and the dcp checkpoint does not "
                            "record whether it is a frozen parameter or a buffer, which ZeRO-3 stores differently; "
                            "convert to ZeRO-1/2 (zero=2), whose files hold both alike")
    assert not (tmp_path / "z3").exists()
    reshard.convert(tmp_path / "dcp", tmp_path / "z2", format="deepspeed", to="dp=3,zero=2")
    got = logical_read(FORMAT.open(tmp_path / "z2"))
    for name in TRAINED:
        for state in ("master", "exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(got[(name, state)].reshape(values[(name, state)].shape),
                                          values[(name, state)], err_msg=f"{name} {state}")
    for name in ("scale", "frozen.weight"):
        np.testing.assert_array_equal(got[(name, "param")].reshape(values[(name, "param")].shape),
                                      values[(name, "param")], err_msg=name)
