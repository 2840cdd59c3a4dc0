"""The one table of element types: every torch dtype a checkpoint may name, its size, and its safetensors code.

Names are torch's, without ``torch.`` (``bfloat16``). ``SUPPORTED`` are the dtypes whose elements reshard
moves: a tensor of any other dtype in the table can be read as a record of a file but not resharded.
"""

from __future__ import annotations

from dataclasses import dataclass

from reshard.errors import CheckpointFormatError

__all__ = ["DTYPES", "ITEMSIZE", "SAFETENSORS_CODES", "SUPPORTED", "DType", "itemsize"]


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    """torch's name (``bfloat16``)."""
    itemsize: int
    """Bytes per element."""
    safetensors: str | None = None
    """The safetensors header's code (``BF16``); None where safetensors has none."""
    supported: bool = False
    """Whether reshard moves tensors of this dtype (the rest are known by name and size only)."""


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float64", 8, "F64", True),
    DType("float32", 4, "F32", True),
    DType("float16", 2, "F16", True),
    DType("bfloat16", 2, "BF16", True),
    DType("float8_e4m3fn", 1, "F8_E4M3", True),
    DType("float8_e5m2", 1, "F8_E5M2", True),
    DType("int64", 8, "I64", True),
    DType("int32", 4, "I32", True),
    DType("int16", 2, "I16", True),
    DType("int8", 1, "I8", True),
    DType("uint8", 1, "U8", True),
    DType("bool", 1, "BOOL", True),
    DType("complex64", 8, "C64", True),
    DType("complex128", 16),
    DType("complex32", 4),
    DType("uint16", 2, "U16"),
    DType("uint32", 4, "U32"),
    DType("uint64", 8, "U64"),
    DType("float8_e4m3fnuz", 1, "F8_E4M3FNUZ"),
    DType("float8_e5m2fnuz", 1, "F8_E5M2FNUZ"),
    DType("float8_e8m0fnu", 1, "F8_E8M0"),
    DType("float4_e2m1fn_x2", 1),
    DType("bits8", 1),
    DType("bits16", 2),
    DType("bits1x8", 1),
    DType("bits2x4", 1),
    DType("bits4x2", 1),
)}

ITEMSIZE: dict[str, int] = {d.name: d.itemsize for d in DTYPES.values()}
"""Bytes per element of every dtype in the table."""

SUPPORTED: dict[str, int] = {d.name: d.itemsize for d in DTYPES.values() if d.supported}
"""Bytes per element of the dtypes reshard reshards."""

SAFETENSORS_CODES: dict[str, str] = {d.safetensors: d.name for d in DTYPES.values() if d.safetensors}
"""safetensors code -> torch name."""


def itemsize(dtype: str) -> int:
    """Bytes per element of a supported dtype; CheckpointFormatError naming the supported ones otherwise."""
    try:
        return SUPPORTED[dtype]
    except (KeyError, TypeError):
        raise CheckpointFormatError(f"unsupported dtype '{dtype}' (supported: {', '.join(SUPPORTED)})") from None
