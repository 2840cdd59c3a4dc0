"""A Hugging Face checkpoint's files: the safetensors shards and their index, and the order and sharding
of the tensors a target writes (as ``save_pretrained`` splits them)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from reshard.core.layout import PARAM, Item, Layout
from reshard.errors import CheckpointFormatError
from reshard.formats.base import (
    Source,
    Target,
    itemsize,
    read_json,
)
from reshard.io.safetensors_io import INDEX_NAME, WEIGHTS_NAME, ShardPlan, TensorInfo, plan_shards, read_header

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
    listed = [it for items in layout.order.values() for it in items]
    if listed == list(layout.items):  # each item registered once, in the layout's own order (compared by identity)
        registered = listed
    else:
        registered = list(dict.fromkeys(it for it in listed if it in layout.items))
        registered += sorted(set(layout.items) - set(registered))
    # once per item, from C: 100,000 of them in some checkpoints
    layers = list(map(_LAYER.search, [it.key for it in registered]))
    first = next((k for k, m in enumerate(layers) if m), len(registered))
    if first == len(registered):  # no layers: the registered order
        return registered

    def rank(k: int) -> tuple[int, int, int]:
        m = layers[k]
        if m:
            return (1, int(m.group(1)), k)
        return (0 if k < first else 2, 0, k)

    return [registered[k] for k in sorted(range(len(registered)), key=rank)]


@dataclass(frozen=True, slots=True)
class _Plan:
    """What ``HFFormat.files_of`` and ``HFFormat.write`` both need of a target: worked out once per target."""

    items: list[Item]
    """In state-dict order."""
    by_key: dict[str, Item]
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    """Each item's (dtype, shape), by key, in state-dict order: what ``SafetensorsWriter`` takes."""
    shards: ShardPlan


_PLAN = "hf.plan"
"""``Target.extra`` key of the target's ``_Plan``, with what it was made from (a conversion plans the files, then
writes them, and a worker writing its share gets the target with it)."""


def _shard_plan(target: Target) -> _Plan:
    """The target's items in state-dict order, by key, their dtypes and shapes, and how they split into shards.

    Kept in ``target.extra`` and made again when the target's layout, dtypes or ``max_shard_size`` changed
    (a layout is immutable: compared by identity; dtypes by their items, which compare by identity first).
    """
    dtypes = target.dtypes
    made = target.extra.get(_PLAN)
    if made is not None:
        layout, of, keys, values, max_shard_size, plan = made
        if layout is target.layout and of is dtypes and max_shard_size == target.max_shard_size and \
                keys == list(dtypes) and values == list(dtypes.values()):
            return plan
    plan = _make_plan(target)
    target.extra[_PLAN] = (target.layout, dtypes, list(dtypes), list(dtypes.values()), target.max_shard_size, plan)
    return plan


def _make_plan(target: Target) -> _Plan:
    layout = target.layout
    others = sorted({it.state for it in layout.items} - {PARAM})
    if others:
        raise CheckpointFormatError(
            f"hf checkpoints hold model weights only; the target layout also has states {', '.join(others)}")
    items = _ordered_items(layout)
    keys = [it.key for it in items]
    by_key = dict(zip(keys, items))
    if len(by_key) != len(items):
        by_key = {}
        for it in items:
            if it.key in by_key:
                raise CheckpointFormatError(f"two target items are both named '{it.key}': {by_key[it.key]} and {it}")
            by_key[it.key] = it
    dtypes = target.dtypes
    try:
        # in the layout's order, as the items often are, without hashing each item again
        same = type(dtypes) is dict and list(dtypes) == items
        dtype_list = list(dtypes.values()) if same else [dtypes[it] for it in items]
    except KeyError:
        raise CheckpointFormatError(f"target item {next(it for it in items if it not in dtypes)} has no dtype") from None
    infos = layout.items
    shapes = [info.shape for info in infos.values()] if list(infos) == items else [infos[it].shape for it in items]
    widths = {dtype: itemsize(dtype) for dtype in set(dtype_list)}
    nbytes = {(shape, dtype): math.prod(shape) * widths[dtype] for shape, dtype in set(zip(shapes, dtype_list))}
    sizes = list(zip(keys, map(nbytes.__getitem__, zip(shapes, dtype_list))))
    shards = plan_shards(sizes, target.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    return _Plan(items, by_key, dict(zip(keys, zip(dtype_list, shapes))), shards)

def _check_param_only(layout: Layout, spec_name: str) -> None:
    if layout.states not in ((), (PARAM,)):
        raise CheckpointFormatError(
            f"spec '{spec_name}' declares states {', '.join(layout.states)}; "
            "hf checkpoints hold model weights (param) only")
