"""The directory of a zip archive, every integer in it checked against the archive's real size.

A torch.save file is a zip archive (``reshard.io.torchfile``). ``zipfile`` trusts the archive's
integers: a header offset past the end reaches ``seek`` as a ValueError, a zip64 size becomes a
read of that many bytes. This module reads only what reshard needs, checking each integer
before it is used (``reshard.io.bounds``):

- The end of central directory record is in the archive's last 65,557 bytes. When a zip64
  end locator sits just before it, the zip64 end record it points to (before the locator) gives
  the central directory's entry count, size and offset instead.
- The central directory lies inside the archive, before the end records, and holds exactly the
  number of entries the end record counts, 46 bytes at least each.
- Each entry's name, extra field and comment fit inside the central directory. A zip64 extra
  field (id 1) holds an 8-byte value for each of uncompressed size, compressed size and local
  header offset, in that order, that the entry stores as 0xFFFFFFFF.
- Each record's 30-byte local header and compressed bytes lie inside the archive, and its
  compressed size fits in what follows its header; a stored record's two sizes agree.
- Read, a record's local header repeats the entry's name, and its name and extra field fit
  in the archive; deflated data inflates to exactly the declared size, and no more is inflated.

Archives spanning several disks, encrypted records, names used twice and compression methods
other than stored (0) and deflated (8) are refused.
"""

from __future__ import annotations

import struct
import zlib

try:  # zlib-ng's CRC32 (folded with carry-less multiplies) runs about 4x zlib's here: zip records of every .pt
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; the same values, slower
    from zlib import crc32
from dataclasses import dataclass

from reshard.io.bounds import FieldError, check_count, check_range
from reshard.io.location import RemoteFile, pread

__all__ = ["DEFLATED", "STORED", "ZipEntry", "ZipReader", "crc32"]

_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory record, 22 bytes
_LOCATOR = struct.Struct("<IIQI")  # zip64 end of central directory locator, 20 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record, 56 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry, 46 bytes
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_MAX_COMMENT = 0xFFFF
_MAX_INFLATE = 1032  # deflate's best ratio: 258 bytes from each 2-bit code
_U32 = 0xFFFFFFFF
STORED, DEFLATED = 0, 8


@dataclass(frozen=True, slots=True)
class ZipEntry:
    """One record, as the central directory describes it; offsets and sizes in bytes."""

    name: str
    flags: int
    method: int
    crc: int
    compressed_size: int
    size: int
    """Uncompressed."""
    header_offset: int
    """Of its local header, from the archive's first byte."""


class ZipReader:
    """The records of the zip archive at bytes ``[base, base + size)`` of the open file ``fd`` (a descriptor,
    or a ``RemoteFile`` in object storage).

    Raises ``FieldError`` on the first field that breaks a rule above; ``end`` names the
    archive's extent in those messages ("the file", or "the archive" for one inside a larger file).
    """

    def __init__(self, fd: int | RemoteFile, base: int, size: int, *, end: str = "the file") -> None:
        self.fd, self.base, self.size, self.end = fd, base, size, end
        self.entries: dict[str, ZipEntry] = {}
        """By name, in central directory order."""
        self._tail, self._tail_at = b"", size
        cd_offset, cd_size, count = self._end_records()
        self._read_directory(cd_offset, cd_size, count)

    def read(self, offset: int, length: int, field: str) -> bytes:
        """Bytes ``[offset, offset + length)`` of the archive, after checking they lie inside it."""
        check_range(field, offset, length, self.size, end=self.end)
        if offset >= self._tail_at:  # inside the end of the archive read already (all of a small one)
            return self._tail[offset - self._tail_at:offset - self._tail_at + length]
        data = pread(self.fd, length, self.base + offset)
        if len(data) != length:  # the file shrank since we took its size
            raise FieldError(f"{field}: the file ends at byte {self.base + offset + len(data)} (truncated while read?)")
        return data

    def _end_records(self) -> tuple[int, int, int]:
        tail_len = min(self.size, _EOCD.size + _MAX_COMMENT)
        tail = self.read(self.size - tail_len, tail_len, "zip end records")
        self._tail, self._tail_at = tail, self.size - tail_len
        at = tail.rfind(b"PK\x05\x06")
        while at >= 0 and at + _EOCD.size > len(tail):
            at = tail.rfind(b"PK\x05\x06", 0, at)
        if at < 0:
            raise FieldError(f"not a readable zip archive (truncated?): no end of central directory record in its "
                             f"last {tail_len} bytes")
        eocd = self.size - tail_len + at
        _, disk, cd_disk, disk_count, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
        limit = eocd
        locator = tail[at - _LOCATOR.size:at] if at >= _LOCATOR.size else b""
        if locator[:4] == b"PK\x06\x07":
            _, z64_disk, z64_offset, disks = _LOCATOR.unpack(locator)
            if z64_disk != 0 or disks > 1:
                raise FieldError(f"zip64 end locator puts the archive on {disks} disks (its zip64 end record on disk "
                                 f"{z64_disk}), which reshard does not read")
            limit = eocd - _LOCATOR.size
            check_range("zip64 end record offset", z64_offset, _EOCD64.size, limit,
                        end="the space before the zip64 end locator")
            rec = self.read(z64_offset, _EOCD64.size, "zip64 end record offset")
            sig, rec_size, _, _, disk, cd_disk, disk_count, count, cd_size, cd_offset = _EOCD64.unpack(rec)
            if sig != 0x06064B50:
                raise FieldError(f"zip64 end locator points at byte {z64_offset}, where there is no zip64 end record")
            if not _EOCD64.size - 12 <= rec_size <= limit - z64_offset - 12:
                raise FieldError(f"zip64 end record size is {rec_size}; it must be at least {_EOCD64.size - 12} and "
                                 f"end before the zip64 end locator (at byte {limit})")
            limit = z64_offset
        if disk != 0 or cd_disk != 0:
            raise FieldError(f"zip archive spans several disks (this is disk {disk}, its directory starts on disk "
                             f"{cd_disk}), which reshard does not read")
        if disk_count != count:
            raise FieldError(f"zip end record counts {disk_count} entries on this disk but {count} in all, so the "
                             "archive spans several disks, which reshard does not read")
        check_range("zip central directory offset", cd_offset, cd_size, limit, end="the space before the end records")
        if count * _CENTRAL.size > cd_size:
            raise FieldError(f"zip end record counts {count} entries, more than its {cd_size}-byte central "
                             f"directory holds ({cd_size // _CENTRAL.size} at most)")
        return cd_offset, cd_size, count

    def _read_directory(self, cd_offset: int, cd_size: int, count: int) -> None:
        cd = self.read(cd_offset, cd_size, "zip central directory offset")
        at = 0
        for k in range(count):
            if at + _CENTRAL.size > cd_size:
                raise FieldError(f"zip central directory entry {k} starts at byte {cd_offset + at}, and its 46 bytes "
                                 f"run past the central directory's end ({cd_offset + cd_size})")
            (sig, _, _, flags, method, _, _, crc, csize, size, name_len, extra_len, comment_len, _, _, _,
             header_offset) = _CENTRAL.unpack_from(cd, at)
            if sig != 0x02014B50:
                raise FieldError(f"zip central directory entry {k} at byte {cd_offset + at} has no entry signature")
            head_end = at + _CENTRAL.size
            if head_end + name_len + extra_len + comment_len > cd_size:
                raise FieldError(f"zip central directory entry {k}: its name ({name_len} bytes), extra field "
                                 f"({extra_len}) and comment ({comment_len}) run past the central directory's end")
            raw_name = cd[head_end:head_end + name_len]
            name = _decode(raw_name, flags, k)
            extra = cd[head_end + name_len:head_end + name_len + extra_len]
            size, csize, header_offset = _zip64(name, extra, size, csize, header_offset)
            at = head_end + name_len + extra_len + comment_len
            if name in self.entries:
                raise FieldError(f"zip record name '{name}' appears twice in the central directory")
            check_range(f"zip local header offset of record '{name}'", header_offset, _LOCAL.size, self.size,
                        end=self.end)
            room = self.size - header_offset - _LOCAL.size
            if csize > room:
                raise FieldError(f"zip compressed size of record '{name}' is {csize}, more than the {room} bytes "
                                 f"after its local header in {self.end}")
            check_count(f"zip size of record '{name}'", size)
            if method == STORED and csize != size:
                raise FieldError(f"zip record '{name}' is stored, yet its compressed size {csize} and size {size} "
                                 "differ")
            self.entries[name] = ZipEntry(name=name, flags=flags, method=method, crc=crc, compressed_size=csize,
                                          size=size, header_offset=header_offset)

    def data_start(self, e: ZipEntry) -> int:
        """Where record ``e``'s compressed bytes start, from the archive's first byte, its local header checked."""
        if e.flags & 1:
            raise FieldError(f"record {e.name} is encrypted")
        field = f"zip local header offset of record '{e.name}'"
        # the name the central directory gives is read with the header: one read, not two, of a remote file
        ahead = max(0, min(len(_encode(e.name, e.flags)), self.size - e.header_offset - _LOCAL.size))
        block = self.read(e.header_offset, _LOCAL.size + ahead, field)
        sig, *_, name_len, extra_len = _LOCAL.unpack_from(block)
        if sig != 0x04034B50:
            raise FieldError(f"record {e.name}: no local header at byte {e.header_offset}")
        name_at = e.header_offset + _LOCAL.size
        raw_name = block[_LOCAL.size:_LOCAL.size + name_len] if name_len <= ahead else \
            self.read(name_at, name_len, f"zip local name of record '{e.name}'")
        if _decode(raw_name, e.flags, e.name) != e.name:
            raise FieldError(f"zip record '{e.name}' has local header name {raw_name[:80]!r}")
        start = name_at + name_len + extra_len
        check_range(f"zip data offset of record '{e.name}'", start, e.compressed_size, self.size, end=self.end)
        return start

    def record(self, e: ZipEntry) -> bytes:
        """Record ``e``'s bytes, inflated if deflated, CRC-32 checked unless the CRC is 0 (torch may write 0)."""
        start = self.data_start(e)
        raw = self.read(start, e.compressed_size, f"zip data offset of record '{e.name}'")
        if e.method == DEFLATED:
            if e.size > _MAX_INFLATE * e.compressed_size + _MAX_INFLATE:
                raise FieldError(f"zip size of record '{e.name}' is {e.size}, more than deflate makes of its "
                                 f"{e.compressed_size} compressed bytes ({_MAX_INFLATE} a byte at most)")
            inflate = zlib.decompressobj(-15)
            try:
                data = inflate.decompress(raw, e.size)  # never more than the declared size
            except zlib.error as err:
                raise FieldError(f"zip record '{e.name}' does not inflate: {err}") from None
            if len(data) != e.size or not inflate.eof:
                raise FieldError(f"zip record '{e.name}' does not inflate to its declared size of {e.size} bytes")
        elif e.method == STORED:
            data = raw
        else:
            raise FieldError(f"zip record '{e.name}' uses compression method {e.method}; reshard reads stored (0) "
                             "and deflated (8) records")
        if e.crc and crc32(data) != e.crc:
            raise FieldError(f"record {e.name} fails its CRC-32 check")
        return data


def _encode(name: str, flags: int) -> bytes:
    """A record name as its central directory entry stores it (``_decode`` undone)."""
    try:
        return name.encode("utf-8") if flags & 0x800 else name.encode("cp437")
    except UnicodeEncodeError:
        return b""

def _decode(raw: bytes, flags: int, which: object) -> str:
    try:
        return raw.decode("utf-8") if flags & 0x800 else raw.decode("cp437")
    except UnicodeDecodeError as e:
        raise FieldError(f"zip record name {raw[:80]!r} (entry {which}) is not valid UTF-8 ({e.reason})") from None


def _zip64(name: str, extra: bytes, size: int, csize: int, header_offset: int) -> tuple[int, int, int]:
    """The entry's sizes and header offset, the 0xFFFFFFFF ones taken from its zip64 extra field."""
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, at)
        if at + 4 + length > len(extra):
            raise FieldError(f"zip extra field {tag:#06x} of record '{name}' is {length} bytes, past the end of "
                             f"its {len(extra)}-byte extra data")
        if tag == 1:
            wanted = [v == _U32 for v in (size, csize, header_offset)]
            if 8 * sum(wanted) > length:
                raise FieldError(f"zip64 extra field of record '{name}' is {length} bytes, too short for the "
                                 f"{sum(wanted)} values its entry leaves to it")
            values = iter(struct.unpack_from(f"<{sum(wanted)}Q", extra, at + 4))
            size, csize, header_offset = (next(values) if w else v
                                          for w, v in zip(wanted, (size, csize, header_offset), strict=True))
        at += 4 + length
    return size, csize, header_offset


