"""In-memory execution of layouts and plans over numpy arrays.

``scatter`` lays logical tensors out as a layout's stored items (what the
ranks of a topology would write), ``gather`` rebuilds logical tensors from
items, and ``apply`` carries out a plan. Items are 1-D arrays in row-major
order of their stored shape. These are the reference semantics the file
executor must match; they hold everything in memory, so they are for tests,
fixtures and small models.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from numpy.lib.stride_tricks import as_strided

from reshard.core.layout import Fragment, Item, Layout
from reshard.core.planner import Plan
from reshard.errors import PlanError

__all__ = ["apply", "gather", "scatter", "view"]


def view(flat: np.ndarray, offset: int, strides: tuple[int, ...], lengths: tuple[int, ...]) -> np.ndarray:
    """A strided view of a 1-D array; offset and strides in elements."""
    size = flat.itemsize
    return as_strided(flat[offset:], shape=lengths, strides=tuple(s * size for s in strides), writeable=flat.flags.writeable)


def scatter(layout: Layout, tensors: Mapping[tuple[str, str], np.ndarray], dtype: Mapping[str, np.dtype] | None = None) -> dict[Item, np.ndarray]:
    """Lay ``tensors`` (keyed by (logical name, state)) out as ``layout``'s items.

    Padding is zero, or a copy of logical data where a pad policy says ``last``.
    Each item takes the dtype of its tensors (``dtype`` per state overrides).
    """
    out: dict[Item, np.ndarray] = {}
    firsts: dict[Item, Fragment] = {}  # one pass: looking each item up in all fragments was quadratic
    for f in layout.fragments:
        firsts.setdefault(f.item, f)
    for item, info in layout.items.items():
        dt = (dtype or {}).get(item.state)
        if dt is None:
            first = firsts.get(item)
            dt = tensors[(first.tensor, first.state)].dtype if first else np.uint8
        out[item] = np.zeros(info.numel, dtype=dt)
    for f in layout.fragments:
        src = tensors[(f.tensor, f.state)].reshape(layout.tensors[f.tensor].view)
        sl = tuple(slice(o, o + n) for o, n in zip(f.box.offsets, f.box.lengths))
        view(out[f.item], f.offset, f.strides, f.box.lengths)[...] = src[sl]
    return out


def gather(layout: Layout, items: Mapping[Item, np.ndarray]) -> dict[tuple[str, str], np.ndarray]:
    """Rebuild every logical tensor (per state) from ``layout``'s items.

    Raises ``PlanError`` if some element of a logical tensor is stored nowhere.
    """
    out: dict[tuple[str, str], np.ndarray] = {}
    seen: dict[tuple[str, str], np.ndarray] = {}
    for f in layout.fragments:
        if f.fill:
            continue
        key = (f.tensor, f.state)
        t = layout.tensors[f.tensor]
        if key not in out:
            out[key] = np.zeros(t.view, dtype=items[f.item].dtype)
            seen[key] = np.zeros(t.view, dtype=bool)
        sl = tuple(slice(o, o + n) for o, n in zip(f.box.offsets, f.box.lengths))
        out[key][sl] = view(items[f.item], f.offset, f.strides, f.box.lengths)
        seen[key][sl] = True
    for key, mask in seen.items():
        if not mask.all():
            raise PlanError(f"{key[0]} [{key[1]}]: {int((~mask).sum())} elements are stored nowhere")
    # A tensor of zero elements has no fragment: nothing of it is missing.
    absent = sorted({n for n, t in layout.tensors.items() if not t.blob and math.prod(t.view)} - {name for name, _ in seen})
    if absent:
        raise PlanError(f"{', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''}: stored nowhere")
    return {key: a.reshape(layout.tensors[key[0]].shape) for key, a in out.items()}


def apply(plan: Plan, items: Mapping[Item, np.ndarray]) -> dict[Item, np.ndarray]:
    """Carry out ``plan`` on in-memory source items; returns the destination items."""
    out: dict[Item, np.ndarray] = {}
    dtypes = {c.dst: items[c.src].dtype for c in plan.copies}
    for item, info in plan.dst_items.items():
        out[item] = np.zeros(info.numel, dtype=dtypes.get(item, np.uint8))
    for c in plan.copies:
        src = view(items[c.src], c.src_offset, c.src_strides, c.lengths)
        view(out[c.dst], c.dst_offset, c.dst_strides, c.lengths)[...] = src
    return out
