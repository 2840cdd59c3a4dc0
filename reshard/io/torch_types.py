"""The values ``reshard.io.torchfile`` reads and writes: tensor references and specs, dtypes, sizes, opaque framework objects."""


from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from reshard.core.dtypes import ITEMSIZE
from reshard.errors import CheckpointFormatError

__all__ = ["ALLOWED_PREFIXES", "Opaque", "SmallTensor", "TensorRef", "TensorSpec", "TorchDtype", "TorchSize", "map_tensors",
           "scalar_value"]

# Bytes per element of every dtype a tensor may have here.
_ITEMSIZE = ITEMSIZE  # bytes per element of every dtype a torch file may name
# Legacy typed storages (pickled with _rebuild_tensor_v2); every other dtype goes through _rebuild_tensor_v3.
_LEGACY_STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}
_STORAGE_OF = {dtype: name for name, dtype in _LEGACY_STORAGES.items()}
_DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
                  "short": "int16", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32"}
_DTYPE_NAMES = {*_ITEMSIZE, "qint8", "qint32", "quint8", "quint4x2", "quint2x4",
                *(f"int{i}" for i in range(1, 8)), *(f"uint{i}" for i in range(1, 8))}

# Framework classes kept as Opaque records: never imported, never called.
ALLOWED_PREFIXES = ("deepspeed.", "megatron.", "apex.", "transformer_engine.",
                    "torch.distributed.checkpoint.", "torch.optim.", "collections.")
_ALLOWED = ("torch tensors, storages, dtypes and Size; numpy arrays, dtypes and scalars; argparse.Namespace; "
            "builtin containers; and, kept opaque, classes under " + ", ".join(p[:-1] for p in ALLOWED_PREFIXES))


def _allowlisted(module: str) -> bool:
    return any(module == p[:-1] or module.startswith(p) for p in ALLOWED_PREFIXES)


@dataclass(frozen=True, slots=True)
class TorchDtype:
    """A ``torch.<name>`` dtype stored as a value (``args.params_dtype``, ...), e.g. ``TorchDtype("bfloat16")``."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in _DTYPE_NAMES:
            raise CheckpointFormatError(f"unknown torch dtype 'torch.{self.name}'")

    def __str__(self) -> str:
        return f"torch.{self.name}"


class TorchSize(tuple):
    """A ``torch.Size``: a tuple of ints, written back as ``torch.Size`` (DeepSpeed calls ``.numel()`` on them)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"TorchSize({tuple(self)!r})"


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor found in a torch file; its data is not loaded.

    Element ``[i0, i1, ...]`` is ``itemsize`` bytes at ``data_offset + sum(i_k * stride[k]) * itemsize`` in ``path``.
    """

    dtype: str
    """torch dtype name without ``torch.``, e.g. ``"bfloat16"``."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    """In elements."""
    storage: str
    """Storage key: the zip record ``<archive>/data/<storage>``. Tensors with the same key share bytes."""
    storage_offset: int
    """Elements from the storage's first byte to element ``[0, ..., 0]``."""
    path: Path
    data_offset: int
    """Absolute byte offset in ``path`` of element ``[0, ..., 0]``: storage data start + storage_offset * itemsize."""
    storage_nbytes: int
    requires_grad: bool = False
    parameter: bool = False
    """Pickled as a ``torch.nn.Parameter``."""
    attrs: tuple[tuple[str, object], ...] = ()
    """Plain Python attributes set on the tensor (``(("ds_id", "0_20"),)`` in DeepSpeed ZeRO-3 files)."""

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        """Row-major without gaps (as torch: dims of size 1 may have any stride), so the bytes are one span."""
        if 0 in self.shape:
            return True
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True


@dataclass(frozen=True, slots=True)
class Opaque:
    """An instance of a framework class reshard does not import, kept as plain data.

    Writing it back emits the same GLOBAL, REDUCE or NEWOBJ, items and BUILD opcodes, so the framework
    loads it as before.
    """

    module: str
    name: str
    args: tuple | None
    """Constructor/reduce arguments; None when the pickle names the class or function itself without calling it."""
    state: object = None
    """BUILD state (what ``__setstate__`` or ``__dict__`` receives), if any."""
    newobj: bool = False
    """Made by NEWOBJ ``cls.__new__(cls, *args)`` (protocol 2's way for plain instances), not REDUCE ``cls(*args)``."""
    listitems: tuple = ()
    """Items appended to the object (APPENDS), for list-like classes."""
    dictitems: tuple = ()
    """``(key, value)`` pairs set on the object (SETITEMS), for dict-like classes."""


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor to be written: contiguous, in a storage of its own; its bytes are streamed in by the caller."""

    dtype: str
    shape: tuple[int, ...]
    key: object
    """The caller's hashable id, the key of ``TorchFileWriter.entries`` and ``write``."""
    requires_grad: bool = False
    parameter: bool = False
    """Write as a ``torch.nn.Parameter``."""
    attrs: tuple[tuple[str, object], ...] = ()
    """Plain attributes to set on the tensor (DeepSpeed ZeRO-3's ``ds_id``); not with ``parameter``."""

    def __post_init__(self) -> None:
        if self.attrs and self.parameter:
            raise CheckpointFormatError(f"tensor {self.key!r}: attributes on a Parameter are not supported")
        if self.dtype not in _ITEMSIZE:
            raise CheckpointFormatError(f"unsupported dtype '{self.dtype}' (supported: {', '.join(_ITEMSIZE)})")
        object.__setattr__(self, "shape", tuple(self.shape))
        if not all(type(n) is int and n >= 0 for n in self.shape):
            raise CheckpointFormatError(f"tensor {self.key!r}: shape {self.shape} must be non-negative ints")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ITEMSIZE[self.dtype]


def map_tensors(obj: object, fn: Callable[[TensorRef], object]) -> object:
    """A copy of the tree ``obj`` with every ``TensorRef`` leaf replaced by ``fn(ref)``.

    Containers (dict and its subclasses, list, tuple, ``argparse.Namespace``, ``Opaque``) are copied,
    other leaves shared; a sub-tree reached twice is copied once. Typical use, before writing:
    ``map_tensors(tree, lambda r: TensorSpec(r.dtype, r.shape, key=r, parameter=r.parameter))``.
    """
    memo: dict[int, object] = {}  # id(input container) -> its copy; inputs live in obj, so ids stay unique

    def walk(x: object) -> object:
        if isinstance(x, TensorRef):
            return fn(x)
        if id(x) in memo:
            return memo[id(x)]
        t = type(x)
        if isinstance(x, dict):
            out = memo[id(x)] = copy.copy(x)  # keeps the type, default_factory and attributes (state-dict _metadata)
            for k, v in x.items():
                out[k] = walk(v)
        elif t is list:
            out = memo[id(x)] = []
            out.extend(walk(v) for v in x)
        elif t is tuple:
            out = memo[id(x)] = tuple(walk(v) for v in x)
        elif t is argparse.Namespace:
            out = memo[id(x)] = argparse.Namespace(**{k: walk(v) for k, v in vars(x).items()})
        elif t is Opaque:
            out = memo[id(x)] = replace(x, args=walk(x.args), state=walk(x.state), listitems=walk(x.listitems),
                                        dictitems=walk(x.dictitems))
        else:
            out = x
        return out

    return walk(obj)


_SCALAR_KINDS = {"float32": "<f4", "float64": "<f8", "int64": "<i8", "int32": "<i4"}


def scalar_value(raw: bytes, dtype: str) -> float | None:
    """The value of a 0-d tensor from its little-endian bytes; None for a dtype that is not a plain number."""
    import numpy as np

    kind = _SCALAR_KINDS.get(dtype)
    return float(np.frombuffer(raw, dtype=kind, count=1)[0]) if kind and len(raw) >= np.dtype(kind).itemsize else None


@dataclass(frozen=True, slots=True)
class SmallTensor:
    """A small tensor a checkpoint's non-model state holds, carried by value: an optimizer ``step``, an rng
    state, a loss scale, Transformer Engine's extra state, a ZeRO-3 placeholder. Never resharded: written back
    as it was read, as a ``TensorSpec`` leaf whose bytes are ``data``."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes = b""

    @staticmethod
    def scalar(value: float, dtype: str = "float32") -> SmallTensor:
        import numpy as np

        return SmallTensor(dtype, (), np.array(value, dtype=dtype).tobytes())

    def to_torch(self):
        """The tensor it was, as a torch tensor of its own memory."""
        import torch

        return torch.frombuffer(bytearray(self.data), dtype=getattr(torch, self.dtype)).reshape(self.shape).clone()

    def value(self) -> float:
        value = scalar_value(self.data, self.dtype) if self.shape in ((), (1,)) else None
        if value is None:
            raise CheckpointFormatError(f"a {self.dtype} {list(self.shape)} tensor where a number (step) was expected")
        return value
