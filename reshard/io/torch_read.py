"""Reading torch.save files: a restricted unpickler that maps tensors to ``TensorRef``s; the format is described in ``reshard.io.torchfile``."""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from reshard.errors import CheckpointFormatError
from reshard.io.bounds import FieldError, brief, check_count, check_offset, check_range, check_shape
from reshard.io.location import RemoteFile, UrlPath, file_size, pread
from reshard.io.pickle_scan import check_pickle
from reshard.io.torch_types import (
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
from reshard.io.zipdir import STORED, ZipEntry, ZipReader


class _BadFileError(FieldError):
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
        bad = next((k for k in state if type(k) is not str), None)
        if bad is not None:
            raise _BadFileError(f"argparse.Namespace attribute name {brief(bad)} is not a string")
        self.__dict__.update(state)


class _DtypeBuilder:
    """``numpy.dtype(spec, align, copy)`` then BUILD ``(version, byteorder, subarray, names, fields, ...)``."""

    def __init__(self, spec, align=False, copy=True) -> None:
        if not isinstance(spec, str) or not re.fullmatch(r"[biufc]\d{1,2}|[SUV][1-9]\d{0,8}", spec):
            raise _BadFileError(f"numpy dtype {brief(spec)} is not supported")
        try:
            self.dtype = np.dtype(spec)
        except TypeError:  # a size numpy has no such type for: i3, f1, ...
            raise _BadFileError(f"numpy dtype {spec!r} is not supported") from None

    def __setstate__(self, state) -> None:
        if not isinstance(state, tuple) or len(state) < 5 or any(x is not None for x in state[2:5]):
            raise _BadFileError(f"numpy dtype state {brief(state)} is not supported (structured or subarray dtype?)")
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
        if len(shape) > 64:
            raise _BadFileError(f"numpy array has {len(shape)} dims, more than numpy's 64")
        numel = check_shape("numpy array shape", shape, dtype.itemsize)
        if len(raw) != numel * dtype.itemsize:
            raise _BadFileError(f"numpy array of shape {brief(shape)} and dtype {dtype} has {len(raw)} bytes, "
                                f"not {numel * dtype.itemsize}")
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
        raise _BadFileError(f"tensor {what} {brief(value)} is not a tuple of non-negative ints")
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
        raise _BadFileError(f"a Parameter with Python attributes {brief(state)} is not supported")
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
            raise _BadFileError(f"a tensor with Python attributes {brief(state)} is not supported "
                                "(only plain str/int/float/bool values on a torch.Tensor are)")
        attrs = tuple(sorted(state.items()))
    return func(*args)._replace(parameter=new_type is _PARAMETER, attrs=attrs)


def _encode(text, encoding="utf-8", errors="strict"):  # _codecs.encode: how protocol 2 spells bytes
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8", "ascii"):
        raise _BadFileError(f"_codecs.encode with encoding {brief(encoding, 40)} is not supported")
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


def _check_magic(magic: bytes) -> None:
    """Refuse a file whose first bytes are not a zip record's: a legacy torch.save file, or no zip."""
    if magic != b"PK\x03\x04":
        if magic[:1] == b"\x80":
            raise _BadFileError("written in the legacy torch.save format (_use_new_zipfile_serialization=False), "
                                "which reshard does not read; re-save it with a current torch.save")
        raise _BadFileError("not a zip archive, so not a torch.save file (those start with PK\\x03\\x04)")


class _Archive:
    """The zip side of a torch file: its records and where their data starts.

    The archive may sit inside a larger file (a DCP ``.distcp`` holds one per
    chunk): ``base`` is where it starts there, and every offset this class
    returns is absolute in that file.
    """

    def __init__(self, path: Path, fh, base: int = 0, size: int | None = None) -> None:
        self.path, self.base = path, base
        fd = fh if isinstance(fh, RemoteFile) else fh.fileno()
        total = file_size(fh)
        check_count("archive offset", base)
        if size is None:
            check_offset("archive offset", base, total)
            size = total - base
        check_range("archive offset", base, check_count("archive length", size), total)
        self.size = size
        try:  # the end records first: with them comes all of a small file, its first bytes too
            self.zip = ZipReader(fd, base, size, end="the file" if (base, size) == (0, total) else "the archive")
        except FieldError:
            _check_magic(pread(fd, min(4, size), base))  # not a zip at all says more than its broken end
            raise
        _check_magic(self.zip.read(0, min(4, size), "archive offset"))
        names = list(self.zip.entries)
        if not names or "/" not in names[0]:
            raise _BadFileError("zip archive is not a torch.save file: its records are not under one directory")
        self.prefix = names[0].split("/", 1)[0]
        self.storages: dict[str, _Storage] = {}

    def info(self, name: str) -> ZipEntry | None:
        return self.zip.entries.get(f"{self.prefix}/{name}")

    def storage(self, pid) -> _Storage:
        """``persistent_load``: ``('storage', storage_type, key, location, numel)`` -> the record's bytes."""
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise _BadFileError(f"unsupported persistent id {brief(pid)}")
        _, stype, key, _location, numel = pid
        if isinstance(key, bytes):
            if not key.isascii():
                raise _BadFileError(f"storage key {key[:40]!r} is not ASCII")
            key = key.decode("ascii")
        if type(stype) is not _StorageType or type(key) is not str:
            raise _BadFileError(f"malformed storage reference {brief(pid)}")
        nbytes = check_count(f"storage {key[:40]!r} numel", numel) * _ITEMSIZE[stype.dtype]
        known = self.storages.get(key)
        if known is not None:
            if (known.dtype, known.nbytes) != (stype.dtype, nbytes):
                raise _BadFileError(f"storage {key} is declared twice with different types or sizes")
            return known
        name = f"{self.prefix}/data/{key}"
        info = self.info(f"data/{key}")
        if info is None:
            raise _BadFileError(f"missing storage record {name}")
        if info.method != STORED:
            raise _BadFileError(f"storage record {name} is compressed (zip method {info.method}); "
                       "reshard reads tensors in place and needs stored records")
        if info.size != nbytes:
            raise _BadFileError(f"storage record {name} holds {info.size} bytes but the pickle declares {nbytes}")
        self.storages[key] = _Storage(self.path, key, stype.dtype, nbytes, self.base + self.zip.data_start(info))
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
    """The tensor, once its dtype, offset, size and stride are checked to keep every element in its storage."""
    st = p.storage
    if type(st) is not _Storage:
        raise _BadFileError("a tensor's storage is not a storage record")
    dtype = p.dtype.name if type(p.dtype) is TorchDtype else p.dtype
    if type(dtype) is not str or dtype not in _ITEMSIZE:
        raise _BadFileError(f"tensor dtype {brief(dtype, 40)} is not supported")
    if p.metadata is not None and (not isinstance(p.metadata, dict) or p.metadata):
        raise _BadFileError(f"tensor metadata {brief(p.metadata, 60)} (conjugate/negative bits) is not supported")
    shape, stride = _ints(p.size, "size"), _ints(p.stride, "stride")
    if len(shape) != len(stride) or type(p.requires_grad) is not bool:
        raise _BadFileError(f"malformed tensor: size {brief(shape)}, stride {brief(stride)}, "
                            f"requires_grad {brief(p.requires_grad, 20)}")
    what = f"a {dtype} tensor of storage {st.key[:40]}"
    offset = check_count(f"{what}: storage offset", p.offset)
    itemsize = _ITEMSIZE[dtype]
    check_shape(f"{what}: size", shape, itemsize)
    for k, s in enumerate(stride):
        check_count(f"{what}: stride {k}", s)
    if 0 in shape:  # no elements, but its data offset must still be a byte of the storage
        if offset * itemsize > st.nbytes:
            raise _BadFileError(f"{what}: storage offset is {offset}, past the end of the storage ({st.nbytes} "
                                f"bytes) even though the tensor is empty")
    else:
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        if (offset + extent) * itemsize > st.nbytes:
            raise _BadFileError(f"a {dtype} tensor of shape {brief(list(shape))}, stride {brief(list(stride))} at "
                                f"storage offset {offset} needs {(offset + extent) * itemsize} bytes of storage "
                                f"{st.key[:40]}, which holds {st.nbytes}")
    return TensorRef(dtype=dtype, shape=shape, stride=stride, storage=st.key, storage_offset=offset,
                     path=st.path, data_offset=st.data_start + offset * itemsize, storage_nbytes=st.nbytes,
                     requires_grad=p.requires_grad, parameter=p.parameter, attrs=p.attrs)


# Deeper than any checkpoint (a state dict is about 6 deep), and shallow enough that code walking the
# result recursively (map_tensors, the writer) stays far from Python's recursion limit.
_MAX_DEPTH = 100
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, slice, TorchSize, np.ndarray, np.generic)


def _finish(obj: object, memo: dict[int, tuple[object, object]], depth: int = 0) -> object:
    """Turns what the unpickler built into the values read_torch_file returns, checking every tensor.

    ``memo`` maps ``id(original)`` to ``(original, result)``, keeping originals alive so ids stay unique.
    ``depth`` counts the containers above ``obj``: past ``_MAX_DEPTH``, the file is refused.
    """
    if isinstance(obj, _ATOMS) or _is_builtin_type(obj):
        return obj
    if id(obj) in memo:
        return memo[id(obj)][1]
    if depth >= _MAX_DEPTH:
        raise _BadFileError(f"data.pkl nests containers more than {_MAX_DEPTH} deep")
    t = type(obj)
    if isinstance(obj, dict):  # dict, OrderedDict, defaultdict: rebuilt in place, so shared references stay shared
        memo[id(obj)] = (obj, obj)
        items = [(_finish(k, memo, depth + 1), _finish(v, memo, depth + 1)) for k, v in obj.items()]
        obj.clear()
        obj.update(items)
        if t is collections.OrderedDict:  # state-dict _metadata arrives as BUILD state
            obj.__dict__.update({k: _finish(v, memo, depth + 1) for k, v in vars(obj).items()})
        return obj
    if t is list:
        memo[id(obj)] = (obj, obj)
        obj[:] = [_finish(v, memo, depth + 1) for v in obj]
        return obj
    if t is _Namespace:
        out = argparse.Namespace()
        memo[id(obj)] = (obj, out)
        out.__dict__.update({k: _finish(v, memo, depth + 1) for k, v in vars(obj).items()})
        return out
    if t is tuple or t is set or t is frozenset:
        out = t(_finish(v, memo, depth + 1) for v in obj)
    elif t is _Pending:
        out = _tensor_ref(obj)
    elif t is TorchDtype:
        out = TorchDtype(obj.name)
    elif isinstance(obj, _OpaqueInstance):
        module, name = t._global
        inner = depth + 1
        out = Opaque(module, name, _finish(obj.args, memo, inner), _finish(obj.state, memo, inner), obj.newobj,
                     _finish(tuple(obj.listitems), memo, inner), _finish(tuple(obj.dictitems), memo, inner))
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

    Every integer is checked before use: the zip's offsets and sizes against the archive's real size
    (``reshard.io.zipdir``), the pickle's memo indices and byte counts before the unpickler sees them
    (``reshard.io.pickle_scan``), and each tensor's storage offset, size and stride so that every element,
    in int64 arithmetic, lies inside its storage record, which lies inside the file. Containers nest
    at most ``_MAX_DEPTH`` (100) deep.

    Raises:
        CheckpointFormatError: naming the file and the reason: not a zip (legacy torch.save format),
            truncated, no ``data.pkl``, a forbidden global, a missing, compressed or too short storage
            record, or a field out of range (its name, value and the limit it broke).

    Example:
        >>> sd = read_torch_file("iter_0000100/mp_rank_00/model_optim_rng.pt")
        >>> ref = sd["model"]["embedding.word_embeddings.weight"]
        >>> ref.dtype, ref.shape, ref.data_offset  # read ref.nbytes bytes there when ref.is_contiguous
    """
    path = path if isinstance(path, UrlPath) else Path(path)
    try:
        with path.open("rb") as fh:
            archive = _Archive(path, fh, offset, length)
            info = archive.info("data.pkl")
            if info is None:
                raise _BadFileError(f"no {archive.prefix}/data.pkl record, so not a torch.save file")
            order = archive.info("byteorder")
            if order is not None and (order.size > 8 or archive.zip.record(order) != b"little"):
                raise _BadFileError("written on a big-endian machine; reshard copies bytes verbatim and reads "
                                    "only little-endian files")
            data = archive.zip.record(info)
            try:
                check_pickle(data)
                tree = _SafeUnpickler(data, archive).load()
                return _finish(tree, {})
            except (FieldError, OSError):
                raise
            except Exception as e:  # a malformed pickle: wrong opcodes, wrong argument counts, deep nesting, ...
                raise _BadFileError(f"data.pkl is not a pickle reshard can read ({type(e).__name__}: {e})") from e
    except FieldError as e:
        where = f" (archive at bytes {offset}..{offset + length})" if length is not None else ""
        raise CheckpointFormatError(f"{path}{where}: {e}") from e.__cause__
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read: {e.strerror or e}") from e
