"""The checksums a conversion records: of each file's bytes (the manifest's ``files``, the resume journal) and of
each tensor's.

A tensor's checksum (``HASH``) is the xxh3-128 of its bytes in row-major order, as hex: what hashing
``tensor.contiguous()`` gives, whatever file holds it.

A file's checksum (``FILE_HASH``) is taken over blocks, so that processes writing one file side by side can each
take the blocks they write, and the process that finishes the file reads back only the blocks no one of them wrote
whole (the framing between their parts), not the whole file:

- the file is cut into blocks of ``BLOCK`` (64 KiB) bytes, the last one shorter (an empty file has none);
- each block's xxh3-128 is taken as 16 bytes (the canonical, big-endian form);
- the checksum is the xxh3-128 of those digests, concatenated in file order, as hex.

In Python: ``xxh3_128_hexdigest(b"".join(xxh3_128_digest(data[i:i + 65536]) for i in range(0, len(data),
65536)))``. ``FileHash`` takes it from bytes fed in order; ``PartBlocks`` takes a part's whole blocks from runs
of in-order writes; ``blocks_digest`` puts a file's checksum together from the blocks others took and the rest read
back. Manifests written before this checksum record the plain xxh3-128 of each file (``HASH``), which
``plain_digest`` takes for ``verify``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

__all__ = ["BLOCK", "FILE_HASH", "HASH", "FileHash", "PartBlocks", "Taken", "blocks_digest", "file_digest",
           "plain_digest"]

HASH = "xxh3_128"
"""A tensor's checksum: xxh3-128 of its bytes, as hex; in manifests from before ``FILE_HASH``, a file's too."""

FILE_HASH = "xxh3_128_64k"
"""A file's checksum: xxh3-128 of the xxh3-128 digests of its 64 KiB blocks (the module's docstring), as hex."""

BLOCK = 64 << 10
"""The bytes of a block of ``FILE_HASH``. Taking a digest per block costs about half as much again as hashing the
bytes in one stream (0.3 against 0.2 ms per 16 MiB), and a file finished from parts reads back one block at
each seam between parts."""

_READ = 8 << 20
"""The most bytes read at once to checksum a file, or the blocks of it no part took."""

_digest = xxhash.xxh3_128_digest


def _bytes(data) -> memoryview:
    return data if isinstance(data, memoryview) and data.format == "B" else memoryview(data).cast("B")


class _Blocks:
    """Bytes fed in order from the first byte of a block on, cut into blocks: each whole block's digest goes to
    ``emit``; the last, partial block's is ``tail``."""

    __slots__ = ("_block", "_emit", "_fill")

    def __init__(self, emit: Callable[[bytes], object]) -> None:
        self._emit = emit
        self._block = xxhash.xxh3_128()
        self._fill = 0  # bytes of the current block fed so far

    def update(self, view: memoryview) -> None:
        n, i = len(view), 0
        if self._fill:
            i = min(BLOCK - self._fill, n)
            self._block.update(view[:i])
            self._fill += i
            if self._fill < BLOCK:
                return
            self._emit(self._block.digest())
            self._block.reset()
            self._fill = 0
        emit = self._emit
        while n - i >= BLOCK:
            emit(_digest(view[i:i + BLOCK]))
            i += BLOCK
        if i < n:
            self._block.update(view[i:])
            self._fill = n - i

    def tail(self) -> bytes | None:
        return self._block.digest() if self._fill else None


class FileHash:
    """``FILE_HASH`` of bytes fed in file order from the first."""

    __slots__ = ("_blocks", "_outer")

    def __init__(self) -> None:
        self._outer = xxhash.xxh3_128()  # fed each whole block's digest: memory does not grow with the file
        self._blocks = _Blocks(self._outer.update)

    def update(self, data) -> None:
        self._blocks.update(_bytes(data))

    def hexdigest(self) -> str:
        outer = self._outer.copy()
        tail = self._blocks.tail()
        if tail is not None:
            outer.update(tail)
        return outer.hexdigest()


Taken = tuple[list[tuple[int, bytes]], list[tuple[int, int]]]
"""What a part took of a file's checksum (``PartBlocks.taken``): its runs of whole blocks' digests, ``(first block,
16 bytes per block)``, and the byte spans it wrote, ``(first byte, end byte)``."""


class PartBlocks:
    """The digests of the whole blocks a part of a file covers with runs of writes in file order, and the spans of
    bytes it wrote: what a process writing some of a file's bytes (``FilePart``) takes of its checksum. A block is
    taken only where one run of writes holds all of its bytes, from its first; a write that does not follow the
    one before starts a new run at the next block's start. A write before the end of one made earlier may change
    blocks taken: from then on, none are."""

    __slots__ = ("_high", "_run", "_runs", "_spans")

    def __init__(self) -> None:
        self._runs: list[tuple[int, bytearray]] = []
        self._spans: list[list[int]] = []
        self._run: _Blocks | None = None  # the run under way, from a block's first byte; None: none is
        self._high: int | None = 0  # the furthest any write reached; None: a write went back before it

    def update(self, data, offset: int) -> None:
        view = _bytes(data)
        n = len(view)
        if not n:
            return
        spans = self._spans  # kept whatever happens: another part's blocks these bytes fall in are read back
        if spans and spans[-1][1] == offset:
            spans[-1][1] = offset + n
        else:  # not where the last write ended: the block under way is not whole
            spans.append([offset, offset + n])
            self._run = None
            if self._high is not None and offset < self._high:
                self._runs.clear()
                self._high = None
        if self._high is None:
            return
        self._high = offset + n
        if self._run is None:  # start at the next block's first byte
            skip = -offset % BLOCK
            if skip >= n:
                return
            digests = bytearray()
            self._runs.append(((offset + skip) // BLOCK, digests))
            self._run = _Blocks(digests.extend)
            view = view[skip:]
        self._run.update(view)

    def taken(self) -> Taken:
        """The runs of whole blocks' digests and the spans written, as plain values (for another process)."""
        return [(first, bytes(d)) for first, d in self._runs if d], [(a, b) for a, b in self._spans]


def blocks_digest(size: int, parts: Sequence[Taken], read: Callable[[int, memoryview], None]) -> tuple[str, int]:
    """``FILE_HASH`` of a file of ``size`` bytes from what the processes that wrote it took (``parts``: each one's
    ``PartBlocks.taken``), the blocks none took read back with ``read(offset, into)`` (filling ``into``). A block
    holding bytes that two parts wrote is read back too: the later write's bytes are the file's, which may not be
    those its taker saw (parts may write the same frames, as a DCP archive's). Returns the checksum and the bytes
    read back."""
    count = -(-size // BLOCK)
    starts = _trusted([r for runs, _ in parts for r in runs], _shared([spans for _, spans in parts]), count)
    firsts = [r[0] for r in starts]
    outer = xxhash.xxh3_128()
    buf = memoryview(bytearray(min(_READ, max(BLOCK, size))))
    read_back = 0
    k = 0
    while k < count:
        r = bisect.bisect_right(firsts, k) - 1
        if r >= 0:
            first, digests = starts[r]
            have = len(digests) // 16
            if k < first + have:  # blocks k.. are in this run
                take = first + have - k
                outer.update(digests[(k - first) * 16:(k - first + take) * 16])
                k += take
                continue
        stop = firsts[r + 1] if r + 1 < len(firsts) else count  # read back up to the next run
        stop = min(stop, k + len(buf) // BLOCK)
        lo, hi = k * BLOCK, min(size, stop * BLOCK)
        view = buf[:hi - lo]
        read(lo, view)
        read_back += hi - lo
        for a in range(0, hi - lo, BLOCK):
            outer.update(_digest(view[a:a + BLOCK]))
        k = stop
    return outer.hexdigest(), read_back


def _shared(spans: Sequence[Sequence[tuple[int, int]]]) -> list[tuple[int, int]]:
    """The blocks (first, end) holding bytes that more than one of the parts wrote (``spans``: each part's)."""
    out: list[tuple[int, int]] = []
    active: list[tuple[int, int]] = []  # (end, part) of the spans that reach past the current start
    for a, b, k in sorted((a, b, k) for k, own in enumerate(spans) for a, b in _merged(own)):
        active = [(e, j) for e, j in active if e > a]
        out += [(a // BLOCK, (min(b, e) - 1) // BLOCK + 1) for e, j in active if j != k]
        active.append((b, k))
    return _merged(out)


def _trusted(runs: list[tuple[int, bytes | bytearray]], shared: list[tuple[int, int]],
             count: int) -> list[tuple[int, memoryview]]:
    """``runs`` in order, without the ``shared`` blocks; none where runs overlap or reach past block ``count``
    (parts that wrote the same whole blocks)."""
    out: list[tuple[int, memoryview]] = []
    for first, digests in sorted(runs, key=lambda r: r[0]):
        end, at = first + len(digests) // 16, first
        view = memoryview(digests)
        k = bisect.bisect_right(shared, (first, count + 1)) - 1
        for lo, hi in shared[max(k, 0):]:
            if lo >= end:
                break
            if hi > at and lo > at:
                out.append((at, view[(at - first) * 16:(lo - first) * 16]))
            at = max(at, hi)
        if at < end:
            out.append((at, view[(at - first) * 16:]))
    reach = 0
    for first, digests in out:
        if first < reach or first + len(digests) // 16 > count:
            return []
        reach = first + len(digests) // 16
    return out


def _merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, those that overlap or touch made one."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def file_digest(path: str | Path) -> str:
    """``FILE_HASH`` of a file's bytes, as hex."""
    return _fed(path, FileHash()).hexdigest()


def plain_digest(path: str | Path) -> str:
    """xxh3-128 of a file's bytes, as hex: the file checksum of manifests written before ``FILE_HASH``."""
    return _fed(path, xxhash.xxh3_128()).hexdigest()


def _fed(path: str | Path, h):
    """``h`` fed a file's bytes in order."""
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h
