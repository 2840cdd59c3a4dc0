"""A file's checksum is the xxh3-128 of its 64 KiB blocks' digests: taken from bytes fed in any pieces, or put
together from the whole blocks several writers took and the rest read back, it is the same; writers that wrote the
same bytes are trusted for none of them."""

from __future__ import annotations

import random

import pytest
import xxhash

from reshard.io.checksum import BLOCK, FileHash, PartBlocks, blocks_digest, file_digest, plain_digest

SIZES = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 5 * BLOCK + 777]


def definition(data: bytes) -> str:
    """The checksum as the module's docstring defines it."""
    return xxhash.xxh3_128_hexdigest(b"".join(xxhash.xxh3_128_digest(data[i:i + BLOCK])
                                              for i in range(0, len(data), BLOCK)))


def reader(data: bytes | bytearray, log: list | None = None):
    def read(offset: int, into: memoryview) -> None:
        length = len(into)
        assert offset % BLOCK == 0 and (length % BLOCK == 0 or offset + length == len(data))
        into[:] = data[offset:offset + length]
        if log is not None:
            log.append((offset, length))
    return read


@pytest.mark.parametrize("size", SIZES)
def test_bytes_fed_in_any_pieces_give_the_blocks_checksum(tmp_path, size):
    rng = random.Random(size)
    data = rng.randbytes(size)
    for _ in range(5):
        h, at = FileHash(), 0
        while at < size:
            step = rng.choice([1, 100, BLOCK - 3, BLOCK, 2 * BLOCK + 1, rng.randrange(1, 4 * BLOCK)])
            h.update(memoryview(data)[at:at + step])
            at += step
        assert h.hexdigest() == definition(data)
    (tmp_path / "f").write_bytes(data)
    assert file_digest(tmp_path / "f") == definition(data)
    assert plain_digest(tmp_path / "f") == xxhash.xxh3_128_hexdigest(data)
    assert size < BLOCK or definition(data) != xxhash.xxh3_128_hexdigest(data)


def test_a_file_from_parts_reads_back_only_the_blocks_no_part_wrote_whole():
    """A finisher's header, two parts that meet inside a block, and a tail: the header's block, the seam's and the
    tail's are read back, every other block comes from the parts."""
    data = random.Random(0).randbytes(20 * BLOCK + 300)
    seam, tail = 9 * BLOCK + 1000, 20 * BLOCK + 100
    first, second, finisher = PartBlocks(), PartBlocks(), PartBlocks()
    finisher.update(data[:200], 0)
    for at in range(200, seam, 50_000):  # in windows that do not keep to blocks
        first.update(data[at:min(seam, at + 50_000)], at)
    second.update(data[seam:tail], seam)
    finisher.update(data[tail:], tail)
    log: list = []
    digest, read_back = blocks_digest(len(data), [first.taken(), second.taken(), finisher.taken()], reader(data, log))
    assert digest == definition(data)
    assert log == [(0, BLOCK), (9 * BLOCK, BLOCK), (20 * BLOCK, 300)] and read_back == 2 * BLOCK + 300


def test_random_parts_give_the_checksum_of_the_bytes_on_disk():
    """Many files cut at random among four writers and bytes no writer reports (holes, a finisher's frames), in
    random order, some bytes written again by the writer that wrote them or by another: the checksum is always that
    of the final bytes."""
    rng = random.Random(1)
    for _ in range(300):
        size = rng.choice(SIZES + [rng.randrange(1, 12 * BLOCK)])
        cuts = sorted({0, size, *(rng.randrange(size + 1) for _ in range(rng.randrange(8)))})
        spans = list(zip(cuts, cuts[1:]))
        if rng.random() < 0.3:
            rng.shuffle(spans)
        parts = [PartBlocks() for _ in range(4)]
        final = bytearray(size)
        for a, b in spans:
            new = rng.randbytes(b - a)
            final[a:b] = new
            k = rng.randrange(5)
            for at in range(a, b, 40_000) if k < 4 else ():
                parts[k].update(new[at - a:min(b, at + 40_000) - a], at)
        for _ in range(rng.choice([0, 0, 1, 2])):
            if size:
                a = rng.randrange(size)
                b = min(size, a + rng.randrange(1, 2 * BLOCK))
                final[a:b] = rng.randbytes(b - a)
                parts[rng.randrange(4)].update(final[a:b], a)
        digest, read_back = blocks_digest(size, [p.taken() for p in parts], reader(final))
        assert digest == definition(bytes(final)) and read_back <= size


def test_blocks_holding_bytes_two_parts_wrote_are_read_back():
    """The second part's bytes are the file's, inside a block the first took: that block is read back; the
    second part wrote the same whole blocks as the first at the end: no run of either is trusted there."""
    data = bytearray(random.Random(2).randbytes(12 * BLOCK))
    first, second = PartBlocks(), PartBlocks()
    first.update(data, 0)
    data[3 * BLOCK + 10:4 * BLOCK - 10] = bytes(BLOCK - 20)
    second.update(data[3 * BLOCK + 10:4 * BLOCK - 10], 3 * BLOCK + 10)
    log: list = []
    digest, read_back = blocks_digest(len(data), [first.taken(), second.taken()], reader(data, log))
    assert digest == definition(bytes(data)) and log == [(3 * BLOCK, BLOCK)]
    data[9 * BLOCK:] = bytes(3 * BLOCK)
    second.update(data[9 * BLOCK:], 9 * BLOCK)
    log.clear()
    digest, read_back = blocks_digest(len(data), [first.taken(), second.taken()], reader(data, log))
    assert digest == definition(bytes(data)) and log == [(3 * BLOCK, BLOCK), (9 * BLOCK, 3 * BLOCK)]


def test_a_part_that_writes_over_its_own_bytes_takes_no_blocks():
    data = bytearray(random.Random(3).randbytes(6 * BLOCK))
    part = PartBlocks()
    part.update(data[:4 * BLOCK], 0)
    data[BLOCK + 5] ^= 1
    part.update(data[BLOCK + 5:BLOCK + 6], BLOCK + 5)
    part.update(data[4 * BLOCK:], 4 * BLOCK)
    assert part.taken()[0] == []
    digest, read_back = blocks_digest(len(data), [part.taken()], reader(data))
    assert digest == definition(bytes(data)) and read_back == len(data)


def test_runs_past_the_end_are_not_trusted():
    data = random.Random(4).randbytes(4 * BLOCK)
    part = PartBlocks()
    part.update(data, 0)
    digest, read_back = blocks_digest(3 * BLOCK, [part.taken()], reader(data[:3 * BLOCK]))
    assert digest == definition(data[:3 * BLOCK]) and read_back == 3 * BLOCK


def test_a_manifest_from_before_the_block_checksum_still_verifies(tmp_path):
    """Older manifests record each file's plain xxh3-128 under ``xxh3_128``: ``verify`` checks that, and names the
    file that no longer matches it."""
    import json

    import reshard
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "src", to="tp=2,pp=1")
    reshard.convert(tmp_path / "src", tmp_path / "dst", to="tp=1,pp=1")
    path = tmp_path / "dst" / "reshard.json"
    manifest = json.loads(path.read_text())
    for rel, entry in manifest["files"].items():
        assert entry.pop("xxh3_128_64k") == file_digest(tmp_path / "dst" / rel)
        entry["xxh3_128"] = plain_digest(tmp_path / "dst" / rel)
    path.write_text(json.dumps(manifest))
    assert reshard.verify(tmp_path / "dst")
    rel = next(r for r in manifest["files"] if r.endswith(".pt"))
    data = bytearray((tmp_path / "dst" / rel).read_bytes())
    data[-3000] ^= 1
    (tmp_path / "dst" / rel).write_bytes(bytes(data))
    result = reshard.verify(tmp_path / "dst")
    assert not result.identical and result.differences[0].startswith(f"{rel}: xxh3_128 ")


def test_a_part_that_wrote_over_its_own_bytes_still_makes_others_blocks_it_wrote_read_back():
    """After writing back over its own bytes a part takes no blocks, but the bytes it goes on to write still count:
    another part's block they land in is read back."""
    data = bytearray(random.Random(5).randbytes(8 * BLOCK))
    first, second = PartBlocks(), PartBlocks()
    second.update(data[4 * BLOCK:], 4 * BLOCK)
    first.update(data[:2 * BLOCK], 0)
    first.update(data[10:20], 10)
    data[5 * BLOCK + 1:5 * BLOCK + 9] = bytes(8)
    first.update(data[5 * BLOCK + 1:5 * BLOCK + 9], 5 * BLOCK + 1)
    log: list = []
    digest, _ = blocks_digest(len(data), [first.taken(), second.taken()], reader(data, log))
    assert digest == definition(bytes(data)) and (5 * BLOCK, BLOCK) in log
