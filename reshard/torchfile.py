"""Read and write ``torch.save`` files without torch and without running their pickles.

The format, as torch 2.13 writes it (``torch/serialization.py`` ``_save``/``_load`` and
``caffe2/serialize/inline_container.cc``; checked against real files):

- A zip archive whose records all sit under one directory, the *archive name*: the file's base name
  up to its last ``.`` (``x.pt`` -> ``x/``), or ``archive`` when torch writes to a buffer. Readers take
  it from the first record's name. No record is ever compressed.
- Records in this order: ``data.pkl`` (the object, pickle protocol 2), ``.format_version`` (``1``),
  ``.storage_alignment`` (``64``), ``byteorder`` (``little``), ``data/0``, ``data/1``, ... (one per
  storage, raw bytes, keys numbered in pickling order), ``version`` (``3\\n``) and
  ``.data/serialization_id`` (40 digits that torch only logs).
- Every record's data starts at a multiple of 64 bytes in the file: the local header's extra field
  ends with a padding block, id ``FB``, filled with ``Z``.
- Each non-empty record has flag bit 3 set: its local header holds zeros for CRC-32 and sizes, and a
  16-byte data descriptor after the data (24 bytes, with a zip64 extra field in the header, when the
  record is 4 GiB or more or starts at 4 GiB or more) holds them. The archive always ends with zip64
  end records. torch's loader relies on exactly this layout when it computes storage offsets itself
  (``torch.utils.serialization.config.load.calculate_storage_offsets``), so the writer reproduces it.
- torch.load never verifies CRC-32 (PyTorch builds miniz with ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``,
  and ``torch.serialization.set_crc32_options(False)`` writes zeros). reshard checks ``data.pkl``'s
  CRC when it is not zero, and never reads storages to check theirs.
- A tensor is ``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
  OrderedDict())`` whose storage is the persistent id ``('storage', torch.<X>Storage, key, location,
  numel)``. Dtypes without a legacy storage class (float8, uint16, ...) use ``_rebuild_tensor_v3(...,
  dtype)`` with ``torch.storage.UntypedStorage``, whose numel counts bytes. A Parameter wraps its tensor
  in ``torch._utils._rebuild_parameter(tensor, requires_grad, OrderedDict())``. Offsets, sizes and
  strides count elements.

Reading maps the pickle onto plain values: containers stay containers, ``torch.Size`` becomes a
``TorchSize`` (a tuple), a dtype a ``TorchDtype``, numpy arrays/dtypes/scalars are rebuilt from their
bytes, tensors become ``TensorRef`` and instances of allowlisted framework classes become ``Opaque``.
Any other global is refused before anything is called.
"""

from __future__ import annotations

import argparse
import collections
import copy
import hashlib
import io
import math
import os
import pickle
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from reshard.errors import CheckpointFormatError

__all__ = [
    "Opaque", "TensorRef", "TensorSpec", "TorchDtype", "TorchFileWriter", "TorchSize",
    "map_tensors", "read_torch_file", "write_torch_file",
]

# Bytes per element of every dtype a tensor may have here.
_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "complex128": 16, "complex64": 8, "complex32": 4, "uint16": 2, "uint32": 4,
    "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}
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

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise CheckpointFormatError(f"unsupported dtype '{self.dtype}' (supported: {', '.join(_ITEMSIZE)})")
        object.__setattr__(self, "shape", tuple(self.shape))
        if not all(type(n) is int and n >= 0 for n in self.shape):
            raise ValueError(f"tensor {self.key!r}: shape {self.shape} must be non-negative ints")

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


# ---------------------------------------------------------------------------------------------- reading


class _BadFileError(Exception):
    """A reason the file cannot be read; read_torch_file prefixes the path."""


class _Storage(NamedTuple):
    path: Path
    key: str
    dtype: str  # "uint8" for an UntypedStorage
    nbytes: int
    data_start: int  # absolute byte offset of the record's data


class _StorageType(NamedTuple):
    dtype: str


class _Pending(NamedTuple):
    """A tensor as the pickle describes it, checked and turned into a TensorRef once unpickling ends.

    Tuples cannot be altered by a later BUILD, which a frozen dataclass could.
    """

    storage: object
    dtype: object
    offset: object
    size: object
    stride: object
    requires_grad: object
    parameter: bool = False
    metadata: object = None


class _Marker(NamedTuple):
    name: str  # a class the pickle names only to pass it to a rebuilder below; compared by identity


_NDARRAY, _TENSOR, _PARAMETER = _Marker("numpy.ndarray"), _Marker("torch.Tensor"), _Marker("torch.nn.Parameter")


class _Callable:
    """A function the pickle may call. Refuses BUILD, so a pickle cannot set attributes on it."""

    __slots__ = ("fn", "name")

    def __init__(self, fn: Callable, name: str) -> None:
        self.fn, self.name = fn, name

    def __call__(self, *args):
        return self.fn(*args)

    def __setstate__(self, state):
        raise _BadFileError(f"pickle sets state on {self.name}")


class _OpaqueInstance:
    """An instance of an allowlisted class under construction; each global gets a subclass with ``_global`` set."""

    _global = ("", "")

    def __new__(cls, *args, **kwargs):
        if kwargs:
            raise _BadFileError(f"pickle passes keyword arguments to {'.'.join(cls._global)}")
        self = object.__new__(cls)
        self.args, self.newobj, self.state, self.listitems, self.dictitems = args, True, None, [], []
        return self

    def __init__(self, *args) -> None:
        self.newobj = False  # called as cls(*args) (REDUCE), not cls.__new__(cls, *args) (NEWOBJ)

    def __setstate__(self, state) -> None:
        self.state = state

    def append(self, item) -> None:
        self.listitems.append(item)

    def extend(self, items) -> None:
        self.listitems.extend(items)

    def __setitem__(self, key, value) -> None:
        self.dictitems.append((key, value))


class _Namespace(argparse.Namespace):
    def __setstate__(self, state) -> None:
        if not isinstance(state, dict):
            raise _BadFileError("argparse.Namespace state is not a dict")
        self.__dict__.update(state)


class _DtypeBuilder:
    """``numpy.dtype(spec, align, copy)`` then BUILD ``(version, byteorder, subarray, names, fields, ...)``."""

    def __init__(self, spec, align=False, copy=True) -> None:
        if not isinstance(spec, str) or not re.fullmatch(r"[biufc]\d+|[SUV]\d+", spec):
            raise _BadFileError(f"numpy dtype {spec!r} is not supported")
        self.dtype = np.dtype(spec)

    def __setstate__(self, state) -> None:
        if not isinstance(state, tuple) or len(state) < 5 or any(x is not None for x in state[2:5]):
            raise _BadFileError(f"numpy dtype state {state!r:.80} is not supported (structured or subarray dtype?)")
        if state[1] in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(state[1])


def _np_dtype(x) -> np.dtype:
    if not isinstance(x, _DtypeBuilder):
        raise _BadFileError(f"expected a numpy dtype, found {type(x).__name__}")
    return x.dtype


def _np_bytes(raw) -> bytes:
    if isinstance(raw, str):  # pickles written by Python 2
        return raw.encode("latin1")
    if not isinstance(raw, bytes):
        raise _BadFileError(f"numpy data is a {type(raw).__name__}, not bytes (object arrays are not supported)")
    return raw


class _ArrayBuilder:
    """``numpy.core.multiarray._reconstruct(ndarray, (0,), b'b')``, then BUILD ``([version,] shape, dtype, F, raw)``."""

    value = None

    def __setstate__(self, state) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise _BadFileError("malformed numpy array state")
        shape, dtype, fortran, raw = state[-4:]
        dtype, raw, shape = _np_dtype(dtype), _np_bytes(raw), _ints(shape, "numpy shape")
        if len(raw) != math.prod(shape) * dtype.itemsize:
            raise _BadFileError(f"numpy array of shape {shape} and dtype {dtype} has {len(raw)} bytes")
        self.value = np.frombuffer(raw, dtype).reshape(shape, order="F" if fortran else "C").copy(order="K")


def _np_reconstruct(subtype, shape, typecode) -> _ArrayBuilder:
    if subtype is not _NDARRAY:
        raise _BadFileError("numpy _reconstruct of a type other than numpy.ndarray")
    return _ArrayBuilder()


def _np_scalar(dtype, raw=None):
    dtype, raw = _np_dtype(dtype), _np_bytes(raw)
    if len(raw) != dtype.itemsize:
        raise _BadFileError(f"numpy {dtype} scalar has {len(raw)} bytes")
    return np.frombuffer(raw, dtype)[0]


def _ints(value, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(n) is int and n >= 0 for n in value):
        raise _BadFileError(f"tensor {what} {value!r:.80} is not a tuple of non-negative ints")
    return tuple(value)


def _rebuild_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return _Pending(storage, getattr(storage, "dtype", None), offset, size, stride, requires_grad, False, metadata)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _Pending(storage, dtype, offset, size, stride, requires_grad, False, metadata)


def _rebuild_v1(storage, offset, size, stride):
    return _rebuild_v2(storage, offset, size, stride)


def _rebuild_parameter(data, requires_grad, hooks, state=None):
    if not isinstance(data, _Pending):
        raise _BadFileError("torch._utils._rebuild_parameter of something that is not a tensor")
    if state:
        raise _BadFileError(f"a Parameter with Python attributes {sorted(state)!r:.80} is not supported")
    return data._replace(requires_grad=requires_grad, parameter=True)


def _rebuild_from_type_v2(func, new_type, args, state):
    if not (isinstance(func, _Callable) and func.fn in (_rebuild_v1, _rebuild_v2, _rebuild_v3)):
        raise _BadFileError("torch._tensor._rebuild_from_type_v2 of something that is not a tensor")
    if not (new_type is _TENSOR or new_type is _PARAMETER) or state:
        raise _BadFileError("tensor subclasses and tensors with Python attributes are not supported")
    return func(*args)._replace(parameter=new_type is _PARAMETER)


def _encode(text, encoding="utf-8", errors="strict"):  # _codecs.encode: how protocol 2 spells bytes
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8", "ascii"):
        raise _BadFileError(f"_codecs.encode with encoding {encoding!r:.40} is not supported")
    return text.encode(encoding)


def _bytes_of(kind: type) -> Callable:
    def make(*args):
        if not args:
            return kind()
        if isinstance(args[0], str) and len(args) == 2:
            return kind(_encode(*args))
        if len(args) == 1 and isinstance(args[0], (bytes, bytearray, list, tuple)):
            return kind(args[0])
        raise _BadFileError(f"{kind.__name__}() with these arguments is not supported")
    return make


_BUILTIN_TYPES = {t.__name__: t for t in (set, frozenset, list, dict, tuple, int, float, complex, str, bool, slice)}


def _is_builtin_type(obj: object) -> bool:
    return isinstance(obj, type) and obj in _BUILTIN_TYPES.values()


def _defaultdict(factory=None):
    if factory is not None and not _is_builtin_type(factory):
        raise _BadFileError("collections.defaultdict with a default factory that is not a builtin type")
    return collections.defaultdict(factory)


def _torch_size(dims=()):
    return TorchSize(_ints(tuple(dims), "torch.Size"))


def _static_globals() -> dict[tuple[str, str], object]:
    table: dict[tuple[str, str], object] = {
        ("torch._utils", "_rebuild_tensor"): _rebuild_v1,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Size"): _torch_size,
        ("collections", "defaultdict"): _defaultdict,
        ("_codecs", "encode"): _encode,
        ("builtins", "bytes"): _bytes_of(bytes),
        ("builtins", "bytearray"): _bytes_of(bytearray),
    }
    table = {k: _Callable(fn, ".".join(k)) for k, fn in table.items()}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(mod, "_reconstruct")] = _Callable(_np_reconstruct, f"{mod}._reconstruct")
        table[(mod, "scalar")] = _Callable(_np_scalar, f"{mod}.scalar")
    table.update({
        ("numpy", "ndarray"): _NDARRAY,
        ("numpy", "dtype"): _DtypeBuilder,
        ("torch", "Tensor"): _TENSOR,
        ("torch._tensor", "Tensor"): _TENSOR,
        ("torch.nn.parameter", "Parameter"): _PARAMETER,
        ("torch.storage", "UntypedStorage"): _StorageType("uint8"),
        ("torch", "UntypedStorage"): _StorageType("uint8"),
        ("collections", "OrderedDict"): collections.OrderedDict,  # a C type: a pickle cannot set attributes on it
        ("argparse", "Namespace"): _Namespace,
    })
    table.update({("builtins", name): t for name, t in _BUILTIN_TYPES.items()})
    table.update({("torch", name): _StorageType(dtype) for name, dtype in _LEGACY_STORAGES.items()})
    return table


_GLOBALS = _static_globals()


class _Archive:
    """The zip side of a torch file: its records and where their data starts."""

    def __init__(self, path: Path, fh) -> None:
        self.path, self.fh = path, fh
        self.size = os.fstat(fh.fileno()).st_size
        magic = fh.read(4)
        if magic != b"PK\x03\x04":
            if magic[:1] == b"\x80":
                raise _BadFileError("written in the legacy torch.save format (_use_new_zipfile_serialization=False), "
                           "which reshard does not read; re-save it with a current torch.save")
            raise _BadFileError("not a zip archive, so not a torch.save file (those start with PK\\x03\\x04)")
        try:
            self.zf = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
            raise _BadFileError(f"not a readable zip archive (truncated?): {e}") from None
        names = self.zf.namelist()
        if not names or "/" not in names[0]:
            raise _BadFileError("zip archive is not a torch.save file: its records are not under one directory")
        self.prefix = names[0].split("/", 1)[0]
        self.storages: dict[str, _Storage] = {}

    def info(self, name: str) -> zipfile.ZipInfo | None:
        try:
            return self.zf.getinfo(f"{self.prefix}/{name}")
        except KeyError:
            return None

    def data_start(self, info: zipfile.ZipInfo) -> int:
        if info.flag_bits & 1:
            raise _BadFileError(f"record {info.filename} is encrypted")
        self.fh.seek(info.header_offset)
        head = self.fh.read(30)
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise _BadFileError(f"record {info.filename}: no local header at byte {info.header_offset}")
        name_len, extra_len = struct.unpack_from("<HH", head, 26)
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.compress_size > self.size:
            raise _BadFileError(f"record {info.filename} runs past the end of the file (truncated?)")
        return start

    def record_bytes(self, info: zipfile.ZipInfo) -> bytes:
        if info.compress_type != zipfile.ZIP_STORED:
            try:
                return self.zf.read(info)
            except (zipfile.BadZipFile, zlib.error, NotImplementedError, EOFError) as e:
                raise _BadFileError(f"record {info.filename}: {e}") from None
        self.fh.seek(self.data_start(info))
        data = self.fh.read(info.file_size)
        # torch.save with set_crc32_options(False) writes CRC 0, and torch never checks: skip those.
        if info.CRC and zlib.crc32(data) != info.CRC:
            raise _BadFileError(f"record {info.filename} fails its CRC-32 check")
        return data

    def storage(self, pid) -> _Storage:
        """``persistent_load``: ``('storage', storage_type, key, location, numel)`` -> the record's bytes."""
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise _BadFileError(f"unsupported persistent id {pid!r:.80}")
        _, stype, key, _location, numel = pid
        key = key.decode("ascii") if isinstance(key, bytes) else key
        if type(stype) is not _StorageType or type(key) is not str or type(numel) is not int or numel < 0:
            raise _BadFileError(f"malformed storage reference {pid!r:.80}")
        nbytes = numel * _ITEMSIZE[stype.dtype]
        known = self.storages.get(key)
        if known is not None:
            if (known.dtype, known.nbytes) != (stype.dtype, nbytes):
                raise _BadFileError(f"storage {key} is declared twice with different types or sizes")
            return known
        name = f"{self.prefix}/data/{key}"
        info = self.info(f"data/{key}")
        if info is None:
            raise _BadFileError(f"missing storage record {name}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise _BadFileError(f"storage record {name} is compressed (zip method {info.compress_type}); "
                       "reshard reads tensors in place and needs stored records")
        if info.file_size != nbytes:
            raise _BadFileError(f"storage record {name} holds {info.file_size} bytes but the pickle declares {nbytes}")
        self.storages[key] = _Storage(self.path, key, stype.dtype, nbytes, self.data_start(info))
        return self.storages[key]


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: _Archive) -> None:
        super().__init__(io.BytesIO(data))
        self._archive = archive
        self._opaque: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        module = {"__builtin__": "builtins", "copy_reg": "copyreg"}.get(module, module)
        key = (module, name)
        if key in _GLOBALS:
            return _GLOBALS[key]
        if module == "torch" and _DTYPE_ALIASES.get(name, name) in _DTYPE_NAMES:
            return TorchDtype(_DTYPE_ALIASES.get(name, name))  # _finish re-creates it, undoing any BUILD on it
        if _allowlisted(module) or key == ("torch", "device"):
            if key not in self._opaque:
                self._opaque[key] = type(name, (_OpaqueInstance,), {"_global": key, "__slots__": ()})
            return self._opaque[key]
        raise _BadFileError(f"pickle references {module}.{name}, which reshard will not load (allowed: {_ALLOWED})")

    def persistent_load(self, pid: Any) -> Any:
        return self._archive.storage(pid)


def _tensor_ref(p: _Pending) -> TensorRef:
    st = p.storage
    if type(st) is not _Storage:
        raise _BadFileError("a tensor's storage is not a storage record")
    dtype = p.dtype.name if type(p.dtype) is TorchDtype else p.dtype
    if dtype not in _ITEMSIZE:
        raise _BadFileError(f"tensor dtype {dtype!r:.40} is not supported")
    if p.metadata:
        raise _BadFileError(f"tensor metadata {p.metadata!r:.60} (conjugate/negative bits) is not supported")
    shape, stride = _ints(p.size, "size"), _ints(p.stride, "stride")
    if len(shape) != len(stride) or type(p.offset) is not int or p.offset < 0 or type(p.requires_grad) is not bool:
        raise _BadFileError(f"malformed tensor: offset {p.offset!r:.20}, size {shape}, stride {stride}")
    itemsize = _ITEMSIZE[dtype]
    extent = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    if extent and (p.offset + extent) * itemsize > st.nbytes:
        raise _BadFileError(f"a {dtype} tensor of shape {list(shape)}, stride {list(stride)} at storage offset "
                            f"{p.offset} needs {(p.offset + extent) * itemsize} bytes of storage {st.key}, "
                            f"which holds {st.nbytes}")
    return TensorRef(dtype=dtype, shape=shape, stride=stride, storage=st.key, storage_offset=p.offset,
                     path=st.path, data_offset=st.data_start + p.offset * itemsize, storage_nbytes=st.nbytes,
                     requires_grad=p.requires_grad, parameter=p.parameter)


_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, slice, TorchSize, np.ndarray, np.generic)


def _finish(obj: object, memo: dict[int, tuple[object, object]]) -> object:
    """Turns what the unpickler built into the values read_torch_file returns, checking every tensor.

    ``memo`` maps ``id(original)`` to ``(original, result)``, keeping originals alive so ids stay unique.
    """
    if isinstance(obj, _ATOMS) or _is_builtin_type(obj):
        return obj
    if id(obj) in memo:
        return memo[id(obj)][1]
    t = type(obj)
    if isinstance(obj, dict):  # dict, OrderedDict, defaultdict: rebuilt in place, so shared references stay shared
        memo[id(obj)] = (obj, obj)
        items = [(_finish(k, memo), _finish(v, memo)) for k, v in obj.items()]
        obj.clear()
        obj.update(items)
        if t is collections.OrderedDict:  # state-dict _metadata arrives as BUILD state
            obj.__dict__.update({k: _finish(v, memo) for k, v in vars(obj).items()})
        return obj
    if t is list:
        memo[id(obj)] = (obj, obj)
        obj[:] = [_finish(v, memo) for v in obj]
        return obj
    if t is _Namespace:
        out = argparse.Namespace()
        memo[id(obj)] = (obj, out)
        out.__dict__.update({k: _finish(v, memo) for k, v in vars(obj).items()})
        return out
    if t is tuple or t is set or t is frozenset:
        out = t(_finish(v, memo) for v in obj)
    elif t is _Pending:
        out = _tensor_ref(obj)
    elif t is TorchDtype:
        out = TorchDtype(obj.name)
    elif isinstance(obj, _OpaqueInstance):
        module, name = t._global
        out = Opaque(module, name, _finish(obj.args, memo), _finish(obj.state, memo), obj.newobj,
                     _finish(tuple(obj.listitems), memo), _finish(tuple(obj.dictitems), memo))
    elif isinstance(obj, type) and issubclass(obj, _OpaqueInstance):
        out = Opaque(*obj._global, None)
    elif t is _ArrayBuilder and obj.value is not None:
        out = obj.value
    elif t is _DtypeBuilder:
        out = obj.dtype
    else:
        what = obj.name if t in (_Callable, _Marker) else t.__name__
        raise _BadFileError(f"pickle stores {what} as a value, which reshard does not support")
    memo[id(obj)] = (obj, out)
    return out


def read_torch_file(path: str | Path) -> object:
    """The object a ``torch.save`` file holds, with tensors as ``TensorRef`` and no tensor data read.

    Nothing from the file is imported or called: the pickle may name only torch's tensor rebuilders,
    storages, dtypes and ``torch.Size``, numpy arrays/dtypes/scalars (rebuilt here from their bytes),
    ``argparse.Namespace``, builtin containers, and classes under ``ALLOWED_PREFIXES``, which become
    ``Opaque`` records. Dtypes come back as ``TorchDtype``, ``torch.Size`` as ``TorchSize`` (a tuple).

    Raises:
        CheckpointFormatError: naming the file and the reason: not a zip (legacy torch.save format),
            truncated, no ``data.pkl``, a forbidden global, a missing, compressed or too short storage record.

    Example:
        >>> sd = read_torch_file("iter_0000100/mp_rank_00/model_optim_rng.pt")
        >>> ref = sd["model"]["embedding.word_embeddings.weight"]
        >>> ref.dtype, ref.shape, ref.data_offset  # read ref.nbytes bytes there when ref.is_contiguous
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            archive = _Archive(path, fh)
            info = archive.info("data.pkl")
            if info is None:
                raise _BadFileError(f"no {archive.prefix}/data.pkl record, so not a torch.save file")
            order = archive.info("byteorder")
            if order is not None and archive.record_bytes(order) != b"little":
                raise _BadFileError("written on a big-endian machine; reshard copies bytes verbatim and reads "
                                    "only little-endian files")
            data = archive.record_bytes(info)
            try:
                tree = _SafeUnpickler(data, archive).load()
                return _finish(tree, {})
            except (_BadFileError, OSError):
                raise
            except Exception as e:  # a malformed pickle: wrong opcodes, wrong argument counts, deep nesting, ...
                raise _BadFileError(f"data.pkl is not a pickle reshard can read ({type(e).__name__}: {e})") from e
    except _BadFileError as e:
        raise CheckpointFormatError(f"{path}: {e}") from e.__cause__
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read: {e.strerror or e}") from e


# ---------------------------------------------------------------------------------------------- writing


class _Pickler:
    """Writes the protocol-2 pickle torch.save writes for a tree, naming globals without importing them.

    Like pickle, it memoizes globals and containers (BINPUT, then BINGET on the next visit), so shared
    objects stay shared and a tree that shares sub-trees is written once.
    """

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.memo: dict[object, int] = {}  # global name or id(object) -> memo index
        self.alive: list[object] = []  # memoized objects, kept alive so their ids stay unique
        self.storages: dict[object, tuple[str, TensorSpec]] = {}  # spec key -> (storage key, spec), in pickling order

    def dump(self, obj: object) -> bytes:
        self.out.write(b"\x80\x02")
        self.save(obj)
        self.out.write(b".")
        return self.out.getvalue()

    def get(self, index: int) -> None:
        self.out.write(b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index))

    def put(self, key: object, obj: object = None) -> None:
        index = self.memo[key] = len(self.memo)
        self.alive.append(obj)
        self.out.write(b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index))

    def save(self, obj: object) -> None:
        w, t = self.out.write, type(obj)
        if id(obj) in self.memo:
            self.get(self.memo[id(obj)])
        elif obj is None or t in (bool, int, float, str, bytes):
            self.save_atom(obj)
        elif t is tuple or t is TorchSize:
            if t is TorchSize:
                self.save_global(("torch", "Size"))
            self.save_tuple(tuple(obj))
            if t is TorchSize:
                w(b"\x85R")
            self.put(id(obj), obj)
        elif t is list or t is dict:
            w(b"]" if t is list else b"}")
            self.put(id(obj), obj)
            self.save_batches(obj if t is list else obj.items(), pairs=t is dict)
        elif t is collections.OrderedDict or t is collections.defaultdict:
            args = () if t is collections.OrderedDict else (obj.default_factory,)
            self.save_reduce(("collections", t.__name__), args)
            self.put(id(obj), obj)
            self.save_batches(obj.items(), pairs=True)
            self.save_state(getattr(obj, "__dict__", None))  # a state dict's _metadata
        elif t in (set, frozenset, complex, bytearray):
            args = (list(obj),) if t in (set, frozenset) else (obj.real, obj.imag) if t is complex else (bytes(obj),)
            self.save_reduce(("__builtin__", t.__name__), args)
            self.put(id(obj), obj)
        elif t is argparse.Namespace:
            self.save_global(("argparse", "Namespace"))
            w(b")\x81")
            self.put(id(obj), obj)
            self.save_state(vars(obj))
        elif t is TorchDtype:
            self.save_global(("torch", obj.name))
        elif t is TensorSpec:
            self.save_tensor(obj)
            self.put(id(obj), obj)
        elif t is Opaque:
            self.save_opaque(obj)
            self.put(id(obj), obj)
        elif isinstance(obj, (np.ndarray, np.generic, np.dtype)):
            func, args, *rest = obj.__reduce_ex__(2)  # numpy's own reduction, as torch.save's pickler uses
            self.save_reduce(_numpy_global(func), args)
            self.save_state(rest[0] if rest else None)
        elif _is_builtin_type(obj):  # a defaultdict's factory
            self.save_global(("__builtin__", obj.__name__))
        elif isinstance(obj, type) and obj.__module__.split(".")[0] == "numpy":
            self.save_global(_numpy_global(obj))
        elif t is TensorRef:
            raise TypeError(f"cannot write TensorRef {obj.storage}: replace it with a TensorSpec (see map_tensors)")
        else:
            raise TypeError(f"reshard cannot write a {t.__module__}.{t.__qualname__} into a torch file")

    def save_atom(self, obj: None | bool | int | float | str | bytes) -> None:
        w, t = self.out.write, type(obj)
        if obj is None or t is bool:
            w(b"N" if obj is None else b"\x88" if obj else b"\x89")
        elif t is float:
            w(b"G" + struct.pack(">d", obj))
        elif t is str:
            data = obj.encode("utf-8", "surrogatepass")
            w(b"X" + struct.pack("<I", len(data)) + data)
        elif t is bytes:  # protocol 2 has no bytes opcode
            args = (obj.decode("latin1"), "latin1") if obj else ()
            self.save_reduce(("_codecs", "encode") if obj else ("__builtin__", "bytes"), args)
        elif 0 <= obj < 65536:
            w(b"K" + bytes([obj]) if obj < 256 else b"M" + struct.pack("<H", obj))
        elif -(2**31) <= obj < 2**31:
            w(b"J" + struct.pack("<i", obj))
        else:  # LONG1/LONG4: little-endian two's complement, shortest form
            data = obj.to_bytes(obj.bit_length() // 8 + 1, "little", signed=True)
            if obj < 0 and len(data) > 1 and data[-1] == 0xFF and data[-2] & 0x80:
                data = data[:-1]
            w((b"\x8a" + bytes([len(data)]) if len(data) < 256 else b"\x8b" + struct.pack("<i", len(data))) + data)

    def save_tuple(self, items: tuple) -> None:
        if len(items) > 3:
            self.out.write(b"(")
        for item in items:
            self.save(item)
        self.out.write(b")\x85\x86\x87"[len(items): len(items) + 1] if len(items) <= 3 else b"t")

    def save_batches(self, items, *, pairs: bool) -> None:
        """APPENDS or SETITEMS (``pairs``) in batches of 1000, as pickle does."""
        items = list(items)
        for i in range(0, len(items), 1000):
            batch = items[i: i + 1000]
            if len(batch) > 1:
                self.out.write(b"(")
            for item in batch:
                for part in item if pairs else (item,):
                    self.save(part)
            self.out.write((b"u" if len(batch) > 1 else b"s") if pairs else (b"e" if len(batch) > 1 else b"a"))

    def save_state(self, state: object) -> None:
        if state:
            self.save(state)
            self.out.write(b"b")

    def save_global(self, name: tuple[str, str]) -> None:
        if name in self.memo:
            self.get(self.memo[name])
        else:
            self.out.write(f"c{name[0]}\n{name[1]}\n".encode())
            self.put(name)

    def save_reduce(self, name: tuple[str, str], args: tuple) -> None:
        self.save_global(name)
        self.save_tuple(args)
        self.out.write(b"R")

    def save_tensor(self, spec: TensorSpec) -> None:
        known = self.storages.setdefault(spec.key, (str(len(self.storages)), spec))
        if (known[1].dtype, known[1].shape) != (spec.dtype, spec.shape):
            raise ValueError(f"tensor key {spec.key!r} names two different tensors")
        if spec.parameter:
            self.save_global(("torch._utils", "_rebuild_parameter"))
        legacy = spec.dtype in _STORAGE_OF
        self.save_global(("torch._utils", "_rebuild_tensor_v2" if legacy else "_rebuild_tensor_v3"))
        self.out.write(b"((")  # the arguments, then the persistent id
        self.save("storage")
        self.save_global(("torch", _STORAGE_OF[spec.dtype]) if legacy else ("torch.storage", "UntypedStorage"))
        for part in (known[0], "cpu", spec.numel if legacy else spec.nbytes):
            self.save(part)
        self.out.write(b"tQ")  # BINPERSID
        for part in (0, spec.shape, _contiguous_stride(spec.shape), spec.requires_grad and not spec.parameter):
            self.save(part)
        self.save_reduce(("collections", "OrderedDict"), ())  # backward hooks, always empty
        if not legacy:
            self.save_global(("torch", spec.dtype))
        self.out.write(b"tR")
        if spec.parameter:
            self.save(spec.requires_grad)
            self.save_reduce(("collections", "OrderedDict"), ())
            self.out.write(b"\x87R")

    def save_opaque(self, o: Opaque) -> None:
        if not (_allowlisted(o.module) or (o.module, o.name) == ("torch", "device")):
            raise ValueError(f"Opaque {o.module}.{o.name} is outside the allowlist ({', '.join(ALLOWED_PREFIXES)})")
        self.save_global((o.module, o.name))
        if o.args is None:
            return
        self.save_tuple(tuple(o.args))
        self.out.write(b"\x81" if o.newobj else b"R")
        if o.listitems:
            self.save_batches(o.listitems, pairs=False)
        if o.dictitems:
            self.save_batches(o.dictitems, pairs=True)
        if o.state is not None:
            self.save(o.state)
            self.out.write(b"b")


def _numpy_global(obj) -> tuple[str, str]:
    module, name = obj.__module__, obj.__qualname__
    if module.split(".")[0] != "numpy":
        raise TypeError(f"numpy reduced to {module}.{name}, which reshard does not write")
    return module, name


_LOCAL = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry, 46 bytes
_U32 = 0xFFFFFFFF
_ALIGNMENT = 64


@dataclass(slots=True)
class _Record:
    name: bytes  # full name, archive prefix included
    size: int
    payload: bytes | None = None  # None: tensor bytes come through write()
    header_offset: int = 0
    data_offset: int = 0
    central_offset: int = 0  # of its central directory entry
    written: int = 0
    crc: int = 0

    def zip64_fields(self) -> bytes:
        """The zip64 extra field miniz writes: sizes when >= 4 GiB, then the header offset when it is >= 4 GiB."""
        fields = [self.size, self.size] if self.size >= _U32 else []
        fields += [self.header_offset] if self.header_offset >= _U32 else []
        return struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""

    def place(self, offset: int) -> int:
        """Puts the header at ``offset``; returns where the next record starts."""
        self.header_offset = offset
        start = offset + _LOCAL.size + len(self.name) + len(self.zip64_fields()) + 4  # 4: the FB padding block's header
        self.data_offset = -(-start // _ALIGNMENT) * _ALIGNMENT
        return self.data_offset + self.size + self.descriptor_size()

    def descriptor_size(self) -> int:
        return 0 if not self.size else 24 if self.zip64_fields() else 16

    def flags(self) -> int:
        return 0x0808 if self.size else 0x0800  # UTF-8 names; sizes and CRC in a data descriptor

    def local_header(self) -> bytes:
        z64 = self.zip64_fields()
        pad = self.data_offset - (self.header_offset + _LOCAL.size + len(self.name) + len(z64) + 4)
        extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        return _LOCAL.pack(0x04034B50, 45 if z64 else 0, self.flags(), 0, 0, 0, 0, 0, 0,
                           len(self.name), len(extra)) + self.name + extra

    def descriptor(self) -> bytes:
        if not self.size:
            return b""
        sizes = struct.pack("<QQ" if self.zip64_fields() else "<II", self.size, self.size)
        return struct.pack("<II", 0x08074B50, self.crc) + sizes

    def central_entry(self) -> bytes:
        z64, size32 = self.zip64_fields(), min(self.size, _U32)
        return _CENTRAL.pack(0x02014B50, 0, 45 if z64 else 0, self.flags(), 0, 0, 0, self.crc, size32, size32,
                             len(self.name), len(z64), 0, 0, 0, 0, min(self.header_offset, _U32)) + self.name + z64


def _end_records(cd_offset: int, cd_size: int, count: int) -> bytes:
    return (struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, count, count, cd_size, cd_offset)
            + struct.pack("<IIQI", 0x07064B50, 0, cd_offset + cd_size, 1)
            + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                          min(cd_size, _U32), min(cd_offset, _U32), 0))


def _archive_name(path: Path) -> str:
    stem = path.name[: path.name.rfind(".")] if "." in path.name else path.name
    return stem if stem and stem.isascii() else "archive"  # torch falls back to "archive" for non-ASCII names


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class TorchFileWriter:
    """Writes a torch.save file whose tensor bytes are streamed in afterwards, tensor by tensor.

    The constructor pickles ``obj`` (a tree of dict/OrderedDict/defaultdict/list/tuple/set, scalars, str,
    bytes, None, ``argparse.Namespace``, numpy arrays and scalars, ``Opaque``, ``TorchDtype``, ``TorchSize``
    and ``TensorSpec`` leaves), lays out the whole zip as torch.save does, creates the file at its final
    size and writes everything but tensor bytes. Each ``TensorSpec`` gets its own contiguous storage; a key
    used twice gives two tensors sharing one storage. Then ``write`` appends each tensor's bytes, and
    ``close`` checks every tensor is complete, fills in the CRC-32s and fsyncs.

    Used as a context manager, an exception (or an incomplete tensor) removes the partial file.

    Example:
        >>> tree = {"w": TensorSpec("bfloat16", (4096, 4096), key="w"), "iteration": 100}
        >>> with TorchFileWriter("model.pt", tree) as out:
        ...     offset, nbytes = out.entries["w"]
        ...     for lo in range(0, nbytes, 1 << 22):
        ...         out.write("w", fill(lo, min(lo + (1 << 22), nbytes)))
    """

    entries: dict[object, tuple[int, int]]
    """``TensorSpec.key`` -> (absolute byte offset of the tensor's bytes in the file, nbytes)."""

    def __init__(self, path: str | Path, obj: object, *, archive_name: str | None = None) -> None:
        self.path = Path(path)
        pickler = _Pickler()
        data = pickler.dump(obj)
        prefix = archive_name or _archive_name(self.path)
        if "/" in prefix or not prefix.isascii():
            raise ValueError(f"archive name {prefix!r} must be ASCII without '/'")
        head = [("data.pkl", data), (".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")]
        records = [_Record(f"{prefix}/{name}".encode(), len(p), p) for name, p in head]
        self._tensors = {k: _Record(f"{prefix}/data/{skey}".encode(), spec.nbytes)
                         for k, (skey, spec) in pickler.storages.items()}
        self._id = _Record(f"{prefix}/.data/serialization_id".encode(), 40, b"0" * 40)  # filled in by close()
        version = _Record(f"{prefix}/version".encode(), 2, b"3\n")
        self._records = [*records, *self._tensors.values(), version, self._id]
        offset = 0
        for r in self._records:
            offset = r.place(offset)
            if r.payload is not None:
                r.crc, r.written = zlib.crc32(r.payload), r.size
        for r in self._records:
            r.central_offset, offset = offset, offset + len(r.central_entry())
        cd_offset = self._records[0].central_offset
        tail = _end_records(cd_offset, offset - cd_offset, len(self._records))
        self.entries = {k: (r.data_offset, r.size) for k, r in self._tensors.items()}
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self._fd, offset + len(tail))
            for r in self._records:
                _pwrite(self._fd, r.local_header(), r.header_offset)
                if r.payload is not None:
                    _pwrite(self._fd, r.payload + r.descriptor(), r.data_offset)
                _pwrite(self._fd, r.central_entry(), r.central_offset)
            _pwrite(self._fd, tail, offset)
        except BaseException:
            self.abort()
            raise

    def write(self, key: object, data: bytes | memoryview | np.ndarray) -> None:
        """Appends the next bytes of tensor ``key`` (row-major; an array's raw bytes are used whatever its dtype)."""
        if self._fd is None:
            raise CheckpointFormatError(f"{self.path}: write after close")
        r = self._tensors[key]
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        n = memoryview(data).nbytes
        if r.written + n > r.size:
            raise CheckpointFormatError(
                f"{self.path}: tensor {key!r} takes {r.size} bytes; {n} more after {r.written} would overflow it")
        _pwrite(self._fd, data, r.data_offset + r.written)
        r.crc = zlib.crc32(data, r.crc)
        r.written += n

    def close(self) -> None:
        """Checks every tensor got exactly its bytes, writes the CRC-32s and fsyncs. Removes the file if not."""
        if self._fd is None:
            return
        short = [f"{k!r} ({r.written} of {r.size} bytes)" for k, r in self._tensors.items() if r.written != r.size]
        if short:
            self.abort()
            more = f" and {len(short) - 5} more" if len(short) > 5 else ""
            raise CheckpointFormatError(f"{self.path}: tensors not fully written: {', '.join(short[:5])}{more}")
        # torch only logs the serialization id; ours is, like torch's, a hash of the record names then of the CRCs.
        names = hashlib.blake2b(b"\0".join(r.name for r in self._records), digest_size=8).digest()
        crcs = hashlib.blake2b(b"".join(struct.pack("<I", r.crc) for r in self._records), digest_size=8).digest()
        self._id.payload = f"{int.from_bytes(names, 'little'):020d}{int.from_bytes(crcs, 'little'):020d}".encode()
        self._id.crc = zlib.crc32(self._id.payload)
        try:
            _pwrite(self._fd, self._id.payload, self._id.data_offset)
            for r in [*self._tensors.values(), self._id]:
                if r.size:  # the data descriptor, then the central directory entry
                    _pwrite(self._fd, struct.pack("<I", r.crc), r.data_offset + r.size + 4)
                _pwrite(self._fd, struct.pack("<I", r.crc), r.central_offset + 16)
            os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        self._fd = None

    def abort(self) -> None:
        """Closes and removes the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> TorchFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_torch_file(path: str | Path, obj: object, tensors: Mapping[object, bytes | np.ndarray]) -> None:
    """Writes ``obj`` with each ``TensorSpec``'s bytes taken whole from ``tensors[spec.key]``: for small files."""
    with TorchFileWriter(path, obj) as out:
        for key in out.entries:
            out.write(key, tensors[key])
