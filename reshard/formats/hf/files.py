"""A Hugging Face checkpoint's files: the safetensors shards and their index, and the order and sharding
of the tensors a target writes (as ``save_pretrained`` splits them)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path, PurePosixPath
from typing import Any

from reshard.core.layout import PARAM, Item, Layout
from reshard.errors import CheckpointFormatError
from reshard.formats.base import (
    Source,
    Target,
    itemsize,
    read_json,
)
from reshard.io.safetensors_io import INDEX_NAME, WEIGHTS_NAME, TensorInfo, plan_shards, read_header

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""huggingface_hub's default; transformers 5's ``save_pretrained`` defaults to 50GB."""


_MAX_LISTED = 20  # problems listed in one error before "... and N more"

_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")  # Llama: model.layers.N., GPT-2: transformer.h.N.

def _stored_tensors(path: Path) -> dict[str, tuple[Path, TensorInfo]]:
    """Every tensor of the checkpoint: name -> (file, header entry), cross-checked with the index."""
    single, index = path / WEIGHTS_NAME, path / INDEX_NAME
    if single.is_file() and index.is_file():
        raise CheckpointFormatError(
            f"{path}: holds both {WEIGHTS_NAME} and {INDEX_NAME}; transformers would load {WEIGHTS_NAME} "
            f"and ignore the index, so remove the one that is stale")
    if single.is_file():
        return {name: (single, t) for name, t in read_header(single).tensors.items()}
    if not index.is_file():
        raise CheckpointFormatError(f"{path}: no {WEIGHTS_NAME} or {INDEX_NAME}")
    weight_map = _weight_map(index)
    out: dict[str, tuple[Path, TensorInfo]] = {}
    problems: list[str] = []
    for file in dict.fromkeys(weight_map.values()):
        shard = path / file
        if not shard.is_file():
            problems.append(f"{index}: names {file}, which does not exist")
            continue
        for name, t in read_header(shard).tensors.items():
            if name in out:
                problems.append(f"tensor '{name}' is stored twice, in {out[name][0]} and {shard}")
            elif weight_map.get(name) != file:
                listed = f"maps it to {weight_map[name]}" if name in weight_map else "does not list it"
                problems.append(f"{shard}: holds tensor '{name}' but {index.name} {listed}")
            else:
                out[name] = (shard, t)
    for name, file in weight_map.items():
        if name not in out and (path / file).is_file():
            problems.append(f"{index.name}: maps tensor '{name}' to {file}, which does not hold it")
    if problems:
        raise CheckpointFormatError(f"{path}: the index and the shards disagree:\n  " + _listing(problems))
    return out

def _weight_map(index: Path) -> dict[str, str]:
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(f"{index}: expected an object with a 'weight_map' object")
    for name, file in weight_map.items():
        # Shard names are plain file names in the checkpoint directory; anything else could read outside it.
        if not isinstance(file, str) or not file or PurePosixPath(file).name != file or file in (".", ".."):
            raise CheckpointFormatError(
                f"{index}: weight_map maps '{name}' to {json.dumps(file)}, not a file name in the checkpoint directory")
    return weight_map

def _listing(problems: list[str]) -> str:
    shown = problems[:_MAX_LISTED]
    more = len(problems) - len(shown)
    return "\n  ".join(shown + ([f"... and {more} more"] if more else []))

def _target_dtypes(source: Source, layout: Layout) -> dict[Item, str]:
    """Each target item's dtype: that of the source item holding its tensor's weights (float32 if none)."""
    # An item's fragments are listed together: its lookups are made once per run of them (hashing an item is a
    # Python call).
    by_tensor: dict[str, str] = {}
    last = held = None
    for f in source.layout.fragments:
        if f.state == PARAM and not f.fill:
            if f.item is not last:
                last, held = f.item, source.where.get(f.item)
            if held is not None:
                by_tensor.setdefault(f.tensor, held.dtype)
    out: dict[Item, str] = {}
    last, done = None, False
    for f in layout.fragments:
        if f.item is not last:
            last, done = f.item, f.item in out
        if not done and f.tensor in by_tensor:
            out[last], done = by_tensor[f.tensor], True
    return {it: out.get(it, "float32") for it in layout.items}

def _ordered_items(layout: Layout) -> list[Item]:
    """Items in the order a model's state dict has them: leading items, layer 0, layer 1, ..., trailing items.

    The spec registers items rule by rule (all input norms, then all q_proj, ...);
    regrouping by layer keeps each layer's tensors together in one shard.
    """
    registered = list(dict.fromkeys(it for items in layout.order.values() for it in items if it in layout.items))
    registered += sorted(set(layout.items) - set(registered))
    layers = [_LAYER.search(it.key) for it in registered]  # once per item: 100,000 of them in some checkpoints
    first = next((k for k, m in enumerate(layers) if m), len(registered))

    def rank(k: int) -> tuple[int, int, int]:
        m = layers[k]
        if m:
            return (1, int(m.group(1)), k)
        return (0 if k < first else 2, 0, k)

    return [registered[k] for k in sorted(range(len(registered)), key=rank)]

def _shard_plan(target: Target) -> tuple[list[Item], dict[str, Item], dict[Item, str], Any]:
    """The target's items in state-dict order, by key, their dtypes, and how they split into shards."""
    others = sorted({it.state for it in target.layout.items} - {PARAM})
    if others:
        raise CheckpointFormatError(
            f"hf checkpoints hold model weights only; the target layout also has states {', '.join(others)}")
    items = _ordered_items(target.layout)
    by_key: dict[str, Item] = {}
    for it in items:
        if it.key in by_key:
            raise CheckpointFormatError(f"two target items are both named '{it.key}': {by_key[it.key]} and {it}")
        by_key[it.key] = it
    dtypes = target.dtypes
    try:
        dtype_of = {it: dtypes[it] for it in items}
    except KeyError:
        raise CheckpointFormatError(f"target item {next(it for it in items if it not in dtypes)} has no dtype") from None
    widths = {dtype: itemsize(dtype) for dtype in set(dtype_of.values())}
    infos = target.layout.items
    sizes = [(it.key, math.prod(infos[it].shape) * widths[dtype]) for it, dtype in dtype_of.items()]
    return items, by_key, dtype_of, plan_shards(sizes, target.max_shard_size or DEFAULT_MAX_SHARD_SIZE)

def _check_param_only(layout: Layout, spec_name: str) -> None:
    if layout.states not in ((), (PARAM,)):
        raise CheckpointFormatError(
            f"spec '{spec_name}' declares states {', '.join(layout.states)}; "
            "hf checkpoints hold model weights (param) only")
