"""Checkpoints in object storage: a URL (``s3://bucket/ckpt``, ``gs://...``) read through fsspec, one range
request per read.

``as_path`` turns what a user names as a source into what the readers take: a local ``pathlib.Path`` for a
local path or a ``file://`` URL (read as before, with positioned reads on descriptors), or a ``UrlPath`` for
any other fsspec URL. ``UrlPath`` is the part of ``pathlib.Path`` the checkpoint readers use (``/``, ``name``,
``stem``, ``parent``, ``is_file``, ``is_dir``, ``exists``, ``iterdir``, ``glob``, ``open("rb")``, ``read_bytes``,
``stat``, ``relative_to``), and ``read_range`` is its one way to fetch bytes: each call is one ranged GET of
exactly the bytes asked for, with no read-ahead, so what a reader reads is what is transferred.
``UrlPath.open`` gives a ``RemoteFile`` whose reads are such range requests too, and ``read_at`` reads bytes at
an offset of either kind of path (a positioned read of a local file). Every format's reader takes either.

Credentials and endpoints are the filesystem's own (for S3: the usual ``AWS_*`` variables, or fsspec's
``FSSPEC_S3_ENDPOINT_URL``-style settings).
"""

from __future__ import annotations

import fnmatch
import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any

from reshard.errors import CheckpointFormatError

__all__ = ["RemoteFile", "UrlPath", "as_path", "file_size", "is_url", "pread", "read_at"]


def is_url(path: object) -> bool:
    """Whether ``path`` names a location in object storage (a ``UrlPath``, or a ``scheme://`` string other
    than ``file://``)."""
    if isinstance(path, UrlPath):
        return True
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def as_path(path: str | os.PathLike | UrlPath) -> Path | UrlPath:
    """A local ``Path``, or a ``UrlPath`` for an fsspec URL; ``file://`` URLs are local paths."""
    if isinstance(path, UrlPath):
        return path
    if isinstance(path, str) and path.startswith("file://"):
        return Path(path[len("file://"):])
    if is_url(path):
        return UrlPath.from_url(path)
    return Path(path)


@dataclass(frozen=True, slots=True)
class UrlPath:
    """A file or directory in object storage: an fsspec filesystem and a path in it."""

    fs: Any
    """The fsspec filesystem (picklable, so worker processes read through it too)."""
    path: str
    """The path inside ``fs``, without the protocol (``bucket/ckpt/model.safetensors``)."""

    @classmethod
    def from_url(cls, url: str) -> UrlPath:
        try:
            from fsspec.core import url_to_fs
        except ImportError:
            raise CheckpointFormatError(f"{url}: reading a URL needs the fsspec package and the filesystem "
                                        "for its scheme (e.g. s3fs for s3://)") from None
        try:
            fs, path = url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise CheckpointFormatError(f"{url}: no filesystem for this URL ({e})") from None
        return cls(fs, path.rstrip("/"))

    # --- the pathlib surface -------------------------------------------------------------------------------
    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)

    def __repr__(self) -> str:
        return f"UrlPath({str(self)!r})"

    def __lt__(self, other: UrlPath) -> bool:
        return str(self) < str(other)

    def __truediv__(self, other: str | os.PathLike) -> UrlPath:
        rel = PurePosixPath(os.fspath(other))
        if rel.is_absolute() or ".." in rel.parts:
            raise CheckpointFormatError(f"{self}: '{rel}' is not a path inside it")
        return UrlPath(self.fs, f"{self.path}/{rel}" if str(rel) != "." else self.path)

    def joinpath(self, *parts: str | os.PathLike) -> UrlPath:
        out = self
        for p in parts:
            out = out / p
        return out

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def stem(self) -> str:
        return PurePosixPath(self.path).stem

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.path).suffix

    @property
    def parent(self) -> UrlPath:
        """The directory holding this one; the top of the store (a bucket) is its own parent, as ``/`` is."""
        parent = str(PurePosixPath(self.path).parent)
        return self if parent == "." else UrlPath(self.fs, parent)

    @property
    def parents(self) -> list[UrlPath]:
        return [UrlPath(self.fs, str(p)) for p in PurePosixPath(self.path).parents if str(p) != "."]

    def relative_to(self, other: UrlPath) -> PurePosixPath:
        if not isinstance(other, UrlPath) or other.fs != self.fs:
            raise ValueError(f"{self} is not in {other}")
        return PurePosixPath(self.path).relative_to(other.path)

    def is_relative_to(self, other: object) -> bool:
        return (isinstance(other, UrlPath) and other.fs == self.fs
                and PurePosixPath(self.path).is_relative_to(other.path))

    def resolve(self) -> UrlPath:
        return self

    def _info(self) -> dict | None:
        try:
            return self.fs.info(self.path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointFormatError(f"{self}: cannot look up ({e})") from None

    def exists(self) -> bool:
        return self._info() is not None

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "file"

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def is_symlink(self) -> bool:
        return False

    def glob(self, pattern: str) -> list[UrlPath]:
        """The entries of this directory whose names match ``pattern`` (one level, ``fnmatch`` rules)."""
        return [p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)]

    def iterdir(self) -> list[UrlPath]:
        try:
            names = self.fs.ls(self.path, detail=False)
        except OSError as e:
            raise CheckpointFormatError(f"{self}: cannot list ({e})") from None
        return [UrlPath(self.fs, n.rstrip("/")) for n in names if n.rstrip("/") != self.path]

    def stat(self) -> SimpleNamespace:
        """``st_mode``, ``st_size`` and ``st_mtime_ns`` (from the store's last-modified time, else 0)."""
        info = self._info()
        if info is None:
            raise FileNotFoundError(f"{self}: no such file")
        mode = stat.S_IFREG if info.get("type") == "file" else stat.S_IFDIR
        modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
        mtime_ns = int(modified.timestamp() * 1e9) if hasattr(modified, "timestamp") else 0
        return SimpleNamespace(st_mode=mode, st_size=int(info.get("size") or 0), st_mtime_ns=mtime_ns)

    def size(self) -> int:
        return self.stat().st_size

    def open(self, mode: str = "rb") -> RemoteFile:
        if mode != "rb":
            raise CheckpointFormatError(f"{self}: object storage sources are read-only (mode {mode!r})")
        return RemoteFile(self, self.size())

    def read_bytes(self) -> bytes:
        with self.open() as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    # --- bytes ---------------------------------------------------------------------------------------------
    def read_range(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)``: one range request."""
        if length <= 0:
            return b""
        try:
            return self.fs.cat_file(self.path, start=offset, end=offset + length)
        except FileNotFoundError:
            raise CheckpointFormatError(f"{self}: no such file") from None
        except OSError as e:
            raise CheckpointFormatError(f"{self}: cannot read {length} bytes at byte {offset} ({e})") from None


class RemoteFile(io.RawIOBase):
    """A ``UrlPath`` opened for reading: ``read``/``seek`` and positioned ``pread``, each read one range request."""

    def __init__(self, path: UrlPath, size: int) -> None:
        super().__init__()
        self.path = path
        self.size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        data = self.pread(end - self._pos, self._pos) if end > self._pos else b""
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

    def pread(self, length: int, offset: int) -> bytes:
        length = min(length, self.size - offset)
        return self.path.read_range(offset, length) if length > 0 else b""


def file_size(f: Any) -> int:
    """The size of an open file: a local one's (``fstat``) or a ``RemoteFile``'s."""
    return f.size if isinstance(f, RemoteFile) else os.fstat(f.fileno()).st_size


def pread(f: Any, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset`` of a descriptor, a local file object or a ``RemoteFile``."""
    if isinstance(f, RemoteFile):
        return f.pread(length, offset)
    return os.pread(f if isinstance(f, int) else f.fileno(), length, offset)


def read_at(path: Path | UrlPath, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of a file (fewer where it ends first): a positioned read of a local file,
    one range request of one in object storage."""
    if isinstance(path, UrlPath):
        return path.read_range(offset, length)
    with open(path, "rb", buffering=0) as f:
        return os.pread(f.fileno(), length, offset)
