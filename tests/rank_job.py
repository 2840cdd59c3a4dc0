"""One rank of a torchrun conversion through the API, for the torchrun tests (started by torchrun).

    torchrun ... tests/rank_job.py SRC DST TO [resume]

Calls ``reshard.convert`` with a progress callback and prints one JSON line with what this rank saw:
``rank``, ``ranks``, ``report`` (whether it holds the plan), ``files``, ``reused``, ``progress`` (the
last call it got, ``[done, total]``), ``calls``, ``growing`` (each call counted more than the last), or ``error`` (the exception's type) and ``message``.

``RESHARD_TEST_FAULT=ACTION:RANK:N``: on rank RANK, right after its N-th output file is closed (and
journaled), ``kill`` SIGKILLs the rank (as the OOM killer would) and ``error`` raises a
``CheckpointFormatError`` (as a failing disk would).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import reshard
import reshard.io.storage
from reshard.errors import CheckpointFormatError, ReshardError

SRC, DST, TO = sys.argv[1:4]
RESUME = sys.argv[4:] == ["resume"]
RANK = int(os.environ["RANK"])


def inject(action: str, n: int) -> None:
    real_close = reshard.io.storage.OutputFile.close
    closes = [0]

    def close(file, **kwargs):
        digest = real_close(file, **kwargs)
        closes[0] += 1
        if closes[0] == n:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise CheckpointFormatError(f"{file.path}: injected failure on rank {RANK}")
        return digest

    reshard.io.storage.OutputFile.close = close


fault = os.environ.get("RESHARD_TEST_FAULT")
if fault:
    action, rank, n = fault.split(":")
    if int(rank) == RANK:
        inject(action, int(n))
calls: list[list[int]] = []


def say(result: dict) -> None:
    """One JSON line in one write: the ranks share torchrun's stdout, and a pipe keeps a write of up to 4 KiB
    whole, where print's separate writes of text and newline can interleave with another rank's."""
    os.write(1, (json.dumps(result) + "\n").encode())


try:
    r = reshard.convert(SRC, DST, to=TO, resume=RESUME, progress=lambda done, total: calls.append([done, total]))
except ReshardError as e:
    say({"rank": RANK, "error": type(e).__name__, "message": str(e)})
    sys.exit(2)
say({"rank": RANK, "ranks": r.ranks, "report": r.report is not None, "files": sorted(r.files),
     "reused": r.reused, "progress": calls[-1] if calls else None, "calls": len(calls),
     "growing": all(a[0] < b[0] for a, b in zip(calls, calls[1:]))})
