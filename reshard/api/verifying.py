"""``verify``: two checkpoints' logical tensors compared bit for bit, or one checked against its manifest."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import xxhash

from reshard.api.planning import open_checkpoint
from reshard.core.dtypes import itemsize
from reshard.errors import CheckpointFormatError, ReshardError
from reshard.execution.executor import ByteReader, SourceReader, uint_dtype
from reshard.execution.manifest import MANIFEST, VerifyResult, read_manifest, verify_manifest
from reshard.formats.base import Source
from reshard.io.checksum import HASH

__all__ = ["VerifyResult", "verify"]


def verify(a: str | Path, b: str | Path | None = None, *, states: tuple[str, ...] | None = None, limit: int = 10,
           sizes: Mapping[str, int] | None = None) -> VerifyResult:
    """Compare the logical tensors of two checkpoints in any layouts and formats, bit for bit.

    With one checkpoint, check it against the manifest (``reshard.json``) its
    conversion wrote: every listed file present with its size and checksum,
    and no other checkpoint file beside them (``compared`` counts files). A
    file whose checksum differs is opened again to name the stored tensors
    that differ from their own checksums.

    Every logical tensor and state the two hold in common is compared. When
    both checkpoints carry a manifest that they still match (each file's
    checksum is checked) and both manifests record the tensor's logical
    checksum, those are compared. Otherwise the tensor is rebuilt from each
    side (one tensor in memory at a time) and compared by value; replicas
    inside one checkpoint must agree too. A tensor or state only one side
    holds is a difference, unless ``states`` restricts the comparison.

    Returns a ``VerifyResult``; ``differences`` name the first differing
    tensors and the first differing position in each.
    """
    if b is None:
        return verify_manifest(Path(a), _tensor_differences)
    sa, sb = open_checkpoint(a, sizes=sizes), open_checkpoint(b, sizes=sizes)
    diffs: list[str] = []
    keys_a, keys_b = _logical_keys(sa, states), _logical_keys(sb, states)
    only: dict[tuple[str, str], list[str]] = defaultdict(list)
    for key in sorted(keys_a.keys() ^ keys_b.keys()):
        only[("first" if key in keys_a else "second", key[1])].append(key[0])
    for (side, state), names in sorted(only.items()):
        what = names[0] if len(names) == 1 else f"{len(names)} logical tensors, e.g. {names[0]}"
        diffs.append(f"{what} [{state}]: only in the {side} checkpoint")
    compared = by_checksum = 0
    common = keys_a.keys() & keys_b.keys()
    sums_a, sums_b = (_manifest_logical(Path(a)), _manifest_logical(Path(b))) if common else ({}, {})
    with ByteReader() as reader:
        for key in sorted(common):
            ta, tb = sa.layout.tensors[key[0]], sb.layout.tensors[key[0]]
            if ta.shape != tb.shape:
                diffs.append(f"{key[0]} [{key[1]}]: shape {ta.shape} != {tb.shape}")
                continue
            if key in sums_a and sums_a.get(key) == sums_b.get(key):
                compared += 1
                by_checksum += 1
                continue
            va = _logical(sa, keys_a[key], reader, diffs)
            vb = _logical(sb, keys_b[key], reader, diffs)
            compared += 1
            if va is None or vb is None:
                continue
            va, vb = va.reshape(ta.shape), vb.reshape(tb.shape)  # the layouts may view the tensor through other axes
            if va.dtype.itemsize != vb.dtype.itemsize:
                diffs.append(f"{key[0]} [{key[1]}]: dtype {_dtype(sa, keys_a[key])} != {_dtype(sb, keys_b[key])}")
                continue
            if not np.array_equal(va, vb):
                pos = tuple(int(i) for i in np.argwhere(va != vb)[0])
                diffs.append(f"{key[0]} [{key[1]}]: first difference at {pos} ({int(np.sum(va != vb))} elements differ)")
            if len(diffs) >= limit + len(only):
                break
    return VerifyResult(identical=not diffs, compared=compared, differences=tuple(diffs[: limit + len(only)]),
                        by_checksum=by_checksum)

def _manifest_logical(path: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """The logical checksums (dtype, digest) by (tensor, state) of the manifest at ``path``, if there is one
    and the checkpoint still matches it file by file; else none."""
    try:
        logical = read_manifest(path).get("logical") if (path / MANIFEST).is_file() else None
        if not logical or not verify_manifest(path):
            return {}
    except CheckpointFormatError:  # a broken manifest: compare by value
        return {}
    return {(name, state): (v["dtype"], v[HASH]) for state, per in logical.items() for name, v in per.items()}

def _tensor_differences(path: Path, rel: str, want: Mapping[str, str]) -> list[str]:
    """Which stored tensors of a file that fails its checksum differ from the manifest's, when the
    checkpoint still opens; else nothing more than the file-level difference."""
    if not want:
        return []
    try:
        src = open_checkpoint(path)
    except ReshardError:
        return ["  (the checkpoint does not open, so its tensors cannot be checked one by one)"]
    out = []
    with ByteReader() as reader:
        for item, loc in src.where.items():
            label = str(item)
            if label not in want or Path(loc.path).resolve() != (path / rel).resolve():
                continue
            h = xxhash.xxh3_128()
            nbytes = src.layout.items[item].numel * itemsize(loc.dtype)
            for lo in range(0, nbytes, 8 << 20):
                buf = bytearray(min(8 << 20, nbytes - lo))
                reader.read_into(Path(loc.path), loc.offset + lo, memoryview(buf))
                h.update(buf)
            if h.hexdigest() != want[label]:
                out.append(f"  tensor {label}: {HASH} {h.hexdigest()} differs from the manifest's {want[label]}")
    return out

def _logical_keys(src: Source, states: tuple[str, ...] | None) -> dict[tuple[str, str], list]:
    out: dict[tuple[str, str], list] = defaultdict(list)
    for f in src.layout.fragments:
        if not f.fill and (states is None or f.state in states) and f.item in src.where:
            out[(f.tensor, f.state)].append(f)
    return out

def _dtype(src: Source, frags: list) -> str:
    return src.where[frags[0].item].dtype

def _logical(src: Source, frags: list, reader: ByteReader, diffs: list[str]) -> np.ndarray | None:
    t = src.layout.tensors[frags[0].tensor]
    dtype = uint_dtype(_dtype(src, frags))
    if sum(math.prod(f.box.lengths) for f in frags) < math.prod(t.view):  # before allocating the tensor
        diffs.append(f"{t.name} [{frags[0].state}]: part of it is stored nowhere in {src.path}")
        return None
    out = np.zeros(t.view, dtype=dtype)
    seen = np.zeros(t.view, dtype=bool)
    fill = SourceReader(src.where, reader)
    for f in frags:
        region = fill.read_region(f.item, f.offset, f.strides, f.box.lengths, dtype)
        sl = tuple(slice(o, o + n) for o, n in zip(f.box.offsets, f.box.lengths))
        already = seen[sl]
        if already.any() and not np.array_equal(out[sl][already], region[already]):
            diffs.append(f"{t.name} [{f.state}]: replicas disagree ({f.item} differs from an earlier copy)")
        out[sl] = region
        seen[sl] = True
    if not seen.all():
        diffs.append(f"{t.name} [{frags[0].state}]: {int((~seen).sum())} elements are stored nowhere in {src.path}")
        return None
    return out
