"""Hostile and broken checkpoints end to end: a clear error naming the file, exit code 2, nothing written, nothing run."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from cli.main import app
from fixtures import make_fixture

torch = pytest.importorskip("torch")
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
