"""Every size and structure a format adapter takes from a checkpoint is checked before it drives slicing.

Sizes, counts, shapes, world sizes, partition counts, steps, tags and manifest fields are read from
untrusted files: a wrong type (a string, a bool, a float), a negative or huge value, or one that
disagrees with the other fields or with the tensors really stored is a ``CheckpointFormatError``
naming the file, the field, the value and the limit, never a raw ``ValueError``/``TypeError``/
``KeyError``/``MemoryError``, a hang, or a silently wrong conversion.

Each test pins one rule, most of them found by fuzzing whole checkpoints (tests/fuzz_formats.py); the
fuzzed files themselves are replayed from tests/fuzz_regressions/. Inputs are fixtures
(``make_fixture``) with one targeted edit.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from reshard.fixtures import make_fixture

import reshard
from reshard.errors import CheckpointFormatError, ReshardError
from reshard.formats.base import MAX_SIZE, expect_int, expect_shape, read_json, read_tag
from reshard.io.torchfile import TensorRef, TensorSpec, read_torch_file, write_torch_file


def refused(call: Callable[[], Any], match: str) -> str:
    """The CheckpointFormatError ``call`` raises; ``match`` is searched for in its message."""
    with pytest.raises(CheckpointFormatError) as e:
        call()
    assert re.search(match, str(e.value)), str(e.value)
    return str(e.value)


def rewrite(path: Path, edit: Callable[[Any], Any]) -> None:
    """Read a torch file, apply ``edit`` to its object tree (tensors kept, with their bytes), write it back."""
    raw = path.read_bytes()
    data: dict[Any, bytes] = {}

    def spec(x: Any) -> Any:
        if isinstance(x, TensorRef):
            key = len(data)
            data[key] = raw[x.data_offset:x.data_offset + x.nbytes]
            return TensorSpec(x.dtype, x.shape, key)
        if isinstance(x, dict):
            for k, v in x.items():
                x[k] = spec(v)
        elif isinstance(x, list):
            x[:] = [spec(v) for v in x]
        elif isinstance(x, argparse.Namespace):
            for k, v in vars(x).items():
                setattr(x, k, spec(v))
        return x

    tree = edit(spec(read_torch_file(path)))
    write_torch_file(path, tree, data)


def edit_json(path: Path, edit: Callable[[Any], Any]) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def put(tree: Any, keys: tuple, value: Any) -> Any:
    node = tree
    for k in keys[:-1]:
        node = node[k] if not isinstance(node, argparse.Namespace) else getattr(node, k)
    if isinstance(node, argparse.Namespace):
        setattr(node, keys[-1], value)
    else:
        node[keys[-1]] = value
    return tree


def convert(src: Path, tmp_path: Path, **kw) -> None:
    reshard.convert(src, tmp_path / "out", **kw)


# --------------------------------------------------------------------------------------------- the rules


def test_an_integer_field_names_the_file_the_field_the_value_and_the_bounds():
    for value, shown in ((True, "bool True"), ("4", "the string '4'"), (4.0, "float 4.0")):
        refused(lambda v=value: expect_int(v, "dp_world_size", "m.pt", lo=1, hi=8),
                rf"^m\.pt: dp_world_size is {re.escape(shown)}, expected an integer in \[1, 8\]$")
    refused(lambda: expect_int(-1, "partition_count[0]", "o.pt", lo=1, hi=8),
            r"^o\.pt: partition_count\[0\] is -1, outside \[1, 8\]$")
    assert expect_int(8, "x", "f", hi=8) == 8


def test_a_shape_needs_non_negative_integer_dims_and_a_bounded_element_count():
    refused(lambda: expect_shape((4, -3), "param_shapes[0]['w']", "m.pt"),
            r"^m\.pt: param_shapes\[0\]\['w'\] dim 1 is -3, outside \[0, ")
    refused(lambda: expect_shape((1 << 30, 1 << 30), "w", "m.pt"), rf"elements, more than {MAX_SIZE}$")
    refused(lambda: expect_shape("4x4", "w", "m.pt"), r"is the string '4x4', not a tensor shape$")
    assert expect_shape([2, 0], "w", "m.pt") == (2, 0)


def test_a_tracker_file_is_bounded_utf8_text_naming_one_directory(tmp_path):
    latest = tmp_path / "latest"
    for data, match in ((b"\xff\xfe", r"not UTF-8 text"), (b"x" * 5000, r"more than 4096 bytes, too large for a checkpoint tag"),
                        (b"../up", r"not a checkpoint tag: '../up'"), (b"a\x00b", r"not a checkpoint tag"),
                        (b"  \n", r"not a checkpoint tag: ''")):
        latest.write_bytes(data)
        refused(lambda: read_tag(latest), match)
    latest.write_bytes(b"global_step5\n")
    assert read_tag(latest) == "global_step5"


def test_a_json_file_too_deep_for_the_parser_is_a_format_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    refused(lambda: read_json(path), r"config\.json: not readable JSON \(RecursionError")
    path.write_bytes(b'{"a": "\xff"}')
    refused(lambda: read_json(path), r"config\.json: not UTF-8")


# --------------------------------------------------------------------------------------------- deepspeed


@pytest.fixture
def zero2(tmp_path) -> Path:
    make_fixture(tmp_path / "ds", format="deepspeed", to="dp=2,zero=2")
    return tmp_path / "ds"


def test_a_deepspeed_latest_file_that_is_not_utf8_is_named(zero2, tmp_path):
    (zero2 / "latest").write_bytes(b"global_step1\xff")
    refused(lambda: convert(zero2, tmp_path, to="dp=3"), r"latest: not UTF-8 text")


def test_a_negative_dim_in_param_shapes_is_refused_before_it_becomes_a_box(zero2, tmp_path):
    model = zero2 / "global_step1" / "mp_rank_00_model_states.pt"
    rewrite(model, lambda t: put(t, ("param_shapes", 0, "model.embed_tokens.weight"), (-1100, 64)))
    refused(lambda: convert(zero2, tmp_path, to="dp=3"),
            r"mp_rank_00_model_states\.pt: param_shapes\[0\]\['model\.embed_tokens\.weight'\] dim 0 is -1100, "
            r"outside \[0, ")


@pytest.mark.parametrize("value,shown", [("2", "the string '2'"), (2.0, "float 2.0"), (True, "bool True"),
                                         (0, "0, outside")])
def test_a_deepspeed_world_size_of_the_wrong_type_is_refused(zero2, tmp_path, value, shown):
    model = zero2 / "global_step1" / "mp_rank_00_model_states.pt"
    rewrite(model, lambda t: put(t, ("dp_world_size",), value))
    refused(lambda: convert(zero2, tmp_path, to="dp=3"),
            rf"mp_rank_00_model_states\.pt: dp_world_size is {re.escape(shown)}")


def test_a_partition_count_that_disagrees_with_dp_world_size_is_refused(zero2, tmp_path):
    optim = zero2 / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rewrite(optim, lambda t: put(t, ("optimizer_state_dict", "partition_count", 0), 3))
    refused(lambda: convert(zero2, tmp_path, to="dp=3"), r"partition_count\[0\] is 3, but dp_world_size is 2")
    rewrite(optim, lambda t: put(t, ("optimizer_state_dict", "partition_count", 0), "2"))
    refused(lambda: convert(zero2, tmp_path, to="dp=3"), r"partition_count\[0\] is the string '2'")


def test_frozen_param_shapes_of_any_shape_is_refused_with_its_value(zero2, tmp_path):
    model = zero2 / "global_step1" / "mp_rank_00_model_states.pt"
    rewrite(model, lambda t: put(t, ("frozen_param_shapes",), 5))
    refused(lambda: convert(zero2, tmp_path, to="dp=3"), r"frozen_param_shapes is 5, expected a mapping")


def test_a_config_json_size_that_is_not_a_positive_integer_is_named(zero2, tmp_path):
    edit_json(zero2 / "config.json", lambda c: {**c, "num_attention_heads": 0})
    refused(lambda: convert(zero2, tmp_path, to="dp=3"), r"config\.json: 'num_attention_heads' must be a positive "
                                                         r"integer, got 0")


def test_a_layer_count_beyond_what_param_shapes_can_hold_is_refused_before_resolving(zero2, tmp_path):
    edit_json(zero2 / "config.json", lambda c: {**c, "num_hidden_layers": 10**12})
    refused(lambda: convert(zero2, tmp_path, to="dp=3"), r"config\.json: model size 'layers' is 1000000000000, outside")


def test_an_optimizer_state_keyed_by_something_else_than_group_numbers_is_refused(zero2, tmp_path):
    optim = zero2 / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    rewrite(optim, lambda t: put(t, ("optimizer_state_dict", "base_optimizer_state", "state", "x"), {}))
    refused(lambda: convert(zero2, tmp_path, to="dp=3"), r"base_optimizer_state\.state is keyed \[0, 'x'\]")


def test_param_slice_mappings_that_are_not_a_mapping_are_refused(zero2, tmp_path):
    optim = zero2 / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    rewrite(optim, lambda t: put(t, ("optimizer_state_dict", "param_slice_mappings", 0), [1, 2]))
    refused(lambda: convert(zero2, tmp_path, to="dp=3"), r"param_slice_mappings\[0\] is \[1, 2\], expected a mapping")


def test_a_zero3_config_without_zero_optimization_settings_still_converts(tmp_path):
    src = tmp_path / "z3"
    make_fixture(src, format="deepspeed", to="dp=2,zero=3")
    for model in src.glob("*/zero_pp_rank_*_mp_rank_00_model_states.pt"):
        rewrite(model, lambda t: put(t, ("ds_config", "zero_optimization"), None))
    convert(src, tmp_path, to="dp=3")
    written = read_torch_file(next((tmp_path / "out").glob("*/zero_pp_rank_0_mp_rank_00_model_states.pt")))
    assert written["ds_config"]["zero_optimization"] == {"stage": 3}
    rewrite(next(src.glob("*/zero_pp_rank_0_mp_rank_00_model_states.pt")),
            lambda t: put(t, ("ds_config", "zero_optimization"), [3]))
    refused(lambda: convert(src, tmp_path / "again", to="dp=3"),
            r"ds_config is .*zero_optimization, if any, is a mapping")


def test_a_zero3_step_that_is_not_a_whole_number_is_refused(tmp_path):
    src = tmp_path / "z3"
    make_fixture(src, format="deepspeed", to="dp=2,zero=3")
    rewrite(next(src.glob("*/zero_pp_rank_0_mp_rank_00_model_states.pt")),
            lambda t: put(t, ("global_steps",), float("nan")))
    refused(lambda: convert(src, tmp_path, to="dp=3"), r"global_steps is float nan, expected an integer in \[0, ")


def test_a_pipeline_layer_name_with_non_ascii_digits_is_not_a_layer_index(tmp_path):
    src = tmp_path / "pipe"
    make_fixture(src, format="deepspeed", to="pp=2,dp=1,zero=1")
    model = src / "global_step1" / "mp_rank_00_model_states.pt"

    def rename(t):
        group = t["param_shapes"][0]
        first = next(iter(group))
        t["param_shapes"][0] = {"²" + first.partition(".")[1] + first.partition(".")[2]: group[first],
                                **{k: v for k, v in group.items() if k != first}}
        return t

    rewrite(model, rename)
    refused(lambda: convert(src, tmp_path, to="pp=1,dp=1,zero=1"), r"param_shapes\[0\] position 0 is '²\.")


def test_a_pipeline_model_file_with_another_number_of_param_groups_is_refused(tmp_path):
    src = tmp_path / "pipe"
    make_fixture(src, format="deepspeed", to="pp=2,dp=1,zero=1")
    model = src / "global_step1" / "mp_rank_01_model_states.pt"
    rewrite(model, lambda t: put(t, ("param_shapes",), [t["param_shapes"][0], {}]))
    refused(lambda: convert(src, tmp_path, to="pp=1,dp=1,zero=1"),
            r"mp_rank_01_model_states\.pt: 2 param groups in param_shapes, but spec 'deepspeed-pipe-llama' has 1 flat")


# ---------------------------------------------------------------------------------------------- megatron


@pytest.fixture
def megatron(tmp_path) -> Path:
    make_fixture(tmp_path / "m", format="megatron", to="tp=2,pp=1,dp=1")
    return tmp_path / "m"


def set_args(root: Path, **values) -> None:
    for rank in sorted((root / "iter_0000000").iterdir()):
        rewrite(rank / "model_optim_rng.pt", lambda t: [setattr(t["args"], k, v) for k, v in values.items()] and t)


def test_a_layer_count_beyond_the_tensors_stored_is_refused_before_resolving(megatron, tmp_path):
    set_args(megatron, num_layers=40000)
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), r"args: model size 'layers' is 40000, outside \[1, \d+\]")


def test_a_tensor_parallel_size_beyond_the_rank_directories_is_refused_without_listing_them(megatron, tmp_path):
    set_args(megatron, tensor_model_parallel_size=2**40)
    refused(lambda: convert(megatron, tmp_path, to="tp=1"),
            r"model_optim_rng\.pt: args\.tensor_model_parallel_size is 1099511627776, outside \[1, 2\]")


@pytest.mark.parametrize("name,value,shown", [("hidden_size", "64", "the string '64'"),
                                              ("num_attention_heads", 0, "0, outside"),
                                              ("make_vocab_size_divisible_by", 1.5, "float 1.5"),
                                              ("virtual_pipeline_model_parallel_size", 9, "9, outside \\[1, 4\\]")])
def test_an_args_size_of_the_wrong_type_or_range_is_named(megatron, tmp_path, name, value, shown):
    set_args(megatron, **{name: value})
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), rf"args\.{name} is {shown}")


def test_a_seed_numpy_cannot_take_is_refused_when_the_rng_state_is_regenerated(megatron, tmp_path):
    set_args(megatron, seed=-5)
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), r"args\.seed is -5, outside \[0, 4294967295\]")


def test_a_tracker_with_an_iteration_too_long_to_be_one_is_refused(megatron, tmp_path):
    (megatron / "latest_checkpointed_iteration.txt").write_text("9" * 5000)
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), r"more than 4096 bytes")
    (megatron / "latest_checkpointed_iteration.txt").write_text("9" * 40)
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), r"expected an iteration number or 'release'")


def test_a_state_dict_key_that_is_not_a_string_is_refused_without_printing_it_whole(megatron, tmp_path):
    rank = megatron / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    rewrite(rank, lambda t: put(t, ("model", 10**5000), None))  # Python cannot even str() this integer
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), r"state dict key a 16610-bit integer \(in ''\) is not a string")
    rewrite(rank, lambda t: [t["model"].pop(10**5000)] and put(t, (7,), None))
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), r"model_optim_rng\.pt: top-level key 7 is not a string")
    rewrite(rank, lambda t: [t.pop(7)] and put(t, ("optimizer", "optimizer", "state", 0, -10**5000), None))
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), r"state name a 16610-bit integer is not a string")


def test_a_param_group_without_a_params_list_is_refused(megatron, tmp_path):
    rank = megatron / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    rewrite(rank, lambda t: put(t, ("optimizer", "optimizer", "param_groups", 0, "params"), None))
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), r"param group 0's 'params' is None, not a list")


def test_a_mixed_precision_optimizer_without_its_torch_state_dict_is_refused(megatron, tmp_path):
    rank = megatron / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt"
    rewrite(rank, lambda t: [t["optimizer"].pop("optimizer")] and t)
    refused(lambda: reshard.plan(megatron, to="tp=1,pp=2"),
            r"mp_rank_01/model_optim_rng\.pt: optimizer has no list of param_groups")


def test_a_param_group_with_a_wd_mult_that_is_not_a_number_is_refused(megatron, tmp_path):
    rank = megatron / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    rewrite(rank, lambda t: put(t, ("optimizer", "optimizer", "param_groups", 0, "wd_mult"), "one"))
    refused(lambda: convert(megatron, tmp_path, to="tp=1"), r"param group 0 has wd_mult 'one', not a number")


def test_an_extra_state_of_a_layer_the_rank_does_not_hold_is_refused(megatron, tmp_path):
    rank = megatron / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    rewrite(rank, lambda t: put(t, ("model", "decoder.layers.77.mlp.linear_fc1._extra_state"), None))
    refused(lambda: convert(megatron, tmp_path, to="tp=1"),
            r"decoder\.layers\.77\.mlp\.linear_fc1\._extra_state: names a layer or expert this rank does not hold")


@pytest.fixture
def distopt(tmp_path) -> Path:
    make_fixture(tmp_path / "d", format="megatron", to="tp=1,pp=1,dp=2,zero=1")
    return tmp_path / "d"


def test_a_distributed_optimizer_buffer_that_is_not_a_state_mapping_is_refused(distopt, tmp_path):
    path = distopt / "iter_0000000" / "mp_rank_00" / "distrib_optim.pt"
    rewrite(path, lambda t: {**t, 0: {k: [1, 2] for k in t[0]}})
    refused(lambda: convert(distopt, tmp_path, to="tp=2,zero=1"),
            r"distrib_optim\.pt: buffer 0 is .*list\}, expected \{\(param_dtype, grad_dtype\): \{state: tensor\}\}")


def test_a_buffer_keyed_by_dtypes_reshard_does_not_know_is_refused(distopt, tmp_path):
    path = distopt / "iter_0000000" / "mp_rank_00" / "distrib_optim.pt"
    rewrite(path, lambda t: {**t, 0: {("float33", "float32"): v for v in t[0].values()}})
    refused(lambda: convert(distopt, tmp_path, to="tp=2,zero=1"), r"buffer 0 is \{\('float33', 'float32'\)")


def test_a_numel_unpadded_that_is_not_an_integer_is_refused(distopt, tmp_path):
    path = distopt / "iter_0000000" / "mp_rank_00" / "distrib_optim.pt"
    rewrite(path, lambda t: [v.update(numel_unpadded="many") for v in t[0].values()] and t)
    refused(lambda: convert(distopt, tmp_path, to="tp=2,zero=1"), r"buffer 0 numel_unpadded is the string 'many'")


# ------------------------------------------------------------------------------------------ hf, dcp, mcore


def test_an_hf_layer_count_beyond_the_stored_tensors_is_refused_before_resolving(tmp_path):
    src = tmp_path / "hf"
    make_fixture(src, format="hf", to="tp=1")
    edit_json(src / "config.json", lambda c: {**c, "num_hidden_layers": 60000})
    refused(lambda: reshard.inspect(src), r"config\.json: model size 'layers' is 60000, outside \[1, 39\]")


def test_a_dcp_tensor_whose_chunks_overlap_is_refused(tmp_path):
    from reshard.io.dcp_metadata import DcpTensor, read_metadata, write_metadata

    src = tmp_path / "dcp"
    make_fixture(src, format="dcp", to="dp=2")
    md = read_metadata(src)
    key = "model.model.embed_tokens.weight"
    t = md.tensors[key]
    md.tensors[key] = DcpTensor(t.dtype, t.size, (*t.chunks, t.chunks[0]))  # the first chunk listed twice
    write_metadata(src, md)
    refused(lambda: reshard.inspect(src), rf"'{re.escape(key)}' of size \[1100, 64\] \(70400 elements\) has chunks "
                                          r"holding 105600 elements \(overlapping chunks\)")


def test_a_dcp_step_that_is_not_a_whole_number_is_refused(tmp_path):
    import io

    import torch

    from reshard.io.dcp_metadata import read_metadata

    src = tmp_path / "dcp"
    make_fixture(src, format="dcp", to="dp=2")
    md = read_metadata(src)
    key = next(k for k in md.tensors if k.endswith(".step"))
    s = md.storage[(key, ())]
    buf = io.BytesIO()
    torch.save(torch.tensor(float("nan")), buf)
    data = bytearray((src / s.relative_path).read_bytes())
    nan = buf.getvalue()
    assert len(nan) == s.length  # a 0-d float32 archive: same layout, other value
    data[s.offset:s.offset + s.length] = nan
    (src / s.relative_path).write_bytes(bytes(data))
    refused(lambda: reshard.inspect(src), rf"'{re.escape(key)}' is float nan, expected an integer in \[0, ")


def test_mcore_dist_parallel_sizes_are_bounded_before_they_make_a_topology(tmp_path):
    src = tmp_path / "mc"
    make_fixture(src, format="mcore-dist", to="tp=2")
    rewrite(src / "common.pt", lambda t: put(t, ("args", "tensor_model_parallel_size"), 2**40))
    refused(lambda: reshard.inspect(src), r"common\.pt: args: args\.tensor_model_parallel_size is 1099511627776, "
                                          r"outside \[1, 65536\]")
    rewrite(src / "common.pt", lambda t: put(t, ("args", "tensor_model_parallel_size"), 2))
    rewrite(src / "common.pt", lambda t: put(t, ("args", "pipeline_model_parallel_size"), 5))  # 4 layers stored
    refused(lambda: reshard.inspect(src), r"args\.pipeline_model_parallel_size is 5, outside \[1, 4\]")


def test_an_mcore_dist_iteration_that_is_not_a_whole_number_is_refused(tmp_path):
    src = tmp_path / "mc"
    make_fixture(src, format="mcore-dist", to="tp=2")
    rewrite(src / "common.pt", lambda t: put(t, ("iteration",), 2.5))
    refused(lambda: reshard.inspect(src), r"common\.pt: iteration is float 2\.5")


# ---------------------------------------------------------------------------------------------------- ucp


@pytest.fixture
def ucp(tmp_path) -> Path:
    make_fixture(tmp_path / "ds", format="deepspeed", to="dp=2,zero=2")
    reshard.convert(tmp_path / "ds", tmp_path / "ucp", format="ucp")
    (tmp_path / "ucp" / "reshard.json").unlink()
    return tmp_path / "ucp"


def test_a_universal_fp32_file_disagreeing_with_param_shapes_is_refused(ucp, tmp_path):
    model = ucp / "global_step1" / "mp_rank_00_model_states.pt"
    rewrite(model, lambda t: put(t, ("param_shapes", 0, "model.norm.weight"), (65,)))
    refused(lambda: convert(ucp, tmp_path, format="deepspeed", to="dp=2"),
            r"fp32\.pt: 'model\.norm\.weight' is \[64\], but the model file's param_shapes says \[65\]")


def test_a_universal_step_that_is_not_a_whole_number_is_refused(ucp, tmp_path):
    for step in (ucp / "global_step1" / "zero").glob("*/step.pt"):
        write_torch_file(step, TensorSpec("float32", (), 0), {0: b"\x00\x00\xc0\x7f"})  # NaN
    refused(lambda: convert(ucp, tmp_path, format="deepspeed", to="dp=2"), r"step\.pt\) is float nan")


def test_a_universal_tag_that_leaves_the_folder_is_refused(ucp):
    from reshard.formats.deepspeed.ucp import FORMAT

    (ucp / "latest_universal").write_text("..")
    refused(lambda: FORMAT.open(ucp), r"latest_universal: not a checkpoint tag: '\.\.'")


# ------------------------------------------------------------------------------------ manifest and resume


@pytest.fixture
def converted(tmp_path) -> Path:
    make_fixture(tmp_path / "src", format="megatron", to="tp=2,pp=1")
    reshard.convert(tmp_path / "src", tmp_path / "out", to="tp=1,pp=1")
    return tmp_path / "out"


@pytest.mark.parametrize("edit,match", [
    (lambda m: {**m, "files": list(m["files"])}, r"'files' is \[.*expected an object"),
    (lambda m: {**m, "files": {k: {**v, "bytes": "12"} for k, v in m["files"].items()}},
     r"files\['.*'\]\.bytes is the string '12', expected an integer"),
    (lambda m: {**m, "files": {k: {**v, "bytes": -1} for k, v in m["files"].items()}},
     r"files\['.*'\]\.bytes is -1, outside \[0, "),
    (lambda m: {**m, "files": {"../../etc/passwd": next(iter(m["files"].values()))}},
     r"a file name is '\.\./\.\./etc/passwd', expected a path inside the checkpoint"),
    (lambda m: {**m, "files": {k: 7 for k in m["files"]}}, r"files\['.*'\] is 7, expected an object"),
    (lambda m: {**m, "logical": {"param": {"w": {"dtype": 3}}}}, r"'logical' is .*expected state -> tensor"),
    (lambda m: [m], r"'files' is \[\{"),
])
def test_a_manifest_field_of_the_wrong_type_is_refused_by_verify(converted, edit, match):
    edit_json(converted / "reshard.json", edit)
    refused(lambda: reshard.verify(converted), r"reshard\.json: (not a reshard manifest: )?" + match)


def test_a_broken_manifest_only_stops_the_checksum_shortcut_of_a_two_way_verify(converted, tmp_path):
    edit_json(converted / "reshard.json", lambda m: {**m, "files": 3})
    assert reshard.verify(converted, tmp_path / "src")  # compared by value


def test_a_resume_header_that_is_not_an_object_is_refused(tmp_path):
    from reshard.execution.partial import HEADER, Partial, partial_path

    dst = tmp_path / "dst"
    partial_path(dst).mkdir()
    (partial_path(dst) / HEADER).write_text("[1, 2]")
    refused(lambda: Partial(dst, {}, resume=True, manifest="reshard.json"), r"not a resume header")


def test_a_journal_entry_naming_a_file_outside_the_partial_directory_is_not_kept(tmp_path):
    from reshard.execution.partial import HEADER, Partial, partial_path
    from reshard.io.checksum import FILE_HASH, file_digest
    from reshard.io.storage import JOURNAL

    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    dst = tmp_path / "dst"
    partial_path(dst).mkdir()
    (partial_path(dst) / HEADER).write_text("{}")
    entry = {"file": str(outside), "bytes": 1, FILE_HASH: file_digest(outside), "tensors": {}}
    (partial_path(dst) / JOURNAL).write_text(json.dumps(entry) + "\n")
    partial = Partial(dst, {}, resume=True, manifest="reshard.json")
    try:
        assert partial.kept == {}
    finally:
        partial.release()
    assert outside.exists()


def test_a_read_before_a_files_start_is_a_format_error(tmp_path):
    from reshard.execution.executor import ByteReader

    path = tmp_path / "f"
    path.write_bytes(b"abcd")
    with ByteReader() as reader:
        refused(lambda: reader.read_into(path, -4, memoryview(bytearray(2))),
                r"a read at byte -4, before the file's start")
        refused(lambda: reader.read_into(path, 2**63 - 1, memoryview(bytearray(2))), r"f: (cannot read|file ends)")


def test_a_memory_budget_of_infinity_is_a_size_error():
    from reshard.core.units import parse_size

    for bad in ("inf", "nanGiB", 1.5, None):
        with pytest.raises(ReshardError, match=r"cannot read .* as a size"):
            parse_size(bad)


@pytest.mark.timeout(60)
def test_a_metadata_file_that_is_a_fifo_is_refused_instead_of_read(converted):
    import os

    (converted / "reshard.json").unlink()
    os.mkfifo(converted / "reshard.json")  # opening it for reading would wait for a writer forever
    refused(lambda: reshard.verify(converted), r"reshard\.json: not a regular file")
