"""How ``save_pretrained`` splits a state dict into safetensors shard files, and the index it writes beside them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from reshard.core.units import parse_size
from reshard.errors import CheckpointFormatError
from reshard.io import json_text

__all__ = ["INDEX_NAME", "WEIGHTS_NAME", "ShardPlan", "plan_shards"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """Which tensors go to which file of a Hugging Face checkpoint."""

    shards: tuple[tuple[str, tuple[str, ...]], ...]
    """(file name, tensor names in the given order), in file order."""
    total_size: int
    """Bytes of all tensors (the index's ``metadata.total_size``)."""

    @property
    def sharded(self) -> bool:
        """Whether the checkpoint needs ``model.safetensors.index.json`` (more than one file)."""
        return len(self.shards) > 1

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: file for file, names in self.shards for name in names}

    def index(self, total_parameters: int | None = None) -> dict[str, Any]:
        """The index file's content: ``{"metadata": {...}, "weight_map": {name: file}}``.

        ``total_parameters`` (elements) is added to the metadata as transformers 5 does.
        """
        meta: dict[str, Any] = {"total_size": self.total_size}
        if total_parameters is not None:
            meta["total_parameters"] = total_parameters
        return {"metadata": meta, "weight_map": self.weight_map}

    def index_json(self, total_parameters: int | None = None) -> str:
        """The index file's text, formatted as ``save_pretrained`` writes it."""
        return json_text.dumps(self.index(total_parameters), indent=2, sort_keys=True) + "\n"


def plan_shards(tensors: Iterable[tuple[str, int]], max_shard_size: int | str = "5GB", *,
                weights_name: str = WEIGHTS_NAME) -> ShardPlan:
    """Split tensors into shard files as ``huggingface_hub.split_torch_state_dict_into_shards`` does.

    Tensors are taken in the given order: a tensor that would tip the current
    shard over ``max_shard_size`` starts a new shard; a tensor larger than
    ``max_shard_size`` gets a shard of its own (placed before the shard being
    filled, as huggingface_hub does). One shard is named ``weights_name``;
    several are ``model-00001-of-0000N.safetensors``, ...

    Args:
      tensors: (name, size in bytes) pairs.
      max_shard_size: bytes, or a string like ``"5GB"`` (decimal units).
      weights_name: the single-file name; shard names insert ``-0000K-of-0000N`` before its suffix.

    >>> plan_shards([("a", 6), ("b", 6), ("c", 2)], 10).shards
    (('model-00001-of-00002.safetensors', ('a',)), ('model-00002-of-00002.safetensors', ('b', 'c')))
    """
    limit = parse_size(max_shard_size, "max_shard_size")
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    seen: set[str] = set()
    for name, nbytes in tensors:
        if name in seen:
            raise CheckpointFormatError(f"tensor '{name}' is listed twice")
        seen.add(name)
        total += nbytes
        if nbytes > limit:
            shards.append([name])
            continue
        if current_size + nbytes > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += nbytes
    if current or not shards:
        shards.append(current)
    stem, dot, suffix = weights_name.rpartition(".")
    if len(shards) == 1:
        files = [weights_name]
    else:
        files = [f"{stem}-{k + 1:05d}-of-{len(shards):05d}{dot}{suffix}" for k in range(len(shards))]
    return ShardPlan(shards=tuple((f, tuple(s)) for f, s in zip(files, shards, strict=True)), total_size=total)
