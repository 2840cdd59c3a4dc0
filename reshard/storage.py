"""Output files: positioned writes, fsync on close, and the checksum of the final bytes taken as they are written.

Every format writer creates its tensor files through ``OutputFile``. A writer
lays a file out first (headers, placeholders) and then streams tensor bytes in
file order, so the checksum (xxh3-128 of the whole file, ``file_digest``) is
taken from the bytes as they pass: a write that starts where the checksummed
prefix ends is hashed from memory, and the small pieces written ahead of it
(headers, descriptors) are read back from the page cache when the prefix
reaches them. Only a file written out of that order is read back whole at
``close``. The manifest gets the checksum without a second pass over the output.

``close`` fsyncs; a failed write raises ``CheckpointFormatError`` naming the
file and the reason (disk full, permission), and ``abort`` removes the file.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path

import xxhash

from reshard.errors import CheckpointFormatError

__all__ = ["HASH", "ItemHasher", "OutputFile", "file_digest", "take_digest", "take_item_digests"]

HASH = "xxh3_128"
"""The manifest's checksum: xxh3-128 of a file's bytes, as hex."""

_CHUNK = 8 << 20
_digests: dict[str, str] = {}
_item_digests: dict[object, str] = {}


def file_digest(path: str | Path) -> str:
    """xxh3-128 of a file's bytes, as hex."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def take_digest(path: str | Path) -> str | None:
    """The checksum ``OutputFile.close`` took of ``path`` in this process, if it wrote it (and forget it)."""
    return _digests.pop(str(Path(path).absolute()), None)


def take_item_digests() -> dict[object, str]:
    """The checksums ``ItemHasher`` took of each stored tensor written in this process (and forget them)."""
    out = dict(_item_digests)
    _item_digests.clear()
    return out


class ItemHasher:
    """xxh3-128 of one stored tensor's bytes, fed window by window as a writer streams them."""

    def __init__(self, item: object) -> None:
        self.item = item
        self._hash = xxhash.xxh3_128()

    def update(self, data) -> None:
        self._hash.update(data)

    def done(self) -> str:
        digest = self._hash.hexdigest()
        _item_digests[self.item] = digest
        return digest


class OutputFile:
    """A file written at byte offsets whose checksum is taken while it is written.

    Args:
      path: the file to create (replaced if it exists).
      size: if given, the file is sized up front (its unwritten bytes read as zeros).
    """

    def __init__(self, path: str | Path, size: int | None = None) -> None:
        self.path = Path(path)
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise CheckpointFormatError(f"{self.path}: cannot create ({e.strerror})") from None
        self.size = 0
        self.digest: str | None = None
        self._hash = xxhash.xxh3_128()
        self._done = 0  # bytes [0, _done) are in the hash
        self._ahead: list[tuple[int, int]] = []  # written ranges past _done, not yet hashed
        self._rehash = False  # a write landed in the hashed prefix: hash the whole file at close
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
        at, rest = offset, view
        try:
            while rest:
                n = os.pwrite(self._fd, rest, at)
                rest, at = rest[n:], at + n
        except OSError as e:
            raise CheckpointFormatError(f"{self.path}: cannot write {len(view)} bytes at byte {offset} "
                                        f"({e.strerror})") from None
        end = offset + len(view)
        self.size = max(self.size, end)
        if self._rehash or not view:
            return
        if offset < self._done:
            self._rehash = True
            return
        if offset > self._done:
            self._catch_up(offset)
        if offset == self._done:
            self._hash.update(view)
            self._done = end
        else:
            bisect.insort(self._ahead, (offset, end))

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

    def _read_into_hash(self, a: int, b: int, h: xxhash.xxh3_128 | None = None) -> None:
        h = h or self._hash
        rfd = os.open(self.path, os.O_RDONLY)
        try:
            while a < b:
                chunk = os.pread(rfd, min(_CHUNK, b - a), a)
                if not chunk:  # past the end: the file is shorter than its writes said
                    raise CheckpointFormatError(f"{self.path}: ends at byte {a}, expected {b}")
                h.update(chunk)
                a += len(chunk)
                self.read_back += len(chunk)
        finally:
            os.close(rfd)

    def close(self, *, sync: bool = True) -> str:
        """Fsync, close and return the checksum of the file's bytes."""
        if self._fd is None:
            if self.digest is None:
                raise CheckpointFormatError(f"{self.path}: closed after a failed write")
            return self.digest
        try:
            if self._rehash:
                self._hash = xxhash.xxh3_128()
                self._read_into_hash(0, self.size)
            else:
                self._catch_up(self.size)
                if self._done < self.size:  # holes (zeros) and anything left ahead
                    self._read_into_hash(self._done, self.size)
            if sync:
                os.fsync(self._fd)
        except OSError as e:
            self.abort()
            raise CheckpointFormatError(f"{self.path}: cannot finish ({e.strerror})") from None
        except BaseException:
            self.abort()
            raise
        fd, self._fd = self._fd, None
        os.close(fd)
        self.digest = self._hash.hexdigest()
        _digests[str(self.path.absolute())] = self.digest
        return self.digest

    def abort(self) -> None:
        """Close and remove the file."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
            self.path.unlink(missing_ok=True)
