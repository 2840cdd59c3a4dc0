"""Small files a checkpoint keeps beside its tensors (tracker tags, JSON metadata), read with limits, and
where a stored item's bytes are."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError

__all__ = ["Located", "read_json", "read_tag"]

_TEXT_LIMIT = 4096
_JSON_LIMIT = 256 << 20


@dataclass(frozen=True, slots=True)
class Located:
    """Where one stored item's bytes are: ``numel * itemsize(dtype)`` bytes at ``offset``."""

    path: Path
    offset: int
    """Byte offset of the item's first element in ``path``."""
    dtype: str


def _read_small(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a small regular file (never a FIFO or a device, whose read could block or never end)."""
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: {'not a regular file' if path.exists() else 'no such file'}")
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) > limit:
        raise CheckpointFormatError(f"{path}: more than {limit} bytes, too large for {what}")
    return raw


def read_tag(path: Path, what: str = "checkpoint tag") -> str:
    """The content of a tracker file (``latest``, ``latest_universal``, ...), stripped: a few KiB at most of
    UTF-8 text naming one directory beside it (no '/', no NUL, not '.' or '..'); else CheckpointFormatError."""
    raw = _read_small(path, _TEXT_LIMIT, f"a {what}")
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}), not a {what}") from None
    if not tag or any(c in tag for c in "/\\\0") or tag in (".", ".."):
        raise CheckpointFormatError(f"{path}: not a {what}: {tag[:40]!r}")
    return tag


def read_json(path: Path) -> Any:
    """A JSON file's value; CheckpointFormatError when it cannot be read, is not UTF-8 JSON, is nested too
    deeply or is larger than any metadata file should be."""
    raw = _read_small(path, _JSON_LIMIT, "a JSON metadata file")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # an integer of too many digits; nesting deeper than Python's stack
        raise CheckpointFormatError(f"{path}: not readable JSON ({type(e).__name__}: {str(e)[:80]})") from None
