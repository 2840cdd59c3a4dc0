"""Reading torch.save files: a restricted unpickler that maps tensors to ``TensorRef``s; the format is described in ``reshard.torchfile``."""

from __future__ import annotations

import argparse
import collections
import io
import math
import os
import pickle
import re
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from reshard.errors import CheckpointFormatError
from reshard.torch_types import (
    _ALLOWED,
    _DTYPE_ALIASES,
    _DTYPE_NAMES,
    _ITEMSIZE,
    _LEGACY_STORAGES,
    Opaque,
    TensorRef,
    TorchDtype,
    TorchSize,
    _allowlisted,
)


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
    attrs: tuple = ()


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
    if not (new_type is _TENSOR or new_type is _PARAMETER):
        raise _BadFileError("tensor subclasses are not supported")
    attrs: tuple = ()
    if state:
        # Plain attributes set on a tensor (DeepSpeed ZeRO-3 tags its flat groups with ds_id): kept as data.
        if new_type is not _TENSOR or not isinstance(state, dict) or not all(
                type(k) is str and type(v) in (str, int, float, bool, type(None)) for k, v in state.items()):
            raise _BadFileError(f"a tensor with Python attributes {state!r:.80} is not supported "
                                "(only plain str/int/float/bool values on a torch.Tensor are)")
        attrs = tuple(sorted(state.items()))
    return func(*args)._replace(parameter=new_type is _PARAMETER, attrs=attrs)


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


class _Slice(io.RawIOBase):
    """Bytes ``[base, base + size)`` of an open file, as a file of their own (a zip embedded in a larger file)."""

    def __init__(self, fh, base: int, size: int) -> None:
        super().__init__()
        self._fh, self._base, self._size, self._pos = fh, base, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        origin = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, origin + offset)
        return self._pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self._size - self._pos))
        if not n:
            return 0
        got = os.preadv(self._fh.fileno(), [memoryview(buf)[:n]], self._base + self._pos)
        self._pos += got
        return got


class _Archive:
    """The zip side of a torch file: its records and where their data starts.

    The archive may sit inside a larger file (a DCP ``.distcp`` holds one per
    chunk): ``base`` is where it starts there, and every offset this class
    returns is absolute in that file.
    """

    def __init__(self, path: Path, fh, base: int = 0, size: int | None = None) -> None:
        self.path, self.base = path, base
        total = os.fstat(fh.fileno()).st_size
        if size is None:
            size = total - base
        if base < 0 or size < 0 or base + size > total:
            raise _BadFileError(f"bytes [{base}, {base + size}) run past the end of the file ({total} bytes; truncated?)")
        self.size = size
        self.fh = fh = _Slice(fh, base, size) if (base, size) != (0, total) else fh
        magic = fh.read(4)
        if magic != b"PK\x03\x04":
            if magic[:1] == b"\x80":
                raise _BadFileError("written in the legacy torch.save format (_use_new_zipfile_serialization=False), "
                           "which reshard does not read; re-save it with a current torch.save")
            raise _BadFileError("not a zip archive, so not a torch.save file (those start with PK\\x03\\x04)")
        try:
            self.zf = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError, UnicodeDecodeError,
                struct.error) as e:
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
        self.storages[key] = _Storage(self.path, key, stype.dtype, nbytes, self.base + self.data_start(info))
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
                     requires_grad=p.requires_grad, parameter=p.parameter, attrs=p.attrs)


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


def read_torch_file(path: str | Path, *, offset: int = 0, length: int | None = None) -> object:
    """The object a ``torch.save`` file holds, with tensors as ``TensorRef`` and no tensor data read.

    With ``offset``/``length``, the torch.save archive is those bytes of the file (as in DCP's
    ``.distcp`` files, which hold one archive per chunk); ``TensorRef.data_offset`` is still
    absolute in ``path``.

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
            archive = _Archive(path, fh, offset, length)
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
        where = f" (archive at bytes {offset}..{offset + length})" if length is not None else ""
        raise CheckpointFormatError(f"{path}{where}: {e}") from e.__cause__
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read: {e.strerror or e}") from e
