"""Faults injected into conversion workers, for the worker tests and ``crash_job.py``.

A ``FaultyWrite`` wraps a format's ``write`` in a worker's share (``dataclasses.replace(share, write=...)``).
It travels to the worker with the share, so it must be importable there: workers see the test process's
``sys.path``, which holds this folder.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import reshard.execution.session


class FaultyWrite:
    """Run ``write``, and after the worker's ``n``-th file is closed, synced and journaled do ``action``:

    - ``kill``: SIGKILL the worker itself (as the OOM killer would);
    - ``exit``: ``os._exit(1)``, without a result;
    - ``kill-parent``: the first worker to get here writes its pid to ``marker + '.worker-pid'`` and SIGKILLs
      the conversion's main process; every worker then waits to be killed with it (one that outlives the
      parent by 5 s writes ``marker + '.worker-survived'``).
    """

    def __init__(self, write, action: str, n: int = 1, marker: str = "") -> None:
        self.write, self.action, self.n, self.marker = write, action, n, marker

    def __call__(self, target, out, fill, session=None, **kw):
        entries = [0]
        real_append = reshard.execution.session._append_line

        def append(journal, line, what):  # patched in the worker process only, which ends with this share
            real_append(journal, line, what)
            entries[0] += 1
            if entries[0] == self.n:
                self._act()

        reshard.execution.session._append_line = append
        return self.write(target, out, fill, session, **kw)

    def _act(self) -> None:
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "exit":
            os._exit(1)
        elif self.action == "kill-parent":
            # Only the first worker to get here kills the parent, and only once its pid is written whole:
            # a second worker could otherwise be killed with the parent halfway through rewriting the file.
            try:
                fd = os.open(self.marker + ".worker-pid", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                fd = None
            if fd is not None:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(5)
            Path(self.marker + ".worker-survived").write_text(str(os.getpid()))
        else:
            raise ValueError(f"unknown fault action {self.action!r}")


class KillInPart:
    """Run ``write``, and SIGKILL the worker right after its ``n``-th positioned write into its part of a file
    split between workers (``FilePart``): its range half written, nothing of it journaled."""

    def __init__(self, write, n: int = 1) -> None:
        self.write, self.n = write, n

    def __call__(self, target, out, fill, session=None, **kw):
        import reshard.io.storage

        writes = [0]
        real = reshard.io.storage.FilePart.pwrite

        def pwrite(part, data, offset):  # patched in the worker process only, which ends with this share
            real(part, data, offset)
            writes[0] += 1
            if writes[0] == self.n:
                os.kill(os.getpid(), signal.SIGKILL)

        reshard.io.storage.FilePart.pwrite = pwrite
        return self.write(target, out, fill, session, **kw)
