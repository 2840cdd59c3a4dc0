"""``inspect``: what a checkpoint holds, from its metadata alone.

``inspect`` describes any checkpoint every format reads (its format, topology, model identity,
training progress, optimizer states, and every logical tensor with its dtype and size per state);
``inspect_spec`` gives its layout in the spec language, the start of a user's own spec.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.api.planning import open_checkpoint
from reshard.core.dtypes import itemsize
from reshard.core.layout import MASTER, PARAM
from reshard.formats.specs import source_family
from reshard.formats.base import Source
from reshard.formats.derived import logical_lines, recorded_of

__all__ = ["describe", "inspect", "inspect_spec", "spec_text"]


def inspect(src: str | Path, *, sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """What the checkpoint at ``src`` holds (``describe`` of it), from its metadata alone.

    Raises:
      ReshardError: ``src`` is no checkpoint reshard reads, or its metadata is inconsistent.
    """
    return describe(open_checkpoint(src, sizes=sizes))


def describe(s: Source) -> dict[str, Any]:
    """An opened checkpoint, JSON-ready.

    Keys: ``path``, ``format``, ``spec`` (the layout's name), ``topology``, ``sizes``, ``model`` (``family``,
    ``model_type``, ``architectures``: each None where the checkpoint does not record it), ``progress``
    (``step``, ``iteration``, ``lr``), ``states`` (those it holds: the weights, their master copy, then the
    optimizer's own), ``optimizer_states``
    (those of them that are not the weights themselves; empty for weights only), ``files``, ``tensor_count``,
    ``dtypes`` (how many tensor states of each dtype), ``bytes`` (of every tensor state), and ``tensors``:
    each logical tensor's full name -> its ``shape`` and, per state, its ``dtype`` and ``bytes``.
    """
    tensors: dict[str, dict[str, Any]] = {}
    for f in s.layout.fragments:
        if f.fill or f.item not in s.where:
            continue
        t = s.layout.tensors[f.tensor]
        row = tensors.setdefault(f.tensor, {"shape": list(t.shape), "states": {}})
        if f.state not in row["states"]:
            dtype = s.where[f.item].dtype
            row["states"][f.state] = {"dtype": dtype, "bytes": math.prod(t.shape) * itemsize(dtype)}
    held = {state for row in tensors.values() for state in row["states"]}
    order = [PARAM, MASTER, *s.layout.states, *sorted(held)]
    states = [st for st in dict.fromkeys(order) if st in held]
    for row in tensors.values():
        row["states"] = {st: row["states"][st] for st in states if st in row["states"]}
    dtypes = Counter(st["dtype"] for row in tensors.values() for st in row["states"].values())
    files = sorted({str(loc.path.relative_to(s.path)) if loc.path.is_relative_to(s.path) else str(loc.path)
                    for loc in s.where.values()})
    return {
        "path": str(s.path),
        "format": s.format,
        "spec": s.spec_name,
        "topology": str(s.topology),
        "sizes": dict(s.sizes),
        "model": _identity(s),
        "progress": {"step": s.progress.step, "iteration": s.progress.iteration, "lr": s.progress.lr},
        "states": states,
        "optimizer_states": [st for st in states if st != PARAM],
        "files": files,
        "tensor_count": len(tensors),
        "dtypes": dict(sorted(dtypes.items())),
        "bytes": sum(st["bytes"] for r in tensors.values() for st in r["states"].values()),
        "tensors": dict(sorted(tensors.items())),
    }


def _identity(s: Source) -> dict[str, Any]:
    """The model as the checkpoint records it: its family, its config's ``model_type`` and ``architectures``."""
    config = s.model.config if isinstance(s.model.config, Mapping) else {}
    family = source_family(s)
    return {"family": family.name if family else s.model.family, "model_type": config.get("model_type"),
            "architectures": config.get("architectures")}


def inspect_spec(src: str | Path, *, sizes: Mapping[str, int] | None = None) -> str:
    """The layout of the checkpoint at ``src`` in the spec language (``spec_text`` of it).

    Raises:
      ReshardError: ``src`` is no checkpoint reshard reads, or a tensor name the spec language cannot spell.
    """
    return spec_text(open_checkpoint(src, sizes=sizes))


def spec_text(s: Source) -> str:
    """An opened checkpoint's layout as spec text that parses (``reshard.core.spec.parse_spec``).

    The spec it was read with, where it has one (a family's, a user's, or one derived from the tensors the
    checkpoint records); otherwise (a format that lays tensors out without a spec, as DCP does) a declaration
    of every tensor it holds, under its own name and shape. Comment lines first say where it came from.
    """
    where = " ".join(str(s.path).splitlines())  # a comment is one line
    if s.spec.lines:
        head = [f"# layout of {where}: {s.format} at {s.topology}, read with spec {s.spec_name}"]
        if s.sizes:
            head.append("# model sizes: " + ", ".join(f"{k}={v}" for k, v in sorted(s.sizes.items())))
        return "\n".join([*head, *s.spec.lines]).rstrip("\n") + "\n"
    head = [f"# tensors of {where}, as its {s.format} checkpoint at {s.topology} records them",
            f"# ({s.format} lays them out without a spec; each one is its own logical tensor)"]
    return "\n".join([*head, *logical_lines(recorded_of(s.layout), s.path)]) + "\n"
