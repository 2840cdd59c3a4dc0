"""The manifest a conversion writes last (``reshard.json``): every file's size and checksum, the per-tensor
checksums the writers took, and the logical tensors' checksums; and checking a checkpoint against it."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.core.dtypes import itemsize
from reshard.core.layout import Item, Layout
from reshard.errors import CheckpointFormatError
from reshard.io.bounds import brief
from reshard.io.fields import expect_int
from reshard.io.smallfiles import read_json
from reshard.io.checksum import FILE_HASH, HASH, file_digest, plain_digest

__all__ = ["MANIFEST", "VerifyResult", "file_record", "logical_digests", "logical_sources", "read_manifest",
           "segments_of", "tensor_digests", "verify_manifest"]

MANIFEST = "reshard.json"


@dataclass(frozen=True, slots=True)
class VerifyResult:
    identical: bool
    compared: int
    """Logical tensors (per state) compared."""
    differences: tuple[str, ...] = field(default=())
    by_checksum: int = 0
    """Of those, the ones compared by the logical checksums both manifests carry, without reading them."""

    def __bool__(self) -> bool:
        return self.identical


def tensor_digests(digests: Mapping[Item, str], dst_files: Mapping[Item, Path]) -> dict[str, dict[str, str]]:
    """The per-tensor checksums the writers took, by destination file."""
    out: dict[str, dict[str, str]] = {}
    by_path: dict[int, dict[str, str]] = {}  # by the Path object's id: a file's items share one, mostly
    for item, digest in digests.items():
        path = dst_files.get(item)
        if path is not None:
            per = by_path.get(id(path))
            if per is None:
                per = by_path[id(path)] = out.setdefault(str(path), {})
            per[str(item)] = digest
    return out

def logical_sources(layout: Layout, dtypes: Mapping[Item, str]) -> dict[tuple[str, str], list[tuple[Item, int, int | None]]]:
    """Where the destination holds each logical tensor row-major in one piece, by (tensor, state): per
    copy, the item and the byte range of it (``None`` for the end: the whole item is the tensor). Tensors
    stored in pieces (split over ranks, or interleaved like a fused qkv) are left out."""
    tensors, infos = layout.tensors, layout.items
    views: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}  # view -> its row-major strides, numel
    out: dict[tuple[str, str], list[tuple[Item, int, int | None]]] = {}
    pieced: set[tuple[str, str]] = set()
    for f in layout.fragments:
        key = (f.tensor, f.state)
        if pieced and key in pieced:
            continue
        t = tensors[f.tensor]
        view = t.view
        known = views.get(view)
        if known is None:
            known = views[view] = (_row_major(view), math.prod(view))
        strides, numel = known
        box = f.box
        if t.blob or f.fill or any(box.offsets) or box.lengths != view or (f.strides != strides
                                                                           and not _row_major_whole(f, view)):
            pieced.add(key)
            out.pop(key, None)
            continue
        item, offset = f.item, f.offset
        if offset == 0 and (infos[item].shape == view or infos[item].numel == numel):
            place = (item, 0, None)
        else:
            size = itemsize(dtypes[item])
            place = (item, offset * size, (offset + numel) * size)
        places = out.get(key)
        if places is None:
            out[key] = [place]
        else:
            places.append(place)
    return out

def _row_major(view: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of ``view`` laid out row-major in one piece."""
    strides, step = [], 1
    for n in reversed(view):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))

def _row_major_whole(f, view: tuple[int, ...]) -> bool:
    """The fragment is the whole tensor, laid out row-major from ``f.offset`` on (strides of axes of one element
    aside)."""
    if any(f.box.offsets) or f.box.lengths != view:
        return False
    step = 1
    for n, stride in zip(reversed(f.box.lengths), reversed(f.strides)):
        if n > 1 and stride != step:
            return False
        step *= n
    return True

def segments_of(sources: Mapping[tuple[str, str], list[tuple[Item, int, int | None]]]) -> dict[Item, list[tuple[int, int]]]:
    """The byte ranges inside items the writers checksum on their own: tensors held in part of an item."""
    out: dict[Item, list[tuple[int, int]]] = defaultdict(list)
    for places in sources.values():
        for item, lo, hi in places:
            if hi is not None:
                out[item].append((lo, hi))
    return dict(out)

def logical_digests(dtypes: Mapping[Item, str], sources, tensors: Mapping[str, Mapping[str, str]],
                     segments: Mapping[tuple[str, int, int], str]) -> dict[str, dict[str, Any]]:
    """Checksums of logical tensors, by state and tensor: the xxh3-128 of the tensor's bytes in row-major
    order (what hashing ``tensor.contiguous()`` gives), with its dtype.

    For a tensor the destination holds row-major in one piece (every copy of it, when replicated): the
    checksum of its item, or of its byte range inside the item, both taken while writing. Tensors stored
    in pieces are left out; ``verify`` compares those by value.
    """
    digests: dict[str, str] = {}
    for per_file in tensors.values():
        digests.update(per_file)
    out: dict[str, dict[str, Any]] = defaultdict(dict)
    for (name, state), places in sorted(sources.items()):
        if len(places) == 1:  # most tensors: no replica to agree with
            item, lo, hi = places[0]
            dtype, digest = dtypes[item], digests.get(str(item)) if hi is None else segments.get((str(item), lo, hi))
            if digest is not None and dtype is not None:
                out[state][name] = {"dtype": dtype, HASH: digest}
            continue
        found = {(dtypes[item],
                  digests.get(str(item)) if hi is None else segments.get((str(item), lo, hi)))
                 for item, lo, hi in places}
        if len(found) == 1 and None not in next(iter(found)):
            dtype, digest = found.pop()
            out[state][name] = {"dtype": dtype, HASH: digest}
    return dict(out)

def file_record(path: Path, digest: str | None = None) -> dict[str, Any]:
    """A manifest entry: size and checksum (``FILE_HASH``), the one taken while writing if given, else read from
    the file."""
    return {"bytes": path.stat().st_size, FILE_HASH: digest or file_digest(path)}

def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, every field of the types a conversion writes: ``files``
    (relative path -> ``bytes``, checksum, optional per-tensor checksums) and optional ``logical`` (state ->
    tensor -> dtype and checksum). CheckpointFormatError naming the field otherwise."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointFormatError(f"{manifest_path}: no manifest; give a second checkpoint to compare with")
    manifest = read_json(manifest_path)

    def bad(field: str, value: Any, expected: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{manifest_path}: not a reshard manifest: {field} is {brief(value, 60)}, "
                                     f"expected {expected}")

    def strings(value: Any, field: str) -> dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise bad(field, value, "an object of strings")
        return value

    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise bad("'files'", manifest.get("files") if isinstance(manifest, dict) else manifest, "an object")
    for rel, want in manifest["files"].items():
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts or "\0" in rel:
            raise bad("a file name", rel, "a path inside the checkpoint")
        if not isinstance(want, dict) or not isinstance(want.get(FILE_HASH, want.get(HASH, "")), str):
            raise bad(f"files['{rel}']", want, f"an object with 'bytes' and a '{FILE_HASH}' string")
        expect_int(want.get("bytes"), f"files['{rel}'].bytes", manifest_path)
        strings(want.get("tensors") or {}, f"files['{rel}'].tensors")
    logical = manifest.get("logical")
    if logical is not None and not (isinstance(logical, dict) and all(
            isinstance(per, dict) and all(isinstance(v, dict) and isinstance(v.get("dtype"), str)
                                          and isinstance(v.get(HASH), str) for v in per.values())
            for per in logical.values())):
        raise bad("'logical'", logical, f"state -> tensor -> {{'dtype', '{HASH}'}} strings")
    return manifest

def verify_manifest(path: Path, explain: Callable[[Path, str, Mapping[str, str]], list[str]] | None = None) -> VerifyResult:
    """Check the checkpoint at ``path`` against its manifest; ``explain(path, file, tensor_digests)`` may add
    lines naming what differs inside a file whose checksum does not match."""
    files = read_manifest(path)["files"]
    diffs = []
    for rel, want in sorted(files.items()):
        file = path / rel
        if not file.is_file():
            diffs.append(f"{rel}: missing")
            continue
        size = file.stat().st_size
        if size != want["bytes"]:
            diffs.append(f"{rel}: {size} bytes, the manifest says {want['bytes']}")
            continue
        # manifests written before FILE_HASH record the plain xxh3-128 of each file
        kind = FILE_HASH if FILE_HASH in want else HASH if HASH in want else None
        if kind is None:
            diffs.append(f"{rel}: the manifest has no {FILE_HASH} checksum")
            continue
        got = file_digest(file) if kind == FILE_HASH else plain_digest(file)
        if got != want[kind]:
            diffs.append(f"{rel}: {kind} {got} differs from the manifest's {want[kind]}")
            if explain is not None:
                diffs += explain(path, rel, want.get("tensors") or {})
    listed = set(files) | {MANIFEST}
    extra = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and str(p.relative_to(path)) not in listed)
    diffs += [f"{rel}: not in the manifest" for rel in extra]
    return VerifyResult(identical=not diffs, compared=len(files), differences=tuple(diffs))
