"""Crash safety and resume: a conversion SIGKILLed anywhere leaves either no destination or a
complete one that verifies, and ``resume`` finishes it from the files that still verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import reshard
from reshard.fixtures import make_fixture
from reshard.execution.partial import HEADER, partial_path
from reshard.io.storage import JOURNAL, read_journal

JOB = Path(__file__).resolve().parents[1] / "crash_job.py"
ROOT = JOB.parent.parent
TO = "tp=1,pp=4"  # four rank files of ~1.1 MiB, some 480 positioned writes in all (120 in the first)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("crash") / "src"
    make_fixture(src, to="tp=2,pp=2")
    return src


@pytest.fixture(scope="module")
def uninterrupted(source) -> dict:
    """The manifest of the same conversion run without a fault: a resumed one must produce these very bytes."""
    dst = source.parent / "uninterrupted"
    reshard.convert(source, dst, to=TO)
    return json.loads((dst / "reshard.json").read_text())


def _kill_at(src: Path, dst: Path, point: str, n: int, workers: int = 1, resume: bool = False) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(JOB), str(src), str(dst), TO, str(workers), point, str(n),
                           *(["resume"] if resume else [])],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, f"{point} {n}: exit {proc.returncode}\n{proc.stderr[-3000:]}"


def _assert_nothing_or_complete(src: Path, dst: Path) -> bool:
    """The state a kill leaves: no destination, or one that verifies and equals the source."""
    names = {p.name for p in dst.parent.iterdir()} - {src.name}
    assert names <= {dst.name, partial_path(dst).name}, names
    if not dst.exists():
        return False
    assert reshard.verify(dst), reshard.verify(dst).differences
    assert reshard.verify(src, dst), reshard.verify(src, dst).differences
    return True


def _resume_and_check(src: Path, dst: Path, uninterrupted: dict) -> reshard.ConvertResult:
    result = reshard.convert(src, dst, to=TO, resume=True)
    assert not partial_path(dst).exists()
    check = reshard.verify(dst)
    assert check and check.compared == 5, check.differences
    same = reshard.verify(src, dst)
    assert same and same.compared > 0, same.differences
    manifest = json.loads((dst / "reshard.json").read_text())
    for key in ("files", "logical", "destination"):  # byte for byte what an uninterrupted run writes
        assert manifest[key] == uninterrupted[key], key
    return result


# (point, n, files the resumed run keeps; for a kill inside a file, at most): kills before, inside and
# between files, around the journal, in the manifest and on both sides of the rename.
POINTS = [
    ("header", 1, 0),
    ("write", 1, 0),
    ("write", 80, 0),
    ("write", 200, 1),
    ("write", 470, 3),
    ("journal", 1, 0),
    ("journal", 3, 2),
    ("close", 1, 1),
    ("close", 2, 2),
    ("close", 4, 4),
    ("manifest", 1, 4),
    ("rename", 1, None),
    ("renamed", 1, None),
]


@pytest.mark.parametrize(("point", "n", "kept"), POINTS, ids=[f"{p}-{n}" for p, n, _ in POINTS])
def test_a_kill_anywhere_leaves_nothing_or_a_complete_checkpoint_and_resume_finishes(source, uninterrupted, tmp_path,
                                                                                     point, n, kept):
    dst = tmp_path / "dst"
    _kill_at(source, dst, point, n)
    complete = _assert_nothing_or_complete(source, dst)
    assert complete == (point == "renamed")
    if not complete:
        journaled = len({e["file"] for e in read_journal(partial_path(dst))})
        if kept is not None and point == "write":  # files closed before the kill may still have been syncing
            assert journaled <= kept
            kept = journaled
        assert kept is None or journaled == kept
    result = _resume_and_check(source, dst, uninterrupted)
    if kept is not None:
        assert result.reused == kept
        assert result.bytes_read > 0 if kept < 4 else result.bytes_read == 0
    else:  # the rename or less was left: nothing is rewritten, everything is checked
        assert result.reused == 5 and result.bytes_read == 0


def test_a_killed_conversion_kills_its_workers_and_resumes(source, uninterrupted, tmp_path):
    dst = tmp_path / "dst"
    _kill_at(source, dst, "worker-close", 1, workers=2)
    pid = int(Path(str(dst) + ".worker-pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "a worker outlived the conversion that started it"
    assert not Path(str(dst) + ".worker-survived").exists()
    Path(str(dst) + ".worker-pid").unlink()
    assert not _assert_nothing_or_complete(source, dst)
    result = _resume_and_check(source, dst, uninterrupted)
    assert 1 <= result.reused < 4


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _interrupted(source: Path, dst: Path, closes: int) -> Path:
    _kill_at(source, dst, "close", closes)
    return partial_path(dst)


def test_a_resumed_conversion_killed_again_resumes_and_loses_no_checksum(source, uninterrupted, tmp_path):
    dst = tmp_path / "dst"
    _kill_at(source, dst, "close", 2)
    _kill_at(source, dst, "close", 1, resume=True)  # keeps two, writes a third, dies
    assert len(read_journal(partial_path(dst))) == 3
    assert _resume_and_check(source, dst, uninterrupted).reused == 3


def test_without_resume_a_left_partial_conversion_is_an_error_that_says_what_to_do(source, tmp_path):
    dst = tmp_path / "dst"
    partial = _interrupted(source, dst, 2)
    with pytest.raises(reshard.ReshardError, match=r"interrupted conversion left .*reshard-partial; rerun with --resume"):
        reshard.convert(source, dst, to=TO)
    assert partial.exists() and not dst.exists()  # the refusal touched nothing
    assert len(read_journal(partial)) == 2


def test_resume_redoes_a_kept_file_that_no_longer_verifies(source, uninterrupted, tmp_path):
    dst = tmp_path / "dst"
    partial = _interrupted(source, dst, 3)
    first = partial / read_journal(partial)[0]["file"]
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0x10
    first.write_bytes(bytes(data))
    assert _resume_and_check(source, dst, uninterrupted).reused == 2


def test_resume_refuses_another_conversion_or_a_changed_source(source, uninterrupted, tmp_path):
    dst = tmp_path / "dst"
    partial = _interrupted(source, dst, 2)
    with pytest.raises(reshard.ReshardError, match=r"cannot resume .*destination differs"):
        reshard.convert(source, dst, to="tp=2,pp=2", resume=True)
    src2 = tmp_path / "src2"
    make_fixture(src2, to="tp=2,pp=2")
    with pytest.raises(reshard.ReshardError, match=r"cannot resume .*source differs"):
        reshard.convert(src2, dst, to=TO, resume=True)
    header = json.loads((partial / HEADER).read_text())
    changed = next(iter(header["source_files"]))
    os.utime(changed, ns=(time.time_ns(), time.time_ns()))
    try:
        with pytest.raises(reshard.ReshardError, match=r"cannot resume .*the source files changed"):
            reshard.convert(source, dst, to=TO, resume=True)
    finally:
        size, mtime = header["source_files"][changed]
        os.utime(changed, ns=(mtime, mtime))
    assert (partial / JOURNAL).exists() and len(read_journal(partial)) == 2  # refusals keep the work
    assert _resume_and_check(source, dst, uninterrupted).reused == 2


def test_resume_of_a_finished_conversion_checks_it_and_rewrites_nothing(source, tmp_path):
    dst = tmp_path / "dst"
    reshard.convert(source, dst, to=TO)
    before = {p: p.stat().st_mtime_ns for p in dst.rglob("*")}
    result = reshard.convert(source, dst, to=TO, resume=True)
    assert result.reused == 5 and result.bytes_read == 0
    assert {p: p.stat().st_mtime_ns for p in dst.rglob("*")} == before
    rank = dst / "iter_0000000/mp_rank_00_002/model_optim_rng.pt"
    data = bytearray(rank.read_bytes())
    data[-100] ^= 1
    rank.write_bytes(bytes(data))
    with pytest.raises(reshard.ReshardError, match=r"fails its manifest: iter_0000000/mp_rank_00_002/model_optim_rng\.pt"):
        reshard.convert(source, dst, to=TO, resume=True)
    with pytest.raises(reshard.ReshardError, match="destination exists and is not empty"):
        reshard.convert(source, dst, to=TO)


def test_a_second_conversion_to_the_same_destination_is_refused_while_one_runs(source, uninterrupted, tmp_path):
    import fcntl

    dst = tmp_path / "dst"
    partial = _interrupted(source, dst, 1)
    fd = os.open(partial, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running conversion holds it
        with pytest.raises(reshard.ReshardError, match="another conversion is writing it"):
            reshard.convert(source, dst, to=TO, resume=True)
    finally:
        os.close(fd)
    assert _resume_and_check(source, dst, uninterrupted).reused == 1


def test_the_cli_resumes_and_says_how_many_files_it_kept(source, tmp_path):
    dst = tmp_path / "dst"
    _interrupted(source, dst, 3)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "reshard.cli.main", "convert", str(source), str(dst), "--to", TO]
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "3 files kept from the interrupted conversion" in done.stdout
    assert reshard.verify(source, dst)
