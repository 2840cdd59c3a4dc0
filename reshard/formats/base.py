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

from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from reshard.errors import CheckpointFormatError
from reshard.layout import Item, Layout
from reshard.storage import ItemHasher
from reshard.spec import Spec
from reshard.topology import Topology

__all__ = ["DTYPE_SIZES", "LLAMA_SIZES", "Fill", "Format", "Located", "Source", "Target", "itemsize", "require_sizes",
           "scalar_value", "stream_item"]

# torch dtype names (without "torch.") and their sizes in bytes.
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
}


def itemsize(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise CheckpointFormatError(f"unsupported dtype '{dtype}' (supported: {', '.join(DTYPE_SIZES)})") from None


LLAMA_SIZES = ("h", "heads", "g", "hd", "f", "vocab", "layers")
"""The sizes a Llama-style model's specs need."""


def require_sizes(source: Source, keys: tuple[str, ...], target: str) -> None:
    """Fail before writing when ``source`` does not know the model sizes a ``target`` format needs."""
    missing = [k for k in keys if k not in source.sizes]
    if missing:
        hint = (" (a DCP checkpoint carries no model config: put the model's Hugging Face config.json beside "
                "its .metadata, or pass sizes)") if source.format == "dcp" else ""
        raise CheckpointFormatError(f"{source.path}: writing {target} needs model sizes {', '.join(missing)}, "
                                    f"which the source does not record{hint}")


@dataclass(frozen=True, slots=True)
class Located:
    """Where one stored item's bytes are: ``numel * itemsize(dtype)`` bytes at ``offset``."""

    path: Path
    offset: int
    """Byte offset of the item's first element in ``path``."""
    dtype: str


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
    import numpy as np

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

