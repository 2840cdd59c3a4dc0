"""A conversion that SIGKILLs itself at one chosen point, for the crash-safety tests.

    python tests/crash_job.py SRC DST TO WORKERS POINT N [resume]

POINT is where the process dies, at its N-th occurrence:
  header        the partial directory and its header exist, nothing else
  write         inside a file: right after the N-th positioned write
  journal       a file is complete and fsynced, its journal entry not yet written
  close         right after the N-th file is closed, fsynced and journaled
  manifest      halfway through writing the manifest
  rename        the journal is gone, the manifest written, the rename not yet done
  renamed       right after the rename
  worker-close  a worker, after its N-th file, kills the conversion's main process and
                waits to be killed with it (writes its pid to DST.worker-pid; if it
                outlives the parent by 5 s it writes DST.worker-survived); the workers
                get this fault with their shares (``worker_faults.FaultyWrite``)
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import reshard
import reshard.api.converting
import reshard.execution.partial
import reshard.execution.session
import reshard.io.storage

SRC, DST, TO, WORKERS, POINT, N = sys.argv[1:7]
RESUME = sys.argv[7:] == ["resume"]
N = int(N)
_count = [0]


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _hit() -> bool:
    _count[0] += 1
    return _count[0] == N


_pwrite = reshard.io.storage.OutputFile.pwrite
_journal = reshard.execution.session._append_line
_start, _write_synced, _replace = reshard.execution.partial.Partial._start, reshard.execution.partial._write_synced, os.replace


def pwrite(self, data, offset):
    _pwrite(self, data, offset)
    if POINT == "write" and _hit():
        _kill()


def journal(journal_path, line, what):
    if POINT == "journal" and _hit():
        _kill()
    _journal(journal_path, line, what)
    if POINT == "close" and _hit():
        _kill()


def start(self, header):
    _start(self, header)
    if POINT == "header":
        _kill()


def write_synced(path, text):
    if POINT == "manifest" and path.name == "reshard.json":
        with open(path, "w") as f:
            f.write(text[: len(text) // 2])
        _kill()
    _write_synced(path, text)


def replace(a, b):
    if POINT == "rename" and str(b) == DST:
        _kill()
    _replace(a, b)
    if POINT == "renamed" and str(b) == DST:
        _kill()


def worker_shares(*args, **kw):
    from worker_faults import FaultyWrite

    return [dataclasses.replace(s, write=FaultyWrite(s.write, "kill-parent", N, DST))
            for s in _worker_shares(*args, **kw)]


_worker_shares = reshard.api.converting.worker_shares
if POINT == "worker-close":
    reshard.api.converting.worker_shares = worker_shares
reshard.io.storage.OutputFile.pwrite = pwrite
reshard.execution.session._append_line = journal
reshard.execution.partial.Partial._start = start
reshard.execution.partial._write_synced = write_synced
reshard.execution.partial.os.replace = replace

if __name__ == "__main__":
    reshard.convert(SRC, DST, to=TO, workers=int(WORKERS), resume=RESUME)
    sys.exit(3)  # the point was never reached
