"""What a checkpoint format provides: reading a source, and writing a target.

A format adapter turns a directory written by a framework into a ``Source``
(its spec, topology, model sizes, the resolved ``Layout`` and, for every
stored item, where its bytes sit in which file), and writes a ``Target``
directory the framework itself can load, pulling each item's bytes from a
``Fill`` callback window by window so no file is ever held in memory whole.

Items are always stored row-major and contiguous: an item's bytes are
``numel * itemsize`` bytes at ``Located.offset`` in ``Located.path``. Copying
is bit-level, so the executor only needs each dtype's item size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from reshard.io.bounds import brief, show
from reshard.core.dtypes import SUPPORTED, itemsize
from reshard.errors import CheckpointFormatError
from reshard.io.smallfiles import Located, read_json, read_tag
from reshard.core.layout import Item, Layout
from reshard.io.storage import ItemHasher
from reshard.core.spec import Spec
from reshard.core.topology import Topology

__all__ = ["LLAMA_SIZES", "MAX_COUNT", "MAX_SIZE", "Fill", "Format", "Located", "Source", "Target",
           "check_sizes", "expect_int", "expect_shape", "expect_step", "given_sizes", "itemsize", "name_of",
           "read_json", "read_tag", "require_sizes", "scalar_value", "stream_item"]

LLAMA_SIZES = ("h", "heads", "g", "hd", "f", "vocab", "layers")
"""The sizes a Llama-style model's specs need."""


# --- what a checkpoint may declare ------------------------------------------------------------------
#
# Every integer a format reads from a checkpoint (a size, a count, a dimension, an offset) goes through
# ``expect_int`` before it drives slicing or a loop: checkpoints are untrusted files, and a wrong number
# must become a message naming the file, the field, the value and the limit, never a traceback, a hang
# or a silently wrong layout.

MAX_SIZE = 1 << 48
"""Largest model size, tensor dimension or element count a checkpoint may declare (a 1 PiB fp32 tensor)."""
MAX_COUNT = 1 << 16
"""Most layers, experts or ranks along one parallel axis a checkpoint may declare, unless the files tell
a tighter bound (each layer and expert stores at least one tensor)."""
COUNT_SIZES = ("layers", "experts")
"""Model sizes that count things the spec enumerates one by one (so a huge one is a hang, not a shape)."""


def _show(value: Any) -> str:
    return f"the string {brief(value, 60)}" if isinstance(value, str) else f"{type(value).__name__} {brief(value, 60)}"


def name_of(key: Any) -> str:
    """A key read from a checkpoint as text: itself when a string, else a short repr (never ``str`` of a
    pickled int of thousands of digits, which Python refuses to print)."""
    return key if isinstance(key, str) else brief(key, 60)


def expect_int(value: Any, field: str, where: str | Path, *, lo: int = 0, hi: int = MAX_SIZE) -> int:
    """``value`` as an int in ``[lo, hi]``, else CheckpointFormatError naming the file, field, value and bounds.

    Only integers count (numpy's too): a bool, a float or a string is refused even when it would
    convert, since a checkpoint that says ``True`` or ``"4"`` for a size is not one reshard can trust.

    >>> expect_int(4, "dp_world_size", "mp_rank_00_model_states.pt", lo=1)
    4
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise CheckpointFormatError(f"{where}: {field} is {_show(value)}, expected an integer in [{lo}, {hi}]")
    value = int(value)
    if not lo <= value <= hi:
        raise CheckpointFormatError(f"{where}: {field} is {show(value)}, outside [{lo}, {hi}]")
    return value


def expect_shape(value: Any, field: str, where: str | Path) -> tuple[int, ...]:
    """A tensor shape (a tuple or list of dims; ``torch.Size`` reads as a tuple): each dim and the element
    count in ``[0, MAX_SIZE]``; else CheckpointFormatError naming the entry."""
    if not isinstance(value, tuple | list) or len(value) > 64:
        raise CheckpointFormatError(f"{where}: {field} is {_show(value)}, not a tensor shape")
    shape = tuple(expect_int(n, f"{field} dim {k}", where) for k, n in enumerate(value))
    if math.prod(shape) > MAX_SIZE:
        raise CheckpointFormatError(f"{where}: {field} is {list(shape)}: {math.prod(shape)} elements, "
                                    f"more than {MAX_SIZE}")
    return shape


def expect_step(value: Any, field: str, where: str | Path) -> int:
    """An optimizer step or iteration count, which frameworks store as an int or a float (Adam's ``step``
    tensor): a whole number in ``[0, 2**53]``; else CheckpointFormatError (NaN, 2.5, -1, 1e300 are not steps)."""
    if isinstance(value, float | np.floating) and math.isfinite(value) and float(value).is_integer():
        value = int(value)
    return expect_int(value, field, where, hi=1 << 53)


def check_sizes(sizes: Mapping[str, Any], where: str | Path, *,
                counts: Mapping[str, int] | None = None) -> dict[str, int]:
    """Model sizes read from a checkpoint (or given by a caller), before they resolve a spec: each an
    integer in ``[1, MAX_SIZE]``, and each of ``COUNT_SIZES`` at most ``counts[name]`` (what the files
    can hold; ``MAX_COUNT`` when not given). Returns them as plain ints."""
    out = {}
    for name, value in sizes.items():
        hi = (counts or {}).get(name, MAX_COUNT) if name in COUNT_SIZES else MAX_SIZE
        out[str(name)] = expect_int(value, f"model size '{name}'", where, lo=1, hi=hi)
    return out


def given_sizes(sizes: Mapping[str, Any] | None) -> dict[str, int]:
    """The ``sizes`` a caller passed to ``open``, checked as a checkpoint's are."""
    if sizes is not None and not isinstance(sizes, Mapping):
        raise CheckpointFormatError(f"sizes must be a mapping of size names to integers, got {_show(sizes)}")
    return check_sizes(sizes or {}, "sizes given")


def require_sizes(source: Source, keys: tuple[str, ...], target: str) -> None:
    """Fail before writing when ``source`` does not know the model sizes a ``target`` format needs."""
    missing = [k for k in keys if k not in source.sizes]
    if missing:
        hint = (" (a DCP checkpoint carries no model config: put the model's Hugging Face config.json beside "
                "its .metadata, or pass sizes)") if source.format == "dcp" else ""
        raise CheckpointFormatError(f"{source.path}: writing {target} needs model sizes {', '.join(missing)}, "
                                    f"which the source does not record{hint}")


@dataclass(slots=True, kw_only=True)
class Source:
    """A checkpoint opened for reading: how it is laid out and where every item is."""

    format: str
    path: Path
    spec_name: str
    spec: Spec
    topology: Topology
    sizes: dict[str, int]
    layout: Layout
    where: Mapping[Item, Located]
    """Every item of ``layout`` that holds logical data."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Non-tensor state the format carries to a target of the same format (args, iteration, config, ...)."""
    blob_sizes: dict[str, int] = field(default_factory=dict)

    def item_dtype(self, item: Item) -> str:
        return self.where[item].dtype


@dataclass(slots=True, kw_only=True)
class Target:
    """What to write: the destination layout, each item's dtype, and format state."""

    format: str
    spec_name: str
    spec: Spec
    topology: Topology
    sizes: dict[str, int]
    layout: Layout
    dtypes: Mapping[Item, str]
    extra: dict[str, Any] = field(default_factory=dict)


Fill = Callable[[Item, int, int], "bytes | memoryview"]
"""``fill(item, lo, hi)``: the bytes of the item's elements ``[lo, hi)`` (row-major), padding included."""


def stream_item(fill: Fill, item: Item, numel: int, dtype: str, write: Callable[["bytes | memoryview"], None],
                progress: Callable[[int], None] | None, window: int) -> None:
    """Copy an item's ``numel`` elements from ``fill`` to ``write``, at most ``window`` bytes at a time.

    A window is written (checksummed, CRC'd, handed to the kernel) on a helper
    thread while the next one is filled: both sides spend their time in code that
    releases the GIL, so reading and writing overlap. At most two windows are in
    flight.

    Raises CheckpointFormatError when ``fill`` returns the wrong number of bytes.
    """
    size = itemsize(dtype)
    step = max(1, window // size)
    digest = ItemHasher(item)  # the manifest's per-tensor checksum
    if numel <= step:  # one window: nothing to overlap
        data = fill(item, 0, numel)
        got = _check_window(data, item, 0, numel, size, dtype)
        digest.update(data)
        write(data)
        digest.done()
        if progress:
            progress(got)
        return
    pending: Future | None = None
    try:
        for lo in range(0, numel, step):
            hi = min(numel, lo + step)
            data = fill(item, lo, hi)
            got = _check_window(data, item, lo, hi, size, dtype)
            digest.update(data)
            if pending is not None:
                pending.result()
            pending = _WRITER.submit(write, data)
            if progress:
                progress(got)
        if pending is not None:
            pending.result()
            pending = None
        digest.done()
    finally:
        if pending is not None:  # an error while filling: let the write in flight end before unwinding
            pending.exception()


def _check_window(data, item: Item, lo: int, hi: int, size: int, dtype: str) -> int:
    got = memoryview(data).nbytes
    if got != (hi - lo) * size:
        raise CheckpointFormatError(
            f"fill returned {got} bytes for elements [{lo}, {hi}) of {item}, expected {(hi - lo) * size} ({dtype})")
    return got


_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-write")


_SCALAR_KINDS = {"float32": "<f4", "float64": "<f8", "int64": "<i8", "int32": "<i4"}


def scalar_value(raw: bytes, dtype: str) -> float | None:
    """The value of a 0-d tensor from its little-endian bytes; None for a dtype that is not a plain number."""
    kind = _SCALAR_KINDS.get(dtype)
    return float(np.frombuffer(raw, dtype=kind, count=1)[0]) if kind and len(raw) >= np.dtype(kind).itemsize else None


class Format(Protocol):
    """One checkpoint format. Adapters live in ``reshard/formats/<name>.py``."""

    name: str

    def detect(self, path: Path) -> bool:
        """Whether ``path`` (a directory) holds a checkpoint of this format. Cheap: names and headers only."""
        ...

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read metadata (never tensor data) and resolve the layout. ``spec``/``sizes`` override detection.

        Raises CheckpointFormatError naming the file and the reason.
        """
        ...

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        """The layout this format would write for ``source``'s model at ``topology``."""
        ...

    def write(self, target: Target, out: Path, fill: Fill, *, progress: Callable[[int], None] | None = None,
              only: Collection[Path] | None = None, window_bytes: int | None = None) -> list[Path]:
        """Write every file of ``target`` under directory ``out`` (which exists and is empty).

        Item bytes come only from ``fill``, in windows of at most ``window_bytes``
        (a format default of a few MiB when None); ``progress(nbytes)`` is called
        as tensor bytes are written. With a non-empty ``only`` (paths relative to
        ``out``, as ``files_of`` names them), write just those item-holding files
        and none of the files that hold no items (trackers, configs, indexes);
        with ``only=()``, just the latter. Parallel workers each write their
        share, then one call with ``only=()`` writes the rest. Returns the files
        written, relative to ``out``.
        """
        ...

    def files_of(self, target: Target) -> dict[Item, Path]:
        """The file (relative to the checkpoint directory) that holds each item of ``target``."""
        ...

