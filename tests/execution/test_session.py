"""Two conversions in one process share nothing: each has its own write session (checksums, journal,
writer thread), so they can run side by side in threads (the load API inside a job, the tests under
xdist, torchrun workers) and each manifest describes only its own output."""

from __future__ import annotations

import json
import threading

import reshard
from reshard.fixtures import make_fixture


def _manifest(path):
    data = json.loads((path / "reshard.json").read_text())
    return {rel: {k: v for k, v in entry.items()} for rel, entry in data["files"].items()}, data["logical"]


def test_two_conversions_in_parallel_threads_each_verify_and_match_a_run_alone(tmp_path):
    make_fixture(tmp_path / "meg", format="megatron", to="tp=2,pp=2")
    make_fixture(tmp_path / "hf", format="hf", model="tiny-llama")
    jobs = {"a": (tmp_path / "meg", dict(to="tp=1,pp=4")), "b": (tmp_path / "hf", dict(format="megatron", to="tp=2"))}
    for name, (src, kw) in jobs.items():  # alone, one after the other: the reference
        reshard.convert(src, tmp_path / f"alone-{name}", memory_budget="1GiB", **kw)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def run(name: str) -> None:
        src, kw = jobs[name]
        try:
            barrier.wait()
            for _ in range(2):  # interleave more than once
                out = tmp_path / f"together-{name}-{_}"
                reshard.convert(src, out, memory_budget="1GiB", **kw)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name, (src, _) in jobs.items():
        alone_files, alone_logical = _manifest(tmp_path / f"alone-{name}")
        for k in range(2):
            out = tmp_path / f"together-{name}-{k}"
            files, logical = _manifest(out)
            assert files == alone_files and logical == alone_logical  # every file, tensor and logical checksum
            assert reshard.verify(out)  # the output matches its manifest
            assert reshard.verify(src, out, states=("param",))  # and holds the source's weights, bit for bit
            assert not list(out.rglob(".reshard-journal"))


def test_a_file_synced_behind_reaches_the_journal_after_its_sync_and_a_failed_sync_fails_the_flush(tmp_path,
                                                                                               monkeypatch):
    """With ``sync_behind``, ``close`` returns before the fsync; the journal entry, which tells ``resume`` the
    file is on disk, is written only after it; a sync that fails is raised by ``flush``, naming the file."""
    import pytest

    import reshard.execution.session as session_module
    from reshard.errors import CheckpointFormatError
    from reshard.execution.session import WriteSession
    from reshard.io.storage import read_journal

    order: list[str] = []
    real_sync = session_module.sync_file
    gate = threading.Event()

    def sync(path):
        gate.wait(10)
        order.append(f"sync {path.name}")
        real_sync(path)

    monkeypatch.setattr(session_module, "sync_file", sync)
    with WriteSession(journal=tmp_path, sync_behind=True) as s:
        for name in ("a", "b"):
            f = s.open(tmp_path / name)
            f.pwrite(name.encode() * 10, 0)
            f.close()
        assert s.digest(tmp_path / "a") and read_journal(tmp_path) == []  # closed, not yet synced
        gate.set()
        s.flush()
        assert order == ["sync a", "sync b"] and [e["file"] for e in read_journal(tmp_path)] == ["a", "b"]

    def failing(path):
        raise CheckpointFormatError(f"{path}: cannot sync to disk (Input/output error)")

    monkeypatch.setattr(session_module, "sync_file", failing)
    with WriteSession(journal=tmp_path / "c", sync_behind=True) as s:
        (tmp_path / "c").mkdir()
        f = s.open(tmp_path / "c" / "x")
        f.pwrite(b"x", 0)
        f.close()
        with pytest.raises(CheckpointFormatError, match=r"c/x: cannot sync to disk"):
            s.flush()
    assert read_journal(tmp_path / "c") == []
