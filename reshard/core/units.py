"""Byte counts written by people: ``1073741824``, ``"512MiB"``, ``"1GiB"``, ``"2G"``, ``"5GB"``.

Binary units (K, M, G, T and KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers of
1000, as huggingface_hub reads ``max_shard_size``. Case and spaces do not matter.
"""

from __future__ import annotations

from reshard.errors import ReshardError

__all__ = ["UNITS", "parse_size"]

UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
         "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
"""Lower-case unit -> bytes."""


def parse_size(size: int | str, what: str = "size") -> int:
    """A positive byte count; ReshardError naming ``what`` when ``size`` is not one."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        text = size.strip().lower().replace(" ", "") if isinstance(size, str) else ""
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):]
        try:
            value = int(float(digits) * UNITS[unit])
        except (ValueError, KeyError, OverflowError):  # OverflowError: "inf"
            raise ReshardError(f"{what}: cannot read {size!r} as a size (write e.g. 1073741824, 512MiB, 1GiB, 5GB)") from None
    if value <= 0:
        raise ReshardError(f"{what} must be positive, got {size}")
    return value
