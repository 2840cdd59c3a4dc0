"""A destination file larger than a fair share is split between workers at its stored tensors: each writes
its own tensors into the one file and takes their blocks of its checksum, the parent its framing and the rest
of the checksum; the bytes and the manifest are one worker's, shares stay balanced with fewer files than
workers, and a worker killed inside its range leaves nothing that looks complete, which ``resume`` rewrites
with any number of workers."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from reshard.fixtures import make_fixture

import reshard
from reshard.api.workers import file_bytes, shares
from reshard.execution.partial import partial_path
from reshard.execution.workers import WorkerLost
from reshard.io.storage import read_journal

# One destination file each: a torch.save zip (Megatron), a safetensors file (Hugging Face), and a .distcp
# holding one zip archive per tensor (DCP, Megatron's torch_dist).
ONE_FILE = {
    "megatron": ({"format": "megatron", "to": "tp=1,pp=1"}, "iter_0000000/mp_rank_00/model_optim_rng.pt"),
    "hf": ({"format": "hf"}, "model.safetensors"),
    "dcp": ({"format": "dcp", "to": "dp=1"}, "__0_0.distcp"),
    "mcore-dist": ({"format": "mcore-dist", "to": "tp=1,pp=1"}, "__0_0.distcp"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("split") / "meg"
    make_fixture(src, format="megatron", to="tp=2,pp=2")
    return src


def contents(path: Path) -> dict[str, bytes | dict]:
    """Every file's bytes; the manifest as JSON without its creation time."""
    out: dict[str, bytes | dict] = {p.relative_to(path).as_posix(): p.read_bytes()
                                    for p in sorted(path.rglob("*")) if p.is_file()}
    manifest = json.loads(out.pop("reshard.json"))
    manifest.pop("created")
    out["reshard.json"] = manifest
    return out


@pytest.mark.parametrize("fmt", sorted(ONE_FILE))
@pytest.mark.parametrize("workers", [2, 3])
def test_a_one_file_destination_split_between_workers_is_one_workers_bytes_manifest_included(
        source, tmp_path, monkeypatch, fmt, workers):
    import reshard.api.converting

    options, only = ONE_FILE[fmt]
    sent = []
    real = reshard.api.converting.run_shares
    monkeypatch.setattr(reshard.api.converting, "run_shares", lambda s, **kw: sent.extend(s) or real(s, **kw))
    reshard.convert(source, tmp_path / "one", workers=1, **options)
    result = reshard.convert(source, tmp_path / "many", workers=workers, **options)
    assert [s.split for s in sent] == [(only,)] * workers  # every worker wrote a part of the one file
    assert contents(tmp_path / "many") == contents(tmp_path / "one")
    assert result.bytes_read - result.gap_bytes == reshard.plan(source, **options).needed_bytes()
    assert reshard.verify(tmp_path / "many")


SEVERAL = {  # destinations of two to four files, each larger than a fair share of five workers
    "megatron": {"format": "megatron", "to": "tp=1,pp=2"},
    "hf": {"format": "hf", "max_shard_size": "40KiB"},
    "dcp": {"format": "dcp", "to": "dp=2"},
    "deepspeed": {"format": "deepspeed", "to": "dp=2"},
}


@pytest.mark.parametrize("fmt", sorted(SEVERAL))
def test_several_split_files_are_finished_side_by_side_with_one_workers_bytes(source, tmp_path, monkeypatch, fmt):
    """The main process finishes each split file in a thread of its own (reading back the blocks of its checksum no
    worker took, and its tensors written in pieces, from the disk where the parts were written directly): the bytes
    and the manifest are one worker's."""
    import threading

    import reshard.execution.workers as workers_module

    options = SEVERAL[fmt]
    threads: dict[str, str] = {}
    real = workers_module.WriteSession

    class Spy(real):
        def open(self, path, size=None):
            threads[str(path)] = threading.current_thread().name
            return super().open(path, size)

    reshard.convert(source, tmp_path / "one", workers=1, **options)
    monkeypatch.setattr(workers_module, "WriteSession", Spy)
    reshard.convert(source, tmp_path / "many", workers=5, **options)
    finishers = {name for name in threads.values() if name.startswith("reshard-finish")}
    assert len(threads) >= 2 and len(finishers) >= 2, threads
    assert contents(tmp_path / "many") == contents(tmp_path / "one")
    assert reshard.verify(tmp_path / "many")


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_split_shares_hold_every_tensor_once_within_a_tenth_of_the_mean(source, workers):
    report = reshard.plan(source, format="megatron", to="tp=1,pp=1")
    parts = shares(report, workers)
    assert len(parts) == workers
    (only,) = file_bytes(report)
    held = [it for p in parts for f, its in p.split for it in its]
    assert sorted(map(str, held)) == sorted(str(it) for it, f in report.dst_files.items() if str(f) == only)
    loads = [p.bytes for p in parts]
    assert sum(loads) == file_bytes(report)[only] and max(loads) <= 1.1 * sum(loads) / workers, loads
    table = report.to_json(workers=workers)["workers"]
    assert [row["bytes"] for row in table["shares"]] == loads and table["largest_over_mean"] <= 1.1
    assert [sum(p["bytes"] for p in row["parts"]) for row in table["shares"]] == loads


def test_more_files_than_workers_that_balance_badly_are_split(source):
    """Four files of about equal size for three workers: whole, one worker would write two of them (1.5 x
    the mean), so three files go whole and the fourth is split between the three workers, every share within a
    tenth of the mean."""
    report = reshard.plan(source, format="megatron", to="tp=2,pp=2")
    weight = file_bytes(report)
    assert len(weight) == 4 and max(weight.values()) <= 1.01 * min(weight.values())
    parts = shares(report, 3)
    assert [len(p.split) for p in parts] == [1, 1, 1] and len({f for p in parts for f, _ in p.split}) == 1
    (cut,) = {f for p in parts for f, _ in p.split}
    assert sorted(f for p in parts for f in p.files if f != cut) == sorted(set(weight) - {cut})
    assert max(p.bytes for p in parts) <= 1.1 * sum(weight.values()) / 3


@pytest.mark.parametrize("to", ["tp=2,pp=2", "tp=1,pp=4", "tp=4,pp=1"])
@pytest.mark.parametrize("workers", [2, 3, 4, 6])
def test_shares_are_within_a_tenth_of_the_mean_or_of_one_tensor(source, to, workers):
    report = reshard.plan(source, format="megatron", to=to)
    weight = file_bytes(report)
    parts = shares(report, workers)
    loads = [p.bytes for p in parts]
    largest = max(report.target.layout.items[it].numel for it in report.dst_files) * 4  # fp32 at most
    assert sum(loads) == sum(weight.values()) and len(parts) <= workers
    assert max(loads) <= max(1.1 * sum(loads) / workers, sum(loads) / workers + largest), (loads, largest)


ZERO = {"format": "deepspeed", "to": "dp=1"}  # the flat fp32 buffers: one stored tensor each


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_tensors_larger_than_the_slack_are_written_in_pieces_with_one_workers_bytes(source, tmp_path, workers):
    """DeepSpeed's optimizer states are three flat buffers: cut between tensors, two workers' shares would be
    1.14 x the mean at best; cut inside them, each worker writes a piece of a buffer and the main process reads
    the pieced buffers back for their checksums and CRC-32s."""
    report = reshard.plan(source, **ZERO)
    parts = shares(report, workers)
    assert any(p.pieces for p in parts) and max(p.bytes for p in parts) <= 1.1 * sum(p.bytes for p in parts) / workers
    for _, item, lo, hi in (x for p in parts for x in p.pieces):  # the pieces of a tensor tile it
        assert 0 <= lo < hi <= report.target.layout.items[item].numel
    cover: dict = {}
    for p in parts:
        for _, item, lo, hi in p.pieces:
            cover.setdefault(item, []).append((lo, hi))
    for item, spans in cover.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == report.target.layout.items[item].numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    reshard.convert(source, tmp_path / "one", workers=1, **ZERO)
    result = reshard.convert(source, tmp_path / "many", workers=workers, **ZERO)
    assert contents(tmp_path / "many") == contents(tmp_path / "one")
    assert result.bytes_read - result.gap_bytes == report.needed_bytes()


def test_a_worker_killed_inside_its_piece_of_a_tensor_leaves_it_to_resume(source, tmp_path, monkeypatch):
    from worker_faults import KillInPart

    import reshard.api.converting

    real = reshard.api.converting.worker_shares

    def faulty(*args, **kw):  # the first worker dies after its second write into its part
        parts = real(*args, **kw)
        assert parts[0].pieces
        return [dataclasses.replace(parts[0], write=KillInPart(parts[0].write, 2)), *parts[1:]]

    monkeypatch.setattr(reshard.api.converting, "worker_shares", faulty)
    dst = tmp_path / "dst"
    with pytest.raises(WorkerLost, match=r"^worker 1 of 3 was killed \(SIGKILL\) while writing "):
        reshard.convert(source, dst, workers=3, **ZERO)
    monkeypatch.undo()
    assert not dst.exists() and not (partial_path(dst) / "reshard.json").exists()
    reshard.convert(source, tmp_path / "one", workers=1, **ZERO)
    reshard.convert(source, dst, workers=2, resume=True, **ZERO)
    assert contents(dst) == contents(tmp_path / "one")


@pytest.mark.parametrize("resume_workers", [1, 3])
def test_a_worker_killed_inside_its_range_leaves_no_complete_file_and_resume_rewrites_it(
        source, tmp_path, monkeypatch, resume_workers):
    from worker_faults import KillInPart

    import reshard.api.converting

    options, only = ONE_FILE["megatron"]
    real = reshard.api.converting.worker_shares

    def faulty(*args, **kw):  # the second worker dies after its third write into its part
        parts = real(*args, **kw)
        return [parts[0], dataclasses.replace(parts[1], write=KillInPart(parts[1].write, 3))]

    monkeypatch.setattr(reshard.api.converting, "worker_shares", faulty)
    dst = tmp_path / "dst"
    with pytest.raises(WorkerLost, match=r"^worker 2 of 2 was killed \(SIGKILL\) while writing "):
        reshard.convert(source, dst, workers=2, **options)
    monkeypatch.undo()
    partial = partial_path(dst)
    assert not dst.exists() and not (partial / "reshard.json").exists()
    assert (partial / only).exists() and only not in {e["file"] for e in read_journal(partial)}
    reshard.convert(source, tmp_path / "one", workers=1, **options)
    result = reshard.convert(source, dst, workers=resume_workers, resume=True, **options)
    assert result.reused == 0 and not partial.exists()
    assert contents(dst) == contents(tmp_path / "one")


def test_the_cli_plan_names_the_files_a_worker_writes_in_part(source):
    from reshard.cli.main import app
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["plan", str(source), "--format", "hf", "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert "2 workers, largest byte share 1.00 x the mean:" in result.output
    assert "  worker 0: 306.1 KiB in 1 file: model.safetensors (306.1 KiB of it, 20 tensors)" in result.output


FORKED = """
import sys
sys.path.insert(0, {tests!r})
import reshard, reshard.api.converting as converting, reshard.execution.workers as workers
from reshard.execution.workers import WorkerLost
forks = []
start = workers._Forked.__init__
workers._Forked.__init__ = lambda self, *a: forks.append(1) or start(self, *a)
if {kill!r}:
    import dataclasses
    from worker_faults import KillInPart
    real = converting.worker_shares
    converting.worker_shares = lambda *a, **kw: [s if k == 0 else dataclasses.replace(s, write=KillInPart(s.write, 2))
                                                 for k, s in enumerate(real(*a, **kw))]
try:
    reshard.convert({src!r}, {dst!r}, format="hf", workers=2)
except WorkerLost as e:
    print("lost:", str(e).split(" while")[0])
print("forked:", len(forks))
"""


@pytest.mark.parametrize("kill", [False, True])
def test_a_single_threaded_process_forks_its_workers_and_sees_one_die(source, tmp_path, kill):
    """In a process of one thread (a CLI run) workers are forks, holding their shares without a pickle: the
    same bytes as one worker; a forked worker killed inside its range is seen at once (its end of the pipe
    is its alone)."""
    import subprocess
    import sys

    code = FORKED.format(tests=str(Path(__file__).resolve().parents[1]), kill=kill, src=str(source),
                         dst=str(tmp_path / "two"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    if kill:
        assert run.stdout.splitlines() == ["lost: worker 2 of 2 was killed (SIGKILL)", "forked: 2"]
        return
    assert run.stdout.splitlines() == ["forked: 2"]
    reshard.convert(source, tmp_path / "one", format="hf", workers=1)
    assert contents(tmp_path / "two") == contents(tmp_path / "one")


CLI_IN_A_TERMINAL = """
import reshard.execution.workers as workers
from reshard.cli.main import app
forks = []
start = workers._Forked.__init__
workers._Forked.__init__ = lambda self, *a: forks.append(1) or start(self, *a)
try:
    app(["convert", {src!r}, {dst!r}, "--format", "hf", "--workers", "2"])
except SystemExit:
    pass
print("forked:", len(forks))
"""


def test_the_cli_in_a_terminal_draws_its_bar_without_a_thread_and_forks_its_workers(source, tmp_path):
    """rich redraws a progress bar on a thread of its own unless told not to: with it, a conversion from the
    command line would start fresh interpreters."""
    import os
    import pty
    import sys

    pid, fd = pty.fork()
    if pid == 0:  # the child, on the terminal
        os.execv(sys.executable, [sys.executable, "-c", CLI_IN_A_TERMINAL.format(src=str(source),
                                                                                 dst=str(tmp_path / "two"))])
    out = b""
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:  # the terminal closed with the child
            break
        if not data:
            break
        out += data
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, out.decode(errors="replace")
    text = out.decode(errors="replace")
    assert "converting" in text and "forked: 2" in text, text[-2000:]


def test_the_shares_of_a_split_file_take_each_workers_tensors_once_per_file(source, tmp_path, monkeypatch):
    """Which of a split file's tensors a worker skips is found against one set of its own per file, not one per
    tensor (made per tensor, 100,000 small tensors over 2 workers did not finish in 9 minutes)."""
    import reshard.api.workers as workers_module

    report = reshard.plan(source, format="hf")
    parts = shares(report, 2)
    assert all(p.split for p in parts)
    made = []
    monkeypatch.setattr(workers_module, "set", lambda *a: made.append(a) or set(*a), raising=False)
    sent = workers_module.worker_shares(report, parts, tmp_path, 1 << 20)
    assert len(made) == sum(len(p.split) for p in parts) == 2  # the one file, once per worker
    (only,) = {f for p in parts for f, _ in p.split}
    held = {it for it, path in report.dst_files.items() if str(path) == only}  # every tensor of the one file
    for share, part in zip(sent, parts):
        mine = {it for _, its in part.split for it in its}
        assert share.skip == frozenset(held - mine) and not share.skip & mine


@pytest.mark.parametrize("options", [{"format": "hf"}, {"format": "megatron", "to": "tp=1,pp=1"},
                                     {"format": "dcp", "to": "dp=1"}], ids=["hf", "megatron", "dcp"])
def test_a_split_file_is_finished_reading_back_only_the_blocks_at_its_seams(tmp_path, monkeypatch, wide, options):
    """The workers take the checksum blocks of the bytes they write; the parent reads back only the blocks that
    hold its framing or a seam between two workers' tensors (a safetensors header, a zip record's header and
    descriptor), not the whole file, and the manifest is one worker's."""
    from reshard.io.checksum import BLOCK
    from reshard.io.storage import FilePart

    finished = []
    real = FilePart._checksum

    def checksum(self):
        digest = real(self)
        if self.frames:
            finished.append((self.path.name, self.read_back, self.size))
        return digest

    reshard.convert(wide, tmp_path / "one", workers=1, **options)
    monkeypatch.setattr(FilePart, "_checksum", checksum)
    reshard.convert(wide, tmp_path / "two", workers=2, **options)
    assert contents(tmp_path / "two") == contents(tmp_path / "one")
    assert reshard.verify(tmp_path / "two")
    files = json.loads((tmp_path / "two" / "reshard.json").read_text())["files"]
    assert finished
    for name, read_back, size in finished:
        tensors = len(next(e["tensors"] for rel, e in files.items() if rel.endswith(name)))
        # at most the blocks at both ends of each tensor, the file's first and its last
        assert read_back <= min((2 * tensors + 2) * BLOCK, size / 5), (name, read_back, size, tensors)
