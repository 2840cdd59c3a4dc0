"""Writing torch.save files, streaming: the pickle and zip layout torch writes; the format is described in ``reshard.io.torchfile``."""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import io
import os
import struct
from collections.abc import Callable, Mapping
from typing import NamedTuple
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reshard.errors import CheckpointFormatError
from reshard.io.storage import FilePart, OutputFile, ReadBack, Skip
from reshard.io.torch_read import _is_builtin_type
from reshard.io.zipdir import crc32
from reshard.io.torch_types import (
    _STORAGE_OF,
    ALLOWED_PREFIXES,
    Opaque,
    TensorRef,
    TensorSpec,
    TorchDtype,
    TorchSize,
    _allowlisted,
    _contiguous_stride,
)


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
            raise CheckpointFormatError(f"cannot write TensorRef {obj.storage}: replace it with a TensorSpec (see map_tensors)")
        else:
            raise CheckpointFormatError(f"reshard cannot write a {t.__module__}.{t.__qualname__} into a torch file")

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
            raise CheckpointFormatError(f"tensor key {spec.key!r} names two different tensors")
        wrapped = bool(spec.attrs)  # plain attributes: _rebuild_from_type_v2(func, Tensor, args, attrs)
        if spec.parameter:
            self.save_global(("torch._utils", "_rebuild_parameter"))
        if wrapped:
            self.save_global(("torch._tensor", "_rebuild_from_type_v2"))
            self.out.write(b"(")
        legacy = spec.dtype in _STORAGE_OF
        self.save_global(("torch._utils", "_rebuild_tensor_v2" if legacy else "_rebuild_tensor_v3"))
        if wrapped:
            self.save_global(("torch", "Tensor"))
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
        self.out.write(b"t" if wrapped else b"tR")
        if wrapped:
            self.save(dict(spec.attrs))
            self.out.write(b"tR")
        if spec.parameter:
            self.save(spec.requires_grad)
            self.save_reduce(("collections", "OrderedDict"), ())
            self.out.write(b"\x87R")

    def save_opaque(self, o: Opaque) -> None:
        if not (_allowlisted(o.module) or (o.module, o.name) == ("torch", "device")):
            raise CheckpointFormatError(f"Opaque {o.module}.{o.name} is outside the allowlist ({', '.join(ALLOWED_PREFIXES)})")
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
        raise CheckpointFormatError(f"numpy reduced to {module}.{name}, which reshard does not write")
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
    partial: bool = False  # bytes of it were another process's (``Skip``): its CRC is not the record's

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


def _runs(pieces: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """``(offset, bytes)`` pieces joined where one ends where the next starts, in offset order."""
    out: list[tuple[int, list[bytes], int]] = []
    for at, data in sorted(pieces, key=lambda p: p[0]):
        if out and out[-1][2] == at:
            out[-1][1].append(data)
            out[-1] = (out[-1][0], out[-1][1], at + len(data))
        else:
            out.append((at, [data], at + len(data)))
    return [(at, b"".join(parts)) for at, parts, _ in out]


class _Layout(NamedTuple):
    """An archive laid out as torch.save lays it out, before any tensor byte is written."""

    tensors: dict[object, _Record]
    """The tensor records by ``TensorSpec.key``."""
    ident: _Record
    """The serialization-id record (its payload is filled in at close)."""
    records: list[_Record]
    """Every record, in order."""
    size: int
    """Bytes of the whole archive."""
    framing: list[tuple[int, bytes]]
    """Every byte but the tensors' as ``(offset, bytes)`` runs: headers, payloads, the central directory (the
    tensors' and the id's CRCs still 0) and the end records."""
    central: bytes
    """The central directory alone (as in ``framing``), from ``records[0].central_offset``."""


def _lay_out(obj: object, prefix: str) -> _Layout:
    """Pickles ``obj`` and places every record of its archive as torch.save does. A ``TensorSpec`` alone (each
    chunk archive of a DCP ``.distcp``, 200,000 of them for 100,000 small tensors at dp 2) is laid out once per
    spec, and each archive gets fresh records of that layout."""
    try:
        if type(obj) is not TensorSpec or hash(obj) is None:
            return _lay_out_tree(obj, prefix)
    except TypeError:  # a key or attribute that cannot be hashed
        return _lay_out_tree(obj, prefix)
    t = _lay_out_alone(obj, prefix)
    fresh = {id(r): _Record(r.name, r.size, r.payload, r.header_offset, r.data_offset, r.central_offset, r.written,
                            r.crc) for r in t.records}
    return t._replace(tensors={k: fresh[id(r)] for k, r in t.tensors.items()}, ident=fresh[id(t.ident)],
                      records=[fresh[id(r)] for r in t.records])


@functools.lru_cache(maxsize=1024)
def _lay_out_alone(obj: TensorSpec, prefix: str) -> _Layout:
    """``_lay_out_tree`` of a lone ``TensorSpec``, kept as the template its archives copy (never handed out)."""
    return _lay_out_tree(obj, prefix)


def _lay_out_tree(obj: object, prefix: str) -> _Layout:
    if "/" in prefix or not prefix.isascii():
        raise CheckpointFormatError(f"archive name {prefix!r} must be ASCII without '/'")
    pickler = _Pickler()
    data = pickler.dump(obj)
    head = [("data.pkl", data), (".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")]
    records = [_Record(f"{prefix}/{name}".encode(), len(p), p) for name, p in head]
    tensors = {k: _Record(f"{prefix}/data/{skey}".encode(), spec.nbytes) for k, (skey, spec) in pickler.storages.items()}
    ident = _Record(f"{prefix}/.data/serialization_id".encode(), 40, b"0" * 40)  # filled in by close()
    version = _Record(f"{prefix}/version".encode(), 2, b"3\n")
    records = [*records, *tensors.values(), version, ident]
    offset = 0
    for r in records:
        offset = r.place(offset)
        if r.payload is not None:
            r.crc, r.written = crc32(r.payload), r.size
    for r in records:
        r.central_offset, offset = offset, offset + len(r.central_entry())
    cd_offset = records[0].central_offset
    tail = _end_records(cd_offset, offset - cd_offset, len(records))
    central = b"".join(r.central_entry() for r in records)
    pieces = [(r.header_offset, r.local_header()) for r in records]
    pieces += [(r.data_offset, r.payload + r.descriptor()) for r in records if r.payload is not None]
    framing = _runs([*pieces, (cd_offset, central + tail)])
    return _Layout(tensors, ident, records, offset + len(tail), framing, central)


class TorchFileWriter:
    """Writes a torch.save file whose tensor bytes are streamed in afterwards, tensor by tensor.

    The constructor pickles ``obj`` (a tree of dict/OrderedDict/defaultdict/list/tuple/set, scalars, str,
    bytes, None, ``argparse.Namespace``, numpy arrays and scalars, ``Opaque``, ``TorchDtype``, ``TorchSize``
    and ``TensorSpec`` leaves), lays out the whole zip as torch.save does, creates the file at its final
    size and writes everything but tensor bytes. Each ``TensorSpec`` gets its own contiguous storage; a key
    used twice gives two tensors sharing one storage. Then ``write`` appends each tensor's bytes, and
    ``close`` checks every tensor is complete, fills in the CRC-32s and fsyncs. Tensors are written in file
    order (that of ``entries``), so ``OutputFile`` checksums the file as it goes.

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

    size: int
    """Bytes of the whole archive."""

    def __init__(self, path: str | Path, obj: object, *, archive_name: str | None = None,
                 file: OutputFile | None = None, base: int = 0,
                 open_file: Callable[[Path, int], OutputFile] = OutputFile) -> None:
        """With ``file``, the archive is written into that open file at byte ``base`` (DCP's ``.distcp``
        files hold one archive per chunk, each self-contained); the caller owns, sizes and closes it.
        Otherwise ``open_file(path, size)`` creates the file (a write session's ``open``, which keeps its
        checksum)."""
        self.path = Path(path)
        self._base, self._owned = base, file is None
        prefix = archive_name or _archive_name(self.path)
        layout = _lay_out(obj, prefix)
        self._tensors, self._id, self._records, self._central = layout.tensors, layout.ident, layout.records, \
            layout.central
        self.entries = {k: (base + r.data_offset, r.size) for k, r in self._tensors.items()}
        self.size = layout.size
        self._out: OutputFile | None = open_file(self.path, self.size) if file is None else file
        # part of a file that several processes write: the framing is the finishing part's (``FilePart``)
        self._part = self._out if isinstance(self._out, FilePart) else None
        if self._part is not None and not self._part.frames:
            return
        try:
            for at, data in layout.framing:  # one write per run between tensors' bytes
                self._out.pwrite(data, base + at)
        except BaseException:
            self.abort()
            raise

    @staticmethod
    def measure(obj: object, *, archive_name: str) -> int:
        """Bytes of the archive ``TorchFileWriter(path, obj, archive_name=...)`` would write."""
        return _lay_out(obj, archive_name).size

    def write(self, key: object, data: bytes | memoryview | np.ndarray | Skip | ReadBack) -> None:
        """Appends the next bytes of tensor ``key`` (row-major; an array's raw bytes are used whatever its dtype);
        a ``Skip`` moves past bytes another process writes, a ``ReadBack`` reads them back from the file."""
        if self._out is None:
            raise CheckpointFormatError(f"{self.path}: write after close")
        r = self._tensors[key]
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        n = data.nbytes if isinstance(data, (Skip, ReadBack)) else memoryview(data).nbytes
        if r.written + n > r.size:
            raise CheckpointFormatError(
                f"{self.path}: tensor {key!r} takes {r.size} bytes; {n} more after {r.written} would overflow it")
        if isinstance(data, Skip):
            r.written, r.partial = r.written + n, True
            return
        if isinstance(data, ReadBack):
            data.data = self._out.pread(n, self._base + r.data_offset + r.written)
            data = data.data
        else:
            self._out.pwrite(data, self._base + r.data_offset + r.written)
        r.crc = crc32(data, r.crc)
        r.written += n
        if r.written == r.size and not r.partial:  # its data descriptor now: the file is final up to the next tensor
            self._out.pwrite(r.descriptor(), self._base + r.data_offset + r.size)

    def close(self) -> None:
        """Checks every tensor got exactly its bytes, writes the CRC-32s and fsyncs. Removes the file if not."""
        if self._out is None:
            return
        try:
            self._out.settle()  # a write still in flight on the session's writer thread counts its bytes
        except BaseException:
            self.abort()
            raise
        part, base = self._part, self._base
        if part is not None:
            for r in self._tensors.values():
                if r.written == r.size and not r.partial:
                    part.crcs[base + r.data_offset] = r.crc
                elif base + r.data_offset in part.crcs:  # written by another part
                    r.crc, r.written = part.crcs[base + r.data_offset], r.size
            if not part.frames:  # the others' records and the directory are the finishing part's
                out, self._out = self._out, None
                if self._owned:
                    out.close()
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
        self._id.crc = crc32(self._id.payload)
        try:
            self._out.pwrite(self._id.payload + self._id.descriptor(), base + self._id.data_offset)
            # the central directory again, now with every CRC (tensors' data descriptors went with their last bytes)
            central, start = bytearray(self._central), self._records[0].central_offset
            for r in [*self._tensors.values(), self._id]:
                struct.pack_into("<I", central, r.central_offset - start + 16, r.crc)
            self._out.pwrite(central, base + start)
            if self._owned:
                self._out.close()
        except BaseException:
            self.abort()
            raise
        self._out = None

    def abort(self) -> None:
        """Closes and removes the file (an embedded archive leaves that to the file's owner)."""
        if self._out is not None:
            out, self._out = self._out, None
            if self._owned:
                out.abort()

    def __enter__(self) -> TorchFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_torch_file(path: str | Path, obj: object, tensors: Mapping[object, bytes | np.ndarray], *,
                     open_file: Callable[[Path, int], OutputFile] = OutputFile) -> None:
    """Writes ``obj`` with each ``TensorSpec``'s bytes taken whole from ``tensors[spec.key]``: for small files."""
    with TorchFileWriter(path, obj, open_file=open_file) as out:
        for key in out.entries:
            out.write(key, tensors[key])
