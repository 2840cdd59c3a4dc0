"""DeepSpeed ZeRO-1/2 checkpoints: written by reshard, read back, checked against DeepSpeed's own layout.

The model is a tiny Llama (h=16, 4 heads in 2 KV groups of head dim 4, ffn 24,
vocab 100, 2 layers: 7120 parameters). Values are arange-valued per tensor and
state (conftest ``logical_values``), so a misplaced element shows. The oracle
for the flat partitions is built here with numpy, the way DeepSpeed builds
them: params flattened in ``named_parameters()`` order, concatenated, padded
to a multiple of 2 * dp, split into dp equal parts. Golden ``param_slice_mappings``
come from a real DeepSpeed 0.19.8 run of the same model at dp=2.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import shutil
import sys
import types
import zlib
from collections import OrderedDict

import numpy as np
import pytest
from conftest import assert_round_trip, logical_values, require

from reshard.execution.arrays import gather, scatter
from reshard.formats.specs import layout_spec, spec_text
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.execution.executor import ByteReader, PlanFill
from reshard.formats.base import Source
from reshard.formats.deepspeed import FORMAT, DsOptimizer, synthesize_extra
from reshard.core.resolve import resolve
from reshard.core.planner import plan
from reshard.core.topology import parse_topology
from reshard.io.torchfile import Opaque, TensorRef, TorchSize, read_torch_file

SIZES = {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "layers": 2}
STATES = ("param", "master", "exp_avg", "exp_avg_sq")
NUMPY = {"float32": np.float32, "bfloat16": np.uint16}


def hf_order(layers: int = 2) -> list[str]:
    """LlamaForCausalLM.named_parameters(): DeepSpeed's flat-buffer order with one param group."""
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names + ["model.norm.weight", "lm_head.weight"]


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_checkpoint(out, topology="dp=2", *, spec="deepspeed-llama", dtype="float32", **options):
    """reshard's DeepSpeed writer fed from in-memory items, as ``convert`` feeds it from a plan."""
    target = FORMAT.new_target(topology, SIZES, spec=spec, dtype=dtype, **options)
    values = logical_values(target.layout, STATES)
    if dtype == "bfloat16":
        values.update({k: bf16_bits(v) for k, v in values.items() if k[1] == "param"})
    # Per state, so that items holding padding only (no values to take a dtype from) get theirs too.
    items = scatter(target.layout, values, dtype={s: NUMPY[dtype if s == "param" else "float32"] for s in STATES})

    def fill(item, lo, hi):
        assert (hi - lo) * items[item].itemsize <= 8 << 20
        return memoryview(items[item][lo:hi]).cast("B")

    files = FORMAT.write(target, out, fill)
    return target, values, items, files


def read(loc, dtype: str, count: int) -> np.ndarray:
    """``count`` elements at a ``Located`` (or, with ``loc.data_offset``, a ``TensorRef``)."""
    offset = loc.data_offset if isinstance(loc, TensorRef) else loc.offset
    return np.fromfile(loc.path, dtype=NUMPY[dtype], count=count, offset=offset)


def zero_partitions(values, state: str, names: list[str], dp: int) -> list[np.ndarray]:
    """DeepSpeed's flat partitions of one param group, built independently with numpy."""
    flat = np.concatenate([values[(n, state)].ravel() for n in names])
    padded = -(-flat.size // (2 * dp)) * 2 * dp
    return np.split(np.concatenate([flat, np.zeros(padded - flat.size, flat.dtype)]), dp)


def reshard(src, dst, out) -> None:
    """Carry ``src`` over to target ``dst`` at ``out``, as ``reshard.convert`` does: plan, then stream."""
    p = plan(src.layout, dst.layout)
    p.validate()
    with ByteReader() as reader:
        fill = PlanFill(p, src.where, reader)
        dst.dtypes = dict(fill.dtypes)
        FORMAT.write(dst, out, fill)


def optim_name(dp: int, bf16: bool = False, tag: str = "global_step1") -> str:
    return f"{tag}/{'bf16_' if bf16 else ''}zero_pp_rank_{dp}_mp_rank_00_optim_states.pt"


# --- what the writer writes --------------------------------------------------------------


def test_writes_latest_one_model_file_and_one_optimizer_file_per_dp_rank(tmp_path):
    _, _, _, files = write_checkpoint(tmp_path, "dp=2", dtype="bfloat16")
    assert sorted(map(str, files)) == [
        "config.json",  # the model's, beside the tag, as the transformers Trainer leaves it
        "global_step1/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "global_step1/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "global_step1/mp_rank_00_model_states.pt",
        "latest",
    ]
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert not (tmp_path / "zero_to_fp32.py").exists()  # DeepSpeed's own script: never copied
    assert FORMAT.detect(tmp_path) and FORMAT.detect(tmp_path / "global_step1")


def test_model_states_have_deepspeeds_keys_and_param_shapes_in_flat_order(tmp_path):
    write_checkpoint(tmp_path, "dp=2", dtype="bfloat16", zero_stage=2)
    sd = read_torch_file(tmp_path / "global_step1/mp_rank_00_model_states.pt")
    # engine._common_checkpoint_state of DeepSpeed 0.19.8, in its order.
    assert list(sd) == [
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
        "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
        "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    ]
    assert list(sd["module"]) == hf_order()
    assert all(isinstance(t, TensorRef) and t.dtype == "bfloat16" for t in sd["module"].values())
    shapes = sd["param_shapes"]
    assert len(shapes) == 1 and isinstance(shapes[0], OrderedDict) and list(shapes[0]) == hf_order()
    assert shapes[0]["model.layers.0.self_attn.k_proj.weight"] == TorchSize((8, 16))
    assert isinstance(shapes[0]["model.norm.weight"], TorchSize)
    assert (sd["dp_world_size"], sd["mp_world_size"], sd["optimizer"]) == (2, 1, None)
    assert sd["frozen_param_shapes"] == OrderedDict() and sd["shared_params"] == {}
    assert sd["ds_config"]["zero_optimization"] == {"stage": 2} and sd["ds_config"]["bf16"] == {"enabled": True}


def test_param_slice_mappings_equal_a_real_deepspeed_run_at_dp2(tmp_path):
    write_checkpoint(tmp_path, "dp=2", dtype="float32")
    osd = [read_torch_file(tmp_path / optim_name(d))["optimizer_state_dict"] for d in range(2)]
    assert list(osd[0]) == [
        "loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "base_optimizer_state",
        "single_partition_of_fp32_groups", "zero_stage", "group_paddings", "param_alignment_paddings",
        "partition_count", "ds_version", "param_slice_mappings",
    ]

    def mappings(d):
        return {k: (v.state["numel"], v.state["start"]) for k, v in osd[d]["param_slice_mappings"][0].items()}

    frag = next(iter(osd[0]["param_slice_mappings"][0].values()))
    assert (frag.module, frag.name, frag.newobj) == ("deepspeed.utils.tensor_fragment", "fragment_address", True)
    # 7120 elements split 3560 / 3560: layer 1's q_proj (256) straddles, 8 elements on rank 0, 248 on rank 1.
    assert list(mappings(0).items())[-2:] == [("model.layers.0.post_attention_layernorm.weight", (16, 3536)),
                                              ("model.layers.1.self_attn.q_proj.weight", (8, 3552))]
    assert list(mappings(1).items())[:3] == [("model.layers.1.self_attn.q_proj.weight", (248, 0)),
                                             ("model.layers.1.self_attn.k_proj.weight", (128, 248)),
                                             ("model.layers.1.self_attn.v_proj.weight", (128, 376))]
    assert mappings(1)["lm_head.weight"] == (1600, 1960)
    for d in range(2):
        assert osd[d]["group_paddings"] == [0] and osd[d]["partition_count"] == [2]
        assert osd[d]["param_alignment_paddings"] == [[0] * 21]
        assert osd[d]["zero_stage"] == Opaque("deepspeed.runtime.zero.config", "ZeroStageEnum", (2,), None)
        assert [t.shape for t in osd[d]["single_partition_of_fp32_groups"]] == [(3560,)]
        state = osd[d]["base_optimizer_state"]["state"][0]
        assert list(state) == ["step", "exp_avg", "exp_avg_sq"] and state["step"].shape == ()


@pytest.mark.parametrize("dp", [1, 2, 3, 5])
def test_flat_partitions_equal_an_independent_numpy_construction(tmp_path, dp):
    # 7120 elements: dp=3 pads to 7122 (2374 each, 2 padding on rank 2), dp=5 to 7130 (10 on rank 4).
    _, values, _, _ = write_checkpoint(tmp_path, f"dp={dp}")
    for d in range(dp):
        osd = read_torch_file(tmp_path / optim_name(d))["optimizer_state_dict"]
        share = -(-7120 // (2 * dp)) * 2
        padding = max(0, min(share, (d + 1) * share - 7120))
        assert osd["group_paddings"] == [padding]
        fp32 = osd["single_partition_of_fp32_groups"][0]
        assert fp32.shape == (share - padding,)  # DeepSpeed saves the master partition without padding
        want = zero_partitions(values, "master", hf_order(), dp)[d]
        np.testing.assert_array_equal(read(fp32, "float32", fp32.numel), want[: fp32.numel])
        for state in ("exp_avg", "exp_avg_sq"):
            ref = osd["base_optimizer_state"]["state"][0][state]
            assert ref.shape == (share,)  # the torch optimizer's state: the whole partition
            want = zero_partitions(values, state, hf_order(), dp)[d]
            np.testing.assert_array_equal(read(ref, "float32", ref.numel), want)


# --- reading ---------------------------------------------------------------------------------


def logical_read(src: Source) -> dict:
    """Every logical tensor and state of an opened checkpoint, read from its files."""
    items = {item: read(loc, loc.dtype, src.layout.items[item].numel) for item, loc in src.where.items()}
    return gather(src.layout, items)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_open_derives_the_layout_from_what_the_files_record(tmp_path, dtype):
    _, values, _, _ = write_checkpoint(tmp_path, "dp=3", dtype=dtype)
    src = FORMAT.open(tmp_path)
    assert (src.spec_name, str(src.topology)) == ("deepspeed-derived", "tp=1,pp=1,dp=3,zero=2")
    assert src.sizes == SIZES  # from the config.json beside it, which names a llama: nothing told by shapes
    assert src.model.config["model_type"] == "llama"
    assert list(src.layout.tensors) == hf_order()  # the module's order
    logical = logical_read(src)
    assert logical.keys() == values.keys()
    for key, value in values.items():
        np.testing.assert_array_equal(logical[key].reshape(value.shape), value, err_msg=str(key))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_open_locates_every_item_bit_exactly(tmp_path, dtype):
    target, _, items, _ = write_checkpoint(tmp_path, "dp=3", dtype=dtype)
    src = FORMAT.open(tmp_path, spec="deepspeed-llama", sizes=SIZES)
    assert (src.spec_name, str(src.topology), src.sizes) == ("deepspeed-llama", "tp=1,pp=1,dp=3,zero=2", SIZES)
    assert dict(src.layout.items) == dict(target.layout.items)
    assert set(src.where) == set(target.layout.items)
    for item, loc in src.where.items():
        want = items[item]
        stored = want.size - 2 * (item.state == "master" and dict(item.unit)["dp"] == 2)  # master: padding cut
        np.testing.assert_array_equal(read(loc, loc.dtype, stored), want[:stored], err_msg=str(item))
        assert loc.dtype == (dtype if item.state == "param" else "float32")
    extra = src.extra["deepspeed"]
    assert (extra.tag, extra.zero_stage, extra.bf16_names) == ("global_step1", 2, dtype == "bfloat16")


def test_reshard_dp2_to_dp3_through_planner_and_executor(tmp_path):
    _, values, _, _ = write_checkpoint(tmp_path / "a", "dp=2", dtype="bfloat16", global_steps=7)
    src = FORMAT.open(tmp_path / "a", sizes=SIZES)
    reshard(src, FORMAT.target(src, parse_topology("dp=3")), tmp_path / "b")
    back = FORMAT.open(tmp_path / "b", sizes=SIZES)
    assert str(back.topology) == "tp=1,pp=1,dp=3,zero=2"
    for d in range(3):
        sd = read_torch_file(tmp_path / "b" / optim_name(d, bf16=True, tag="global_step7"))
        osd = sd["optimizer_state_dict"]
        for state in ("master", "exp_avg"):
            item = next(it for it in back.where if it.state == state and dict(it.unit)["dp"] == d)
            want = zero_partitions(values, state, hf_order(), 3)[d]
            n = 2372 if state == "master" and d == 2 else 2374
            np.testing.assert_array_equal(read(back.where[item], "float32", n), want[:n])
        assert osd["partition_count"] == [3] and osd["group_paddings"] == [0, 0, 2][d : d + 1]
        step = osd["base_optimizer_state"]["state"][0]["step"]
        assert read(step, "float32", 1)[0] == 7.0  # carried, not resharded
    model = read_torch_file(tmp_path / "b/global_step7/mp_rank_00_model_states.pt")
    assert model["dp_world_size"] == 3 and model["global_steps"] == 7
    embed = model["module"]["model.embed_tokens.weight"]
    want = values[("model.embed_tokens.weight", "param")].ravel()
    np.testing.assert_array_equal(read(embed, "bfloat16", embed.numel), want)


def test_hf_trainer_spec_keeps_norms_in_their_own_param_group(tmp_path):
    """transformers' Trainer (get_decay_parameter_names) exempts every parameter whose name matches a norm:
    both layer norms and the final ``model.norm``."""
    _, values, _, _ = write_checkpoint(tmp_path, "dp=2", spec="deepspeed-llama-hf-trainer")
    norms = [n for n in hf_order() if "norm" in n]
    rest = [n for n in hf_order() if "norm" not in n]
    sd = read_torch_file(tmp_path / "global_step1/mp_rank_00_model_states.pt")
    assert [list(g) for g in sd["param_shapes"]] == [rest, norms]
    osd = read_torch_file(tmp_path / optim_name(1))["optimizer_state_dict"]
    # dp=2: 7040 decay elements (3520 per rank) and 80 no-decay elements (40 per rank): rank 1 holds the last
    # half of layer 1's input norm, its post-attention norm and the final norm.
    assert [t.shape for t in osd["single_partition_of_fp32_groups"]] == [(3520,), (40,)]
    assert {k: (v.state["numel"], v.state["start"]) for k, v in osd["param_slice_mappings"][1].items()} == {
        "model.layers.1.input_layernorm.weight": (8, 0), "model.layers.1.post_attention_layernorm.weight": (16, 8),
        "model.norm.weight": (16, 24)}
    for g, names in enumerate((rest, norms)):
        ref = osd["base_optimizer_state"]["state"][g]["exp_avg"]
        want = zero_partitions(values, "exp_avg", names, 2)[1]
        np.testing.assert_array_equal(read(ref, "float32", ref.numel), want)
    assert FORMAT.open(tmp_path, spec="deepspeed-llama-hf-trainer", sizes=SIZES).spec_name == "deepspeed-llama-hf-trainer"
    src = FORMAT.open(tmp_path)  # derived: its two groups, as param_shapes records them
    assert [[it.key for it in src.layout.items if it.section == g and it.state == "param"]
            for g in ("group0", "group1")] == [rest, norms]
    logical = logical_read(src)
    for key, value in values.items():
        np.testing.assert_array_equal(logical[key].reshape(value.shape), value, err_msg=str(key))


def test_ranks_holding_only_padding_have_empty_mappings_and_no_master_elements(tmp_path):
    # dp=48: the decay group (7040) pads to 7104, 148 per rank; the no-decay group (80) to 96, 2 per rank,
    # so ranks 40..47 hold only its padding.
    _, values, _, _ = write_checkpoint(tmp_path / "a", "dp=48", spec="deepspeed-llama-hf-trainer")
    osd = read_torch_file(tmp_path / "a" / optim_name(47))["optimizer_state_dict"]
    assert osd["group_paddings"] == [64, 2] and osd["param_slice_mappings"][1] == OrderedDict()
    assert osd["single_partition_of_fp32_groups"][1].shape == (0,)
    assert osd["base_optimizer_state"]["state"][1]["exp_avg"].shape == (2,)
    src = FORMAT.open(tmp_path / "a", sizes=SIZES)
    reshard(src, FORMAT.target(src, parse_topology("dp=1")), tmp_path / "b")
    osd = read_torch_file(tmp_path / "b" / optim_name(0))["optimizer_state_dict"]
    norms = [n for n in hf_order() if "norm" in n]
    np.testing.assert_array_equal(read(osd["single_partition_of_fp32_groups"][1], "float32", 80),
                                  zero_partitions(values, "master", norms, 1)[0])


def test_sizes_come_from_a_config_json_next_to_the_checkpoint(tmp_path):
    write_checkpoint(tmp_path, "dp=2")
    assert FORMAT.open(tmp_path).sizes == SIZES  # from the config.json the writer leaves
    (tmp_path / "config.json").unlink()
    assert FORMAT.open(tmp_path).sizes == {}  # a derived layout needs none, and none is guessed from the shapes
    with pytest.raises(CheckpointFormatError) as e:  # a family's spec needs them
        FORMAT.open(tmp_path, spec="deepspeed-llama")
    assert str(e.value) == (
        f"{tmp_path / 'global_step1'}: the attention head layout cannot be told from tensor shapes alone "
        f"(q_proj has 16 rows, k_proj 8): give sizes heads=N (and hd, g if not hidden/heads), "
        f"or put the model's config.json in one of: {tmp_path / 'global_step1'}, {tmp_path}, {tmp_path.parent}")
    assert FORMAT.open(tmp_path, spec="deepspeed-llama", sizes={"heads": 4}).sizes == SIZES
    config = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24,
              "vocab_size": 100, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert FORMAT.open(tmp_path, spec="deepspeed-llama").sizes == SIZES
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert FORMAT.open(tmp_path).sizes == SIZES


# --- errors ------------------------------------------------------------------------------------


def test_optimizer_files_disagreeing_with_dp_world_size_are_refused(tmp_path):
    write_checkpoint(tmp_path, "dp=2")
    (tmp_path / optim_name(1)).unlink()
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path, sizes=SIZES)
    assert str(e.value) == (f"{tmp_path / 'global_step1'}: 1 optimizer files for mp rank 00 but "
                            "mp_rank_00_model_states.pt says dp_world_size=2")


def test_a_missing_rank_file_is_named(tmp_path):
    write_checkpoint(tmp_path, "dp=3")
    (tmp_path / optim_name(2)).rename(tmp_path / optim_name(7))
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path, sizes=SIZES)
    assert str(e.value) == f"{tmp_path / optim_name(2)}: missing (dp_world_size=3)"


def test_param_slice_mappings_disagreeing_with_the_spec_name_the_param(tmp_path):
    write_checkpoint(tmp_path / "ckpt", "dp=2")
    # The same model with every param starting at a multiple of 64: not how DeepSpeed lays it out.
    spec = tmp_path / "aligned.spec"
    shipped = spec_text("deepspeed-llama")
    spec.write_text(shipped.replace("| pad 2*dp | split dp", "| align 64 | pad 2*dp | split dp"))
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path / "ckpt", spec=str(spec), sizes=SIZES)
    assert str(e.value) == (
        f"{tmp_path / 'ckpt' / optim_name(0)}: "
        "param_slice_mappings[0]['model.layers.0.post_attention_layernorm.weight'] "
        f"is fragment_address(numel=16, start=3536) but spec '{spec}' places it at (numel=16, start=3584)")


def test_a_zero3_checkpoint_missing_a_ranks_files_is_named(tmp_path):
    write_checkpoint(tmp_path, "dp=2")
    tag = tmp_path / "global_step1"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(tmp_path, sizes=SIZES)
    assert str(e.value) == (f"{tag}: no ZeRO-3 model file for dp rank 1 "
                            "(zero_pp_rank_0_mp_rank_00_model_states.pt says dp_world_size=2)")


def test_pipeline_checkpoints_have_layer_files_and_a_flat_buffer_per_stage(tmp_path):
    target, values, _, files = write_checkpoint(tmp_path, "pp=2,dp=2", spec="deepspeed-pipe-llama", zero_stage=1)
    layers = [f"global_step1/layer_{i:02d}-model_00-model_states.pt" for i in range(5)]  # embed, 2 layers, norm, head
    models = [f"global_step1/mp_rank_{m:02d}_model_states.pt" for m in range(2)]
    assert sorted(map(str, files)) == sorted(["config.json", "latest", *layers, *models,
                                              *(optim_name(d).replace("mp_rank_00", f"mp_rank_{m:02d}")
                                                for m in range(2) for d in range(2))])
    layer = read_torch_file(tmp_path / layers[2])  # decoder layer 1
    assert list(layer) == [n.removeprefix("model.layers.1.") for n in hf_order() if n.startswith("model.layers.1.")]
    np.testing.assert_array_equal(read(layer["mlp.up_proj.weight"], "float32", 24 * 16),
                                  values[("model.layers.1.mlp.up_proj.weight", "param")].ravel())
    stage1 = read_torch_file(tmp_path / models[1])
    assert stage1["module"] is None and stage1["mp_world_size"] == 2
    assert stage1["checkpoint_parallel_dimensions"] == {"pp_degree": 2, "tp_degree": 1}
    assert list(stage1["param_shapes"][0])[0] == "2.self_attn.q_proj.weight"
    assert list(stage1["param_shapes"][0])[-2:] == ["3.weight", "4.weight"]  # the final norm, the head
    osd = read_torch_file(tmp_path / optim_name(0).replace("mp_rank_00", "mp_rank_01"))["optimizer_state_dict"]
    assert osd["param_slice_mappings"][0]["2.self_attn.q_proj.weight"].state == {"numel": 256, "start": 0}
    src = FORMAT.open(tmp_path, sizes=SIZES)  # read back: the layout proves itself against every file
    assert src.spec_name == "deepspeed-pipe-llama" and (src.topology.pp, src.topology.dp) == (2, 2)
    items = {item: read(loc, loc.dtype, src.layout.items[item].numel) for item, loc in src.where.items()}
    for key, value in gather(src.layout, items).items():
        np.testing.assert_array_equal(value, values[key], err_msg=str(key))


def test_pipeline_layer_files_without_a_model_axis_are_read_and_their_naming_kept(tmp_path):
    """A PipeDataParallelTopology (no 'model' axis) names layer files layer_XX-model_states.pt."""
    import reshard

    write_checkpoint(tmp_path / "src", "pp=2,dp=1", spec="deepspeed-pipe-llama", zero_stage=1)
    for f in (tmp_path / "src" / "global_step1").glob("layer_*"):
        f.rename(f.with_name(f.name.replace("-model_00-", "-")))
    reshard.convert(tmp_path / "src", tmp_path / "one", to="pp=1,dp=2", sizes=SIZES)
    assert sorted(p.name for p in (tmp_path / "one" / "global_step1").glob("layer_*")) == [
        f"layer_{i:02d}-model_states.pt" for i in range(5)]
    reshard.convert(tmp_path / "src", tmp_path / "two", to="pp=1,dp=2", sizes=SIZES, workers=2)
    for f in (tmp_path / "one" / "global_step1").iterdir():
        assert f.read_bytes() == (tmp_path / "two" / "global_step1" / f.name).read_bytes(), f.name
    before, after = logical_of(tmp_path / "src"), logical_of(tmp_path / "one")
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key], err_msg=str(key))


def test_a_pipeline_checkpoint_without_a_family_config_is_read_as_it_records_itself(tmp_path):
    """Without the family's config.json, a pipeline's layers keep the names the pipeline engine gave them
    (``reshard.formats.deepspeed.pipe.recorded_pipeline``); the config or a spec gives the family's layout."""
    _, values, _, _ = write_checkpoint(tmp_path, "pp=2,dp=1", spec="deepspeed-pipe-llama", zero_stage=1)
    assert FORMAT.open(tmp_path).spec_name == "deepspeed-pipe-llama"  # the family its config.json names
    (tmp_path / "config.json").unlink()
    src = FORMAT.open(tmp_path)
    assert src.spec_name == "deepspeed-pipe-derived" and (src.topology.pp, src.topology.dp) == (2, 1)
    items = {item: read(loc, loc.dtype, src.layout.items[item].numel) for item, loc in src.where.items()}
    logical = gather(src.layout, items)
    np.testing.assert_array_equal(logical[("2.mlp.up_proj.weight", "master")].ravel(),  # decoder layer 1, stage 1
                                  values[("model.layers.1.mlp.up_proj.weight", "master")].ravel())
    assert len(logical) == 4 * (3 + 9 * 2)  # embedding, 2 decoder layers, norm, head; param, master, Adam
    assert FORMAT.open(tmp_path, spec="deepspeed-pipe-llama", sizes=SIZES).topology.pp == 2


def test_a_pipeline_checkpoint_missing_a_layer_file_names_it(tmp_path):
    write_checkpoint(tmp_path, "pp=2,dp=1", spec="deepspeed-pipe-llama", zero_stage=1)
    (tmp_path / "global_step1" / "layer_03-model_00-model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError, match=r"layer_03-model_00-model_states\.pt: missing \(spec "
                                                    r"'deepspeed-pipe-llama' places weight there\)"):
        FORMAT.open(tmp_path, sizes=SIZES)


def test_targets_refuse_pipelines_deepspeed_cannot_run_and_unsplit_tensor_parallelism(tmp_path):
    write_checkpoint(tmp_path, "dp=2")
    src = FORMAT.open(tmp_path, sizes=SIZES)
    with pytest.raises(TopologyError, match=r"^spec 'deepspeed-llama' describes DeepSpeed's engine without a pipeline: "
                                            r"pp\(2\) must be 1"):
        FORMAT.target(src, parse_topology("pp=2,dp=1"), spec="deepspeed-llama")
    with pytest.raises(TopologyError, match=r"^DeepSpeed runs ZeRO stage 0 or 1 under a pipeline, not zero=2"):
        FORMAT.target(src, parse_topology("pp=2,dp=1,zero=2"))
    with pytest.raises(TopologyError, match=r"no virtual stages: vpp\(2\) must be 1"):
        FORMAT.target(src, parse_topology("pp=2,vpp=2,dp=1"))
    assert FORMAT.target(src, parse_topology("pp=2,dp=1")).spec_name == "deepspeed-pipe-llama"
    with pytest.raises(TopologyError, match=r"^spec 'deepspeed-llama' splits nothing over tp"):
        FORMAT.target(src, parse_topology("tp=2,dp=1"))


def test_synthesized_state_imitates_one_adam_step_of_deepspeed(tmp_path):
    extra = synthesize_extra(groups=2, dtype="bfloat16", zero_stage=1, global_steps=3, micro_batch=2, dp=4,
                             weight_decay=(0.1, 0.0))
    assert extra.tag == "global_step3" and extra.bf16_names
    assert extra.model_states["global_samples"] == 24 and extra.model_states["frozen_param_shapes"] is None
    groups = extra.optim_states["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert [(g["weight_decay"], g["params"]) for g in groups] == [(0.1, [0]), (0.0, [1])]


TP_SPEC = """
include llama
logical lm_head.weight as head = vocab h
section model per tp pp
model.embed_tokens.weight = vocab/tp h
model.layers.{i/pp}.self_attn.q_proj.weight -> q = (g/tp qpg hd) h
model.layers.{i/pp}.self_attn.k_proj.weight -> k = (g/tp hd) h
model.layers.{i/pp}.self_attn.v_proj.weight -> v = (g/tp hd) h
model.layers.{i/pp}.self_attn.o_proj.weight -> o = h (g/tp qpg hd)
model.layers.{i/pp}.mlp.gate_proj.weight -> gate = f/tp h
model.layers.{i/pp}.mlp.up_proj.weight -> up = f/tp h
model.layers.{i/pp}.mlp.down_proj.weight -> down = h f/tp
model.layers.{i/pp}.input_layernorm.weight -> ln1 = h
model.layers.{i/pp}.post_attention_layernorm.weight -> ln2 = h
model.norm.weight = h
lm_head.weight = vocab/tp h
section optim per tp pp dp states master exp_avg exp_avg_sq
flat optimizer.{state} = model | pad 2*dp | split dp
"""


def test_tensor_parallel_files_with_a_spec_that_splits_over_tp(tmp_path):
    # Megatron-style column/row splits under HF names: each mp rank flattens its own shards.
    spec = tmp_path / "deepspeed-llama-tp.spec"
    spec.write_text(TP_SPEC)
    write_checkpoint(tmp_path / "a", "tp=2,dp=2", spec=str(spec))
    src = FORMAT.open(tmp_path / "a", spec=str(spec), sizes=SIZES)
    assert str(src.topology) == "tp=2,pp=1,dp=2,zero=2"
    shapes = read_torch_file(tmp_path / "a/global_step1/mp_rank_01_model_states.pt")["param_shapes"][0]
    assert shapes["model.embed_tokens.weight"] == (50, 16) and shapes["model.layers.0.mlp.down_proj.weight"] == (16, 12)
    dst = FORMAT.target(src, parse_topology("dp=3"), spec="deepspeed-llama")
    reshard(src, dst, tmp_path / "b")
    values = logical_values(dst.layout, STATES)
    for d in range(3):
        ref = read_torch_file(tmp_path / "b" / optim_name(d))["optimizer_state_dict"]["base_optimizer_state"]
        got = read(ref["state"][0]["exp_avg_sq"], "float32", 2374)
        np.testing.assert_array_equal(got, zero_partitions(values, "exp_avg_sq", hf_order(), 3)[d])
    with pytest.raises(CheckpointFormatError, match=r"mp_world_size=2 but spec 'deepspeed-llama' splits nothing"):
        FORMAT.open(tmp_path / "a", spec="deepspeed-llama", sizes=SIZES)
    with pytest.raises(CheckpointFormatError) as e:  # nothing records how tp split the tensors
        FORMAT.open(tmp_path / "a")
    assert str(e.value) == (f"{tmp_path / 'a/global_step1/mp_rank_00_model_states.pt'}: mp_world_size=2, and "
                            "DeepSpeed does not record how tensor parallelism split its tensors "
                            "('model.embed_tokens.weight' is [50, 16] on this rank): give a spec that says so")


def test_a_new_zero_stage_and_dp_rewrite_the_stage_and_the_batch_size(tmp_path):
    write_checkpoint(tmp_path / "a", "dp=2", zero_stage=1, micro_batch=2, accumulation=4)
    src = FORMAT.open(tmp_path / "a", sizes=SIZES)
    src.extra["deepspeed"].model_states["ds_config"]["train_batch_size"] = 16
    reshard(src, FORMAT.target(src, parse_topology("dp=4,zero=2")), tmp_path / "b")
    model = read_torch_file(tmp_path / "b/global_step1/mp_rank_00_model_states.pt")
    # train_batch_size = micro batch (2) * accumulation steps (4) * dp (4)
    assert model["ds_config"]["train_batch_size"] == 32 and model["ds_config"]["zero_optimization"] == {"stage": 2}
    assert model["frozen_param_shapes"] == OrderedDict()  # saved from stage 2 on
    osd = read_torch_file(tmp_path / "b" / optim_name(3))["optimizer_state_dict"]
    assert osd["zero_stage"].args == (2,) and osd["partition_count"] == [4]
    assert str(FORMAT.open(tmp_path / "b", sizes=SIZES).topology) == "tp=1,pp=1,dp=4,zero=2"


def test_bf16_optimizer_files_keep_the_master_whole_and_count_padding_on_the_last_rank(tmp_path):
    # BF16_Optimizer (bf16 ZeRO-1 with fp32 gradient accumulation) writes no loss scaler and no stage.
    write_checkpoint(tmp_path / "a", "dp=2", dtype="bfloat16", zero_stage=1)
    src = FORMAT.open(tmp_path / "a", sizes=SIZES)
    extra = src.extra["deepspeed"]
    osd = extra.optim_states["optimizer_state_dict"]
    for key in ("loss_scaler", "dynamic_loss_scale", "overflow", "zero_stage", "param_alignment_paddings"):
        del osd[key]
    src.extra["deepspeed"] = dataclasses.replace(extra, optimizer=DsOptimizer.BF16)
    reshard(src, FORMAT.target(src, parse_topology("dp=3")), tmp_path / "b")
    osd = read_torch_file(tmp_path / "b" / optim_name(2, bf16=True))["optimizer_state_dict"]
    assert list(osd) == ["clip_grad", "base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings",
                         "partition_count", "ds_version", "param_slice_mappings"]
    assert osd["group_paddings"] == [2] and osd["single_partition_of_fp32_groups"][0].shape == (2374,)
    back = FORMAT.open(tmp_path / "b", sizes=SIZES)
    assert back.extra["deepspeed"].optimizer is DsOptimizer.BF16
    assert f"{DsOptimizer.BF16}" == str(DsOptimizer.BF16) == "bf16"  # the value, on every Python


def test_megatron_distributed_optimizer_state_plans_into_deepspeed(tmp_path):
    # Same logical names and states on both sides: tp=2, pp=2, dp=2 Megatron -> dp=3 DeepSpeed, and back.
    sizes = {**SIZES, "layers": 4, "vocab_div": 8, "bucket_size": 0}
    spec = layout_spec("megatron-llama-distopt")
    megatron = resolve(spec, parse_topology("tp=2,pp=2,dp=2"), sizes)
    source = Source(format="megatron", path=tmp_path, spec_name="megatron-llama-distopt", spec=spec,
                    topology=megatron.topology, sizes=sizes, layout=megatron, where={})
    deepspeed = FORMAT.target(source, parse_topology("dp=3")).layout
    assert_round_trip(megatron, deepspeed, logical_values(megatron, STATES))


# --- with torch, and with DeepSpeed itself -----------------------------------------------------


def deepspeed_classes(monkeypatch) -> tuple[type, type]:
    """DeepSpeed's ``fragment_address`` and ``ZeroStageEnum``, or stand-ins of the same shape when it is absent."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        return fragment_address, ZeroStageEnum
    except Exception:  # not installed, or fails to initialize here
        pass

    @dataclasses.dataclass
    class fragment_address:  # noqa: N801 - DeepSpeed's name
        numel: int
        start: int

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3

    class LossScaler:
        pass

    for module, cls in (("deepspeed.utils.tensor_fragment", fragment_address),
                        ("deepspeed.runtime.zero.config", ZeroStageEnum),
                        ("deepspeed.runtime.fp16.loss_scaler", LossScaler)):
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        cls.__module__, cls.__qualname__ = module, cls.__name__
        setattr(sys.modules[module], cls.__name__, cls)
    return fragment_address, ZeroStageEnum


def test_torch_load_reads_the_files_with_deepspeeds_classes(tmp_path, monkeypatch):
    import torch
    _, values, _, _ = write_checkpoint(tmp_path, "dp=2", dtype="bfloat16")
    fragment_address, ZeroStageEnum = deepspeed_classes(monkeypatch)  # noqa: N806 - DeepSpeed's names
    model = torch.load(tmp_path / "global_step1/mp_rank_00_model_states.pt", weights_only=False)
    assert model["param_shapes"][0]["lm_head.weight"] == torch.Size([100, 16])
    embed = model["module"]["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16
    bits = embed.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, values[("model.embed_tokens.weight", "param")])
    osd = torch.load(tmp_path / optim_name(1, bf16=True), weights_only=False)["optimizer_state_dict"]
    assert osd["zero_stage"] is ZeroStageEnum.gradients
    assert osd["param_slice_mappings"][0]["lm_head.weight"] == fragment_address(numel=1600, start=1960)
    master = osd["single_partition_of_fp32_groups"][0].numpy()
    np.testing.assert_array_equal(master, zero_partitions(values, "master", hf_order(), 2)[1])
    assert osd["base_optimizer_state"]["state"][0]["step"].item() == 1.0
    assert osd["loss_scaler"].__dict__ == {"cur_scale": 1.0, "dynamic": False}


SCRIPT_COMMON = '''
# What ds_jobs.plain_collectives does: no probe of every op's compiler, no JIT build of the shared-memory CPU
# collectives (tens of seconds a run); gloo's own collectives, the same checkpoints.
deepspeed.ops.__compatible_ops__ = {}

H, HEADS, G, HD, F, V = 16, 4, 2, 4, 24, 100
L = int(os.environ.get("RESHARD_DS_LAYERS", "2"))
TP = int(os.environ.get("RESHARD_TP", "1"))
TP_GROUP = None  # the pipeline grid's 'model' (slice) group, when TP > 1


def tp_sum(x):
    if TP > 1:
        x = x.clone()
        torch.distributed.all_reduce(x, group=TP_GROUP)
    return x


class CopyToTP(torch.autograd.Function):  # Megatron's copy_to_tensor_model_parallel_region
    forward = staticmethod(lambda ctx, x: x)
    backward = staticmethod(lambda ctx, grad: tp_sum(grad))


class ReduceFromTP(torch.autograd.Function):  # reduce_from_tensor_model_parallel_region
    forward = staticmethod(lambda ctx, x: tp_sum(x))
    backward = staticmethod(lambda ctx, grad: grad)


class Attention(nn.Module):  # q, k, v split by output rows over TP ranks, o by input columns
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(H, HEADS * HD // TP, bias=False)
        self.k_proj = nn.Linear(H, G * HD // TP, bias=False)
        self.v_proj, self.o_proj = nn.Linear(H, G * HD // TP, bias=False), nn.Linear(HEADS * HD // TP, H, bias=False)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, F // TP, bias=False), nn.Linear(H, F // TP, bias=False)
        self.down_proj = nn.Linear(F // TP, H, bias=False)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()
        self.input_layernorm, self.post_attention_layernorm = Norm(), Norm()

    def forward(self, x):
        a, m = self.self_attn, self.mlp
        y = CopyToTP.apply(x * self.input_layernorm.weight)
        x = x + ReduceFromTP.apply(a.o_proj(a.q_proj(y) + torch.cat([a.k_proj(y), a.v_proj(y)], -1)))
        y = CopyToTP.apply(x * self.post_attention_layernorm.weight)
        return x + ReduceFromTP.apply(m.down_proj(nn.functional.silu(m.gate_proj(y)) * m.up_proj(y)))


def dump_state(engine, bf16, suffix=""):
    """Every parameter this rank holds, as DeepSpeed sees it: weights (bf16 bits), fp32 master, Adam states."""
    dump = {}
    for name, p in engine.module.named_parameters():
        name += suffix
        if bf16:
            dump[name + ":param"] = p.detach().view(torch.int16).numpy().view(np.uint16).copy()
        dump[name + ":master"] = safe_get_full_fp32_param(p).numpy().copy()
        for key in ("exp_avg", "exp_avg_sq"):
            dump[name + ":" + key] = safe_get_full_optimizer_state(p, key).numpy().copy()
    return dump
'''

DEEPSPEED_RUN = '''
"""Train, save or load a tiny HF-named Llama with DeepSpeed on CPU (gloo): ZeRO-2 and bf16 unless
RESHARD_DS_STAGE / RESHARD_DS_BF16 say otherwise; RESHARD_DS_UNIVERSAL=1 loads a universal folder."""
import os
import sys
import numpy as np
import torch
from torch import nn
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

''' + SCRIPT_COMMON + '''

class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers, self.norm = nn.ModuleList(DecoderLayer() for _ in range(L)), Norm()


class Llama(nn.Module):  # the registration order of transformers' LlamaForCausalLM
    def __init__(self):
        super().__init__()
        self.model, self.lm_head = Inner(), nn.Linear(H, V, bias=False)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x * self.model.norm.weight)


mode, ckpt, out = sys.argv[1:4]
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = Llama()
stage, bf16 = int(os.environ.get("RESHARD_DS_STAGE", "2")), os.environ.get("RESHARD_DS_BF16", "1") == "1"
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": stage},
          "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16},
          "checkpoint": {"load_universal": os.environ.get("RESHARD_DS_UNIVERSAL") == "1"}}
adam = torch.optim.Adam(model.parameters(), lr=1e-3)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adam, config=config)


def step():
    loss = engine(torch.randint(0, V, (2, 5))).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


if mode == "save":
    step()
    step()
    engine.save_checkpoint(ckpt)
else:
    path, _ = engine.load_checkpoint(ckpt)
    assert path is not None
    getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()  # ZeRO-1/2 only
    dump = dump_state(engine, bf16)
    if torch.distributed.get_rank() == 0:
        np.savez(out, **dump)
    step()  # training goes on at the new world size
torch.distributed.barrier()
torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # gloo's threads sometimes abort at interpreter exit, after all the work is done
'''


PIPELINE_RUN = '''
"""Train, save or load a tiny Llama as a DeepSpeed PipelineModule on CPU (gloo): [embedding, decoder layers,
norm, head], partitioned by decoder layer; RESHARD_PP / RESHARD_DP / RESHARD_DS_LAYERS / RESHARD_DS_BF16 set it up."""
import os
import sys
import numpy as np
import torch
from torch import nn
import deepspeed
from deepspeed.pipe import PipelineModule, LayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

''' + SCRIPT_COMMON + '''


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, H))

    def forward(self, ids):
        return nn.functional.embedding(ids, self.weight)


class FinalNorm(Norm):
    def forward(self, x):
        return x * self.weight


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, H) * 0.02)

    def forward(self, x):
        return x @ self.weight.t()


mode, ckpt, out = sys.argv[1:4]
pp, dp = int(os.environ.get("RESHARD_PP", "2")), int(os.environ.get("RESHARD_DP", "1"))
bf16 = os.environ.get("RESHARD_DS_BF16", "0") == "1"
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
layers = [LayerSpec(Embed), *[LayerSpec(DecoderLayer) for _ in range(L)], LayerSpec(FinalNorm), LayerSpec(Head)]
model = PipelineModule(layers=layers, topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=TP, num_dp=dp),
                       loss_fn=lambda logits, labels: logits.float().pow(2).mean(), partition_method="type:DecoderLayer")
TP_GROUP = model._grid.get_slice_parallel_group()
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
          "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16}}
adam = torch.optim.Adam(model.parameters(), lr=1e-3)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adam, config=config)


def batches():
    while True:
        ids = torch.randint(0, V, (2, 5))
        yield ids, ids


def save_dump():
    """Every rank's parameters, named '<layer>.<name>[@tp<rank>]:<state>', in one file written by rank 0."""
    tp_rank = model._grid.get_slice_parallel_rank()
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, dump_state(engine, bf16, f"@tp{tp_rank}" if TP > 1 else ""))
    if torch.distributed.get_rank() == 0:
        merged = {}
        for d in gathered:
            merged.update(d)
        np.savez(out, **merged)


data = batches()
if mode == "save":
    engine.train_batch(data)
    engine.train_batch(data)
    engine.save_checkpoint(ckpt)
    if out != "-":
        save_dump()
else:
    path, _ = engine.load_checkpoint(ckpt)
    assert path is not None
    getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    save_dump()
    engine.train_batch(data)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # gloo's threads sometimes abort at interpreter exit, after all the work is done
'''


def llama_config(layers: int) -> dict:
    """The config.json of the runs' tiny Llama, as the transformers Trainer leaves one beside its checkpoints."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 24, "vocab_size": 100, "num_hidden_layers": layers,
            "tie_word_embeddings": False}


def run_deepspeed(tmp_path, nproc: int, *args: str, stage: int = 2, bf16: bool = True, universal: bool = False,
                  script: str = DEEPSPEED_RUN, env: dict | None = None) -> None:
    from jobs import run_job

    path = tmp_path / f"deepspeed_run_{zlib.crc32(script.encode()):08x}.py"
    path.write_text(script)
    # DeepSpeed JIT-builds a small op on first use; a build dir of this test session's own means a lock left
    # behind by an interrupted earlier run can never hang this one.
    session = next((p for p in tmp_path.parents if p.name.startswith("pytest-") and not p.name.startswith("pytest-of")),
                   tmp_path)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "OMP_NUM_THREADS": "1",
           "RESHARD_DS_STAGE": str(stage), "RESHARD_DS_BF16": "1" if bf16 else "0",
           "RESHARD_DS_UNIVERSAL": "1" if universal else "0", **(env or {}),
           "TORCH_EXTENSIONS_DIR": str(session / "torch-extensions")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(path),
           *args]
    code, output = run_job(cmd, env)
    assert code == 0, output[-6000:]


@pytest.mark.interop
@pytest.mark.slow
def test_deepspeed_loads_a_dp2_checkpoint_resharded_to_dp3_bit_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    require("deepspeed")
    run_deepspeed(tmp_path, 2, "save", str(tmp_path / "dp2"), "-")
    src = FORMAT.open(tmp_path / "dp2", sizes={"heads": 4})  # also proves DeepSpeed's own files match the spec
    reshard(src, FORMAT.target(src, parse_topology("dp=3")), tmp_path / "dp3")
    run_deepspeed(tmp_path, 3, "load", str(tmp_path / "dp3"), str(tmp_path / "dump.npz"))
    # What DeepSpeed sees at dp=3 equals what reshard reads from DeepSpeed's own dp=2 files.
    # 7120 elements split evenly at dp=2: no padding, so every stored tensor holds its whole item.
    items = {item: read(loc, loc.dtype, src.layout.items[item].numel) for item, loc in src.where.items()}
    logical = gather(src.layout, items)
    dump = np.load(tmp_path / "dump.npz")
    assert len(dump.files) == 4 * 21
    for key in dump.files:
        name, state = key.rsplit(":", 1)
        np.testing.assert_array_equal(dump[key], logical[(name, state)], err_msg=key)


@pytest.fixture(scope="module")
def ds_saved(tmp_path_factory):
    """Real DeepSpeed checkpoints of the tiny Llama after two steps at dp=2, one per (stage, bf16), made once."""
    cache = {}

    def get(stage: int, bf16: bool):
        require("deepspeed")
        if (stage, bf16) not in cache:
            root = tmp_path_factory.mktemp(f"ds-z{stage}-{'bf16' if bf16 else 'fp32'}")
            run_deepspeed(root, 2, "save", str(root / "ckpt"), "-", stage=stage, bf16=bf16)
            (root / "ckpt" / "config.json").write_text(json.dumps(llama_config(2)))
            cache[(stage, bf16)] = root / "ckpt"
        return cache[(stage, bf16)]

    return get


def logical_of(path) -> dict:
    """Every logical tensor and state of a checkpoint, as reshard reads it."""
    import reshard

    src = reshard.open_checkpoint(path, sizes={"heads": 4})
    items = {item: read(loc, loc.dtype, src.layout.items[item].numel) for item, loc in src.where.items()}
    return gather(src.layout, items)


STAGES = [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]


@pytest.mark.interop
@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16", STAGES, ids=[f"z{s}-{'bf16' if b else 'fp32'}" for s, b in STAGES])
def test_real_checkpoints_master_weights_equal_zero_to_fp32(ds_saved, tmp_path, stage, bf16):
    import torch
    ckpt = ds_saved(stage, bf16)  # skips, saying why, without deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    theirs = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    ours = logical_of(ckpt)
    assert {n for n, s in ours if s == "master"} == set(theirs)
    for name, v in theirs.items():
        np.testing.assert_array_equal(ours[(name, "master")].reshape(v.shape), v.detach().numpy(), err_msg=name)
    if stage == 3:  # no weights stored but the masters: hf gets them, as zero_to_fp32 does
        import reshard
        from safetensors.torch import load_file

        reshard.convert(ckpt, tmp_path / "hf", format="hf", sizes={"heads": 4})
        hf = load_file(tmp_path / "hf" / "model.safetensors")
        assert hf.keys() == theirs.keys()
        for k, v in theirs.items():
            assert hf[k].dtype == torch.float32 and torch.equal(hf[k], v.contiguous()), k


RESUMES = [
    # (source stage, bf16, destination topology): DeepSpeed loads each without load_universal
    (1, False, "dp=4"), (1, True, "dp=3"), (2, False, "dp=1"), (3, False, "dp=3"), (3, True, "dp=1"),
    (2, True, "dp=4,zero=3"), (3, False, "dp=3,zero=1"),
]


@pytest.mark.interop
@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16,to", RESUMES, ids=[f"z{s}-{'bf16' if b else 'fp32'}-{t}" for s, b, t in RESUMES])
def test_resharded_checkpoints_resume_in_deepspeed_bit_exactly(ds_saved, tmp_path, stage, bf16, to):
    import reshard

    src = ds_saved(stage, bf16)
    result = reshard.convert(src, tmp_path / "dst", to=to, sizes={"heads": 4})
    topo = result.report.target.topology
    run_deepspeed(tmp_path, topo.dp, "load", str(tmp_path / "dst"), str(tmp_path / "dump.npz"), stage=topo.zero,
                  bf16=bf16)
    logical = logical_of(src)
    dump = np.load(tmp_path / "dump.npz")
    compared = 0
    for key in dump.files:
        name, state = key.rsplit(":", 1)
        if (name, state) not in logical:
            assert state == "param" and stage == 3  # ZeRO-3 stores no bf16 weights; DeepSpeed derives them
            continue
        np.testing.assert_array_equal(dump[key], logical[(name, state)].reshape(dump[key].shape), err_msg=key)
        compared += 1
    assert compared >= 3 * 21  # master, exp_avg, exp_avg_sq of every param (and bf16 weights where stored)


@pytest.mark.interop
@pytest.mark.slow
def test_a_universal_checkpoint_from_ds_to_universal_converts_and_resumes_bit_exactly(ds_saved, tmp_path):
    """DeepSpeed's own universal folder as a source: resharded to ZeRO-2 at dp=3, DeepSpeed resumes from it."""
    import reshard

    src = ds_saved(2, False)
    ds_to_universal(src, tmp_path / "ucp")
    ucp = reshard.open_checkpoint(tmp_path / "ucp", sizes={"heads": 4})
    assert ucp.format == "ucp" and ucp.layout.states == ("exp_avg", "exp_avg_sq", "master", "param")
    reshard.convert(tmp_path / "ucp", tmp_path / "dp3", format="deepspeed", to="dp=3,zero=2", sizes={"heads": 4})
    run_deepspeed(tmp_path, 3, "load", str(tmp_path / "dp3"), str(tmp_path / "dump.npz"), stage=2, bf16=False)
    logical = logical_of(src)
    dump = np.load(tmp_path / "dump.npz")
    assert len(dump.files) == 3 * 21
    for key in dump.files:
        name, state = key.rsplit(":", 1)
        np.testing.assert_array_equal(dump[key], logical[(name, state)].reshape(dump[key].shape), err_msg=key)


def ds_to_universal(src, out) -> None:
    """DeepSpeed's own converter on the checkpoint ``src`` (a save dir), into the universal folder ``out``."""
    from jobs import run_job

    code, output = run_job([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            str(src / (src / "latest").read_text().strip()), "--output_folder", str(out),
                            "--inject_missing_state"], {**os.environ, "DS_ACCELERATOR": "cpu"})
    assert code == 0, output[-4000:]


UNIVERSAL = [(2, False, 3), (1, True, 4), (3, False, 3)]  # (source stage, bf16, dp that loads the universal folder)


@pytest.mark.interop
@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16,dp", UNIVERSAL, ids=[f"z{s}-{'bf16' if b else 'fp32'}-dp{d}" for s, b, d in UNIVERSAL])
def test_universal_folders_written_by_reshard_equal_ds_to_universals_and_load_alike(ds_saved, tmp_path, stage, bf16,
                                                                                     dp):
    """reshard's universal export against DeepSpeed's: the same files and values, and DeepSpeed's
    load_universal at a new dp sees the same parameters and optimizer states from both."""
    import torch
    import reshard

    src = ds_saved(stage, bf16)
    tag = (src / "latest").read_text().strip()
    result = reshard.convert(src, tmp_path / "ours", format="ucp", sizes={"heads": 4})
    assert (tmp_path / "ours" / "latest_universal").read_text() == tag
    ds_to_universal(src, tmp_path / "theirs" / tag)
    ours, theirs = tmp_path / "ours" / tag / "zero", tmp_path / "theirs" / tag / "zero"
    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*.pt"))
    assert files == sorted(p.relative_to(ours) for p in ours.rglob("*.pt"))
    # fp32, exp_avg, exp_avg_sq (and under ZeRO-1/2 step) per param; optimizer_state.pt
    assert len(files) == 21 * (3 if stage == 3 else 4) + 1
    for rel in files:
        a, b = torch.load(ours / rel, weights_only=False), torch.load(theirs / rel, weights_only=False)
        if rel.name == "optimizer_state.pt":
            # ds_to_universal also leaves dp rank 0's partitions in ZeRO-3's; DeepSpeed's loader never reads them
            assert a.keys() == b.keys() - {"fp32_flat_groups"} and a["param_groups"] == b["param_groups"], rel
            if stage == 3:
                assert torch.equal(a["optimizer_state_dict"]["state"][0]["step"],
                                   b["optimizer_state_dict"]["state"][0]["step"])
            continue
        if rel.name == "step.pt" or stage == 3:  # ZeRO-3's states are bare flat tensors
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), rel
            continue
        assert list(a) == list(b) == ["cat_dim", "param"] and a["cat_dim"] == b["cat_dim"], rel
        assert a["param"].dtype == b["param"].dtype == torch.float32 and torch.equal(a["param"], b["param"]), rel
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    model = torch.load(tmp_path / "ours" / tag / model_file, weights_only=False)
    original = torch.load(src / tag / model_file, weights_only=False)
    assert model.keys() == original.keys() and model["global_steps"] == original["global_steps"] == 2
    assert [list(g) for g in model["param_shapes"]] == [list(g) for g in original["param_shapes"]]
    for name, v in original["module"].items():
        assert model["module"][name].dtype == v.dtype and torch.equal(model["module"][name], v), name
    assert result.bytes_written == sum(p.stat().st_size for p in (tmp_path / "ours").rglob("*") if p.is_file()
                                       and p.name != "reshard.json")
    dumps = {}
    for name in ("ours", "theirs"):
        dumps[name] = tmp_path / f"{name}.npz"
        run_deepspeed(tmp_path, dp, "load", str(tmp_path / name), str(dumps[name]), stage=stage, bf16=bf16,
                      universal=True)
    mine, ref, logical = np.load(dumps["ours"]), np.load(dumps["theirs"]), logical_of(src)
    assert sorted(mine.files) == sorted(ref.files) and len(mine.files) == 21 * (4 if bf16 else 3)
    for key in mine.files:
        np.testing.assert_array_equal(mine[key], ref[key], err_msg=key)
        name, state = key.rsplit(":", 1)
        np.testing.assert_array_equal(mine[key], logical[(name, state)].reshape(mine[key].shape), err_msg=key)


# --- the pipeline engine ---------------------------------------------------------------------


_ROWS, _COLS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")


def pipeline_logical(dump, layers: int) -> dict:
    """A pipeline run's dump as logical tensors: HF names, tp shards joined as the run split them."""
    parts: dict = {}
    for key in dump.files:
        name, state = key.rsplit(":", 1)
        name, _, tp = name.partition("@tp")
        index, _, local = name.partition(".")
        n = int(index)
        hf = ({0: "model.embed_tokens.weight", layers + 1: "model.norm.weight", layers + 2: "lm_head.weight"}.get(n)
              or f"model.layers.{n - 1}.{local}")
        parts.setdefault((hf, state), {})[int(tp or 0)] = dump[key]
    out = {}
    for key, shards in parts.items():
        ordered = [shards[t] for t in sorted(shards)]
        kind = key[0].split(".")[-2]
        if kind in _ROWS + _COLS:
            out[key] = np.concatenate(ordered, 0 if kind in _ROWS else 1)
        else:
            for other in ordered[1:]:
                np.testing.assert_array_equal(other, ordered[0], err_msg=f"{key}: tp replicas differ")
            out[key] = ordered[0]
    return out


def assert_logical_equal(got: dict, want: dict, count: int) -> None:
    assert len(got) == count
    for key, value in got.items():
        np.testing.assert_array_equal(value, want[key].reshape(value.shape), err_msg=str(key))


@pytest.fixture(scope="module")
def pipe_saved(tmp_path_factory):
    """Real DeepSpeed pipeline-engine checkpoints (ZeRO-1, pp=2, dp=1, 4 decoder layers) after two batches."""
    cache = {}

    def get(bf16: bool):
        require("deepspeed")
        if bf16 not in cache:
            root = tmp_path_factory.mktemp(f"ds-pipe-{'bf16' if bf16 else 'fp32'}")
            run_deepspeed(root, 2, "save", str(root / "ckpt"), "-", bf16=bf16, script=PIPELINE_RUN,
                          env={"RESHARD_PP": "2", "RESHARD_DP": "1", "RESHARD_DS_LAYERS": "4"})
            (root / "ckpt" / "config.json").write_text(json.dumps(llama_config(4)))
            cache[bf16] = root / "ckpt"
        return cache[bf16]

    return get


@pytest.mark.interop
@pytest.mark.slow
def test_real_pipeline_checkpoints_read_with_their_layer_files(pipe_saved):
    import torch
    import reshard

    ckpt = pipe_saved(False)
    src = reshard.open_checkpoint(ckpt, sizes={"heads": 4})
    assert src.spec_name == "deepspeed-pipe-llama" and (src.topology.pp, src.topology.dp, src.topology.zero) == (2, 1, 1)
    assert src.sizes["layers"] == 4
    logical = logical_of(ckpt)
    tag = ckpt / (ckpt / "latest").read_text().strip()
    layer = torch.load(tag / "layer_02-model_00-model_states.pt")  # decoder layer 1
    for local, value in layer.items():
        np.testing.assert_array_equal(logical[(f"model.layers.1.{local}", "param")], value.numpy(), err_msg=local)
    head = torch.load(tag / "layer_06-model_00-model_states.pt")["weight"]
    np.testing.assert_array_equal(logical[("lm_head.weight", "master")], head.numpy())  # fp32: the weights are the master


PIPE_RESUMES = [
    # (bf16, destination topology and spec, ranks, script that loads it)
    (False, "pp=1,dp=3", None, 3, "pipe"),
    (True, "pp=1,dp=2", None, 2, "pipe"),
    (False, "dp=3,zero=2", "deepspeed-llama", 3, "plain"),  # out of the pipeline engine
]


@pytest.mark.interop
@pytest.mark.slow
@pytest.mark.parametrize("bf16,to,spec,ranks,engine", PIPE_RESUMES,
                         ids=[f"{'bf16' if b else 'fp32'}-{t}-{e}" for b, t, _, _, e in PIPE_RESUMES])
def test_resharded_pipeline_checkpoints_resume_in_deepspeed_bit_exactly(pipe_saved, tmp_path, bf16, to, spec, ranks,
                                                                        engine):
    import reshard

    src = pipe_saved(bf16)
    reshard.convert(src, tmp_path / "out", to=to, spec=spec, sizes={"heads": 4})
    topo = reshard.open_checkpoint(tmp_path / "out", sizes={"heads": 4}).topology
    if engine == "pipe":
        run_deepspeed(tmp_path, ranks, "load", str(tmp_path / "out"), str(tmp_path / "dump.npz"), bf16=bf16,
                      script=PIPELINE_RUN, env={"RESHARD_PP": str(topo.pp), "RESHARD_DP": str(topo.dp),
                                                "RESHARD_DS_LAYERS": "4"})
    else:
        run_deepspeed(tmp_path, ranks, "load", str(tmp_path / "out"), str(tmp_path / "dump.npz"), stage=topo.zero,
                      bf16=bf16, env={"RESHARD_DS_LAYERS": "4"})
    dump = np.load(tmp_path / "dump.npz")
    got = pipeline_logical(dump, 4) if engine == "pipe" else {tuple(k.rsplit(":", 1)): dump[k] for k in dump.files}
    assert_logical_equal(got, logical_of(src), (4 if bf16 else 3) * (9 * 4 + 3))


@pytest.mark.interop
@pytest.mark.slow
def test_a_checkpoint_of_the_plain_engine_resumes_in_the_pipeline_engine(ds_saved, tmp_path):
    import reshard

    src = ds_saved(1, False)  # ZeRO-1, fp32, dp=2, 2 decoder layers
    reshard.convert(src, tmp_path / "out", to="pp=2,dp=1", sizes={"heads": 4})
    assert (tmp_path / "out" / "global_step2" / "layer_03-model_00-model_states.pt").is_file()
    run_deepspeed(tmp_path, 2, "load", str(tmp_path / "out"), str(tmp_path / "dump.npz"), bf16=False,
                  script=PIPELINE_RUN, env={"RESHARD_PP": "2", "RESHARD_DP": "1", "RESHARD_DS_LAYERS": "2"})
    assert_logical_equal(pipeline_logical(np.load(tmp_path / "dump.npz"), 2), logical_of(src), 3 * 21)


@pytest.mark.interop
@pytest.mark.slow
def test_tensor_parallel_pipeline_checkpoints_change_tp_bit_exactly(pipe_saved, tmp_path):
    """tp over PipeModelDataParallelTopology's model axis, q/k/v/gate/up split by rows, o/down by columns."""
    import reshard

    require("deepspeed")
    tp2 = {"RESHARD_PP": "1", "RESHARD_DP": "1", "RESHARD_TP": "2"}
    run_deepspeed(tmp_path, 2, "save", str(tmp_path / "tp2"), str(tmp_path / "saved.npz"), bf16=False,
                  script=PIPELINE_RUN, env={**tp2, "RESHARD_DS_LAYERS": "2"})
    assert (tmp_path / "tp2" / "global_step2" / "layer_01-model_01-model_states.pt").is_file()
    with pytest.raises(CheckpointFormatError, match="no config.json naming a family reshard knows"):
        reshard.open_checkpoint(tmp_path / "tp2", sizes={"heads": 4})  # a pipeline's layers are its family's
    with pytest.raises(CheckpointFormatError, match="does not resolve with the sizes known"):
        reshard.open_checkpoint(tmp_path / "tp2", spec="deepspeed-pipe-llama", sizes={"heads": 4})  # tp shards
    (tmp_path / "tp2" / "config.json").write_text(json.dumps(llama_config(2)))  # as the Trainer leaves it
    src = reshard.open_checkpoint(tmp_path / "tp2")
    assert (src.topology.tp, src.topology.pp, src.spec_name) == (2, 1, "deepspeed-pipe-llama")
    logical = logical_of(tmp_path / "tp2")
    # reshard reads the shards as the run itself joins them
    assert_logical_equal(pipeline_logical(np.load(tmp_path / "saved.npz"), 2), logical, 3 * 21)
    reshard.convert(tmp_path / "tp2", tmp_path / "tp1", to="tp=1,dp=2")
    run_deepspeed(tmp_path, 2, "load", str(tmp_path / "tp1"), str(tmp_path / "tp1.npz"), bf16=False,
                  script=PIPELINE_RUN, env={"RESHARD_PP": "1", "RESHARD_DP": "2", "RESHARD_DS_LAYERS": "2"})
    assert_logical_equal(pipeline_logical(np.load(tmp_path / "tp1.npz"), 2), logical, 3 * 21)
    # and into tensor parallelism: the tp=1, pp=2 run split over two tp ranks
    reshard.convert(pipe_saved(False), tmp_path / "to-tp2", to="tp=2,pp=1,dp=1", sizes={"heads": 4})
    run_deepspeed(tmp_path, 2, "load", str(tmp_path / "to-tp2"), str(tmp_path / "to-tp2.npz"), bf16=False,
                  script=PIPELINE_RUN, env={**tp2, "RESHARD_DS_LAYERS": "4"})
    assert_logical_equal(pipeline_logical(np.load(tmp_path / "to-tp2.npz"), 4), logical_of(pipe_saved(False)),
                         3 * 39)


def test_sizes_and_shard_size_reach_the_library(tmp_path):
    """A DeepSpeed checkpoint without config.json needs --sizes; hf output shards at --max-shard-size."""
    from safetensors.numpy import load_file
    from reshard.cli.main import app
    from typer.testing import CliRunner

    runner = CliRunner()

    write_checkpoint(tmp_path / "ds", "dp=2", dtype="float32")
    config = (tmp_path / "ds" / "config.json").read_text()
    (tmp_path / "ds" / "config.json").unlink()
    refused = runner.invoke(app, ["convert", str(tmp_path / "ds"), str(tmp_path / "hf"), "--format", "hf",
                                  "--sizes", "heads=4"])
    assert refused.exit_code == 2 and "put the model's config.json beside" in refused.stderr  # never guessed
    (tmp_path / "ds" / "config.json").write_text(config)
    result = runner.invoke(app, ["convert", str(tmp_path / "ds"), str(tmp_path / "hf"), "--format", "hf",
                                 "--max-shard-size", "10KB"])
    assert result.exit_code == 0, result.output
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    logical = logical_of(tmp_path / "ds")
    for shard in shards:
        for name, value in load_file(tmp_path / "hf" / shard).items():
            assert index["weight_map"][name] == shard
            assert value.tobytes() == logical[(name, "param")].tobytes(), name
    inspect = runner.invoke(app, ["inspect", str(tmp_path / "ds"), "--json"])
    assert inspect.exit_code == 0 and json.loads(inspect.stdout)["sizes"]["hd"] == 4
