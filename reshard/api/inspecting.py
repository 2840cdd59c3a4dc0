"""``inspect``: what a checkpoint holds, from its metadata alone."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.api.planning import open_checkpoint
from reshard.core.dtypes import itemsize

__all__ = ["inspect"]


def inspect(src: str | Path, *, sizes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Format, topology, model sizes, and every logical tensor with its dtype and size."""
    s = open_checkpoint(src, sizes=sizes)
    tensors: dict[str, dict[str, Any]] = {}
    for f in s.layout.fragments:
        if f.fill or f.item not in s.where:
            continue
        t = s.layout.tensors[f.tensor]
        row = tensors.setdefault(f.tensor, {"shape": list(t.shape), "states": {}})
        dtype = s.where[f.item].dtype
        row["states"][f.state] = {"dtype": dtype, "bytes": math.prod(t.shape) * itemsize(dtype)}
    files = sorted({str(loc.path.relative_to(s.path)) if loc.path.is_relative_to(s.path) else str(loc.path)
                    for loc in s.where.values()})
    return {
        "path": str(s.path),
        "format": s.format,
        "spec": s.spec_name,
        "topology": str(s.topology),
        "sizes": dict(s.sizes),
        "states": list(s.layout.states),
        "files": files,
        "tensors": dict(sorted(tensors.items())),
        "bytes": sum(st["bytes"] for r in tensors.values() for st in r["states"].values()),
    }
