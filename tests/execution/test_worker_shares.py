"""Workers split a conversion by destination bytes, whatever its connectivity, from a plan made once:
balanced shares, the same bytes as one process, a dead worker leaves nothing that looks complete and
``resume`` finishes with another worker count."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import reshard
from reshard.api.workers import file_bytes, shares, worker_shares
from reshard.errors import ReshardError
from reshard.execution.partial import partial_path
from reshard.execution.workers import WorkerLost, dumps
from reshard.fixtures import make_fixture
from reshard.io.storage import read_journal

TESTS = Path(__file__).resolve().parents[1]
TO = "tp=2,pp=2"


@pytest.fixture(scope="module")
def hf_shards(tmp_path_factory) -> Path:
    """Hugging Face safetensors in three shards that cut across layers: every Megatron tp=2,pp=2 rank file
    draws from two of them, so the plan is one connected component."""
    base = tmp_path_factory.mktemp("shares")
    make_fixture(base / "meg", format="megatron", to="tp=2,pp=2")
    reshard.convert(base / "meg", base / "hf", format="hf", max_shard_size="300KB", workers=1)
    return base / "hf"


@pytest.fixture(scope="module")
def one_worker(hf_shards) -> Path:
    dst = hf_shards.parent / "one"
    reshard.convert(hf_shards, dst, format="megatron", to=TO, workers=1)
    return dst


def contents(path: Path) -> dict[str, bytes | dict]:
    """Every file's bytes; the manifest as JSON without its creation time."""
    out: dict[str, bytes | dict] = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = p.read_bytes()
    manifest = json.loads(out.pop("reshard.json"))
    manifest.pop("created")
    out["reshard.json"] = manifest
    return out


def test_a_one_component_plan_splits_into_balanced_byte_shares(hf_shards):
    report = reshard.plan(hf_shards, format="megatron", to=TO)
    assert len(report.work_units()) == 1
    weight = file_bytes(report)
    parts = shares(report, 2)
    assert len(parts) == 2 and sorted(f for p in parts for f in p.files) == sorted(weight)
    assert not any(p.split for p in parts)  # whole files balance: none is split
    loads = [sum(weight[f] for f in p.files) for p in parts]
    assert loads == [p.bytes for p in parts] and max(loads) <= 1.1 * sum(loads) / len(loads), loads
    table = report.to_json(workers=2)["workers"]
    assert [row["bytes"] for row in table["shares"]] == loads and table["largest_over_mean"] <= 1.1
    assert shares(report, 8, split=False) == shares(report, 4)  # unsplit, never more shares than files


def test_two_workers_write_what_one_writes_manifest_included(hf_shards, one_worker, tmp_path):
    two = reshard.convert(hf_shards, tmp_path / "two", format="megatron", to=TO, workers=2)
    assert contents(tmp_path / "two") == contents(one_worker)
    assert two.bytes_read - two.gap_bytes == reshard.plan(hf_shards, format="megatron", to=TO).needed_bytes()


def test_workers_on_one_host_skip_the_component_graph_that_ranks_break_ties_by(hf_shards, one_worker, tmp_path,
                                                                                monkeypatch):
    """Components keep files together only between torchrun ranks (maybe on other hosts): workers on one host
    share its disk, and a conversion with them never makes the graph, nor imports networkx (some 0.1 s)."""
    code = (f"import sys, reshard\n"
            f"reshard.convert({str(hf_shards)!r}, {str(tmp_path / 'two')!r}, format='megatron', to={TO!r}, workers=2)\n"
            f"print('networkx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    assert out.stdout.split() == ["False"]
    assert contents(tmp_path / "two") == contents(one_worker)
    report = reshard.plan(hf_shards, format="megatron", to=TO)
    made = []
    monkeypatch.setattr(type(report), "work_units", lambda self: made.append(1) or [([], sorted(file_bytes(self)))])
    assert [p.files for p in shares(report, 2, split=False)] == [p.files for p in
                                                                 shares(report, 2, split=False, locality=True)]
    assert len(made) == 1  # by the ranks' shares alone


def test_a_worker_plans_nothing_and_imports_no_entry_point(hf_shards, one_worker, tmp_path):
    """A worker gets its slice of the plan made by the parent: run in a fresh interpreter, it writes its
    files without importing ``reshard.api`` (where opening and planning a checkpoint live)."""
    report = reshard.plan(hf_shards, format="megatron", to=TO)
    out = tmp_path / "out"
    out.mkdir()
    share = worker_shares(report, shares(report, 2), out, 1 << 20)[0]
    assert len(share.copies) < len(report.plan.copies)
    code = ("import pickle, sys; from reshard.execution.workers import write_share\n"
            "r = write_share(pickle.loads(sys.stdin.buffer.read()))\n"
            "print(sorted(r.files), sorted(m for m in sys.modules if m.startswith('reshard.api')))")
    run = subprocess.run([sys.executable, "-c", code], input=dumps(share), capture_output=True, check=True)
    assert run.stdout.decode().strip() == f"{sorted(share.files)} []"
    for f in share.files:
        assert (out / f).read_bytes() == (one_worker / f).read_bytes()


@pytest.mark.parametrize(("action", "resume_workers"), [("kill", 1), ("exit", 3)])
def test_a_dead_worker_leaves_no_complete_output_and_resume_finishes_with_other_workers(
        hf_shards, one_worker, tmp_path, monkeypatch, action, resume_workers):
    from worker_faults import FaultyWrite

    import reshard.api.converting

    real = reshard.api.converting.worker_shares

    def faulty(*args, **kw):  # the second worker dies after its first file
        parts = real(*args, **kw)
        return [parts[0], dataclasses.replace(parts[1], write=FaultyWrite(parts[1].write, action))]

    monkeypatch.setattr(reshard.api.converting, "worker_shares", faulty)
    dst = tmp_path / "dst"
    with pytest.raises(WorkerLost, match=r"^worker 2 of 2 (was killed \(SIGKILL\)|exited with code 1 without a "
                                         r"result) while writing .*; the files finished so far are kept"):
        reshard.convert(hf_shards, dst, format="megatron", to=TO, workers=2)
    assert not dst.exists()
    partial = partial_path(dst)
    assert not (partial / "reshard.json").exists()
    assert 1 <= len({e["file"] for e in read_journal(partial)}) < 4
    monkeypatch.undo()
    result = reshard.convert(hf_shards, dst, format="megatron", to=TO, workers=resume_workers, resume=True)
    assert 1 <= result.reused < 4 and not partial.exists()
    assert contents(dst) == contents(one_worker)


def test_a_budget_too_small_for_the_workers_names_the_smallest_that_works(hf_shards, tmp_path):
    with pytest.raises(ReshardError, match=r"^memory budget 200 MiB over 2 workers is below the (\d+) MiB this "
                                          r"conversion needs: the main process 224 MiB runtime") as e:
        reshard.convert(hf_shards, tmp_path / "dst", format="megatron", to=TO, workers=2, memory_budget="200MiB")
    assert not (tmp_path / "dst").exists() and not partial_path(tmp_path / "dst").exists()
    need = int(str(e.value).split(" MiB this")[0].rsplit(" ", 1)[1])
    reshard.convert(hf_shards, tmp_path / "dst", format="megatron", to=TO, workers=2, memory_budget=f"{need}MiB")
    assert reshard.verify(tmp_path / "dst")


def test_the_default_budget_holds_a_worker_per_core_with_4_gib_free(hf_shards, monkeypatch):
    import reshard.api.converting as converting

    monkeypatch.setattr(converting, "default_memory_budget", lambda: (4 << 30) * 3 // 4)
    report = reshard.plan(hf_shards, format="megatron", to="tp=4,pp=4")
    files = sorted({str(f) for f in report.dst_files.values()})
    assert len(files) == 16
    assert converting._workers_and_window(report, 16, files, None)[0] == 16
    assert converting._workers_and_window(report, "auto", files, None)[0] == 1  # too few bytes to pay a start


def test_workers_auto_is_bounded_by_cores_tensors_bytes_and_bytes_per_copy(hf_shards, monkeypatch):
    import reshard.api.workers as workers

    report = reshard.plan(hf_shards, format="megatron", to=TO)
    files = sorted(file_bytes(report))
    monkeypatch.setattr(workers, "MIN_SHARE_BYTES", 1)
    monkeypatch.setattr(workers, "MIN_COPY_BYTES", 1)
    monkeypatch.setattr(workers, "usable_cores", lambda: 3)
    assert workers.worker_count(report, "auto", files) == 3
    monkeypatch.setattr(workers, "usable_cores", lambda: 64)  # files are split: one worker per stored tensor at most
    assert workers.worker_count(report, "auto", files) == len(report.dst_files)
    # copies too small to pay for shipping a slice of the plan to each worker: one process
    monkeypatch.setattr(workers, "MIN_COPY_BYTES", sum(file_bytes(report).values()) // len(report.plan.copies) + 1)
    assert workers.worker_count(report, "auto", files) == 1
    assert workers.worker_count(report, 3, files) == 3  # asked for: started
    with pytest.raises(ReshardError, match="workers must be 'auto' or an integer of at least 1, got 0"):
        reshard.convert(hf_shards, "unused", format="megatron", to=TO, workers=0)


def test_a_share_survives_the_trip_to_a_worker(hf_shards):
    """Items keep a hash of their fields, and string hashes differ between processes: a share's items are
    built again on arrival, so they match the ones a worker makes itself."""
    report = reshard.plan(hf_shards, format="megatron", to=TO)
    share = worker_shares(report, shares(report, 1), Path("out"), 1 << 20)[0]
    code = ("import pickle, sys, dataclasses\n"
            "s = pickle.loads(sys.stdin.buffer.read())\n"
            "print(all(dataclasses.replace(i) in s.target.layout.items for i in s.target.layout.items))")
    env = {**os.environ, "PYTHONHASHSEED": "1"}
    run = subprocess.run([sys.executable, "-c", code], input=dumps(share), capture_output=True, check=True, env=env)
    assert run.stdout.decode().strip() == "True"
    assert pickle.loads(dumps(share)).files == share.files


def test_the_cli_plan_prints_each_workers_byte_share(hf_shards, tmp_path):
    from typer.testing import CliRunner

    from reshard.cli.main import app

    result = CliRunner().invoke(app, ["plan", str(hf_shards), "--format", "megatron", "--to", TO, "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert "2 workers, largest byte share 1.00 x the mean:" in result.output
    assert "  worker 1: 329.1 KiB in 2 files: " in result.output
    bad = CliRunner().invoke(app, ["convert", str(hf_shards), str(tmp_path / "d"), "--workers", "many"])
    assert bad.exit_code == 2 and "--workers: 'many' is not auto or a number of at least 1" in bad.output
