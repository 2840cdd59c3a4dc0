"""Parallel workers and the memory budget: same bytes as one process, bounded windows, clean failures."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import reshard
from reshard.cli.main import app
from reshard.fixtures import make_fixture
from reshard.errors import ReshardError
from reshard.execution.executor import PlanFill


def read_all(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != "reshard.json"}


@pytest.mark.parametrize("fmt,src_topo,dst_topo", [
    ("megatron", "tp=2,pp=2", "tp=1,pp=2"),    # two stages: two independent units
    ("megatron", "tp=2,pp=2", "tp=1,pp=4"),
    ("deepspeed", "dp=2,zero=2", "dp=3,zero=2"),
    ("deepspeed", "dp=2,zero=3", "dp=2,zero=3"),  # one unit per rank; the model files hold no items
    ("dcp", "dp=2", "dp=2"),
    ("mcore-dist", "tp=2", "tp=2"),
])
def test_two_workers_write_the_same_bytes_as_one(tmp_path, fmt, src_topo, dst_topo):
    src = tmp_path / "src"
    make_fixture(src, format=fmt, to=src_topo)
    one = reshard.convert(src, tmp_path / "one", to=dst_topo)
    two = reshard.convert(src, tmp_path / "two", to=dst_topo, workers=2)
    assert read_all(tmp_path / "one") == read_all(tmp_path / "two")
    assert two.files == one.files
    assert two.bytes_read == one.bytes_read
    assert reshard.verify(src, tmp_path / "two")


def test_windows_follow_the_memory_budget(tmp_path, monkeypatch):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    from reshard.formats import megatron

    windows, largest = [], [0]
    real_write, real_fill = megatron.FORMAT.write, PlanFill.fill_into

    def write(target, out, fill, session=None, **kw):
        windows.append(session.window_bytes)
        return real_write(target, out, fill, session, **kw)

    def fill_into(self, item, lo, hi, out):  # the session fills its own window buffers
        real_fill(self, item, lo, hi, out)
        largest[0] = max(largest[0], out.nbytes)

    monkeypatch.setattr(megatron.FORMAT, "write", write)
    monkeypatch.setattr(PlanFill, "fill_into", fill_into)
    reshard.convert(src, tmp_path / "small", to="tp=1", memory_budget="230MiB")
    # The runtime and the plan take about 224 MiB; a fifth of the rest is the window.
    assert 1 << 20 <= windows[0] <= 2 << 20 and 0 < largest[0] <= windows[0]
    reshard.convert(src, tmp_path / "big", to="tp=1", memory_budget="4GiB")
    assert windows[1] == 16 << 20  # capped: a window stays in the processor's cache
    assert read_all(tmp_path / "small") == read_all(tmp_path / "big")


def test_a_budget_below_what_the_plan_needs_is_an_error_before_writing(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    with pytest.raises(ReshardError, match=r"^memory budget 64 MiB is below the \d+ MiB this conversion needs: per process, "
                                          r"224 MiB runtime \+ \d+ MiB plan \([\d,]+ copies, [\d,]+ fragments\) \+ 5 windows of 1 MiB$"):
        reshard.convert(src, tmp_path / "dst", to="tp=1", memory_budget="64MiB")
    with pytest.raises(ReshardError, match="memory budget: cannot read 'lots' as a size"):
        reshard.convert(src, tmp_path / "dst", to="tp=1", memory_budget="lots")
    assert not (tmp_path / "dst").exists()


def test_a_worker_error_comes_back_with_the_files_it_was_writing(tmp_path):
    import dataclasses

    from reshard.api.workers import shares, worker_shares
    from reshard.execution.workers import run_shares

    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    report = reshard.plan(src, to="tp=1")
    (tmp_path / "out").mkdir()
    share = worker_shares(report, shares(report, 1), tmp_path / "out", 1 << 20)[0]
    gone = {item: dataclasses.replace(loc, path=tmp_path / "missing.pt") for item, loc in share.where.items()}
    with pytest.raises(ReshardError) as e:
        run_shares([dataclasses.replace(share, where=gone)])
    assert str(e.value) == (f"{tmp_path / 'missing.pt'}: cannot open (No such file or directory) "
                            "(while writing iter_0000000/mp_rank_00/model_optim_rng.pt)")


def test_a_failed_worker_leaves_no_destination(tmp_path, monkeypatch):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=1,pp=2")
    import reshard.api.converting

    def fails(shares, progress=None):
        (shares[0].out / "partial.pt").write_bytes(b"x")
        raise ReshardError("worker died")

    monkeypatch.setattr(reshard.api.converting, "run_shares", fails)
    with pytest.raises(ReshardError, match="worker died"):
        reshard.convert(src, tmp_path / "dst", to="tp=1,pp=2", workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_cli_takes_workers_and_a_memory_budget(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2,pp=2")
    result = CliRunner().invoke(app, ["convert", str(src), str(tmp_path / "dst"), "--to", "tp=1,pp=2",
                                      "--workers", "2", "--memory-budget", "1GiB"])
    assert result.exit_code == 0, result.output
    assert reshard.verify(src, tmp_path / "dst")
