"""Finished checkpoints uploaded to object storage: each file streamed in parts, the manifest last.

A conversion to a URL (``s3://bucket/ckpt``) is assembled in a local directory and then uploaded by
``upload_tree``: every file is read in parts of ``part_size`` bytes and written through the filesystem's own
buffered writer, which for S3 is a multipart upload of parts of that size (at least 5 MiB, as S3 requires) and one
PUT for a smaller file. The manifest (``reshard.json``) goes last, after every other file's size is checked in
the bucket, so a destination holding a manifest holds everything it lists; a failed upload leaves none.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from reshard.errors import CheckpointFormatError
from reshard.io.location import UrlPath

__all__ = ["MIN_PART", "PART_SIZE", "check_empty", "upload_tree"]

MIN_PART = 5 << 20
"""The smallest part S3 takes (all but the last)."""

PART_SIZE = 64 << 20
"""The part size of an upload unless told otherwise."""


def check_empty(dst: UrlPath) -> None:
    """Refuse a destination that holds anything already: a conversion never mixes its files with others."""
    if dst.is_file() or (dst.is_dir() and dst.iterdir()):
        raise CheckpointFormatError(f"{dst}: destination exists and is not empty")


def upload_tree(local: Path, dst: UrlPath, *, last: str, part_size: int = PART_SIZE,
                progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Upload every file under ``local`` to the same relative path under ``dst``, ``last`` (the manifest) after the
    others are in place at their sizes. Returns relative path -> bytes uploaded.

    Raises:
      CheckpointFormatError: a part size below ``MIN_PART``, a file the filesystem refuses, or one whose size in
        the bucket differs from the local file's afterwards (naming it and both sizes).
    """
    if part_size < MIN_PART:
        raise CheckpointFormatError(f"{dst}: an upload part of {part_size} bytes is below the {MIN_PART} bytes "
                                    "object storage takes")
    files = sorted((p for p in local.rglob("*") if p.is_file()),
                   key=lambda p: (p.relative_to(local).as_posix() == last, str(p)))
    sizes: dict[str, int] = {}
    for path in files:
        rel = path.relative_to(local).as_posix()
        remote = dst / rel
        if rel == last:
            for done, size in sizes.items():
                _check_size(dst / done, size)
        try:
            with path.open("rb") as f, dst.fs.open(remote.path, "wb", block_size=part_size) as out:
                while chunk := f.read(part_size):
                    out.write(chunk)
                    if progress:
                        progress(len(chunk))
        except OSError as e:
            raise CheckpointFormatError(f"{remote}: cannot upload {path} ({e})") from None
        sizes[rel] = path.stat().st_size
    if last in sizes:
        _check_size(dst / last, sizes[last])
    return sizes


def _check_size(remote: UrlPath, size: int) -> None:
    remote.fs.invalidate_cache(remote.path)
    if not remote.is_file() or remote.size() != size:
        got = remote.size() if remote.is_file() else "no file"
        raise CheckpointFormatError(f"{remote}: uploaded {size} bytes, the bucket holds {got}")
