"""The checkpoint formats reshard reads and writes, by name.

Adapters are imported lazily, so a missing optional dependency of one format
never breaks the others.
"""

from __future__ import annotations

import errno
import importlib
import os
from pathlib import Path

from reshard.errors import CheckpointFormatError
from reshard.formats.base import Format
from reshard.io.location import UrlPath

__all__ = ["FORMATS", "detect_format", "get_format"]

# name -> module; each module defines FORMAT, an object implementing formats.base.Format.
FORMATS = {
    "megatron": "reshard.formats.megatron",
    "deepspeed": "reshard.formats.deepspeed",
    "hf": "reshard.formats.hf",
    "mcore-dist": "reshard.formats.megatron.torch_dist",  # before dcp: a torch_dist directory is also a DCP one
    "mcore-fsdp": "reshard.formats.megatron.fsdp_dtensor",  # before dcp: Megatron-FSDP saves plain DCP
    "dcp": "reshard.formats.dcp",
    "ucp": "reshard.formats.deepspeed.ucp",
}
PLANNED = ()
URL_FORMATS = tuple(FORMATS)
"""The formats read from object storage (an fsspec URL as the source), in detection order: every format."""


def get_format(name: str) -> Format:
    module = FORMATS.get(name)
    if module is None:
        known = ", ".join(FORMATS)
        if name in PLANNED:
            raise CheckpointFormatError(f"format '{name}' is not supported yet (supported: {known})")
        raise CheckpointFormatError(f"unknown format '{name}' (supported: {known})")
    return importlib.import_module(module).FORMAT


def detect_format(path: Path | UrlPath) -> Format:
    """The format of the checkpoint directory ``path`` (local, or in object storage)."""
    if isinstance(path, UrlPath):
        return _detect_url(path)
    if not path.exists():
        if path.is_symlink():
            what = "a symbolic link loop, which cannot be read" if _is_loop(path) else "a symbolic link to nothing"
            raise CheckpointFormatError(f"{path}: {what}")
        raise CheckpointFormatError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: not a directory (a checkpoint is a directory)")
    _check_links(path)
    for name in FORMATS:
        fmt = get_format(name)
        if fmt.detect(path):
            return fmt
    raise CheckpointFormatError(f"{path}: not a checkpoint reshard recognizes (looked for: {', '.join(FORMATS)})")


def _detect_url(path: UrlPath) -> Format:
    """The format of a checkpoint in object storage, detected in the order a local copy's would be."""
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: no such checkpoint directory in object storage")
    for name in URL_FORMATS:
        fmt = get_format(name)
        if fmt.detect(path):
            return fmt
    raise CheckpointFormatError(f"{path}: not a checkpoint reshard recognizes (looked for: {', '.join(URL_FORMATS)})")


def _is_loop(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def _check_links(root: Path) -> None:
    """Refuse a checkpoint directory holding a symbolic link loop: whatever file it stands for cannot be
    read, and saying so beats reporting that file missing. Links are not followed into directories, so a
    link back up the tree is harmless; a link to nothing is left to the format (it may not matter)."""
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(top) / name
            if p.is_symlink() and _is_loop(p):
                raise CheckpointFormatError(f"{p}: a symbolic link loop, which cannot be read")
