"""Read and write safetensors files without holding them in memory, and plan HF shards.

The format (huggingface/safetensors README, "Format"): 8 bytes ``N``, an
unsigned little-endian 64-bit header length; ``N`` bytes of UTF-8 JSON that
MUST begin with ``{`` and MAY be padded with trailing spaces, mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [BEGIN, END]}`` and the
optional ``__metadata__`` to a string-to-string map; then the byte buffer.
``data_offsets`` are relative to the start of the byte buffer, and the
buffer "needs to be entirely indexed, and cannot contain holes".

``read_header`` enforces every rule above before a single tensor byte is
read; ``SafetensorsWriter`` writes a file byte-identical to
``safetensors.torch.save_file`` for the same tensors, streaming each tensor's
bytes in; ``plan_shards`` (from ``reshard.io.hf_shards``) splits a state dict into shard files the way
``save_pretrained`` does. No torch at runtime.

Dtypes are torch names without ``torch.`` (``bfloat16``, ``float32``, ...),
as everywhere in reshard; safetensors' own codes (``BF16``, ``F32``) stay in
this module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

from reshard.core.dtypes import DTYPES, ITEMSIZE, SAFETENSORS_CODES
from reshard.errors import CheckpointFormatError
from reshard.io.bounds import FieldError, check_count, check_offset, check_shape
from reshard.io.hf_shards import INDEX_NAME, WEIGHTS_NAME, ShardPlan, plan_shards
from reshard.io.location import UrlPath, file_size
from reshard.io.storage import FilePart, OutputFile, ReadBack, Skip

__all__ = [
    "INDEX_NAME",
    "MAX_HEADER_SIZE",
    "WEIGHTS_NAME",
    "SafetensorsHeader",
    "SafetensorsWriter",
    "ShardPlan",
    "TensorInfo",
    "plan_shards",
    "read_header",
]

# safetensors refuses headers above 100 MB; so do we, which also bounds what we read.
MAX_HEADER_SIZE = 100_000_000
_N_LEN = 8
_FIELDS = ("dtype", "shape", "data_offsets")
_FIELD_SET = frozenset(_FIELDS)

# Declaration order of safetensors' Rust `Dtype` enum (increasing alignment), the same in
# every release from 0.6 on. Its serializer sorts tensors by this rank, highest first, then by name.
_ENUM_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
_RANK = {code: k for k, code in enumerate(_ENUM_ORDER)}
_KNOWN = tuple(c for c in _ENUM_ORDER if c in SAFETENSORS_CODES)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorInfo:
    """One tensor of a safetensors file."""

    dtype: str
    """Torch dtype name (``bfloat16``), mapped from the file's code (``BF16``)."""
    shape: tuple[int, ...]
    """In elements."""
    data_offset: int
    """Absolute byte offset of the first element in the file (not relative to the byte buffer)."""
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class SafetensorsHeader:
    """A validated safetensors header."""

    path: Path
    tensors: Mapping[str, TensorInfo]
    """By name, in file order (increasing ``data_offset``)."""
    metadata: Mapping[str, str] | None
    """The ``__metadata__`` map, or None when the file has none."""
    data_start: int
    """Absolute byte offset of the byte buffer: 8 + the header length."""
    file_size: int
    """In bytes."""


def read_header(path: str | Path, *, offset: int = 0) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file ``path``; no tensor data is read.

    With ``offset``, the safetensors data starts there and runs to the end of
    the file (DCP's safetensors serialization appends one to each rank file);
    offsets in the result stay absolute in ``path``.

    Checks, in order: ``offset`` lies in the file; the 8-byte length fits
    the file and the 100 MB limit; the header begins with ``{``, is UTF-8
    JSON without duplicate keys or integers longer than a u64;
    ``__metadata__`` maps strings to strings; every tensor has exactly
    ``dtype`` (a known, whole-byte code), ``shape`` (non-negative integers
    whose row-major strides, in bytes, fit int64 even when a dim is 0) and
    ``data_offsets`` (two non-negative integers, ``BEGIN <= END``), holds
    exactly ``prod(shape) * itemsize`` bytes and ends inside the byte buffer;
    names and metadata are Unicode (no lone surrogate escapes); the tensors
    neither overlap nor leave a hole, and they end exactly at the end of the
    file.

    Raises:
      CheckpointFormatError: ``"<path>: tensor '<name>': <reason>"``, or
        ``"<path>: <reason>"`` when the problem is not one tensor's.

    >>> read_header("model.safetensors").tensors["lm_head.weight"].dtype   # doctest: +SKIP
    'bfloat16'
    """
    path = path if isinstance(path, UrlPath) else Path(path)
    try:
        with path.open("rb") as f:
            try:
                check_offset("safetensors offset", check_count("safetensors offset", offset),
                             file_size(f))
            except FieldError as e:
                raise _error(path, str(e)) from None
            size = file_size(f) - offset
            f.seek(offset)
            if size < _N_LEN:
                raise _error(path, f"file is {size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(f.read(_N_LEN), "little")
            if n > MAX_HEADER_SIZE:
                raise _error(path, f"header length {n} exceeds the limit of {MAX_HEADER_SIZE} bytes")
            if _N_LEN + n > size:
                raise _error(path, f"header length {n} runs past the end of the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read ({e.strerror})") from None
    if not raw.startswith(b"{"):
        found = repr(raw[:1].decode("latin-1")) if raw else "an empty header"
        raise _error(path, f"header must begin with '{{', found {found}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _error(path, f"header is not valid UTF-8 ({e.reason} at byte {_N_LEN + e.start})") from None
    data_len = size - _N_LEN - n
    data_start = offset + _N_LEN + n
    fast = _valid_header(path, text, data_start, data_len)
    if fast is not None:
        metadata, ordered = fast
        return SafetensorsHeader(path=path, tensors=MappingProxyType(ordered), metadata=metadata,
                                 data_start=data_start, file_size=offset + size)
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys, parse_int=_parse_int)
    except _DuplicateKeyError as e:
        raise _error(path, f"header has key '{e.args[0]}' twice") from None
    except _LongIntegerError as e:
        raise _error(path, f"header holds an integer of {e.args[0]} digits, longer than a u64 (20 digits)") from None
    except json.JSONDecodeError as e:
        raise _error(path, f"header is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise _error(path, "header is not valid JSON: nested too deeply") from None
    metadata = _metadata(path, obj.pop("__metadata__", None)) if "__metadata__" in obj else None
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, TensorInfo] = {}
    for name, entry in obj.items():
        begin, end, info = _tensor(path, name, entry, data_start, data_len)
        spans.append((begin, end, name))
        tensors[name] = info
    _check_cover(path, sorted(spans), data_len)
    ordered = {name: tensors[name] for _, _, name in sorted(spans)}
    return SafetensorsHeader(path=path, tensors=MappingProxyType(ordered), metadata=metadata,
                             data_start=data_start, file_size=offset + size)


def _valid_header(path: Path, text: str, data_start: int,
                  data_len: int) -> tuple[Mapping[str, str] | None, dict[str, TensorInfo]] | None:
    """The metadata and the tensors (in file order) of a header that breaks no rule, or None for any other.

    A header of 100,000 tensors takes a second to check through ``json``'s Python hooks (one call per
    object and per integer). Here the C parser runs alone, its only hook ``tuple``, called from C: each JSON
    object comes back as its (key, value) pairs, as written, so a duplicate key shows as a pair too many and an
    object is told from an array (a list). A valid header is checked field by field with no call per value; on
    anything else ``read_header`` parses again the careful way, which finds the problem and names it (an
    integer longer than a u64 fails a bound here).
    """
    try:
        pairs = json.loads(text, object_pairs_hook=tuple)
    except (ValueError, RecursionError):
        return None
    if type(pairs) is not tuple:
        return None
    entries = dict(pairs)
    if len(entries) != len(pairs):  # a name twice
        return None
    metadata = None
    strings = list(entries)
    if "__metadata__" in entries:
        found = entries.pop("__metadata__")
        if type(found) is not tuple:
            return None
        metadata = dict(found)
        if len(metadata) != len(found) or any(type(v) is not str for v in metadata.values()):
            return None
        strings += [*metadata, *metadata.values()]
    try:
        "".join(strings).encode("utf-8")
    except UnicodeEncodeError:
        return None
    tensors: dict[str, TensorInfo] = {}
    needs: dict[tuple[str, tuple[int, ...]], int | None] = {}
    at = 0  # where the next tensor starts while each begins where the one before it ends
    for name, entry in entries.items():
        if type(entry) is not tuple or len(entry) != 3:
            return None
        (k0, code), (k1, shape), (k2, offsets) = entry
        if k0 != "dtype" or k1 != "shape" or k2 != "data_offsets":  # the fields in another order, or others
            fields = dict(entry)
            if fields.keys() != _FIELD_SET:
                return None
            code, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
        if type(code) is not str or code not in SAFETENSORS_CODES or type(shape) is not list:
            return None
        if type(offsets) is not list or len(offsets) != 2:
            return None
        for d in shape:
            if type(d) is not int or d < 0:
                return None
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or begin < 0:
            return None
        dims = tuple(shape)
        need = needs.get((code, dims), -1)
        if need == -1:
            need = needs[code, dims] = _need(code, dims)
        if need is None or end - begin != need or end > data_len:
            return None
        # out of file order, a gap or an overlap, or a tensor without bytes: sorted and checked below
        at = end if begin == at and need else -1
        tensors[name] = _info(SAFETENSORS_CODES[code], dims, data_start + begin, need)
    meta = None if metadata is None else MappingProxyType(metadata)
    if at == data_len:  # the tensors, as listed, tile the byte buffer
        return meta, tensors
    spans = sorted((t.data_offset - data_start, t.data_offset - data_start + t.nbytes, name)
                   for name, t in tensors.items())
    _check_cover(path, spans, data_len)
    return meta, {name: tensors[name] for _, _, name in spans}


_new = object.__new__
_set = object.__setattr__


def _info(dtype: str, shape: tuple[int, ...], data_offset: int, nbytes: int) -> TensorInfo:
    """``TensorInfo(dtype=..., shape=..., data_offset=..., nbytes=...)``, made field by field: a header may hold
    100,000 tensors, and the frozen dataclass's keyword ``__init__`` costs more than the object."""
    info = _new(TensorInfo)
    _set(info, "dtype", dtype)
    _set(info, "shape", shape)
    _set(info, "data_offset", data_offset)
    _set(info, "nbytes", nbytes)
    return info


def _need(code: str, shape: tuple[int, ...]) -> int | None:
    """The bytes of a ``code`` tensor of ``shape``, or None when its strides pass int64."""
    size = ITEMSIZE[SAFETENSORS_CODES[code]]
    try:
        return check_shape("shape", shape, size) * size
    except FieldError:
        return None


class _DuplicateKeyError(Exception):
    pass


class _LongIntegerError(Exception):
    pass


def _parse_int(text: str) -> int:
    # Every integer in a header is a u64 (shape dims, offsets); longer ones are refused before Python
    # converts them (which it refuses past 4300 digits, with a ValueError).
    if len(text.lstrip("-")) > 20:
        raise _LongIntegerError(len(text.lstrip("-")))
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _error(path: Path, reason: str, tensor: str | None = None) -> CheckpointFormatError:
    where = f"{path}: tensor '{tensor}'" if tensor is not None else str(path)
    return CheckpointFormatError(f"{where}: {reason}")


def _metadata(path: Path, value: Any) -> Mapping[str, str]:
    if not isinstance(value, dict):
        raise _error(path, f"__metadata__ must be an object of strings, got {_json_type(value)}")
    for k, v in value.items():
        if not isinstance(v, str):
            raise _error(path, f"__metadata__ value of '{k}' must be a string, got {_json_type(v)}")
        _check_unicode(path, "__metadata__ key", k)
        _check_unicode(path, f"__metadata__ value of {k!r:.60}", v)
    return MappingProxyType(dict(value))


def _tensor(path: Path, name: str, entry: Any, data_start: int, data_len: int) -> tuple[int, int, TensorInfo]:
    if not isinstance(entry, dict):
        raise _error(path, f"entry must be an object with dtype, shape and data_offsets, got {_json_type(entry)}", name)
    missing = [k for k in _FIELDS if k not in entry]
    if missing:
        raise _error(path, "missing " + ", ".join(f"'{k}'" for k in missing), name)
    extra = [k for k in entry if k not in _FIELDS]
    if extra:
        raise _error(path, f"unexpected key '{extra[0]}' (expected dtype, shape, data_offsets)", name)
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in SAFETENSORS_CODES:
        raise _error(path, f"unsupported dtype {_brief_json(code)} (supported: {', '.join(_KNOWN)})", name)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _error(path, f"shape must be a list of non-negative integers, got {_brief_json(shape)}", name)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise _error(path, f"data_offsets must be two non-negative integers, got {_brief_json(offsets)}", name)
    _check_unicode(path, "tensor name", name)
    begin, end = offsets
    dtype = SAFETENSORS_CODES[code]
    size = ITEMSIZE[dtype]
    if end < begin:
        raise _error(path, f"data_offsets [{begin}, {end}] end before they begin", name)
    try:
        need = check_shape("shape", shape, size) * size
    except FieldError as e:
        raise _error(path, str(e), name) from None
    if end - begin != need:
        reason = f"data_offsets [{begin}, {end}] hold {end - begin} bytes but {code} {_brief_json(shape)} needs {need}"
        raise _error(path, reason, name)
    if end > data_len:
        raise _error(path, f"data_offsets [{begin}, {end}] end past the byte buffer ({data_len} bytes)", name)
    info = TensorInfo(dtype=dtype, shape=tuple(shape), data_offset=data_start + begin, nbytes=need)
    return begin, end, info


def _check_unicode(path: Path, what: str, text: str) -> None:
    """A JSON string may escape a lone surrogate (``"\\ud800"``), which no UTF-8 file name or header can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _error(path, f"{what} {text!r:.60} holds a lone surrogate escape, not Unicode text") from None


def _check_cover(path: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """Spans (sorted) must tile [0, data_len) exactly: no overlap, no hole (the spec's no-polyglot rule)."""
    at, last = 0, None
    for begin, end, name in spans:
        if last is not None and begin < at:
            raise _error(path, f"tensors '{last[2]}' [{last[0]}, {last[1]}] and '{name}' [{begin}, {end}] overlap")
        if begin > at:
            where = f"between '{last[2]}' and '{name}'" if last else f"before '{name}'"
            raise _error(path, f"byte buffer bytes [{at}, {begin}) belong to no tensor ({where})")
        at, last = end, (begin, end, name)
    if at != data_len:
        where = f"after '{last[2]}'" if last else "the header names no tensors"
        raise _error(path, f"byte buffer bytes [{at}, {data_len}) belong to no tensor ({where})")


def _brief_json(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:76] + " ..."


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _json_type(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, (int, float)):
        return "a number"
    if isinstance(x, str):
        return "a string"
    return "an array" if isinstance(x, list) else "an object"


class SafetensorsWriter:
    """Write one safetensors file, tensor bytes streamed in, header computed up front.

    The tensor order and the header bytes are exactly those of
    ``safetensors.torch.save_file``: tensors sorted by dtype alignment, widest
    first, then by name; compact JSON with ``__metadata__`` first; the header
    padded with spaces to a multiple of 8 bytes. (``save_file`` writes a
    ``__metadata__`` of several keys in hash order; here they keep the order
    given, so only files with at most one metadata key are guaranteed
    byte-identical.)

    The file is created at its final size; ``write(name, data)`` appends the
    next bytes of tensor ``name`` (each tensor is written front to back, any
    tensor at any time); ``close()`` checks every tensor is complete. Used as
    a context manager, an exception (or an incomplete file) removes the file.

    Args:
      path: the file to create (replaced if it exists).
      tensors: name -> (torch dtype name, shape in elements).
      metadata: the ``__metadata__`` string map, e.g. ``{"format": "pt"}``; None for none.
      open_file: creates the file at its size (a write session's ``open``, which keeps its checksum).

    >>> with SafetensorsWriter("a.safetensors", {"w": ("float32", (2, 3))}) as w:   # doctest: +SKIP
    ...     w.write("w", bytes(24))
    """

    def __init__(self, path: str | Path, tensors: Mapping[str, tuple[str, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None, *,
                 open_file: Callable[[Path, int], OutputFile] = OutputFile) -> None:
        self.path = Path(path)
        header, self.tensors = _layout(self.path, tensors, metadata)
        self.size = _N_LEN + len(header) + sum(t.nbytes for t in self.tensors.values())
        """Final file size in bytes."""
        self._written = dict.fromkeys(self.tensors, 0)
        self._partial: set[str] = set()  # tensors part of which another process writes (``Skip``)
        self._out: OutputFile | None = open_file(self.path, self.size)
        # part of a file that several processes write: the header is the finishing part's (``FilePart``)
        self._part = self._out if isinstance(self._out, FilePart) else None
        if self._part is not None and not self._part.frames:
            return
        try:
            self._out.pwrite(len(header).to_bytes(_N_LEN, "little") + header, 0)
        except BaseException:
            self.abort()
            raise

    @property
    def order(self) -> tuple[str, ...]:
        """Tensor names in file order."""
        return tuple(self.tensors)

    def write(self, name: str, data: bytes | bytearray | memoryview | Skip | ReadBack) -> None:
        """Append ``data`` to tensor ``name`` (its next bytes, row-major); a ``Skip`` moves past bytes another
        process writes, a ``ReadBack`` reads them back from the file."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointFormatError(f"{self.path}: tensor '{name}' is not in this file")
        if self._out is None:
            raise CheckpointFormatError(f"{self.path}: write to tensor '{name}' after the file was closed")
        marker = isinstance(data, (Skip, ReadBack))
        n = data.nbytes if marker else memoryview(data).nbytes
        done = self._written[name]
        if done + n > info.nbytes:
            raise _error(self.path, f"writing {n} bytes at byte {done} overflows its {info.nbytes} bytes", name)
        if isinstance(data, Skip):
            self._partial.add(name)
        elif isinstance(data, ReadBack):
            data.data = self._out.pread(n, info.data_offset + done, data.buffer)
        else:
            self._out.pwrite(memoryview(data).cast("B"), info.data_offset + done)
        self._written[name] = done + n

    def write_run(self, names: Sequence[str], data: bytes | bytearray | memoryview) -> None:
        """Write tensors that follow one another in the file (``order``), none of them begun, whole: ``data`` is
        their bytes one after the other, written with one call."""
        if self._out is None:
            raise CheckpointFormatError(f"{self.path}: write to tensor '{names[0]}' after the file was closed")
        view = memoryview(data).cast("B")
        start = end = self.tensors[names[0]].data_offset if names and names[0] in self.tensors else 0
        for name in names:
            info = self.tensors.get(name)
            if info is None:
                raise CheckpointFormatError(f"{self.path}: tensor '{name}' is not in this file")
            if info.data_offset != end or self._written[name]:
                raise _error(self.path, "not the next tensor of the run in the file, or begun already", name)
            end += info.nbytes
        if end - start != len(view):
            raise _error(self.path, f"{len(view)} bytes for a run of {len(names)} tensors of {end - start}", names[0])
        self._out.pwrite(view, start)
        for name in names:
            self._written[name] = self.tensors[name].nbytes

    def close(self) -> None:
        """Finish the file; raises (and removes the file) if a tensor is incomplete."""
        if self._out is None:
            return
        try:
            self._out.settle()  # a write still in flight on the session's writer thread counts its bytes
        except BaseException:
            self.abort()
            raise
        # a part writes some tensors whole and leaves the others to the other parts
        short = [f"'{n}' ({self._written[n]} of {t.nbytes} bytes)" for n, t in self.tensors.items()
                 if self._written[n] != t.nbytes and (self._part is None or (self._written[n] and n not in self._partial))]
        if short:
            self.abort()
            raise CheckpointFormatError(f"{self.path}: incomplete, tensors not fully written: {', '.join(short)}")
        out, self._out = self._out, None
        out.close()

    def abort(self) -> None:
        """Close and remove the partial file."""
        if self._out is not None:
            out, self._out = self._out, None
            out.abort()
        if self._part is None:  # a part leaves the file to the others
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


def _layout(path: Path, tensors: Mapping[str, tuple[str, Sequence[int]]],
            metadata: Mapping[str, str] | None) -> tuple[bytes, dict[str, TensorInfo]]:
    """The padded header bytes and each tensor's place, in safetensors' serializer order."""
    entries = []
    codes: dict[str, str | None] = {}
    # A model has few shapes and dtypes; each is checked once. A shape is keyed with its dims' types, as True and
    # 2.0 are equal to 1 and 2.
    counts: dict[tuple[tuple[int, ...], tuple[type, ...]], bool] = {}
    for name, (dtype, shape) in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise CheckpointFormatError(f"{path}: invalid tensor name {name!r}")
        code = codes.get(dtype, "") if isinstance(dtype, str) else None
        if code == "":
            code = codes[dtype] = DTYPES[dtype].safetensors if dtype in DTYPES else None
        if code is None:
            raise _error(path, f"unsupported dtype '{dtype}' (supported: {', '.join(SAFETENSORS_CODES[c] for c in _KNOWN)})", name)
        shape = tuple(shape)
        typed = (shape, tuple(map(type, shape)))
        ok = counts.get(typed)
        if ok is None:
            ok = counts[typed] = all(_is_count(d) for d in shape)
        if not ok:
            raise _error(path, f"shape must be non-negative integers, got {shape}", name)
        entries.append((-_RANK[code], name, code, shape))
    entries.sort()
    parts = []
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointFormatError(f"{path}: __metadata__ must map strings to strings")
        parts.append('"__metadata__":' + _dumps(dict(metadata)))
    infos: list[tuple[str, str, tuple[int, ...], int, int]] = []
    at = 0
    shaped: dict[tuple[str, tuple[int, ...]], tuple[int, str]] = {}
    for _, name, code, shape in entries:
        known = shaped.get((code, shape))
        if known is None:
            # ``dims`` is what json writes for ints, without its encoder per tensor.
            known = shaped[code, shape] = (math.prod(shape) * ITEMSIZE[SAFETENSORS_CODES[code]],
                                           f'{{"dtype":"{code}","shape":[{",".join(map(int.__repr__, shape))}],')
        nbytes, head = known
        entry = f'{head}"data_offsets":[{at},{at + nbytes}]}}'
        parts.append(f'"{name}":{entry}' if _plain(name) else f"{_dumps(name)}:{entry}")
        infos.append((name, code, shape, at, nbytes))
        at += nbytes
    try:
        header = ("{" + ",".join(parts) + "}").encode("utf-8")
    except UnicodeEncodeError as e:
        raise CheckpointFormatError(
            f"{path}: a tensor name or metadata string is not encodable as UTF-8 ({e.reason})") from None
    header += b" " * (-len(header) % _N_LEN)
    if len(header) > MAX_HEADER_SIZE:
        raise CheckpointFormatError(
            f"{path}: header of {len(header)} bytes exceeds the limit of {MAX_HEADER_SIZE} bytes")
    start = _N_LEN + len(header)
    out = {name: _info(SAFETENSORS_CODES[code], shape, start + begin, nbytes) for name, code, shape, begin, nbytes in infos}
    return header, out


def _plain(name: str) -> bool:
    """Whether JSON writes ``name`` as it is, between quotes: no quote, backslash or control character."""
    return name.isprintable() and '"' not in name and "\\" not in name


def _dumps(value: Any) -> str:
    # serde_json's compact form: no spaces, non-ASCII kept as UTF-8, the same escapes as Python's.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
