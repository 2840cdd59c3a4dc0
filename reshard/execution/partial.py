"""Where a conversion's output is built, and how it becomes the destination or resumes.

A conversion writes into a hidden sibling of the destination,
``.{name}.reshard-partial``, holding an exclusive lock on it. First it writes
``.reshard-resume.json``: what is being converted (source, options, a digest of
the plan) and each source file's size and mtime. Every output file, once fsynced,
gets a line in the journal (``reshard.io.storage``). Last come the manifest, then
the journal and header are removed and the directory is renamed onto the
destination in one ``rename``. So at any instant the destination either does not
exist or is complete with its manifest; a kill anywhere leaves at most the
partial directory.

``resume`` picks the partial directory up: the header must match the new
conversion exactly, journaled files are kept when their size and checksum still
verify, and everything else in it is removed and written again.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.io.smallfiles import read_json
from reshard.io.checksum import FILE_HASH, file_digest
from reshard.io.storage import JOURNAL, read_journal

__all__ = ["HEADER", "Partial", "partial_path"]

HEADER = ".reshard-resume.json"


def partial_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.reshard-partial"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Partial:
    """The partial directory of one conversion to ``dst``, locked while this object lives.

    Args:
      dst: the destination directory.
      header: what identifies the conversion (JSON-able); a resumed one must match it.
      resume: continue from an interrupted conversion's partial directory if there is one;
        without it, such a directory is an error that says to resume or remove it.
      manifest: the manifest's file name, written last.
    """

    def __init__(self, dst: Path, header: Mapping[str, Any], *, resume: bool, manifest: str) -> None:
        self.dst = dst
        self.manifest = manifest
        self.path = partial_path(dst)
        self.kept: dict[str, dict[str, Any]] = {}
        """Journaled files that verified, by path relative to the directory: the journal entries."""
        self.tensors: dict[str, str] = {}
        """Checksums of stored tensors the journal recorded, by item label."""
        self.segments: dict[tuple[str, int, int], str] = {}
        """Checksums of tensors held inside items the journal recorded, by (item label, first byte, end byte)."""
        self.complete = False
        """The directory already holds a finished conversion (killed before its rename)."""
        existed = self.path.exists()
        if not existed:
            self.path.mkdir(parents=True)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise CheckpointFormatError(f"{dst}: another conversion is writing it (it holds {self.path})") from None
        try:
            if existed:
                self._take_over(dict(header), resume)
            else:
                self._start(dict(header))
        except BaseException:
            self.release()
            raise

    def _start(self, header: dict[str, Any]) -> None:
        for p in list(self.path.iterdir()):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        _write_synced(self.path / HEADER, json.dumps(header, indent=1, sort_keys=True) + "\n")
        _fsync_dir(self.path)

    def _take_over(self, header: dict[str, Any], resume: bool) -> None:
        if not resume:
            raise CheckpointFormatError(
                f"{self.dst}: an interrupted conversion left {self.path}; rerun with --resume (resume=True) to "
                f"continue it, or remove it")
        old = read_json(self.path / HEADER) if (self.path / HEADER).exists() else None
        if old is not None and not isinstance(old, dict):
            raise CheckpointFormatError(f"{self.path / HEADER}: not a resume header; remove {self.path} to start over")
        if old is None:
            if (self.path / self.manifest).exists():
                # killed between removing the journal and the rename: the manifest decides
                self.complete = True
                return
            self._start(header)  # killed before the header was written: nothing to keep
            return
        changed = [k for k in sorted(header.keys() | old.keys()) if header.get(k) != old.get(k)]
        if changed:
            what = {"source_files": "the source files changed (size or mtime)", "plan": "the plan differs"}
            reasons = [what.get(k, f"{k} differs ({json.dumps(old.get(k))} then, {json.dumps(header.get(k))} now)")
                       for k in changed]
            raise CheckpointFormatError(f"{self.dst}: cannot resume the conversion in {self.path}: "
                                        f"{'; '.join(reasons)}; remove it to start over")
        entries = read_journal(self.path)
        for e in entries:
            self.tensors.update({str(k): str(v) for k, v in e["tensors"].items()})
            for seg in e.get("segments") or ():
                if isinstance(seg, list) and len(seg) == 4 and all(isinstance(x, int) for x in seg[1:3]):
                    self.segments[(str(seg[0]), seg[1], seg[2])] = str(seg[3])
        # only files inside the directory: an entry naming another path is not one this conversion wrote
        latest = {e["file"]: e for e in entries if e["file"] and not Path(e["file"]).is_absolute()
                  and ".." not in Path(e["file"]).parts and "\0" not in e["file"]}
        for rel, e in latest.items():
            f = self.path / rel
            if f.is_file() and not f.is_symlink() and f.stat().st_size == e["bytes"] and file_digest(f) == e[FILE_HASH]:
                self.kept[rel] = e
        keep = set(self.kept) | {HEADER, JOURNAL}
        for p in sorted(self.path.rglob("*"), key=lambda p: -len(p.parts)):
            rel = str(p.relative_to(self.path))
            if p.is_dir() and not p.is_symlink():
                if not any(p.iterdir()):
                    p.rmdir()
            elif rel not in keep:
                p.unlink()
        # the journal from now on: the kept files, the first carrying every tensor checksum recorded so far
        # (a file's tensors may have been journaled with another file's entry), so another kill loses none
        kept = [dict(e) for e in self.kept.values()]
        if kept:
            kept[0]["tensors"] = dict(self.tensors)
            kept[0]["segments"] = [[label, lo, hi, d] for (label, lo, hi), d in self.segments.items()]
        lines = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in kept)
        _write_synced(self.path / (JOURNAL + ".new"), lines)
        os.replace(self.path / (JOURNAL + ".new"), self.path / JOURNAL)
        _fsync_dir(self.path)

    def commit(self, manifest_text: str | None) -> None:
        """Write the manifest (None: it is already there), drop the journal and header, and rename onto
        ``dst`` (an empty directory there is replaced)."""
        _sync_tree(self.path)  # the small files writers wrote plainly too: configs, trackers, indexes
        if manifest_text is not None:
            _write_synced(self.path / self.manifest, manifest_text)
        for name in (JOURNAL, HEADER):
            (self.path / name).unlink(missing_ok=True)
        _fsync_dir(self.path)
        if self.dst.exists():
            self.dst.rmdir()  # empty, checked before
        os.replace(self.path, self.dst)
        _fsync_dir(self.dst.parent)

    def abandon(self) -> None:
        """Remove the directory: the conversion failed in a way resuming would not mend."""
        shutil.rmtree(self.path, ignore_errors=True)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _sync_tree(root: Path) -> None:
    """Fsync every file and directory under ``root`` (cheap for those already synced), so that what the
    rename publishes is on disk before it, not only in the page cache."""
    for top, dirs, files in os.walk(root):
        for name in files:
            fd = os.open(Path(top) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(top))


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
