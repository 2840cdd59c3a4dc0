"""Writing torch.save files, streaming: the zip layout torch writes around its pickle (``reshard.io.torch_pickle``);
the format is described in ``reshard.io.torchfile``."""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Callable, Mapping
from typing import NamedTuple
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reshard.errors import CheckpointFormatError
from reshard.io.storage import FilePart, OutputFile, ReadBack, Skip
from reshard.io.torch_pickle import TorchPickler
from reshard.io.torch_types import TensorSpec
from reshard.io.zipdir import crc32


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
    pickler = TorchPickler()
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


# torch only logs the serialization id; ours is, like torch's, a hash of the record names then of the CRCs:
# twenty digits of each.
def _names_id(records: list[_Record]) -> bytes:
    names = hashlib.blake2b(b"\0".join(r.name for r in records), digest_size=8).digest()
    return f"{int.from_bytes(names, 'little'):020d}".encode()


def _crcs_id(packed: bytes) -> bytes:
    return b"%020d" % int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


_U32_PACK = struct.Struct("<I").pack


class LoneArchive:
    """The torch.save archive of one ``TensorSpec`` alone (each chunk of a DCP ``.distcp``), made in memory around
    its tensor's bytes: ``frame`` writes every other byte, the CRC-32s and the serialization id included, so that
    a run of archives goes out with one write. The bytes are those ``TorchFileWriter(path, spec, ...)`` writes.

    Laid out once per spec (``lone_archive``); the record names' hash, and the CRCs of every record but the
    tensor's and the id's, are taken once too.
    """

    def __init__(self, spec: TensorSpec, archive_name: str) -> None:
        t = _lay_out_alone(spec, archive_name)
        (tensor,) = t.tensors.values()
        self.size = t.size
        """Bytes of the archive."""
        self.data_offset = tensor.data_offset
        """Where the tensor's bytes start, from the archive's first byte."""
        self.nbytes = tensor.size
        self._framing = t.framing
        k = t.records.index(tensor)
        crcs = [struct.pack("<I", r.crc) for r in t.records]
        # the id's own CRC enters the id as it was before the id was made (that of the placeholder), as in close()
        self._before, self._after = b"".join(crcs[:k]), b"".join(crcs[k + 1:])
        self._names = _names_id(t.records)
        self._tensor_descriptor = tensor.descriptor()  # CRC 0, patched
        self._id_at, self._id_descriptor = t.ident.data_offset, t.ident.descriptor()
        self._crc_at = (tensor.central_offset + 16, t.ident.central_offset + 16)  # in their central entries
        self._whole = self._templates()

    def _templates(self) -> tuple[bytes, tuple[bytes, ...]] | None:
        """The archive's bytes before its tensor's, and those after cut where the CRCs and the id go, when the
        framing is every other byte and they come in the usual order (the tensor's descriptor, the id record,
        the central directory); else None, and ``frame`` patches the bytes one by one."""
        end = self.data_offset + self.nbytes
        cuts = (end + 4, self._id_at, self._id_at + len(self._names) + 20 + 4, *self._crc_at)
        covered = sum(len(data) for _, data in self._framing) + self.nbytes + len(self._tensor_descriptor)
        if not self.nbytes or covered != self.size or list(cuts) != sorted(cuts) or any(
                at < self.data_offset < at + len(data) or at < end < at + len(data) for at, data in self._framing):
            return None
        image = bytearray(self.size)
        for at, data in self._framing:
            image[at:at + len(data)] = data
        image[end:end + len(self._tensor_descriptor)] = self._tensor_descriptor
        image[cuts[1] + len(self._names) + 20:cuts[1] + len(self._names) + 20 + len(self._id_descriptor)] = \
            self._id_descriptor
        widths = (4, len(self._names) + 20, 4, 4, 4)
        starts = (end, *(at + w for at, w in zip(cuts, widths)))
        return bytes(image[:self.data_offset]), tuple(bytes(image[a:b]) for a, b in zip(starts, (*cuts, self.size)))

    def frame(self, buf: memoryview) -> int:
        """Write the archive's bytes around its tensor's, which are in place in ``buf`` (the archive's ``size``
        bytes, writable); returns the tensor's CRC-32."""
        if self._whole is not None:  # two writes: the bytes before the tensor's, and those after with their CRCs
            head, (t0, t1, t2, t3, t4, t5) = self._whole
            end = len(head) + self.nbytes
            buf[:len(head)] = head
            crc = crc32(buf[len(head):end])
            c = _U32_PACK(crc)
            payload = self._names + _crcs_id(self._before + c + self._after)
            i = _U32_PACK(crc32(payload))
            buf[end:] = b"".join((t0, c, t1, payload, t2, i, t3, c, t4, i, t5))
            return crc
        return self._frame_alone(buf)

    def frame_many(self, buf: memoryview, count: int) -> list[int]:
        """``frame`` of ``count`` archives back to back in ``buf`` (a run of a file's small chunks of one dtype and
        shape): the bytes around their tensors go in with two array writes for them all; returns each tensor's
        CRC-32, in order."""
        if self._whole is None or count < 2:
            return [self.frame(buf[k * self.size:(k + 1) * self.size]) for k in range(count)]
        head, (t0, t1, t2, t3, t4, t5) = self._whole
        size, start, nbytes = self.size, len(head), self.nbytes
        end = start + nbytes
        rows = np.frombuffer(buf, dtype=np.uint8, count=count * size).reshape(count, size)
        rows[:, :start] = np.frombuffer(head, dtype=np.uint8)
        crcs = [crc32(buf[at:at + nbytes]) for at in range(start, count * size, size)]
        names, before, after = self._names, self._before, self._after
        tails: list[bytes] = []
        for crc in crcs:
            c = _U32_PACK(crc)
            payload = names + _crcs_id(before + c + after)
            i = _U32_PACK(crc32(payload))
            tails += (t0, c, t1, payload, t2, i, t3, c, t4, i, t5)
        rows[:, end:] = np.frombuffer(b"".join(tails), dtype=np.uint8).reshape(count, size - end)
        return crcs

    def _frame_alone(self, buf: memoryview) -> int:
        for at, data in self._framing:
            buf[at:at + len(data)] = data
        end = self.data_offset + self.nbytes
        crc = crc32(buf[self.data_offset:end])
        if self.nbytes:
            buf[end:end + len(self._tensor_descriptor)] = self._tensor_descriptor
            struct.pack_into("<I", buf, end + 4, crc)
        payload = self._names + _crcs_id(self._before + struct.pack("<I", crc) + self._after)
        id_crc = crc32(payload)
        buf[self._id_at:self._id_at + len(payload)] = payload
        at = self._id_at + len(payload)
        buf[at:at + len(self._id_descriptor)] = self._id_descriptor
        struct.pack_into("<I", buf, at + 4, id_crc)
        struct.pack_into("<I", buf, self._crc_at[0], crc)
        struct.pack_into("<I", buf, self._crc_at[1], id_crc)
        return crc


@functools.lru_cache(maxsize=1024)
def lone_archive(spec: TensorSpec, archive_name: str) -> LoneArchive:
    """The ``LoneArchive`` of ``spec`` (made once per spec and name)."""
    return LoneArchive(spec, archive_name)


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
        if type(obj) is TensorSpec:  # a lone spec's layout is kept: no fresh records to make
            try:
                return _lay_out_alone(obj, archive_name).size
            except TypeError:  # a key that cannot be hashed
                pass
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
            data.data = self._out.pread(n, self._base + r.data_offset + r.written, data.buffer)
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
        crcs = b"".join(struct.pack("<I", r.crc) for r in self._records)
        self._id.payload = _names_id(self._records) + _crcs_id(crcs)
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
