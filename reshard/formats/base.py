"""What a checkpoint format provides: reading a source, and writing a target.

A format adapter turns a directory written by a framework into a ``Source``
(its spec, topology, model sizes, the resolved ``Layout`` and, for every
stored item, where its bytes sit in which file), and writes a ``Target``
directory the framework itself can load, pulling each item's bytes from a
``Fill`` callback window by window through a ``WriteSession`` (the one writer
driver: files, checksums, journal), so no file is ever held in memory whole.

Items are always stored row-major and contiguous: an item's bytes are
``numel * itemsize`` bytes at ``Located.offset`` in ``Located.path``. Copying
is bit-level, so the executor only needs each dtype's item size.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from reshard.core.dtypes import itemsize
from reshard.core.layout import Item, Layout
from reshard.core.spec import Spec
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.execution.session import Fill, WriteSession
from reshard.io.fields import MAX_COUNT, MAX_SIZE, _show, check_sizes, expect_int, expect_shape, expect_step, name_of
from reshard.io.smallfiles import Located, read_json, read_tag

__all__ = ["MAX_COUNT", "MAX_SIZE", "Fill", "Format", "Located", "ModelMeta", "Progress", "Source", "Target",
           "check_sizes", "expect_int", "expect_shape", "expect_step", "given_sizes", "itemsize", "name_of",
           "read_json", "read_tag", "require_sizes"]



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
class ModelMeta:
    """What identifies the model, carried from a source to every target: never guessed from tensor names."""

    family: str | None = None
    """Its model family (``reshard.models``), when the checkpoint records which it is."""
    config: dict[str, Any] | None = None
    """Its Hugging Face ``config.json`` (read from the checkpoint, or built from its family and sizes)."""
    generation_config: dict[str, Any] | None = None
    """Its ``generation_config.json``, when the checkpoint has one."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Its tokenizer files (``tokenizer.json``, ...) by name, carried verbatim (``reshard.formats.identity``)."""
    hints: dict[str, Any] = field(default_factory=dict)
    """Hugging Face config fields a checkpoint of another kind records (Megatron's args: epsilon, rope base,
    positions, tying, routing), for building a config when none is carried."""


@dataclass(slots=True, kw_only=True)
class Progress:
    """How far training got, as far as the checkpoint records it."""

    step: int | None = None
    """The optimizer's step count."""
    iteration: int | None = None
    """The trainer's iteration (Megatron's, DeepSpeed's ``global_steps``)."""
    lr: float | None = None
    """The learning rate of the first param group."""

    @property
    def step_count(self) -> float:
        """Adam's step where no param group records its own: the step, else the iteration, else 0."""
        return float(self.step or self.iteration or 0)


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
    model: ModelMeta = field(default_factory=ModelMeta)
    progress: Progress = field(default_factory=Progress)
    extra: dict[str, Any] = field(default_factory=dict)
    """The format's own non-tensor state (args, RNG, optimizer structure), read only by the same format."""
    blob_sizes: dict[str, int] = field(default_factory=dict)
    module_names: bool = False
    """Whether the checkpoint names tensors as transformers' module holds them where its files do not (fused
    experts: ``reshard.formats.module_view``); ``layout`` is in the family's logical tensors all the same."""

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
    model: ModelMeta = field(default_factory=ModelMeta)
    """The model's identity, written beside the checkpoint where the format keeps it (a ``config.json``)."""
    max_shard_size: int | str | None = None
    """hf: the largest safetensors shard (bytes, or ``"5GB"``); None: the format's default."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The format's own non-tensor state for writing, read only by the same format."""


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

    def write(self, target: Target, out: Path, fill: Fill, session: WriteSession | None = None, *,
              only: Collection[Path] | None = None) -> list[Path]:
        """Write every file of ``target`` under directory ``out`` (which exists and is empty).

        The format says what goes into which file; the write ``session`` (a fresh one when None)
        does the writing: output files through ``session.open`` (checksums, the resume journal) and
        item bytes through ``session.stream_item`` (from ``fill`` only, in its windows, with its
        per-tensor checksums and progress). With a non-empty ``only`` (paths relative to
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

