"""Checks of the values a checkpoint declares: every integer a format reads (a size, a count, a
dimension, a step) goes through ``expect_int`` before it drives slicing or a loop."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from reshard.errors import CheckpointFormatError
from reshard.io.bounds import brief, show

__all__ = ["COUNT_SIZES", "MAX_COUNT", "MAX_SIZE", "check_sizes", "expect_int", "expect_shape", "expect_step",
           "name_of"]

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


COUNT_SIZES = ("layers", "experts")
"""Model sizes that count things the spec enumerates one by one (so a huge one is a hang, not a shape)."""


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
