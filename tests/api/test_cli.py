"""The reshard command: each command once, and each kind of user error."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from reshard.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "src"
    result = runner.invoke(app, ["fixture", str(out), "--format", "megatron", "--to", "tp=2,pp=2"])
    assert result.exit_code == 0, result.output
    return out


def test_inspect_shows_format_topology_and_tensors(ckpt):
    result = runner.invoke(app, ["inspect", str(ckpt), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert (info["format"], info["topology"]) == ("megatron", "tp=2,pp=2,dp=1")
    assert info["sizes"]["vocab"] == 1100
    q = info["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["shape"] == [64, 64] and q["states"]["param"] == {"dtype": "bfloat16", "bytes": 64 * 64 * 2}
    text = runner.invoke(app, ["inspect", str(ckpt)])
    assert text.exit_code == 0 and "megatron (megatron-llama), tp=2,pp=2,dp=1" in text.stdout


def test_plan_lists_destination_files_and_work_units(ckpt):
    result = runner.invoke(app, ["plan", str(ckpt), "--to", "tp=1,pp=2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [f["destination"] for f in report["files"]] == [
        "iter_0000000/mp_rank_00_000/model_optim_rng.pt", "iter_0000000/mp_rank_00_001/model_optim_rng.pt"]
    assert report["files"][0]["sources"] == [
        "iter_0000000/mp_rank_00_000/model_optim_rng.pt", "iter_0000000/mp_rank_01_000/model_optim_rng.pt"]
    assert len(report["work_units"]) == 2  # stage 0 and stage 1 never exchange bytes


def test_convert_then_verify_and_dry_run_writes_nothing(ckpt, tmp_path):
    dry = runner.invoke(app, ["convert", str(ckpt), str(tmp_path / "dry"), "--to", "tp=1,pp=4", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "independent work units" in dry.stdout and not (tmp_path / "dry").exists()
    result = runner.invoke(app, ["convert", str(ckpt), str(tmp_path / "dst"), "--to", "tp=1,pp=4"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout and (tmp_path / "dst" / "reshard.json").exists()
    check = runner.invoke(app, ["verify", str(ckpt), str(tmp_path / "dst")])
    assert check.exit_code == 0 and "identical" in check.stdout and "by the logical checksums" not in check.stdout
    again = runner.invoke(app, ["convert", str(ckpt), str(tmp_path / "dst2"), "--to", "tp=1,pp=4"])
    assert again.exit_code == 0, again.output
    both = runner.invoke(app, ["verify", str(tmp_path / "dst"), str(tmp_path / "dst2")])
    found = re.search(r"identical: (\d+) logical tensors compared, (\d+) of them by the logical checksums in both "
                      r"manifests", both.stdout)
    assert both.exit_code == 0 and found and 0 < int(found[2]) < int(found[1]), both.stdout  # qkv by value


def test_verify_exits_1_and_names_the_difference(ckpt, tmp_path):
    other = tmp_path / "other"
    runner.invoke(app, ["convert", str(ckpt), str(other), "--format", "hf"])
    result = runner.invoke(app, ["verify", str(ckpt), str(other)])
    assert result.exit_code == 1
    assert "39 logical tensors, e.g. lm_head.weight [exp_avg]: only in the first checkpoint" in result.stderr
    assert "checkpoints differ (39 logical tensors compared)" in result.stderr
    assert runner.invoke(app, ["verify", str(ckpt), str(other), "--states", "param"]).exit_code == 0


@pytest.mark.parametrize("args,message", [
    (["convert", "{src}", "{tmp}/x", "--to", "tq=2"],
     "unknown topology key 'tq' in 'tq=2' (expected one of: tp, pp, dp, cp, ep, etp, vpp, zero, stages, layout, order)"),
    (["convert", "{src}", "{tmp}/x", "--to", "tp=3"], "is not divisible by tp(3)"),
    (["convert", "{src}", "{tmp}/x", "--format", "ucp", "--to", "dp=2"],
     "a universal checkpoint holds whole tensors and no topology"),
    (["convert", "{src}", "{tmp}/x", "--sizes", "heads=four"], "--sizes: 'heads=four' is not name=integer"),
    (["convert", "{src}", "{tmp}/x", "--max-shard-size", "1GB"], "max_shard_size applies to the hf format"),
    (["convert", "{src}", "{tmp}/x", "--format", "hf", "--max-shard-size", "big"], "max_shard_size: cannot read 'big' as a size"),
    (["inspect", "{tmp}/missing"], "missing: no such file or directory"),
    (["fixture", "{tmp}/f", "--model", "gpt-9"], "unknown fixture model 'gpt-9'"),
])
def test_user_errors_print_one_message_and_exit_2(ckpt, tmp_path, args, message):
    result = runner.invoke(app, [a.format(src=ckpt, tmp=tmp_path) for a in args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "x").exists()


def test_demo_converts_and_verifies(tmp_path):
    result = runner.invoke(app, ["demo", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("identical") == 2


def test_verify_with_one_checkpoint_checks_it_against_its_manifest(ckpt, tmp_path):
    dst = tmp_path / "dst"
    assert runner.invoke(app, ["convert", str(ckpt), str(dst), "--to", "tp=1,pp=1"]).exit_code == 0
    good = runner.invoke(app, ["verify", str(dst)])
    assert good.exit_code == 0 and "intact: 2 files checked against reshard.json" in good.stdout
    model = dst / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(model.read_bytes())
    data[-2000] ^= 1  # one bit of tensor data
    model.write_bytes(bytes(data))
    (dst / "stray.txt").write_text("x")
    bad = runner.invoke(app, ["verify", str(dst)])
    assert bad.exit_code == 1
    lines = bad.stderr.splitlines()
    assert lines[0].startswith("iter_0000000/mp_rank_00/model_optim_rng.pt: xxh3_128_64k ")
    assert lines[-2:] == ["stray.txt: not in the manifest", "checkpoint does not match its manifest (2 files checked against reshard.json)"]
    assert all(line.startswith("  ") for line in lines[1:-2])  # what it says of the file's tensors
    assert runner.invoke(app, ["verify", str(ckpt)]).exit_code == 2  # a fixture has no manifest: a user error
