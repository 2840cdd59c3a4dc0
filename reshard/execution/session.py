"""A write session: everything the writers of one conversion share, in one object passed to them.

A conversion (or one worker's share of it) opens a ``WriteSession`` and hands it to the format's
``write``; the format says *what* goes into *which* file, and the session does the writing the
same way for every format:

- output files (``open``): positioned writes, the file's checksum taken while it is written, an
  fsync once it is closed (with ``sync_behind``, on the session's sync thread, so that the disk
  writes one file back while the next is filled; ``flush`` waits for them), and, when the session
  journals, an entry in the resume journal once the file's bytes are on disk;
- stored tensors (``stream_item``): copied from ``fill`` window by window, at most
  ``window_bytes`` at a time, with a per-tensor checksum (and the checksums of the byte ranges
  inside it that hold a logical tensor of their own), up to ``_IN_FLIGHT`` windows written on the
  session's writer thread while the next is filled, in buffers the session reuses, each placed in
  memory as it lies in its file (``_window``) so that its direct write copies nothing (progress is
  the fill's to count: ``PlanFill``);
- runs of small stored tensors (``runs``, ``stream_run``): tensors that lie side by side in a file,
  each smaller than ``_SMALL``, filled into one buffer of at most ``window_bytes`` (a ``PlanFill``
  reads the source runs that lie side by side with one call), checksummed there, and written with
  one call: the Python a tensor costs is paid once per run instead (a checkpoint of 100,000 tensors
  of 10 KiB);
- files split between processes (``split``): a worker's session writes only its own stored
  tensors of such a file (the others are in ``skip``) into a ``FilePart``, journals nothing and
  reports the zip record CRCs and the blocks of the file's checksum it took (``part_crcs``,
  ``part_blocks``); once every worker is done, the parent's session writes the file's framing with
  those CRCs, puts the file's checksum together from those blocks (reading back only the blocks at
  the seams between parts) and journals it with the tensor checksums the workers took.

Nothing is kept in module globals: two sessions in one process (two conversions in parallel
threads, the load API inside a training job) never see each other's checksums or journal.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

from reshard.core.dtypes import itemsize
from reshard.core.layout import Item
from reshard.errors import CheckpointFormatError
from reshard.io.checksum import FILE_HASH, Taken
from reshard.io.storage import JOURNAL, FilePart, ItemHasher, OutputFile, ReadBack, Skip, sync_file

__all__ = ["DEFAULT_WINDOW", "Fill", "Slot", "SplitFile", "WriteSession"]

DEFAULT_WINDOW = 8 << 20
"""Bytes a writer asks of ``fill`` at a time when the session is given no budget."""

_HANDOFF = 1 << 20
"""The smallest window handed to the writer thread when none is in flight there: a smaller one costs less to write
than to hand over."""

_IN_FLIGHT = 2
"""The most windows handed to the writer thread and not yet written. With one, the reads and the writes wait on
each other whenever a window is slower on one side than the last was on the other; a second one took the writer's
idle time out of a 2.6 GiB conversion (``bench/breakdown.py``), and more gained nothing."""

_PAGE = 4096
"""Windows lie in memory at the same offset within a page as in their file, so that direct writes take them as
they are (``reshard.io.storage``: a page, a multiple of every block size)."""

_SMALL = 256 << 10
"""The largest stored tensor (with its framing) ``runs`` puts in a run with others: a larger one costs little more
per byte streamed alone."""

_RUN = 4 << 20
"""The most bytes of a run (and half the window at most): past a few MiB a run saves no more calls."""

Fill = Callable[[Item, int, int], "bytes | memoryview"]
"""``fill(item, lo, hi)``: the bytes of the item's elements ``[lo, hi)`` (row-major), padding included. A fill
that also has ``fill_run(requests, buffer)`` (``PlanFill``) fills a run of items in one go: each request
``(item, lo, hi, at)`` puts the item's elements ``[lo, hi)`` at byte ``at`` of the uint8 array ``buffer``."""


class Slot(NamedTuple):
    """Where one stored tensor goes in an output file, for ``runs`` and ``stream_run``: the file's bytes
    ``[start, end)`` are the tensor's (``numel`` elements of ``dtype`` from byte ``data`` on) and the framing
    its format puts around them (none in a safetensors file; a torch.save archive's records in a DCP
    ``.distcp``). Offsets are in bytes from the start of the file. (A named tuple: a format makes one per
    stored tensor, 100,000 of them for as many small tensors, at a fifth of a frozen dataclass's cost.)"""

    item: Item
    numel: int
    dtype: str
    start: int
    data: int
    end: int
    key: Any = None
    """The format's own handle on the tensor (its name in the file, its entry)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitFile:
    """How a session takes part in writing a file that several processes write side by side."""

    frames: bool = False
    """True: this session finishes the file once the others are done (its framing, its checksum, its journal
    entry): the parent's. False: it writes its stored tensors of it, those not in ``skip``."""
    crcs: Mapping[int, int] = field(default_factory=dict)
    """Finishing: the CRC-32 of each zip record the others wrote, by the byte offset of its data in the file."""
    blocks: Sequence[Taken] = ()
    """Finishing: what each of the others took of the file's checksum (``PartBlocks.taken``)."""
    tensors: Mapping[Item, str] = field(default_factory=dict)
    """Finishing: the checksums the others took of the file's stored tensors, journaled with the file."""
    segments: Mapping[tuple[str, int, int], str] = field(default_factory=dict)
    """Finishing: the checksums the others took of ranges inside those tensors (``segments``)."""


class WriteSession:
    """The shared state of one conversion's writers.

    Args:
      journal: the directory being written, whose journal (``.reshard-journal``) records each file
        closed under it, for ``resume``; None: no journal.
      segments: byte ranges inside stored items to checksum on their own, by item: each a logical
        tensor held row-major inside a larger item (a vocabulary padded for tp, one half of a fused
        weight, one param of a flat buffer).
      window_bytes: the most bytes a writer asks of ``fill`` at a time (from the memory budget).
      sync_behind: fsync each closed file on the session's sync thread, while the next one is written, instead
        of in ``close``; its journal entry follows the sync. The caller must ``flush`` before it relies on the
        files being on disk.
      split: files written side by side with other processes (by path), and this session's part in each.
      skip: stored tensors ``stream_item`` leaves alone: the other processes' tensors of the ``split`` files.
      pieces: stored tensors of the ``split`` files that processes write in pieces: the elements ``[first, end)``
        this session writes of each (no checksum of the tensor here).
      read_back: tensors written in pieces by other processes that this session, finishing their file, reads
        back for their checksums and CRC-32s.
      direct_io: whether the files' writes of 1 MiB or more go to the disk directly (``OutputFile``); False:
        through the page cache.
    """

    def __init__(self, *, journal: str | Path | None = None,
                 segments: Mapping[Item, Sequence[tuple[int, int]]] | None = None,
                 window_bytes: int = DEFAULT_WINDOW, sync_behind: bool = False,
                 split: Mapping[str | Path, SplitFile] | None = None, skip: Collection[Item] = (),
                 pieces: Mapping[Item, tuple[int, int]] | None = None, read_back: Collection[Item] = (),
                 direct_io: bool = True) -> None:
        self.journal = Path(journal).absolute() if journal is not None else None
        self.direct_io = direct_io
        self.sync_behind = sync_behind
        self.window_bytes = window_bytes
        self._split = {str(Path(p).absolute()): v for p, v in (split or {}).items()}
        self._skip = frozenset(skip)
        self._pieces = dict(pieces or {})
        self._read_back = frozenset(read_back)
        self._parts: dict[str, FilePart] = {}
        self._segments = {k: tuple(sorted(v)) for k, v in (segments or {}).items() if v}
        self._lock = threading.Lock()
        self._digests: dict[str, str] = {}
        self._item_digests: dict[Item, str] = {}
        self._segment_digests: dict[tuple[str, int, int], str] = {}
        self._pending_items: dict[str, str] = {}
        self._pending_segments: list[list[Any]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()  # the windows being written on the writer thread, oldest first
        self._syncer: ThreadPoolExecutor | None = None
        self._syncs: list[Future] = []
        self._run_bytes = min(_RUN, window_bytes // 2)
        self._buffers: list[np.ndarray | None] = [None] * (_IN_FLIGHT + 1)  # windows are filled in them in turn
        self._turn = 0

    # --- files -----------------------------------------------------------------------------------

    def open(self, path: str | Path, size: int | None = None) -> OutputFile:
        """Create an output file (sized up front if ``size`` is given) whose checksum this session keeps; for a
        ``split`` file, this session's part of it."""
        key = str(Path(path).absolute())
        split = self._split.get(key)
        if split is None:
            return OutputFile(path, size, on_close=self._closed, fsync=not self.sync_behind, settle=self.settle,
                              direct=self.direct_io)
        if split.frames:  # the file's journal entry carries the tensors the others wrote
            with self._lock:
                self._item_digests.update(split.tensors)
                self._segment_digests.update(split.segments)
                if self.journal is not None:
                    self._pending_items.update({str(it): d for it, d in split.tensors.items()})
                    self._pending_segments += [[label, lo, hi, d] for (label, lo, hi), d in split.segments.items()]
        part = FilePart(path, size, frames=split.frames, crcs=dict(split.crcs), taken=split.blocks,
                        fsync=not self.sync_behind, on_close=self._closed if split.frames else self._part_closed,
                        settle=self.settle, direct=self.direct_io)
        with self._lock:
            self._parts[key] = part
        return part

    def flush(self) -> None:
        """Wait until every file closed so far is on disk (and in the journal); raise the first failure."""
        while True:
            with self._lock:
                pending, self._syncs = self._syncs, []
            if not pending:
                return
            for future in pending:
                future.result()

    def digest(self, path: str | Path) -> str | None:
        """The checksum taken of ``path`` while this session wrote it; None if it did not."""
        with self._lock:
            return self._digests.get(str(Path(path).absolute()))

    def item_digests(self) -> dict[Item, str]:
        """The checksum of each stored tensor written in this session."""
        with self._lock:
            return dict(self._item_digests)

    def part_crcs(self) -> dict[str, dict[int, int]]:
        """The zip record CRC-32s this session took in the parts of ``split`` files it wrote (by absolute path;
        by the byte offset of each record's data)."""
        with self._lock:
            return {p: dict(part.crcs) for p, part in self._parts.items() if not part.frames}

    def part_blocks(self) -> dict[str, Taken]:
        """What this session took of the checksums of the ``split`` files it wrote parts of (by absolute path;
        ``PartBlocks.taken``)."""
        with self._lock:
            return {p: part.blocks.taken() for p, part in self._parts.items() if not part.frames}

    def segment_digests(self) -> dict[tuple[str, int, int], str]:
        """The checksums of the ranges named by ``segments``, by (item label, first byte, end byte)."""
        with self._lock:
            return dict(self._segment_digests)

    # --- tensors ---------------------------------------------------------------------------------

    def stream_item(self, fill: Fill, item: Item, numel: int, dtype: str,
                    write: Callable[["bytes | memoryview"], None], at: int | None = None) -> None:
        """Copy an item's ``numel`` elements from ``fill`` to ``write``, at most ``window_bytes`` at a time.

        A window is written (checksummed, CRC'd, handed to the kernel) on the session's writer
        thread while the next ones are filled, of this item or of the next one streamed: both sides
        spend their time in code that releases the GIL, so reading and writing overlap. At most
        ``_IN_FLIGHT`` windows are in flight; a window under ``_HANDOFF`` bytes is written here where
        none is in flight, else behind them on the writer thread. A file's writer must let the writes in
        flight end before it closes the file (the files ``open`` makes do, in ``close`` and ``abort``).

        A fill with ``fill_into`` (``PlanFill``) fills the session's own window buffers, reused; ``at``, the
        file offset of the item's first byte, puts each window at its file offset's place within a page, so
        that its direct write (``OutputFile``) copies nothing.

        Raises CheckpointFormatError when ``fill`` returns the wrong number of bytes.
        """
        if item in self._skip:  # another process's part of a split file
            return
        size = itemsize(dtype)
        step = max(1, self.window_bytes // size)
        if item in self._read_back:
            return self._read_back_item(item, numel, size, step, write)
        first, end = self._pieces.get(item, (0, numel))
        digest = ItemHasher(item, self._segments.get(item, ()), on_done=self._hashed) if item not in self._pieces \
            else None  # a piece of a tensor: the finishing process reads the tensor back for its checksum
        try:
            if digest is None:
                self.settle()
                write(Skip(first * size))
            fill_into = getattr(fill, "fill_into", None)
            elements = np.dtype((np.void, size))  # fill_into copies bits: any dtype of the element size
            for lo in range(first, max(end, first + 1), step):  # a tensor without elements: one empty window
                hi = min(end, lo + step)
                if fill_into is not None:
                    window = self._window((hi - lo) * size, None if at is None else at + lo * size)
                    fill_into(item, lo, hi, window.view(elements))
                    data = memoryview(window)
                else:
                    data = fill(item, lo, hi)
                    _check_window(data, item, lo, hi, size, dtype)
                if digest is not None:
                    digest.update(data)
                self._hand(write, data)
            if digest is not None:
                digest.done()
        except BaseException:
            self._settle_quietly()  # an error while filling: let the write in flight end before unwinding
            raise

    def _read_back_item(self, item: Item, numel: int, size: int, step: int, write: Callable) -> None:
        """A tensor other processes wrote in pieces: read back from the file through its writer, window by
        window (its CRC, its descriptor), for its checksums."""
        digest = ItemHasher(item, self._segments.get(item, ()), on_done=self._hashed)
        self.settle()  # nothing in flight: the window buffers are free to read into
        for lo in range(0, numel, step):
            nbytes = (min(numel, lo + step) - lo) * size
            window = ReadBack(nbytes, memoryview(self._window(nbytes, None)))
            write(window)
            digest.update(window.data)
        digest.done()

    def runs(self, slots: Iterable[Slot]) -> Iterator[list[Slot]]:
        """``slots`` (in file order) grouped into runs for ``stream_run``: slots that touch in the file (one's
        ``end`` the next one's ``start``), each at most ``_SMALL`` bytes and written whole by this session, at
        most ``_RUN`` bytes and half the window together. Every other slot comes alone (a list of one), for
        ``stream_item``, and so may a small one that has no neighbour to run with."""
        run: list[Slot] = []
        for s in slots:
            small = s.end - s.start <= min(_SMALL, self._run_bytes) and s.item not in self._skip \
                and s.item not in self._pieces and s.item not in self._read_back
            if run and small and run[-1].end == s.start and s.end - run[0].start <= self._run_bytes:
                run.append(s)
                continue
            if run:
                yield run
            run = [s] if small else []
            if not small:
                yield [s]
        if run:
            yield run

    def stream_run(self, fill: Fill, run: Sequence[Slot], write: Callable[[Sequence[Slot], memoryview], None]) -> None:
        """Fill a run of ``runs`` into one buffer, take each tensor's checksums there, and hand it to
        ``write(run, buffer)``: the file's bytes ``[run[0].start, run[-1].end)``, each tensor's in place. The
        bytes around the tensors are not set: ``write`` puts the framing there, then writes the buffer (on the
        session's writer thread when it holds at least ``_HANDOFF`` bytes or follows windows in flight there, while the
        next run is filled).

        Raises CheckpointFormatError when ``fill`` returns the wrong number of bytes.
        """
        start = run[0].start
        buf = self._window(run[-1].end - start, start)
        requests = [(s.item, 0, s.numel, s.data - start) for s in run]
        try:
            fill_run = getattr(fill, "fill_run", None)
            if fill_run is not None:
                fill_run(requests, buf)
            else:
                for s in run:
                    size = itemsize(s.dtype)
                    data = fill(s.item, 0, s.numel)
                    _check_window(data, s.item, 0, s.numel, size, s.dtype)
                    at = s.data - start
                    buf[at:at + s.numel * size] = np.frombuffer(data, dtype=np.uint8)
            view = memoryview(buf)
            digests: list[tuple[Item, str, Sequence[tuple[int, int, str]]]] = []
            for s in run:
                at = s.data - start
                data = view[at:at + s.numel * itemsize(s.dtype)]
                ranges = self._segments.get(s.item)
                if ranges:
                    hasher = ItemHasher(s.item, ranges, on_done=lambda *done: digests.append(done))
                    hasher.update(data)
                    hasher.done()
                else:
                    digests.append((s.item, xxhash.xxh3_128_hexdigest(data), ()))
            self._hashed_many(digests)
        except BaseException:
            self._settle_quietly()
            raise
        self._hand(write, run, view)

    def _hand(self, write: Callable[..., None], *args: Any) -> None:
        """``write(*args)`` (its last argument a window) on the writer thread, once fewer than ``_IN_FLIGHT``
        windows are in flight there; a window under ``_HANDOFF`` bytes here where none is in flight.

        A small window behind windows in flight follows them on the writer thread: waiting for them to end
        (they may be its own tensor's earlier bytes) left the disk idle until the next window was filled. A
        Hugging Face -> Megatron conversion's layer norms did that 86 times: 0.7 s of its 1.9 s waited."""
        if memoryview(args[-1]).nbytes < _HANDOFF and all(f.done() for f in self._pending):
            self.settle()
            write(*args)
            return
        try:
            while len(self._pending) >= _IN_FLIGHT:
                self._pending.popleft().result()
        except BaseException:
            self._settle_quietly()
            raise
        self._pending.append(self._writer().submit(write, *args))

    def _window(self, nbytes: int, at: int | None) -> np.ndarray:
        """The next of the buffers windows are filled in, in turn, as ``nbytes`` bytes (uint8) that lie at ``at``'s
        offset within a page (``at``: the window's offset in its file; None: anywhere).

        ``_IN_FLIGHT + 1`` buffers: the one taken was last handed to the writer at least ``_IN_FLIGHT`` hand-offs
        ago, so its write is done (``_hand`` lets no more be in flight). Each is grown to what a window needs and
        kept: the pages of fresh memory cost more to fault in (0.5 GB/s on a virtual machine) than to fill. Mapped
        anonymously, so page-aligned."""
        self._turn = (self._turn + 1) % len(self._buffers)
        buf = self._buffers[self._turn]
        shift = 0 if at is None else at % _PAGE
        need = shift + nbytes
        if buf is None or len(buf) < need:
            grown = min(2 * len(buf), self.window_bytes + _PAGE) if buf is not None else 0
            size = -(-max(need, grown, 1) // _PAGE) * _PAGE
            buf = self._buffers[self._turn] = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        return buf[shift:need]

    def settle(self) -> None:
        """Wait for the windows in flight, if any, and raise the first failure (once all have ended)."""
        failure = None
        while self._pending:
            e = self._pending.popleft().exception()
            failure = failure or e
        if failure is not None:
            raise failure

    def _settle_quietly(self) -> None:
        while self._pending:
            self._pending.popleft().exception()

    # --- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the writer and sync threads, once their work is done (the session's files are closed by their
        writers; ``flush`` is what reports a failed sync)."""
        self._settle_quietly()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None

    def __enter__(self) -> WriteSession:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:
                self.settle()  # a write failure no file's close reported
        finally:
            self.close()

    # --- internals -------------------------------------------------------------------------------

    def _writer(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-write")
        return self._pool

    def _hashed(self, item: Item, digest: str, ranges: Sequence[tuple[int, int, str]]) -> None:
        self._hashed_many([(item, digest, ranges)])

    def _hashed_many(self, digests: Sequence[tuple[Item, str, Sequence[tuple[int, int, str]]]]) -> None:
        """``_hashed`` of several tensors, in order, under one lock."""
        with self._lock:
            for item, digest, ranges in digests:
                self._item_digests[item] = digest
                label = str(item) if ranges or self.journal is not None else None
                for lo, hi, d in ranges:
                    self._segment_digests[(label, lo, hi)] = d
                if self.journal is not None:
                    self._pending_items[label] = digest
                    self._pending_segments += [[label, lo, hi, d] for lo, hi, d in ranges]

    def _closed(self, path: Path, size: int, digest: str) -> None:
        entry = None
        with self._lock:
            self._digests[str(path.absolute())] = digest
            if self.journal is not None and path.absolute().is_relative_to(self.journal):
                entry = {"file": str(path.absolute().relative_to(self.journal)), "bytes": size, FILE_HASH: digest,
                         "tensors": dict(self._pending_items), "segments": list(self._pending_segments)}
                self._pending_items.clear()
                self._pending_segments.clear()
            if self.sync_behind:
                if self._syncer is None:  # one thread: files reach the journal in the order they were closed
                    self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-sync")
                self._syncs.append(self._syncer.submit(self._synced, path, entry, True))
                return
        self._synced(path, entry, False)  # close fsynced it

    def _part_closed(self, path: Path, size: int, digest: None) -> None:
        """A worker's part of a split file: synced, never journaled (the parent journals the whole file); the
        tensors streamed into it go with the part, not with the next file's journal entry."""
        with self._lock:
            self._pending_items.clear()
            self._pending_segments.clear()
            if self.sync_behind:
                if self._syncer is None:
                    self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-sync")
                self._syncs.append(self._syncer.submit(sync_file, path))

    def _synced(self, path: Path, entry: dict | None, sync: bool) -> None:
        if sync:
            sync_file(path)
        if entry is not None:
            _append_line(self.journal / JOURNAL, json.dumps(entry, separators=(",", ":")), path)


def _append_line(journal: Path, line: str, what: Path) -> None:
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one append per entry: concurrent writers never interleave within a line
        os.fsync(fd)
    except OSError as e:
        raise CheckpointFormatError(f"{journal}: cannot record {what.name} ({e.strerror})") from None
    finally:
        os.close(fd)


def _check_window(data, item: Item, lo: int, hi: int, size: int, dtype: str) -> None:
    got = memoryview(data).nbytes
    if got != (hi - lo) * size:
        raise CheckpointFormatError(
            f"fill returned {got} bytes for elements [{lo}, {hi}) of {item}, expected {(hi - lo) * size} ({dtype})")
