"""PyTorch DCP's ``.metadata`` file, read without running its pickle and written for real ``dcp.load``.

A DCP checkpoint directory holds ``.metadata`` (a pickle of
``torch.distributed.checkpoint.metadata.Metadata``) and data files
``__{rank}_{n}.distcp``. For each flattened state-dict key the metadata says
either ``TensorStorageMetadata(properties.dtype, size, chunks)``, each chunk a
box ``(offsets, sizes)`` of the global tensor, or ``BytesStorageMetadata`` (a
``torch.save``-serialized Python object). ``storage_data`` maps
``MetadataIndex(fqn, offset)`` (``offset=None`` for bytes) to
``_StorageInfo(relative_path, offset, length)``: where that chunk's bytes are.
With DCP's default ``FileSystemWriter`` each tensor chunk is a whole
``torch.save`` archive at those bytes. ``planner_data`` maps each flat key to
its path in the nested state dict (``("optim", "param_groups", 0, "lr")``).

Reading allows only the classes above, ``StorageMeta``, ``torch.Size``,
torch dtypes/layouts/memory formats and ``pathlib`` paths; every class becomes
plain data here and nothing is imported from the file. Anything else in the
pickle is an error naming the global. Every integer is checked before it is
kept: sizes, chunk offsets and chunk sizes are non-negative and within torch's
int64, each chunk lies inside its tensor, and each storage entry names a file
of the checkpoint directory itself (no ``/``, ``..`` or absolute path) and,
when ``read_metadata`` finds that file, bytes inside it.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from operator import add, gt
from pathlib import Path
from typing import Any, NamedTuple

from reshard.core.collector import collector_paused
from reshard.errors import CheckpointFormatError
from reshard.io.bounds import INT64_MAX, FieldError, brief, check_count, check_range, check_shape
from reshard.io.dcp_pickle import encode_metadata
from reshard.io.dcp_scan import check_memoize_pickle
from reshard.io.location import UrlPath, as_path
from reshard.io.torch_types import _DTYPE_ALIASES, _DTYPE_NAMES, _ITEMSIZE

__all__ = ["METADATA_NAME", "DcpChunk", "DcpMetadata", "DcpStorage", "DcpTensor", "read_metadata", "write_metadata"]

METADATA_NAME = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_CLASSES = {(_MD, n) for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                               "BytesStorageMetadata", "MetadataIndex", "StorageMeta")} | {(_FS, "_StorageInfo")} | {
    # Megatron-core caches its save plans in the metadata it writes (kept as plain data, never used).
    ("torch.distributed.checkpoint.planner", n)
    for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")} | {
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")}  # megatron-core <= 0.15's plan type


@dataclass(frozen=True, slots=True)
class DcpChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class DcpTensor(NamedTuple):
    """A tensor entry: its dtype, global size and chunks. (A named tuple, as ``DcpStorage``: one per key.)"""

    dtype: str
    """torch dtype name without ``torch.``."""
    size: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


class DcpStorage(NamedTuple):
    """Where one entry's bytes are: ``length`` bytes from byte ``offset`` of the checkpoint's file
    ``relative_path``. (A named tuple: a checkpoint has one per chunk, 200,000 for 100,000 small tensors at dp 2,
    and reading or writing makes each at half a frozen dataclass's cost.)"""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(slots=True)
class DcpMetadata:
    tensors: dict[str, DcpTensor] = field(default_factory=dict)
    byte_entries: list[str] = field(default_factory=list)
    storage: dict[tuple[str, tuple[int, ...] | None], DcpStorage] = field(default_factory=dict)
    """``(flat key, chunk offsets)`` (offsets ``None`` for bytes entries) -> where the bytes are."""
    planner_data: dict[str, tuple] = field(default_factory=dict)
    version: str | None = None


class _Obj:
    """A DCP class instance as plain data: its class name, NEWOBJ arguments and BUILD state."""

    __slots__ = ("name", "args", "state")

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def fields(self) -> dict[str, Any]:
        state = self.state
        if type(state) is dict:
            return state
        if (isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state)):
            merged = dict(state[0] or {})  # (dict state, slots state)
            merged.update(state[1] or {})
            return merged
        if isinstance(state, dict):
            return state
        if state is None:
            return {}
        raise _Bad(f"{self.name} has state {type(state).__name__}, expected a dict of fields")


class _Bad(FieldError):
    pass


def _callable(fn: Callable) -> Any:
    """``fn`` as an object the pickle may call; it refuses BUILD, so a pickle cannot set its defaults for later files.

    Its methods are staticmethods of a class of its own: a call costs one Python frame, ``fn``'s.
    """
    def refuse(state: Any) -> None:
        raise _Bad(f"the pickle sets state on {fn.__name__}")

    return type(f"_call_{fn.__name__}", (), {"__slots__": (), "__call__": staticmethod(fn),
                                             "__setstate__": staticmethod(refuse)})()


def _newobj_class(name: str) -> type:
    # NEWOBJ does ``cls.__new__(cls, *args)`` and requires a class: give each allowed name its own.
    def new(cls: type, *args: Any) -> _Obj:
        obj = object.__new__(cls)
        obj.name, obj.args, obj.state = name, args, None
        return obj

    return type(name, (_Obj,), {"__slots__": (), "__new__": new, "__init__": lambda self, *a: None})


class _Dtype(str):
    pass


class _Layout(str):
    pass


def _torch_size(dims=()) -> tuple[int, ...]:
    if not isinstance(dims, (tuple, list)) or not set(map(type, dims)) <= _INT:
        raise _Bad(f"torch.Size of {brief(dims, 60)}, not a sequence of integers")
    return tuple(dims)


def _mem_format(value):
    if type(value) is not int:
        raise _Bad(f"_MEM_FORMAT_ENCODING of {brief(value, 40)}, not an integer")
    return value


def _get_layout(name):
    if not isinstance(name, str):
        raise _Bad("torch.serialization._get_layout of a non-string")
    return _Layout(name)


def _path(*parts):
    if not all(isinstance(p, str) for p in parts):
        raise _Bad("a pathlib path of non-strings")
    return "/".join(parts)


_INT = frozenset((int,))
_FUNCTIONS = {key: _callable(fn) for key, fn in {
    (_MD, "_MEM_FORMAT_ENCODING"): _mem_format, ("torch", "Size"): _torch_size,
    ("torch.serialization", "_get_layout"): _get_layout, ("pathlib", "Path"): _path,
    ("collections", "OrderedDict"): dict, ("builtins", "set"): set, ("builtins", "frozenset"): frozenset}.items()}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _CLASSES:
            if key not in self._classes:
                self._classes[key] = _newobj_class(name)
            return self._classes[key]
        if key in _FUNCTIONS:
            return _FUNCTIONS[key]
        if module == "torch" and _DTYPE_ALIASES.get(name, name) in _DTYPE_NAMES:
            return _Dtype(_DTYPE_ALIASES.get(name, name))
        if module == "torch" and name in ("strided", "sparse_coo", "contiguous_format", "preserve_format",
                                          "channels_last"):
            return _Layout(name)
        # Python 3.13 pickles pathlib's classes from pathlib._local (FileSystemWriter keeps the checkpoint's path)
        if module in ("pathlib", "pathlib._local") and name in ("PosixPath", "WindowsPath", "Path", "PurePosixPath",
                                                                  "PureWindowsPath"):
            return _FUNCTIONS[("pathlib", "Path")]
        raise _Bad(f"the pickle references {module}.{name}, which a DCP .metadata never holds and reshard "
                   "will not load (allowed: DCP's metadata dataclasses, torch.Size, torch dtypes, pathlib paths)")


def _plain_ints(value: Any) -> bool:
    """``value`` is a tuple of ints in [0, INT64_MAX]: what ``_ints`` passes unchanged, checked in C loops."""
    return (type(value) is tuple and set(map(type, value)) <= _INT and
            (not value or 0 <= min(value) <= max(value) <= INT64_MAX))


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if _plain_ints(value):
        return value
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise _Bad(f"{what} is {brief(value, 60)}, expected a torch.Size of non-negative integers")
    for k, v in enumerate(value):
        check_count(f"{what} [{k}]", v)
    return tuple(value)


def _expect(obj: Any, name: str, what: str, *what_args: Any) -> dict[str, Any]:
    """The fields of ``obj``, a ``name``; else an error calling it ``what.format(*what_args)``."""
    if isinstance(obj, _Obj) and obj.name == name:
        return obj.state if type(obj.state) is dict else obj.fields()
    got = obj.name if isinstance(obj, _Obj) else type(obj).__name__
    raise _Bad(f"{what.format(*what_args)} is a {got}, expected {name}")


def _tensor(key: str, f: dict[str, Any], seen: dict[tuple, DcpChunk]) -> DcpTensor:
    props = _expect(f.get("properties"), "TensorProperties", "'{}' properties", key)
    dtype = props.get("dtype")
    if not isinstance(dtype, _Dtype):
        raise _Bad(f"'{key}' has dtype {brief(dtype, 40)}, expected a torch dtype")
    size = _ints(f.get("size"), f"'{key}' size")
    itemsize = _ITEMSIZE.get(dtype, 1)
    if 0 in size or prod(size) * itemsize > INT64_MAX:  # else its dims (checked by _ints) pass check_shape
        check_shape(f"'{key}' size", size, itemsize)
    chunks = f.get("chunks")
    if not isinstance(chunks, list | tuple | None):
        raise _Bad(f"'{key}' has chunks {brief(chunks, 40)}, expected a list")
    out = []
    for c in chunks or ():
        cf = _expect(c, "ChunkStorageMetadata", "a chunk of '{}'", key)
        offs, sizes = cf.get("offsets"), cf.get("sizes")
        if not (_plain_ints(offs) and _plain_ints(sizes)):
            offs, sizes = _ints(offs, f"'{key}' chunk offsets"), _ints(sizes, f"'{key}' chunk sizes")
        if len(offs) != len(size) or len(sizes) != len(size) or any(map(gt, map(add, offs, sizes), size)):
            raise _Bad(f"'{key}' has a chunk at {brief(list(offs))} of size {brief(list(sizes))} outside its size "
                       f"{brief(list(size))}")
        chunk = seen.get((offs, sizes))  # equal chunks (every layer's, often) share one frozen DcpChunk
        if chunk is None:
            chunk = seen[(offs, sizes)] = DcpChunk(offs, sizes)
        out.append(chunk)
    return DcpTensor(str(dtype), size, tuple(out))


def _properties_state(obj: Any) -> None:
    # TensorProperties.__getstate__ returns (dtype, layout, requires_grad, memory_format, pin_memory).
    if (isinstance(obj, _Obj) and obj.name == "TensorProperties" and isinstance(obj.state, tuple) and
            len(obj.state) == 5):
        obj.state = {"dtype": obj.state[0], "layout": obj.state[1], "requires_grad": obj.state[2],
                     "memory_format": obj.state[3], "pin_memory": obj.state[4]}


def parse_metadata(data: bytes, where: str = METADATA_NAME) -> DcpMetadata:
    """The metadata a ``.metadata`` pickle describes. Raises CheckpointFormatError naming ``where``."""
    try:
        # a large .metadata unpickles to millions of small containers, none in a cycle: the collector's passes
        # over them cost several times the parse (about 5 of 8 seconds for 200,000 chunks)
        with collector_paused():
            return _parse(data)
    except FieldError as e:
        raise CheckpointFormatError(f"{where}: {e}") from None
    except RecursionError:
        raise CheckpointFormatError(f"{where}: the pickle nests too deeply") from None


def _parse(data: bytes) -> DcpMetadata:
    """``parse_metadata`` without its error wrapping: raises FieldError."""
    try:
        check_memoize_pickle(data)
        root = _Unpickler(data).load()
    except _Bad:
        raise
    except Exception as e:  # malformed pickles: wrong opcodes, truncation, wrong argument counts
        raise _Bad(f"not a pickle reshard can read ({type(e).__name__}: {e})") from e
    top = _expect(root, "Metadata", "the pickled object")
    out = DcpMetadata(version=top.get("version") if isinstance(top.get("version"), str) else None)
    sdm = top.get("state_dict_metadata")
    if not isinstance(sdm, dict):
        raise _Bad("Metadata.state_dict_metadata is not a dict")
    chunks: dict[tuple, DcpChunk] = {}
    for key, md in sdm.items():
        if not isinstance(key, str):
            raise _Bad(f"state dict key {brief(key, 60)} is not a string")
        if isinstance(md, _Obj) and md.name == "BytesStorageMetadata":
            out.byte_entries.append(key)
            continue
        fields = _expect(md, "TensorStorageMetadata", "the metadata of '{}'", key)
        _properties_state(fields.get("properties"))
        out.tensors[key] = _tensor(key, fields, chunks)
    storage = top.get("storage_data")
    if not isinstance(storage, dict):
        raise _Bad("Metadata.storage_data is not a dict (was the checkpoint written by a FileSystemWriter?)")
    named: set[str] = set()
    for index, info in storage.items():
        fi = _expect(index, "MetadataIndex", "a storage_data key")
        fqn, offset = fi.get("fqn"), fi.get("offset")
        if not isinstance(fqn, str):
            raise _Bad(f"a storage_data key has fqn {brief(fqn, 60)}")
        offset = None if offset is None else _ints(offset, f"'{fqn}' storage offset")
        si = _expect(info, "_StorageInfo", "the storage of '{}'", fqn)
        path, off, length = si.get("relative_path"), si.get("offset"), si.get("length")
        if type(path) is not str or path not in named:  # each distinct name checked once
            _check_file_name(fqn, path)
            named.add(path)
        if not (type(off) is int and 0 <= off <= INT64_MAX):
            check_count(f"the storage offset of '{fqn}'", off)
        if not (type(length) is int and 0 <= length <= INT64_MAX):
            check_count(f"the storage length of '{fqn}'", length)
        transforms = si.get("transform_descriptors") or ()
        if transforms and (not isinstance(transforms, list | tuple) or not all(isinstance(t, str) for t in transforms)):
            raise _Bad(f"the storage of '{fqn}' has transform_descriptors {brief(transforms, 60)}, expected a "
                       "list of strings")
        out.storage[(fqn, offset)] = DcpStorage(path, off, length, tuple(transforms))
    planner = top.get("planner_data")
    if isinstance(planner, dict):
        out.planner_data = {k: tuple(v) for k, v in planner.items()
                            if isinstance(k, str) and isinstance(v, tuple | list)}
    return out


def _check_file_name(fqn: str, name: object) -> None:
    """A storage entry's ``relative_path`` must name a file directly inside the checkpoint directory."""
    if not isinstance(name, str):
        raise _Bad(f"the storage of '{fqn}' names {brief(name, 60)}, not a file name")
    if "/" in name or "\\" in name or "\0" in name or name in ("", ".", ".."):
        raise _Bad(f"the storage of '{fqn}' names {brief(name, 80)}, which is not a file in the checkpoint directory")
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        raise _Bad(f"the storage of '{fqn}' names {brief(name, 80)}, which is not a valid file name") from None


def read_metadata(directory: Path | UrlPath) -> DcpMetadata:
    """The ``.metadata`` of the checkpoint ``directory``, its storage entries checked against their files.

    An entry whose file exists must lie inside it; a missing file is left to the reader of the
    data to name. Raises CheckpointFormatError naming the ``.metadata`` file.
    """
    directory = as_path(directory)
    path = directory / METADATA_NAME
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read: {e.strerror or e}") from e
    md = parse_metadata(data, str(path))
    sizes: dict[str, int | None] = {}
    for (fqn, _), s in md.storage.items():
        if s.relative_path not in sizes:
            try:
                st = (directory / s.relative_path).stat()
                sizes[s.relative_path] = st.st_size if stat.S_ISREG(st.st_mode) else None
            except OSError:
                sizes[s.relative_path] = None
        size = sizes[s.relative_path]
        if size is not None and s.offset + s.length > size:  # both are non-negative: parse_metadata checked them
            try:
                check_range(f"the storage offset of '{fqn}' in {s.relative_path}", s.offset, s.length, size,
                            end=s.relative_path)
            except FieldError as e:
                raise CheckpointFormatError(f"{path}: {e}") from None
    return md


def write_metadata(directory: Path, md: DcpMetadata) -> Path:
    """Write ``.metadata`` as DCP's ``FileSystemWriter`` does: the pickle of torch's own classes.

    The bytes are emitted by ``dcp_pickle.encode_metadata`` (the same bytes ``pickle.dump`` writes for
    those objects, without building them).
    """
    path = Path(directory) / METADATA_NAME
    pieces = encode_metadata(md)
    with open(path, "wb") as f:
        f.writelines(pieces)
    return path
