"""Large writes go to the disk directly (O_DIRECT), their whole pages only, and the file holds exactly the bytes
written, whatever their alignment in the file and in memory; a file system that refuses direct writes, a short
direct write and a failing one are handled as the page cache's would be."""

from __future__ import annotations

import errno
import mmap
import os
import random

import numpy as np
import pytest

import reshard
from reshard.errors import CheckpointFormatError
from reshard.io import storage
from reshard.io.checksum import file_digest
from reshard.io.storage import FilePart, OutputFile

MIB = 1 << 20
PAGE = 4096


def _direct_supported(tmp_path) -> bool:
    try:
        fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return True


@pytest.fixture
def writes(tmp_path, monkeypatch):
    """Every ``os.pwrite``, as (descriptor opened with O_DIRECT?, offset, length); skips where the file system
    refuses O_DIRECT (the fallback tests below cover that)."""
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    direct_fds: set[int] = set()
    log: list[tuple[bool, int, int]] = []
    real_open, real_pwrite = os.open, os.pwrite

    def spy_open(path, flags, *args, **kw):
        fd = real_open(path, flags, *args, **kw)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)
        return fd

    def spy_pwrite(fd, data, offset):
        n = real_pwrite(fd, data, offset)
        log.append((fd in direct_fds, offset, n))
        return n

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "pwrite", spy_pwrite)
    return log


def _check_ways(log, offset: int, length: int) -> None:
    """The pages wholly inside ``[offset, offset + length)`` went directly, page-aligned; the rest, through the
    page cache; each byte once."""
    a0, a1 = -(-offset // PAGE) * PAGE, (offset + length) // PAGE * PAGE
    direct = sorted((o, o + n) for d, o, n in log if d)
    cached = sorted((o, o + n) for d, o, n in log if not d and n)
    assert direct and all(o % PAGE == 0 and e % PAGE == 0 for o, e in direct)
    assert direct[0][0] == a0 and direct[-1][1] == a1
    spans = sorted(direct + cached)
    assert spans[0][0] == offset and spans[-1][1] == offset + length
    assert all(e == o for (_, e), (o, _) in zip(spans, spans[1:], strict=False))  # no gap, no overlap


@pytest.mark.parametrize("offset", [0, 1, 100, PAGE - 1, PAGE, 3 * PAGE + 17])
@pytest.mark.parametrize("shift", [0, 1, 64, 333])
@pytest.mark.parametrize("bounce", [None, MIB])
def test_a_large_write_lands_whole_at_any_alignment(tmp_path, writes, monkeypatch, offset, shift, bounce):
    if bounce:  # copied through the aligned buffer a MiB at a time
        monkeypatch.setattr(storage, "_BOUNCE", bounce)
    data = np.frombuffer(os.urandom(3 * MIB + 1234 + shift), dtype=np.uint8)[shift:]  # misaligned in memory
    f = OutputFile(tmp_path / "a", size=offset + len(data))
    f.pwrite(b"h" * offset, 0)
    writes.clear()
    f.pwrite(data, offset)
    _check_ways(writes, offset, len(data))
    digest = f.close()
    on_disk = (tmp_path / "a").read_bytes()
    assert on_disk[offset:] == data.tobytes() and on_disk[:offset] == b"h" * offset
    assert digest == file_digest(tmp_path / "a")


def test_bytes_aligned_in_memory_and_in_the_file_go_without_a_copy(tmp_path, writes):
    buffer = mmap.mmap(-1, 2 * MIB)  # page-aligned
    buffer.write(os.urandom(2 * MIB))
    f = OutputFile(tmp_path / "a")
    f.pwrite(memoryview(buffer), PAGE)
    assert f._bounce is None  # written from the caller's memory
    assert [(d, o, n) for d, o, n in writes] == [(True, PAGE, 2 * MIB)]
    f.close()
    assert (tmp_path / "a").read_bytes()[PAGE:] == bytes(buffer)


def test_a_file_written_in_windows_of_every_size_equals_its_bytes(tmp_path, writes):
    """A header, then windows under and over the direct threshold at odd offsets, some from one reused buffer
    (a session's), some read-back-free: the file and its checksum are the bytes written."""
    rng = random.Random(7)
    total = bytearray()
    f = OutputFile(tmp_path / "a", size=None)
    reused = bytearray(4 * MIB)
    while len(total) < 40 * MIB:
        n = rng.choice([7, 900, MIB - 1, MIB + 5, 2 * MIB + 4095, 4 * MIB])
        reused[:n] = os.urandom(n)
        f.pwrite(memoryview(reused)[:n], len(total))
        total += reused[:n]
    assert any(d for d, _, _ in writes) and f.read_back == 0
    assert f.close() == file_digest(tmp_path / "a")
    assert (tmp_path / "a").read_bytes() == bytes(total)


def test_a_file_system_refusing_o_direct_gets_page_cache_writes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    data = os.urandom(3 * MIB + 5)
    f = OutputFile(tmp_path / "a")
    f.pwrite(data, 11)
    f.pwrite(data, 11 + len(data))
    assert f._direct is False
    f.close()
    assert (tmp_path / "a").read_bytes()[11:] == data + data


@pytest.mark.parametrize("after", [0, 1])
def test_direct_writes_refused_midway_go_on_through_the_page_cache(tmp_path, writes, monkeypatch, after):
    """EINVAL from a direct write (after ``after`` good ones): that write and the rest go through the page
    cache, and the file is whole."""
    spy = os.pwrite
    done, refused = [0], []

    def refusing(fd, data, offset):
        if _is_direct(fd):
            if done[0] >= after:
                refused.append(offset)
                raise OSError(errno.EINVAL, "Invalid argument")
            done[0] += 1
        return spy(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    monkeypatch.setattr(storage, "_BOUNCE", MIB)  # several direct writes per call
    data = os.urandom(5 * MIB + 3)
    f = OutputFile(tmp_path / "a")
    f.pwrite(data, 1)
    f.pwrite(data, 1 + len(data))
    assert len(refused) == 1 and f._direct is False
    assert sum(d for d, _, _ in writes) == after
    assert f.close() == file_digest(tmp_path / "a")
    assert (tmp_path / "a").read_bytes()[1:] == data + data


def _is_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def test_a_short_direct_write_is_finished_through_the_page_cache(tmp_path, writes, monkeypatch):
    real_pwrite = os.pwrite
    cut = []

    def short(fd, data, offset):
        if _is_direct(fd) and not cut:
            cut.append(offset)
            return real_pwrite(fd, memoryview(data)[:PAGE * 3], offset)  # whole pages, fewer than asked
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", short)
    data = os.urandom(2 * MIB + 99)
    f = OutputFile(tmp_path / "a")
    f.pwrite(data, 5)
    assert cut
    f.close()
    assert (tmp_path / "a").read_bytes()[5:] == data


def test_a_full_disk_under_a_direct_write_is_named(tmp_path, writes, monkeypatch):
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        if _is_direct(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    f = OutputFile(tmp_path / "a")
    with pytest.raises(CheckpointFormatError, match=r"/a: cannot write 2097152 bytes at byte 0 \(No space left on device\)"):
        f.pwrite(os.urandom(2 * MIB), 0)
    f.abort()
    assert not (tmp_path / "a").exists()


def test_the_checksum_of_a_direct_write_is_taken_while_the_disk_takes_its_bytes(tmp_path, writes, monkeypatch):
    """Each direct write holds back until the file's checksum has taken its bytes: that only happens where the two
    run at once. Written ahead or in order, with small writes between, the checksum is that of the file's bytes."""
    import threading

    f = OutputFile(tmp_path / "a")
    hashed = threading.Event()

    class Hash:  # the file's checksum, noting each update
        def __init__(self, real):
            self.real = real

        def update(self, data):
            self.real.update(data)
            hashed.set()

        def hexdigest(self):
            return self.real.hexdigest()

    f._hash = Hash(f._hash)
    real_pwrite, waited = os.pwrite, []

    def pwrite(fd, data, offset):
        if _is_direct(fd) and not waited:
            waited.append(hashed.wait(10))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    rng = random.Random(3)
    pieces = [(0, rng.randbytes(2 * MIB + 5)), (2 * MIB + 5, rng.randbytes(100)), (4 * MIB, rng.randbytes(3 * MIB)),
              (2 * MIB + 105, rng.randbytes(4 * MIB - (2 * MIB + 105)))]  # the third written ahead of the fourth
    for offset, data in pieces:
        f.pwrite(data, offset)
    digest = f.close()
    assert waited == [True]
    content = (tmp_path / "a").read_bytes()
    assert len(content) == 7 * MIB and all(content[o:o + len(d)] == d for o, d in pieces)
    assert digest == file_digest(tmp_path / "a")
    assert any(d for d, _, _ in writes)


@pytest.mark.parametrize("direct", [True, False])
def test_a_part_of_a_shared_file_writes_as_asked(tmp_path, writes, direct):
    """Directly, as a whole file (two processes writing one file through the page cache contend for its lock), or
    through the page cache; either way the part's bytes land where they belong and nothing else is written."""
    data = os.urandom(3 * MIB)
    part = FilePart(tmp_path / "a", 4 * MIB, frames=False, direct=direct)
    part.pwrite(data, PAGE + 100)
    part.close()
    assert any(d for d, _, _ in writes) is direct
    assert sum(n for _, _, n in writes) == len(data)
    content = (tmp_path / "a").read_bytes()
    assert len(content) == 4 * MIB and content[PAGE + 100:PAGE + 100 + len(data)] == data
    assert content.count(0, 0, PAGE + 100) == PAGE + 100 and not any(content[PAGE + 100 + len(data):])


@pytest.mark.parametrize("direct_io", [True, False])
def test_workers_write_their_parts_of_a_split_file_as_asked_and_it_equals_one_workers(tmp_path, monkeypatch, wide,
                                                                                      direct_io):
    """A one-file destination split between two workers: each share writes its part of the file directly (or, told
    so, through the page cache), and the file, framed and checksummed by the parent, is one worker's, byte for
    byte."""
    if direct_io and not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    from reshard.api.workers import shares, worker_shares
    from reshard.execution.workers import write_share

    report = reshard.plan(wide, format="hf")
    parts = shares(report, 2)
    assert [p.split and p.split[0][0] for p in parts] == ["model.safetensors"] * 2
    out = tmp_path / "parts"
    out.mkdir()
    used = []
    real = OutputFile._pages
    monkeypatch.setattr(OutputFile, "_pages", lambda self, *a: used.append((type(self), self.path.name))
                        or real(self, *a))
    for k, share in enumerate(worker_shares(report, parts, out, 4 * MIB, direct_io=direct_io)):
        used.clear()
        write_share(share)
        assert ((FilePart, "model.safetensors") in used) is direct_io, k
    monkeypatch.undo()
    reshard.convert(wide, tmp_path / "one", format="hf", workers=1)
    reshard.convert(wide, tmp_path / "two", format="hf", workers=2, direct_io=direct_io)
    file = "model.safetensors"
    assert (tmp_path / "two" / file).read_bytes() == (tmp_path / "one" / file).read_bytes()
    assert reshard.verify(tmp_path / "two")


def test_a_conversion_written_directly_equals_one_through_the_page_cache(tmp_path, monkeypatch, wide):
    """Tensors of several MiB, so that windows go directly: the same bytes, manifest aside, as with every write
    through the page cache."""
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    src = wide
    used = []
    real = OutputFile._pages

    def pages(self, *args):
        used.append(self.path.name)
        return real(self, *args)

    monkeypatch.setattr(OutputFile, "_pages", pages)
    reshard.convert(src, tmp_path / "direct", to="tp=1,pp=4", workers=1)
    assert used
    used.clear()
    reshard.convert(src, tmp_path / "cached", to="tp=1,pp=4", workers=1, direct_io=False)
    assert not used
    files = sorted(p.relative_to(tmp_path / "direct") for p in (tmp_path / "direct").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "cached") for p in (tmp_path / "cached").rglob("*") if p.is_file())
    for rel in files:
        if rel.name != "reshard.json":
            assert (tmp_path / "direct" / rel).read_bytes() == (tmp_path / "cached" / rel).read_bytes(), rel


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_workers_share_writes_as_the_conversion_asks(tmp_path, monkeypatch, wide, direct_io):
    """``direct_io`` travels with each worker's share to the session that writes it."""
    if direct_io and not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    from reshard.api.workers import shares, worker_shares
    from reshard.execution.workers import write_share

    report = reshard.plan(wide, to="tp=1,pp=4")
    parts = shares(report, 2)
    out = tmp_path / "out"
    out.mkdir()
    sent = worker_shares(report, parts, out, 4 * MIB, direct_io=direct_io)
    assert [s.direct_io for s in sent] == [direct_io] * len(parts)
    used = []
    real = OutputFile._pages
    monkeypatch.setattr(OutputFile, "_pages", lambda self, *a: used.append(self.path) or real(self, *a))
    for share in sent:
        write_share(share)
    assert bool(used) is direct_io


def test_the_command_writes_through_the_page_cache_when_told(tmp_path, monkeypatch, wide):
    from typer.testing import CliRunner

    from reshard.cli.main import app

    used = []
    real = OutputFile._pages
    monkeypatch.setattr(OutputFile, "_pages", lambda self, *a: used.append(self.path) or real(self, *a))
    result = CliRunner().invoke(app, ["convert", str(wide), str(tmp_path / "a"), "--to", "tp=1,pp=4", "--workers", "1",
                                      "--no-direct-io"])
    assert result.exit_code == 0, result.output
    assert not used
    if _direct_supported(tmp_path):
        result = CliRunner().invoke(app, ["convert", str(wide), str(tmp_path / "b"), "--to", "tp=1,pp=4",
                                          "--workers", "1"])
        assert result.exit_code == 0, result.output
        assert used
