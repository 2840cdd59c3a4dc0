"""Hostile and broken checkpoints end to end: a clear error naming the file, exit code 2, nothing written, nothing run."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

import reshard
from reshard.cli.main import app
from reshard.fixtures import make_fixture

import torch
runner = CliRunner()


class Payload:
    """Unpickling this runs a shell command: the attack a checkpoint pickle can carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def convert_fails(src, dst, *args):
    result = runner.invoke(app, ["convert", str(src), str(dst), *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.stderr
    assert not dst.exists()
    assert not [p for p in dst.parent.iterdir() if p.name.endswith(".reshard-partial")]
    return result.stderr


@pytest.mark.parametrize("fmt,topology,victim", [
    ("megatron", "tp=2", "iter_0000000/mp_rank_01/model_optim_rng.pt"),
    ("deepspeed", "dp=2,zero=2", "global_step1/mp_rank_00_model_states.pt"),
    ("deepspeed", "dp=2,zero=2", "global_step1/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
])
def test_a_pickle_payload_in_a_rank_file_is_refused_and_never_runs(tmp_path, fmt, topology, victim):
    src = tmp_path / "src"
    make_fixture(src, format=fmt, to=topology)
    marker = tmp_path / "pwned"
    torch.save({"args": Payload(marker), "iteration": 1}, src / victim)
    stderr = convert_fails(src, tmp_path / "dst")
    assert victim.split("/")[-1] in stderr and "posix.system" in stderr and "which reshard will not load" in stderr
    assert not marker.exists()


def test_a_pickle_payload_in_dcp_metadata_is_refused_and_never_runs(tmp_path):
    """DCP's .metadata is a bare pickle, the one torch itself loads with code execution allowed."""
    import pickle

    src = tmp_path / "src"
    make_fixture(src, format="dcp", to="dp=2")
    marker = tmp_path / "pwned"
    (src / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    stderr = convert_fails(src, tmp_path / "dst", "--format", "hf")
    assert ".metadata" in stderr and "posix.system" in stderr
    assert not marker.exists()


def test_a_truncated_rank_file_is_named(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    victim = src / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes()[:5000])
    assert "mp_rank_01/model_optim_rng.pt" in convert_fails(src, tmp_path / "dst", "--to", "tp=1")


def test_a_missing_rank_file_is_named_with_what_args_say(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2,pp=2")
    (src / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    stderr = convert_fails(src, tmp_path / "dst", "--to", "tp=1")
    assert "missing rank file mp_rank_01_001/model_optim_rng.pt" in stderr
    assert "tensor_model_parallel_size=2, pipeline_model_parallel_size=2" in stderr


def test_a_truncated_safetensors_file_is_named(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="hf")
    victim = src / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])
    stderr = convert_fails(src, tmp_path / "dst", "--format", "megatron", "--to", "tp=2")
    assert "model.safetensors" in stderr


def test_a_safetensors_header_longer_than_the_file_is_refused(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="hf")
    victim = src / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")
    victim.write_bytes(bytes(data))
    assert "model.safetensors" in convert_fails(src, tmp_path / "dst", "--format", "megatron", "--to", "tp=2")


def _edit_safetensors_header(path, edit):
    import json

    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit({k: v for k, v in header.items() if k != "__metadata__"})
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])


def _by_offset(header):
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def _overlap(h):
    a, b = _by_offset(h)[:2]
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def _past_end(h):
    last = _by_offset(h)[-1]
    h[last]["data_offsets"] = [o + 64 for o in h[last]["data_offsets"]]


def _shape_disagrees(h):
    name = next(k for k in _by_offset(h) if len(h[k]["shape"]) == 2)
    h[name]["shape"] = [h[name]["shape"][0] // 2, h[name]["shape"][1]]


@pytest.mark.parametrize("edit,expect", [
    (_overlap, r"tensors '[\w.]+' \[\d+, \d+\] and '[\w.]+' \[\d+, \d+\] overlap"),
    (_past_end, r"tensor 'model.norm.weight': data_offsets \[\d+, \d+\] end past the byte buffer \(\d+ bytes\)"),
    (_shape_disagrees, r"tensor '[\w.]+': data_offsets \[\d+, \d+\] hold \d+ bytes but BF16 \[\d+, \d+\] needs \d+"),
], ids=["offsets overlap", "offsets past the end", "offsets disagree with shape x dtype"])
def test_a_safetensors_header_that_lies_about_its_tensors_is_named(tmp_path, edit, expect):
    import re

    src = tmp_path / "src"
    make_fixture(src, format="hf")
    _edit_safetensors_header(src / "model.safetensors", edit)
    stderr = convert_fails(src, tmp_path / "dst", "--format", "megatron", "--to", "tp=2")
    assert "model.safetensors" in stderr and re.search(expect, stderr), stderr


def test_a_truncated_distcp_file_is_named(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="dcp", to="dp=2")
    victim = sorted(src.glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert victim.name in convert_fails(src, tmp_path / "dst", "--format", "hf")


def test_a_zip_missing_a_storage_record_is_named(tmp_path):
    import zipfile

    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    victim = src / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt"
    with zipfile.ZipFile(victim) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    gone = next(name for name in records if name.endswith("/data/0"))
    with zipfile.ZipFile(victim, "w", zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            if name != gone:
                z.writestr(name, data)
    stderr = convert_fails(src, tmp_path / "dst", "--to", "tp=1")
    assert "mp_rank_01/model_optim_rng.pt" in stderr and "missing storage record" in stderr and gone in stderr


def test_rank_files_for_fewer_data_parallel_ranks_than_the_metadata_says_are_refused(tmp_path):
    """Two ZeRO optimizer files per model rank, while the model states say dp_world_size=4."""
    src = tmp_path / "src"
    make_fixture(src, format="deepspeed", to="dp=2,zero=2")
    model = src / "global_step1" / "mp_rank_00_model_states.pt"
    sd = torch.load(model, weights_only=False)  # our own fixture: trusted
    sd["dp_world_size"] = 4
    torch.save(sd, model)
    stderr = convert_fails(src, tmp_path / "dst", "--to", "dp=1")
    assert "2 optimizer files for mp rank 00 but mp_rank_00_model_states.pt says dp_world_size=4" in stderr


def test_rank_files_of_different_iterations_are_refused(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    victim = src / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt"
    sd = torch.load(victim, weights_only=False)
    sd["iteration"] = 5
    torch.save(sd, victim)
    stderr = convert_fails(src, tmp_path / "dst", "--to", "tp=1")
    assert "mp_rank_01/model_optim_rng.pt: iteration 5, but" in stderr and "mixes iterations" in stderr


def test_a_spec_whose_shapes_do_not_match_the_tensors_names_them(tmp_path):
    import json

    src = tmp_path / "src"
    make_fixture(src, format="hf")
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] *= 2
    (src / "config.json").write_text(json.dumps(config))
    stderr = convert_fails(src, tmp_path / "dst", "--format", "megatron", "--to", "tp=2")
    assert "model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape" in stderr
    assert "the spec expects" in stderr


def test_a_tensor_the_target_cannot_place_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    make_fixture(src, format="hf")
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(8)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    stderr = convert_fails(src, tmp_path / "dst", "--format", "megatron", "--to", "tp=2")
    flat = "".join(stderr.split())  # the console wraps long words
    assert "hasnoplacefor1tensor(s)ofthesource,whichwouldbelost" in flat
    assert "'model.layers.0.self_attn.q_proj.bias'[param]in" in flat  # [param] printed, not taken for markup


def test_symbolic_link_loops_are_named(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    (tmp_path / "loop").symlink_to("loop")
    assert "loop: a symbolic link loop" in convert_fails(tmp_path / "loop", tmp_path / "dst")
    (src / "iter_0000000" / "back").symlink_to("..")  # a link up the tree is no loop for reshard: not followed
    (tmp_path / "dloop").symlink_to("dloop")
    stderr = convert_fails(src, tmp_path / "dloop", "--to", "tp=1")
    assert "dloop: cannot be resolved" in stderr
    victim = src / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt"
    victim.unlink()
    victim.symlink_to("model_optim_rng.pt")
    stderr = convert_fails(src, tmp_path / "dst", "--to", "tp=1")
    assert "mp_rank_01/model_optim_rng.pt: a symbolic link loop" in stderr


def test_a_destination_that_is_a_link_fills_the_directory_it_names_or_is_refused_before_anything_is_written(tmp_path):
    """The output is renamed onto the destination's path when done: onto a link, that would replace the link (and
    failed, once the conversion was written). A link to a directory is written through; a link to nothing, or a
    path through a loop (which Python 3.13's ``resolve`` no longer reports), is refused before planning."""
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    (tmp_path / "disk").mkdir()
    (tmp_path / "out").symlink_to("disk")
    result = reshard.convert(src, tmp_path / "out", to="tp=1")
    assert (tmp_path / "out").is_symlink() and result.path == tmp_path / "disk"
    assert reshard.verify(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "out", "src"]  # no partial directory left
    (tmp_path / "dangling").symlink_to("nowhere")
    assert "dangling: a symbolic link to nothing (nowhere)" in convert_fails(src, tmp_path / "dangling", "--to", "tp=1")
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(reshard.ReshardError, match="loop/sub: cannot be resolved"):
        reshard.convert(src, tmp_path / "loop" / "sub", to="tp=1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "disk", "loop", "out", "src"]


def test_a_destination_inside_the_source_is_refused(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    assert "destination is inside the source" in convert_fails(src, src / "out", "--to", "tp=1")
    (tmp_path / "link").symlink_to(src)
    assert "destination is inside the source" in convert_fails(src, tmp_path / "link" / "out", "--to", "tp=1")
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before
