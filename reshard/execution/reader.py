"""``ByteReader``: the whole read surface of a conversion or a load, every byte and every read call counted.

Positioned reads (``os.preadv``) on descriptors kept open, so that windows filled on several threads never
share a file position; a file in object storage (``reshard.io.location.UrlPath``) is read with one range
request per read.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from reshard.errors import CheckpointFormatError
from reshard.io.location import UrlPath

__all__ = ["IOV_MAX", "ByteReader"]

IOV_MAX = 1024
"""Buffers one vectored read takes (Linux's IOV_MAX; POSIX guarantees 16)."""


class ByteReader:
    """Reads byte ranges of files and counts them; the whole read surface.

    Paths are kept open (a checkpoint has a bounded number of files) and read
    with ``os.preadv`` so concurrent windows never share a file position. A
    file in object storage (``reshard.io.location.UrlPath``) is read with one
    range request per read.
    ``bytes_read`` (every byte read, gaps read through included), ``gap_bytes``
    (those of them read only to skip a gap between needed ones, as the caller
    says) and ``reads`` (read calls) add up across threads.
    """

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.gap_bytes = 0
        self.reads = 0

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        with self._lock:  # two threads opening one path keep one descriptor
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise CheckpointFormatError(f"{path}: cannot open ({e.strerror})") from None
                self._fds[path] = fd
            return fd

    def read_into(self, path: Path, offset: int, out: memoryview, gaps: int = 0) -> None:
        """Fill ``out`` with the bytes of ``path`` from byte ``offset`` on; ``gaps`` of them are read only to skip
        gaps between the bytes needed."""
        if isinstance(path, UrlPath) or offset < 0:
            self.read_vectored(path, offset, [out], gaps)
            return
        try:  # one call, most often: a small tensor read whole
            n = os.preadv(self._fd(path), [out], offset)
        except (OSError, OverflowError):
            n = 0  # read_vectored says what went wrong
        if n != len(out):
            self.read_vectored(path, offset + n, [out[n:]])  # the rest, or the error
        with self._lock:
            self.bytes_read += n
            self.gap_bytes += gaps
            self.reads += 1

    def read_vectored(self, path: Path, offset: int, buffers: list[memoryview], gaps: int = 0) -> None:
        """Fill ``buffers``, in order, with the consecutive bytes of ``path`` from byte ``offset`` on; ``gaps`` of
        them are read only to skip gaps between the bytes needed (the discard buffer's)."""
        if offset < 0:
            raise CheckpointFormatError(f"{path}: a read at byte {offset}, before the file's start")
        if isinstance(path, UrlPath):
            self._read_url(path, offset, buffers, gaps)
            return
        fd = self._fd(path)
        total = sum(len(b) for b in buffers)
        done, calls, k = 0, 0, 0
        while k < len(buffers):
            batch = buffers[k:k + IOV_MAX]
            want = sum(len(b) for b in batch)
            try:
                n = os.preadv(fd, batch, offset + done)
            except (OSError, OverflowError) as e:  # an offset past what the OS can address
                raise CheckpointFormatError(f"{path}: cannot read {total - done} bytes at byte {offset + done} "
                                            f"({getattr(e, 'strerror', None) or e})") from None
            calls += 1
            if n == 0 and want:
                raise CheckpointFormatError(f"{path}: file ends at byte {offset + done}, expected {total - done} more bytes")
            done += n
            if n == want:
                k += len(batch)
                continue
            for b in batch:  # a short read: go on from inside the buffer it stopped in
                if n < len(b):
                    buffers = [b[n:], *buffers[k + 1:]]
                    k = 0
                    break
                n -= len(b)
                k += 1
        with self._lock:
            self.bytes_read += total
            self.gap_bytes += gaps
            self.reads += calls

    def _read_url(self, path: UrlPath, offset: int, buffers: list[memoryview], gaps: int) -> None:
        """One range request for the consecutive bytes of ``buffers``, placed in them in order."""
        total = sum(len(b) for b in buffers)
        data = memoryview(path.read_range(offset, total))
        if len(data) != total:
            raise CheckpointFormatError(f"{path}: file ends at byte {offset + len(data)}, expected "
                                        f"{total - len(data)} more bytes")
        at = 0
        for b in buffers:
            b.cast("B")[:] = data[at:at + len(b)]
            at += len(b)
        with self._lock:
            self.bytes_read += total
            self.gap_bytes += gaps
            self.reads += 1

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> ByteReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
