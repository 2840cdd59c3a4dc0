"""Writing shares of a conversion's destination files in worker processes, from a plan made once.

The parent plans and validates once; each worker gets a ``Share``: its destination files, the plan's
copies into them, where the source bytes of those copies are, the target to write, and the format's
``write``, and plans nothing. On Linux, from a process of one Python thread, a worker is a fork made
once the plan is: it holds its share from the start, with no interpreter to start, nothing to import
and nothing to unpickle. Otherwise it is a fresh interpreter that imports this module and unpickles
its share (the format's package comes with it). Workers read the same source files side by side:
positioned reads need no coordination.

A file larger than a fair share is split between workers at its stored tensors: each writes its own
tensors of it into the one file with positioned writes (``FilePart``) and reports the tensors' checksums,
the zip record CRC-32s and the blocks of the file's checksum it took; ``finish_split`` then writes what
depends on all of them (the zip central directory and serialization id, a safetensors header) in the
parent, puts the file's checksum together from those blocks, reading back only the blocks at the seams
between parts, and journals it. A tensor too large for one share is written in pieces, one per worker, and read
back by the parent for its checksums and CRC-32 (``WriteSession``'s ``pieces`` and ``read_back``). The file
is the same, byte for byte, as one process writes it.

A worker that reports an error fails the conversion with that error. A worker that dies (killed, or
exiting without a result) fails it with ``WorkerLost``, after every other worker is stopped: the
files finished so far stay journaled in the partial directory for ``resume``. Workers die with the
process that started them (on Linux, where the kernel can be asked to).
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reshard.core.collector import collector_paused
from reshard.core.layout import Item
from reshard.core.planner import Copy, Plan
from reshard.errors import ReshardError
from reshard.execution.coalescing import conversion
from reshard.execution.executor import ByteReader, PlanFill
from reshard.execution.session import Fill, SplitFile, WriteSession
from reshard.io.checksum import Taken
from reshard.io.smallfiles import Located

__all__ = ["Share", "ShareResult", "WorkerLost", "finish_split", "run_shares", "write_share"]

_FINISHERS = 4
"""The most split files ``finish_split`` reads back at once."""

_PROGRESS_S = 0.05
"""The least time between two of a worker's progress messages."""

Write = Callable[..., list[Path]]
"""A format's ``write(target, out, fill, session, *, only=...)``."""


class WorkerLost(ReshardError):
    """A worker died without a result (killed, or exited): the finished files are kept for ``resume``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Share:
    """What one worker writes, and everything it needs to write it without planning."""

    write: Write
    """The destination format's ``write``."""
    target: Any
    """The destination ``Target`` (layout, dtypes, format state), as the parent resolved it."""
    out: Path
    """The directory being written (the partial directory), journaled."""
    files: tuple[str, ...]
    """This worker's destination files, relative to ``out``, those in ``split`` included."""
    copies: tuple[Copy, ...]
    """The plan's copies into the items of ``files`` it writes, in the plan's order."""
    where: Mapping[Item, Located]
    """Where the source items those copies read are."""
    segments: Mapping[Item, Sequence[tuple[int, int]]]
    """Byte ranges inside this share's items to checksum on their own (``WriteSession``)."""
    window_bytes: int
    """The most bytes a writer asks of ``fill`` at a time."""
    split: tuple[str, ...] = ()
    """The files of ``files`` split between workers, of which this one writes the stored tensors not in ``skip``."""
    skip: frozenset[Item] = frozenset()
    """The stored tensors of the ``split`` files that other workers write."""
    pieces: Mapping[Item, tuple[int, int]] = field(default_factory=dict)
    """Stored tensors of the ``split`` files written in pieces by several workers: the elements ``[first, end)``
    of each that this one writes."""
    direct_io: bool = True
    """Whether its files' large writes go to the disk directly (``WriteSession``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareResult:
    files: dict[str, str | None]
    """The whole files written (relative to ``out``) and the checksum taken of each while writing."""
    bytes_read: int
    gap_bytes: int = 0
    """Of ``bytes_read``, those read only to skip a gap between needed ones."""
    items: dict[Item, str]
    """The checksum of each stored tensor written."""
    segments: dict[tuple[str, int, int], str]
    """The checksums of the ranges named by the share's ``segments``."""
    crcs: dict[str, dict[int, int]]
    """Per ``split`` file, the CRC-32 of each zip record written here, by the byte offset of its data."""
    blocks: dict[str, Taken] = field(default_factory=dict)
    """Per ``split`` file, what this share took of its checksum (``PartBlocks.taken``)."""


def write_share(share: Share, progress: Callable[[int], None] | None = None) -> ShareResult:
    """Write one share's files (in this process or thread); ``progress(nbytes)`` after each window, with the
    bytes its copies moved."""
    plan = Plan(src_items={}, dst_items={}, copies=share.copies, tensors={})
    split = {share.out / f: SplitFile() for f in share.split}
    with collector_paused(), WriteSession(journal=share.out, segments=share.segments, window_bytes=share.window_bytes,
                                          sync_behind=True, split=split, skip=share.skip,
                                          pieces=share.pieces, direct_io=share.direct_io) as session, \
            ByteReader() as reader:
        fill: Fill = PlanFill(plan, share.where, reader, dtypes=share.target.dtypes,
                              coalescing=conversion(share.window_bytes), progress=progress)
        written = share.write(share.target, share.out, fill, session, only=[Path(f) for f in share.files])
        session.flush()
        root = share.out.absolute()
        return ShareResult(files={str(w): session.digest(share.out / w) for w in written if str(w) not in share.split},
                           bytes_read=reader.bytes_read, gap_bytes=reader.gap_bytes, items=session.item_digests(),
                           segments=session.segment_digests(),
                           crcs={str(Path(p).relative_to(root)): c for p, c in session.part_crcs().items()},
                           blocks={str(Path(p).relative_to(root)): b for p, b in session.part_blocks().items()})


def finish_split(write: Write, target: Any, out: Path, results: Sequence[ShareResult],
                 items: Mapping[str, Collection[Item]], *, window_bytes: int, pieced: Collection[Item] = (),
                 segments: Mapping[Item, Sequence[tuple[int, int]]] | None = None) -> ShareResult:
    """Finish the files the workers wrote in parts (``items``: each file's stored tensors): write what depends
    on all the parts (headers, the zip directory with the CRC-32s the workers took), put each file's checksum
    together from the blocks the workers took (reading back the rest: the seams between parts), fsync and
    journal it with the tensor checksums the workers took. The tensors written in
    pieces (``pieced``) are read back first, for their checksums (and those of their ``segments``) and CRC-32s.
    Returns the checksum of each file, and those taken of the tensors read back.

    Raises:
      ReshardError: a stored tensor of a file that no worker reported (a bug).
    """
    digests: dict[Item, str] = {}
    ranges: dict[tuple[str, int, int], str] = {}
    crcs: dict[str, dict[int, int]] = {}
    blocks: dict[str, list[Taken]] = {}
    for r in results:
        digests.update(r.items)
        ranges.update(r.segments)
        for f, c in r.crcs.items():
            crcs.setdefault(f, {}).update(c)
        for f, b in r.blocks.items():
            blocks.setdefault(f, []).append(b)
    split: dict[Path, SplitFile] = {}
    for f, held in items.items():
        missing = [str(it) for it in held if it not in digests and it not in pieced]
        if missing:
            raise ReshardError(f"{out / f}: no worker wrote {', '.join(missing[:3])} of this split file")
        labels = {str(it) for it in held}
        split[out / f] = SplitFile(frames=True, crcs=crcs.get(f, {}), blocks=blocks.get(f, ()),
                                   tensors={it: digests[it] for it in held if it in digests},
                                   segments={k: d for k, d in ranges.items() if k[0] in labels})
    skip = {it for held in items.values() for it in held} - set(pieced)
    pieced_segments = {it: (segments or {}).get(it, ()) for it in pieced}
    labels = {str(it) for it in pieced}

    def finish(f: str) -> ShareResult:  # one file, in a session of its own
        with WriteSession(journal=out, window_bytes=window_bytes, sync_behind=True, split=split, skip=skip,
                          read_back=pieced, segments=pieced_segments) as session:
            written = write(target, out, _no_fill, session, only=[Path(f)])
            session.flush()
            return ShareResult(files={str(w): session.digest(out / w) for w in written}, bytes_read=0, crcs={},
                               items={it: d for it, d in session.item_digests().items() if it in pieced},
                               segments={k: d for k, d in session.segment_digests().items() if k[0] in labels})

    # The files side by side: each reads back its seams and its tensors written in pieces, from the disk where the
    # parts were written directly, and reads of several files at once keep the disk busier than one after another
    # (4 files of 560 MiB read whole: 1.15 s against 1.86 s). Reads and checksums let go of the GIL.
    with ThreadPoolExecutor(max_workers=max(1, min(len(items), _FINISHERS)),
                            thread_name_prefix="reshard-finish") as pool:
        done = list(pool.map(finish, list(items)))
    return ShareResult(files={k: v for r in done for k, v in r.files.items()}, bytes_read=0, crcs={},
                       items={k: v for r in done for k, v in r.items.items()},
                       segments={k: v for r in done for k, v in r.segments.items()})


def _no_fill(item: Item, lo: int, hi: int) -> bytes:
    raise AssertionError(f"{item}: the workers wrote this split file's tensors")  # stream_item skips them all


def dumps(value: Any) -> bytes:
    """A share, or a worker's result, as bytes for the other side of the pipe.

    Layouts and plans hold read-only mappings, which pickle cannot take as they are: they travel as
    dicts and are made read-only again on arrival.
    """
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, MappingProxyType: _reduce_proxy}
    pickler.dump(value)
    return buf.getvalue()


def _reduce_proxy(mapping: MappingProxyType) -> tuple:
    return _proxy, (dict(mapping),)


def _proxy(mapping: dict) -> MappingProxyType:
    return MappingProxyType(mapping)


def run_shares(shares: Sequence[Share], progress: Callable[[int], None] | None = None, *,
               fork: bool | None = None) -> list[ShareResult]:
    """Write each share in its own worker process; their results in the order of ``shares``.

    With ``fork`` (default: on Linux, while this process runs a single Python thread), a worker is a fork of this
    process: it starts holding its share, with no interpreter to start, nothing to import and nothing to
    unpickle. Otherwise (another thread could hold a lock the fork would copy held) a worker is a fresh
    interpreter that imports this module and, as its pickled share arrives, the format's package: nothing of
    the caller's ``__main__`` (no main guard needed, no script run twice).

    Raises:
      ReshardError: the first error a worker reported, naming the files it was writing.
      WorkerLost: a worker died without a result.
    Every other worker is stopped before either is raised.
    """
    from multiprocessing.connection import Connection, wait

    fork = _alone() if fork is None else fork
    if not fork and not sys.executable:
        raise ReshardError("cannot start workers: this Python does not know its own executable; use workers=1")
    # The worker sees the modules this process sees, as multiprocessing's spawn arranges it.
    code = f"import sys; sys.path[:] = {sys.path!r}; from reshard.execution.workers import _main; _main()"
    procs: list[subprocess.Popen | _Forked] = []
    conns: list[Connection] = []
    try:
        for share in shares:
            r, w = os.pipe()
            try:  # closed here once the worker has it: its death then reads as the end of the pipe
                procs.append(_Forked(share, w) if fork else
                             subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), str(w)],
                                              stdin=subprocess.PIPE, pass_fds=(w,)))
            finally:
                os.close(w)
            conns.append(Connection(r, writable=False))
        for proc, share in zip(procs, shares, strict=True):  # all started first: they import side by side
            if isinstance(proc, _Forked):
                continue
            try:
                proc.stdin.write(dumps(share))
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it died already: its connection says so below
        results: list[ShareResult | None] = [None] * len(shares)
        waiting = {id(c): k for k, c in enumerate(conns)}
        while waiting:
            for ready in wait([c for c in conns if id(c) in waiting]):
                k = waiting[id(ready)]
                try:
                    kind, value = pickle.loads(ready.recv_bytes())
                except EOFError:  # the worker is gone without a result
                    raise WorkerLost(f"worker {k + 1} of {len(shares)} {_died(procs[k].wait())} while writing "
                                     f"{_names(shares[k].files)}; the files finished so far are kept: resume the "
                                     f"conversion (--resume) to write the rest") from None
                if kind == "progress":
                    if progress is not None:
                        progress(value)
                elif kind == "done":
                    results[k] = value
                    del waiting[id(ready)]
                elif kind == "error":
                    raise ReshardError(f"{value} (while writing {_names(shares[k].files)})")
                else:  # a bug in the worker: its traceback
                    raise RuntimeError(f"worker {k + 1} of {len(shares)} failed while writing "
                                       f"{_names(shares[k].files)}:\n{value}")
        return [r for r in results if r is not None]
    finally:
        for proc in procs:  # stopped before the caller removes or reuses the directory they write into
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for c in conns:
            c.close()


def _names(files: Collection[str]) -> str:
    files = list(files)
    return ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def _died(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed (signal {-code})"
    return f"exited with code {code} without a result"


def _main() -> None:
    """A worker (``python -c``, argv: the parent's pid, the fd to answer on): die with the parent, read
    the share from stdin, write it, send back its result or its error."""
    _die_with(int(sys.argv[1]))
    _serve(lambda: pickle.loads(sys.stdin.buffer.read()), int(sys.argv[2]))


def _serve(share: Callable[[], Share], fd: int) -> None:
    """Write the share ``share()`` gives, answering on ``fd``: progress, then the result or the error."""
    from multiprocessing.connection import Connection

    conn = Connection(fd, readable=False)
    pending, last = [0], [time.monotonic()]

    def progress(n: int) -> None:  # at most one message per _PROGRESS_S: 100,000 small tensors would send as many
        pending[0] += n
        if time.monotonic() - last[0] >= _PROGRESS_S:
            conn.send_bytes(dumps(("progress", pending[0])))
            pending[0], last[0] = 0, time.monotonic()

    try:
        result = write_share(share(), progress=progress)
        if pending[0]:
            conn.send_bytes(dumps(("progress", pending[0])))
        conn.send_bytes(dumps(("done", result)))
    except ReshardError as e:
        conn.send_bytes(dumps(("error", str(e))))
    except Exception:
        conn.send_bytes(dumps(("bug", traceback.format_exc())))
    finally:
        conn.close()


def _alone() -> bool:
    """Whether a fork of this process is safe: Linux, and no Python thread but this one. Native thread pools
    are left out of the count: numpy's OpenBLAS starts one at import, and stops it around a fork itself
    (``pthread_atfork``); a worker calls into no such library."""
    return sys.platform.startswith("linux") and threading.active_count() == 1


class _Forked:
    """A worker forked from this process, writing ``share`` and answering on ``fd``; with ``Popen``'s
    ``poll``, ``wait`` and ``kill``."""

    def __init__(self, share: Share, fd: int) -> None:
        parent = os.getpid()
        self.returncode: int | None = None
        with warnings.catch_warnings():  # Python 3.12 warns of any native thread, such as OpenBLAS's (``_alone``)
            warnings.simplefilter("ignore", DeprecationWarning)
            self.pid = os.fork()
        if self.pid == 0:  # the worker: never returns into the caller's frames, runs none of its exit handlers
            code = 1
            try:
                _die_with(parent)
                _serve(lambda: share, fd)
                code = 0
            finally:
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _die_with(parent: int) -> None:
    """A worker dies with the conversion: a killed parent must not leave it writing into the
    directory a resumed conversion takes over."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
