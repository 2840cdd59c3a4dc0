"""Output files: positioned writes, fsync on close, and the checksum of the final bytes taken as they are written.

Every format writer creates its tensor files through ``OutputFile``. A writer
lays a file out first (headers, placeholders) and then streams tensor bytes in
file order, so the checksum (``FILE_HASH`` of ``reshard.io.checksum``) is
taken from the bytes as they pass: a write that starts where the checksummed
prefix ends is hashed from memory, and the small pieces written ahead of it
(headers, descriptors) are read back from the page cache when the prefix
reaches them. Only a file written out of that order is read back whole at
``close``. The manifest gets the checksum without a second pass over the output.

Writes of at least 1 MiB go to the disk directly (``O_DIRECT``), their partial pages at either end through the
page cache, where the file system allows it (``OutputFile._write_direct``). A direct write runs on a thread of the
file's own while the caller takes its bytes into the checksum: the disk and the checksum overlap.

``close`` fsyncs (unless its creator syncs the file itself: ``fsync=False``, as the write session does on a
thread of its own, ``sync_file``); a failed write raises ``CheckpointFormatError`` naming the file and the
reason (disk full, permission), and ``abort`` removes the file.

Nothing here keeps state between files: ``close`` hands the file's size and
checksum to the ``on_close`` callback its creator gave (the write session of
``reshard.execution.session``, which keeps the checksums and the resume
journal of one conversion), and ``ItemHasher`` hands a tensor's checksums to
its ``on_done``.
"""

from __future__ import annotations

import bisect
import errno
import json
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from reshard.errors import CheckpointFormatError
from reshard.io.checksum import FILE_HASH, FileHash, PartBlocks, Taken, blocks_digest

__all__ = ["JOURNAL", "FilePart", "ItemHasher", "OutputFile", "ReadBack", "Skip", "read_journal", "sync_file"]

JOURNAL = ".reshard-journal"
"""The journal's file name inside the directory being written."""

_CHUNK = 8 << 20

_DIRECT_MIN = 1 << 20
"""The aligned bytes a write must hold to go to the disk directly (``O_DIRECT``); smaller ones go through the page
cache."""
_ALIGN = 4096
"""The file offsets, lengths and memory addresses a direct write keeps to: a page, a multiple of every block size."""
_BOUNCE = 8 << 20
"""The most bytes of a page-aligned buffer that bytes not aligned in memory are copied into for a direct write (no
more than the largest write needs)."""


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _written(fd: int, view: memoryview, offset: int) -> int:
    """Write ``view`` at ``offset`` through a direct descriptor; the bytes written: all, or fewer where a short
    write ended off a page (the caller writes the rest through the page cache)."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        done += n
        if n == 0 or done % _ALIGN:
            break
    return done


def _read_exactly(fd: int, out: memoryview, offset: int, path: Path) -> None:
    """Fill ``out`` from byte ``offset`` of ``fd``; an error naming ``path`` where the file ends first."""
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if not n:
            raise CheckpointFormatError(f"{path}: ends at byte {offset + got}, expected {offset + len(out)}")
        got += n


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def read_journal(directory: str | Path) -> list[dict]:
    """The entries of the journal in ``directory``, oldest first; a line cut short by a crash is skipped."""
    try:
        text = (Path(directory) / JOURNAL).read_text()
    except FileNotFoundError:
        return []
    entries = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if (isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get(FILE_HASH), str) and isinstance(entry.get("tensors"), dict)):
            entries.append(entry)
    return entries


def sync_file(path: str | Path) -> None:
    """Fsync a closed file's bytes to disk (through a descriptor of its own)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot sync to disk ({e.strerror})") from None


class Skip:
    """Handed to a tensor writer's ``write`` in place of bytes: the next ``nbytes`` of the tensor are another
    process's part of it (a file split inside a tensor), and the writer moves past them, taking no CRC of the
    tensor and writing no descriptor after it."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class ReadBack:
    """Handed to a tensor writer's ``write`` in place of bytes: the next ``nbytes`` of the tensor are in the file
    already (other processes wrote them), and the writer reads them back into ``data``, taking them as written
    (their CRC, the descriptor after the tensor's last byte). ``buffer``: where to read them (at least ``nbytes``,
    reused by the caller), or None for new memory."""

    __slots__ = ("buffer", "data", "nbytes")

    def __init__(self, nbytes: int, buffer: memoryview | None = None) -> None:
        self.nbytes = nbytes
        self.buffer = buffer
        self.data: bytes | memoryview = b""


class ItemHasher:
    """xxh3-128 of one stored tensor's bytes, fed window by window as a writer streams them, and of
    the byte ranges ``ranges`` inside it (each a logical tensor of its own); ``done`` hands them to
    ``on_done(item, digest, [(first byte, end byte, digest), ...])``."""

    def __init__(self, item: object, ranges: Sequence[tuple[int, int]] = (),
                 on_done: Callable[[object, str, list[tuple[int, int, str]]], None] | None = None) -> None:
        self.item = item
        self._on_done = on_done
        self._hash = xxhash.xxh3_128()
        self._ranges = tuple(ranges)
        self._range_hashes = [xxhash.xxh3_128() for _ in self._ranges]
        self._first = 0  # ranges before this one are complete
        self._pos = 0

    def update(self, data) -> None:
        self._hash.update(data)
        if not self._ranges:
            return
        view = memoryview(data).cast("B")
        pos, end = self._pos, self._pos + len(view)
        for k in range(self._first, len(self._ranges)):
            lo, hi = self._ranges[k]
            if lo >= end:
                break
            if hi <= pos:
                self._first = k + 1
                continue
            self._range_hashes[k].update(view[max(lo, pos) - pos:min(hi, end) - pos])
        self._pos = end

    def done(self) -> str:
        digest = self._hash.hexdigest()
        if self._on_done is not None:
            self._on_done(self.item, digest, [(lo, hi, h.hexdigest()) for (lo, hi), h in zip(self._ranges,
                                                                                            self._range_hashes)])
        return digest


class OutputFile:
    """A file written at byte offsets whose checksum is taken while it is written.

    Args:
      path: the file to create (replaced if it exists).
      size: if given, the file is sized up front (its unwritten bytes read as zeros).
      on_close: ``on_close(path, size, checksum)`` once the file is closed: its bytes on disk, or with
        ``fsync=False`` handed to the kernel, for the caller to sync (``sync_file``).
      fsync: whether ``close`` fsyncs the file.
      settle: called first in ``close`` and ``abort``: the write session's wait for a write still in flight on
        its writer thread (``pwrite`` may be called from two threads, for different byte ranges).
      direct: whether writes of 1 MiB or more go to the disk directly (``_write_direct``); False: every write
        through the page cache.
    """

    def __init__(self, path: str | Path, size: int | None = None, *,
                 on_close: Callable[[Path, int, str], None] | None = None, fsync: bool = True,
                 settle: Callable[[], None] | None = None, truncate: bool = True, direct: bool = True) -> None:
        self.path = Path(path)
        self._on_close = on_close
        self._fsync = fsync
        self._settle = settle
        self._lock = threading.Lock()  # the checksum's bookkeeping, for writes from two threads
        try:
            # read and write: pieces written ahead of the checksum are read back through the same descriptor
            flags = os.O_RDWR | os.O_CREAT | (os.O_TRUNC if truncate else 0)
            self._fd: int | None = os.open(self.path, flags, 0o644)
        except OSError as e:
            raise CheckpointFormatError(f"{self.path}: cannot create ({e.strerror})") from None
        self.size = 0
        self.digest: str | None = None
        self._hash = FileHash()
        self._done = 0  # bytes [0, _done) are in the hash
        self._ahead: list[tuple[int, int]] = []  # written ranges past _done, not yet hashed
        self._rehash = False  # a write landed in the hashed prefix: hash the whole file at close
        self._direct: int | bool | None = None if direct else False  # None: not opened yet; False: none
        self._direct_lock = threading.Lock()
        self._bounce: mmap.mmap | None = None
        self._io: ThreadPoolExecutor | None = None  # the thread direct writes run on while their checksum is taken
        self.read_back = 0
        """Bytes read back from the file to checksum it (the pieces written ahead, or all of it)."""
        if size:
            try:
                os.ftruncate(self._fd, size)
            except OSError as e:
                self.abort()
                raise CheckpointFormatError(f"{self.path}: cannot size to {size} bytes ({e.strerror})") from None
            self.size = size

    def pwrite(self, data: bytes | bytearray | memoryview, offset: int) -> None:
        """Write ``data`` at byte ``offset``."""
        if self._fd is None:
            raise CheckpointFormatError(f"{self.path}: write after close")
        view = memoryview(data).cast("B")
        if len(view) < _DIRECT_MIN or self._direct is False:
            self._write(view, offset)
            ahead = self._hashed(view, offset)
        else:  # a direct write leaves the CPU idle while the disk takes the bytes: the checksum is taken meanwhile
            if self._io is None:
                self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-direct")
            writing = self._io.submit(self._write, view, offset)
            try:
                ahead = self._hashed(view, offset)
            finally:
                writing.result()
        if ahead:  # noted once written: the pieces ahead are read back from the file
            with self._lock:
                bisect.insort(self._ahead, (offset, offset + len(view)))

    def _write(self, view: memoryview, offset: int) -> None:
        try:
            if len(view) >= _DIRECT_MIN and self._direct is not False:
                self._write_direct(view, offset)
            else:
                _write_all(self._fd, view, offset)
        except OSError as e:
            raise CheckpointFormatError(f"{self.path}: cannot write {len(view)} bytes at byte {offset} "
                                        f"({e.strerror})") from None

    def _hashed(self, view: memoryview, offset: int) -> bool:
        """Take the bytes of a write into the file's checksum where they follow the checksummed prefix (after the
        pieces written ahead that lead up to them); return whether they lie ahead of it instead."""
        end = offset + len(view)
        with self._lock:
            self.size = max(self.size, end)
            if self._rehash or not view:
                return False
            if offset < self._done:
                self._rehash = True
                return False
            if offset > self._done:
                self._catch_up(offset)
            if offset == self._done:
                self._hash.update(view)
                self._done = end
                return False
            return True

    def _write_direct(self, view: memoryview, offset: int) -> None:
        """Write ``view`` at ``offset``: its whole pages straight to the disk (``O_DIRECT``), bypassing the page
        cache, and the partial pages at either end through it.

        A page-cache write costs the kernel a page of memory per 4 KiB, written back later: on a virtual machine,
        a 2.6 GiB conversion written that way took 1.0 to 4.1 s of system time, with what the memory had held
        before, and written directly 0.6 to 0.7 s (``bench/direct_writes.py``). A page is written one way only, whole by one write, so
        the two ways never overlap. Where the file system refuses direct writes (``EINVAL``), the file goes on
        through the page cache."""
        end = offset + len(view)
        a0, a1 = -(-offset // _ALIGN) * _ALIGN, end // _ALIGN * _ALIGN
        if a1 - a0 < _DIRECT_MIN:
            _write_all(self._fd, view, offset)
            return
        with self._direct_lock:  # one direct write at a time per file: they share the bounce buffer
            direct = self._open_direct()
            if direct is None:
                _write_all(self._fd, view, offset)
                return
            _write_all(self._fd, view[:a0 - offset], offset)
            at = a0
            try:
                at = self._pages(direct, view, offset, a0, a1)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._no_direct()
            _write_all(self._fd, view[at - offset:], at)  # the partial page at the end, or all a refusal left

    def _pages(self, direct: int, view: memoryview, offset: int, a0: int, a1: int) -> int:
        """Write the whole pages ``[a0, a1)`` of ``view`` (which starts at file offset ``offset``) through
        ``direct``; return where it stopped (``a1``, or the first byte a short write left). Bytes not aligned in
        memory go through a page-aligned buffer, ``_BOUNCE`` bytes at a time."""
        pages = view[a0 - offset:a1 - offset]
        if _address(pages) % _ALIGN == 0:  # aligned in memory too: no copy
            return a0 + _written(direct, pages, a0)
        need = min(_BOUNCE, a1 - a0)
        if self._bounce is None or len(self._bounce) < need:  # no larger than the writes: a window at most
            self._bounce = mmap.mmap(-1, need)  # the smaller one is unmapped with its last view
        bounce, at = memoryview(self._bounce), a0
        while at < a1:
            n = min(len(bounce), a1 - at)
            # numpy's copy lets go of the GIL, a memoryview's does not: the thread filling the next window reads on
            np.copyto(np.frombuffer(bounce[:n], dtype=np.uint8), np.frombuffer(pages[at - a0:at - a0 + n], np.uint8))
            done = _written(direct, bounce[:n], at)
            at += done
            if done < n:
                break
        return at

    def _open_direct(self) -> int | None:
        if self._direct is None:
            try:
                self._direct = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
            except (OSError, AttributeError):  # a file system without direct writes; O_DIRECT: Linux and BSDs
                self._direct = False
        return self._direct if type(self._direct) is int else None

    def _no_direct(self) -> None:
        if type(self._direct) is int:
            os.close(self._direct)
        self._direct = False

    def pread(self, length: int, offset: int, into: memoryview | bytearray | None = None) -> memoryview:
        """Bytes ``[offset, offset + length)`` of the file, as written so far (by any process), read into ``into``
        (a buffer of at least ``length`` bytes, reused by the caller) or into new memory."""
        if self._fd is None:
            raise CheckpointFormatError(f"{self.path}: read after close")
        out = memoryview(bytearray(length) if into is None else into).cast("B")[:length]
        try:
            _read_exactly(self._fd, out, offset, self.path)
        except OSError as e:
            raise CheckpointFormatError(f"{self.path}: cannot read {length} bytes at byte {offset} "
                                        f"({e.strerror})") from None
        return out

    def settle(self) -> None:
        """Wait for a write to this file still in flight on another thread (the ``settle`` it was made with);
        raise its failure."""
        if self._settle is not None:
            self._settle()

    def _catch_up(self, upto: int) -> None:
        """Hash the ranges written ahead that now lead up to ``upto``, read back from the file."""
        while self._ahead and self._ahead[0][0] <= self._done < upto:
            a, b = self._ahead.pop(0)
            if b <= self._done:
                continue
            stop = min(b, upto)
            self._read_into_hash(self._done, stop)
            self._done = stop
            if stop < b:
                bisect.insort(self._ahead, (stop, b))

    def _read_into_hash(self, a: int, b: int) -> None:
        """Take bytes ``[a, b)`` of the file into its checksum, read back through one buffer of at most ``_CHUNK``
        bytes: memory made anew for every chunk cost more to fault in than to read (a 2.2 GiB read back, 0.5 M page
        faults)."""
        if a >= b:
            return
        view = memoryview(bytearray(min(_CHUNK, b - a)))
        while a < b:
            chunk = view[:min(len(view), b - a)]
            _read_exactly(self._fd, chunk, a, self.path)  # past the end: the file is shorter than its writes said
            self._hash.update(chunk)
            a += len(chunk)
            self.read_back += len(chunk)

    def close(self) -> str:
        """Fsync (unless made with ``fsync=False``), close and return the checksum of the file's bytes."""
        if self._fd is not None:
            try:
                self.settle()
            except BaseException:
                self.abort()
                raise
        if self._fd is None:
            if self.digest is None:
                raise CheckpointFormatError(f"{self.path}: closed after a failed write")
            return self.digest
        try:
            digest = self._checksum()
            if self._fsync:
                os.fsync(self._fd)
            size = os.fstat(self._fd).st_size
        except OSError as e:
            self.abort()
            raise CheckpointFormatError(f"{self.path}: cannot finish ({e.strerror})") from None
        except BaseException:
            self.abort()
            raise
        fd, self._fd = self._fd, None
        os.close(fd)
        self._close_direct()
        self.digest = digest
        if self._on_close is not None:
            self._on_close(self.path, size, digest)
        return digest

    def _checksum(self) -> str | None:
        """The checksum of the whole file, its bytes not hashed yet read back."""
        if self._rehash:
            self._hash = FileHash()
            self._read_into_hash(0, max(self.size, os.fstat(self._fd).st_size))
        else:
            self._catch_up(self.size)
            if self._done < self.size:  # holes (zeros) and anything left ahead
                self._read_into_hash(self._done, self.size)
        return self._hash.hexdigest()

    def abort(self) -> None:
        """Close and remove the file."""
        if self._fd is not None:
            try:
                self.settle()  # no write may still be using the descriptor
            except BaseException:  # noqa: BLE001 - the file is being removed: its failed write is moot
                pass
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
            self._close_direct()
            self._remove()

    def _close_direct(self) -> None:
        io, self._io = self._io, None
        if io is not None:
            io.shutdown(wait=True)
        self._no_direct()
        bounce, self._bounce = self._bounce, None
        if bounce is not None:
            try:
                bounce.close()
            except BufferError:  # a view of it still held (by a traceback): freed with the last one
                pass

    def _remove(self) -> None:
        self.path.unlink(missing_ok=True)


class FilePart(OutputFile):
    """This process's part of a file that several processes write side by side, each its own stored tensors.

    The file is opened without truncating it (every part sizes it to the same ``size``), and ``abort`` leaves
    it in place (the other parts are still writing it). Each part takes the digests of the whole blocks it writes
    in order (``PartBlocks``: ``blocks``). A part that writes the ``frames`` (headers, the zip central directory:
    whatever depends on every tensor) is the one that finishes the file: it runs after the others, and its
    ``close`` puts the file's checksum together from the blocks the others took (``taken``) and its own, reading
    back only the rest (the blocks at the seams between parts). The others' ``close`` hands ``on_close`` a
    checksum of None.

    Args:
      frames: whether this part writes the file's framing and finishes it.
      crcs: the CRC-32 of each zip record, by the byte offset of its data in the file: for the finishing part,
        those the others wrote; the others add the records they complete (``TorchFileWriter``).
      taken: for the finishing part, what the others took of the file's checksum (each one's
        ``PartBlocks.taken``).
      direct: as ``OutputFile``'s: every part of a file writes the same way.
    """

    def __init__(self, path: str | Path, size: int | None = None, *, frames: bool, crcs: dict[int, int] | None = None,
                 taken: Sequence[Taken] = (), on_close: Callable[[Path, int, str | None], None] | None = None,
                 fsync: bool = True, settle: Callable[[], None] | None = None, direct: bool = True) -> None:
        self.frames = frames
        self.crcs: dict[int, int] = {} if crcs is None else crcs
        self.blocks = PartBlocks()
        self._taken = list(taken)
        # Directly, as a whole file is: through the page cache, two processes writing one file contend for its lock
        # (spinning on it: a tenth of a 2-worker conversion's CPU) and copy every byte into memory, which cost more
        # than the finishing part's read back from the disk (2.61 s against 2.21 s, 2 workers, 2.7 GiB).
        super().__init__(path, None, on_close=on_close, fsync=fsync, settle=settle, truncate=False, direct=direct)
        if size:
            try:
                if os.fstat(self._fd).st_size != size:
                    os.ftruncate(self._fd, size)
            except OSError as e:
                self.abort()
                raise CheckpointFormatError(f"{self.path}: cannot size to {size} bytes ({e.strerror})") from None
            self.size = size

    def _hashed(self, view: memoryview, offset: int) -> bool:
        with self._lock:
            self.size = max(self.size, offset + len(view))
            self.blocks.update(view, offset)
        return False

    def close(self) -> str | None:
        """Fsync (unless made with ``fsync=False``) and close; the finishing part returns the file's checksum, the
        others None."""
        if self._fd is None and not self.frames:
            return None
        return super().close()

    def _checksum(self) -> str | None:
        if not self.frames:
            return None

        def read(offset: int, into: memoryview) -> None:
            _read_exactly(self._fd, into, offset, self.path)

        size = max(self.size, os.fstat(self._fd).st_size)
        digest, self.read_back = blocks_digest(size, [*self._taken, self.blocks.taken()], read)
        return digest

    def _remove(self) -> None:
        pass  # the other parts are still writing it; ``resume`` rewrites it whole
