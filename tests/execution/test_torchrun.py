"""``torchrun … -m reshard convert``: ranks on one host or two write byte-balanced shares of the destination
into one partial directory, and the output is byte for byte one process's; a killed rank leaves nothing
complete-looking, and ``--resume`` finishes at another world size.

Each test starts real torchrun jobs (gloo on the CPU, loopback rendezvous); a job's start is mostly
its ranks importing torch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_worker_shares import contents

import reshard
from reshard.execution.partial import partial_path
from reshard.fixtures import make_fixture
from reshard.io.storage import read_journal

pytestmark = pytest.mark.interop  # torch.distributed jobs

JOB = Path(__file__).resolve().parents[1] / "rank_job.py"
TO = "tp=1,pp=4"  # four rank files of ~1.1 MiB


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("torchrun") / "src"
    make_fixture(src, to="tp=2,pp=2")
    return src


@pytest.fixture(scope="module")
def one_process(source) -> Path:
    dst = source.parent / "one"
    reshard.convert(source, dst, to=TO, workers=1)
    return dst


def torchrun(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """Start ``torchrun ARGS``; its ranks' environment is this one's, with ``env``."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, **kw)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines(stdout: str) -> dict[int, dict]:
    """The JSON line of each rank of ``rank_job.py``, by rank."""
    return {r["rank"]: r for r in (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))}


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_write_what_one_process_writes(source, one_process, tmp_path, ranks):
    dst = tmp_path / "dst"
    code, out, err = finish(torchrun("--standalone", f"--nproc-per-node={ranks}", "-m", "reshard", "convert",
                                     str(source), str(dst), "--to", TO))
    assert code == 0, err[-3000:]
    assert contents(dst) == contents(one_process)
    assert not partial_path(dst).exists()
    (report,) = [line for line in out.splitlines() if line.startswith("wrote ")]  # rank 0 alone reports
    assert report.endswith(f"read by {ranks} ranks")


def test_ranks_split_a_file_larger_than_a_fair_share_and_write_what_one_process_writes(source, tmp_path):
    """To tp=1,pp=1 the destination is one rank file: two ranks each write part of it (byte-balanced), and rank
    0 finishes it; the bytes and the manifest are one process's (its creation time aside)."""
    from reshard.api.planning import plan
    from reshard.api.workers import shares

    one = tmp_path / "one"
    reshard.convert(source, one, to="tp=1,pp=1", workers=1)
    report = plan(source, to="tp=1,pp=1")
    parts = shares(report, 2)
    assert len(parts) == 2 and all(p.split for p in parts)
    assert max(p.bytes for p in parts) <= 1.1 * sum(p.bytes for p in parts) / 2
    dst = tmp_path / "dst"
    code, out, err = finish(torchrun("--standalone", "--nproc-per-node=2", "-m", "reshard", "convert", str(source),
                                     str(dst), "--to", "tp=1,pp=1"))
    assert code == 0, err[-3000:]
    assert contents(dst) == contents(one)
    assert not partial_path(dst).exists()


def test_two_hosts_are_two_torchrun_invocations(source, one_process, tmp_path):
    """``--nnodes 2``: two launchers on loopback, as two hosts sharing a filesystem would run them. With the
    c10d rendezvous the node ranks come from the rendezvous (``--node-rank`` is for the static one); the
    second invocation hosts its store."""
    dst, port = tmp_path / "dst", free_port()
    procs = [torchrun("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                      "--rdzv-id=two-hosts", f"--rdzv-conf=is_host={host}", "-m", "reshard", "convert", str(source),
                      str(dst), "--to", TO) for host in (0, 1)]
    results = [finish(p) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert contents(dst) == contents(one_process)
    assert sum(out.count("read by 2 ranks") for _, out, _ in results) == 1  # rank 0 alone reports


def test_a_rank_killed_on_one_host_fails_the_other_and_one_process_resumes(source, one_process, tmp_path):
    """The static rendezvous (``--node-rank 0/1``): rank 1, alone on the second host, is killed after its
    first file. No launcher stops rank 0 for it: its collective breaks, and it fails with ``RankLost``."""
    dst, port = tmp_path / "dst", free_port()
    procs = [torchrun("--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}", "--master-addr=127.0.0.1",
                      f"--master-port={port}", str(JOB), str(source), str(dst), TO,
                      env={"RESHARD_TEST_FAULT": "kill:1:1"}) for node in (0, 1)]
    (code0, out0, err0), (code1, _, err1) = [finish(p) for p in procs]
    assert code1 != 0 and "SIGKILL" in err1, err1[-3000:]
    rank0 = lines(out0)[0]
    assert code0 != 0 and rank0["error"] == "RankLost", err0[-3000:]
    assert rank0["message"].startswith("rank 0 of 2: the conversion's process group failed (")
    assert rank0["message"].endswith("Nothing was committed; the files finished so far are kept: the same command "
                                     "with --resume (resume=True) continues, with any number of ranks")
    assert not dst.exists() and not (partial_path(dst) / "reshard.json").exists()
    assert read_journal(partial_path(dst))
    result = reshard.convert(source, dst, to=TO, resume=True, workers=2)
    assert result.reused >= 1 and result.ranks == 1
    assert contents(dst) == contents(one_process)


def test_a_killed_rank_leaves_no_complete_output_and_resume_finishes_at_another_world_size(
        source, one_process, tmp_path):
    dst = tmp_path / "dst"
    code, out, err = finish(torchrun("--standalone", "--nproc-per-node=2", str(JOB), str(source), str(dst), TO,
                                     env={"RESHARD_TEST_FAULT": "kill:1:1"}))  # rank 1, after its first file
    assert code != 0 and "SIGKILL" in err, err[-3000:]
    assert not dst.exists()
    partial = partial_path(dst)
    assert not (partial / "reshard.json").exists()
    journaled = {e["file"] for e in read_journal(partial)}
    assert 1 <= len(journaled) < 4
    code, out, err = finish(torchrun("--standalone", "--nproc-per-node=3", str(JOB), str(source), str(dst), TO,
                                     "resume"))
    assert code == 0, err[-3000:]
    ranks = lines(out)
    assert sorted(ranks) == [0, 1, 2] and all(r["ranks"] == 3 for r in ranks.values())
    assert ranks[0]["reused"] == len(journaled) and ranks[0]["report"]
    done, total = ranks[0]["progress"]  # progress is rank 0's, summed over the ranks
    assert done == total > 0 and ranks[0]["growing"]
    assert ranks[1]["calls"] == ranks[2]["calls"] == 0 and not ranks[1]["report"]
    theirs = [set(r["files"]) for k, r in ranks.items() if k]  # what each other rank wrote
    assert not theirs[0] & theirs[1] and theirs[0] | theirs[1] <= set(ranks[0]["files"]) - set(journaled)
    assert contents(dst) == contents(one_process)
    assert not partial.exists()


def test_an_error_on_one_rank_fails_every_rank_and_leaves_nothing(source, tmp_path):
    dst = tmp_path / "dst"
    code, out, err = finish(torchrun("--standalone", "--nproc-per-node=2", str(JOB), str(source), str(dst), TO,
                                     env={"RESHARD_TEST_FAULT": "error:1:1"}))
    assert code != 0
    ranks = lines(out)
    assert ranks[0]["error"] == ranks[1]["error"] == "ReshardError"
    assert ranks[0]["message"] == ranks[1]["message"]
    assert ranks[0]["message"].endswith(")") and ": injected failure on rank 1 (rank 1 of 2, writing iter_0000000/" \
        in ranks[0]["message"]
    assert not dst.exists() and not partial_path(dst).exists()


def test_distributed_true_outside_a_job_says_how_to_start_one(source, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(reshard.ReshardError, match=r"^distributed=True, but this process is not in a torchrun job "
                                                   r"\(no WORLD_SIZE in its environment\) and torch.distributed is not "
                                                   r"initialized: start it with torchrun$"):
        reshard.convert(source, tmp_path / "dst", to=TO, distributed=True)
    assert not (tmp_path / "dst").exists()
