"""Three ways to move a file's bytes unchanged into a new file, in the kernel's time: is ``copy_file_range`` faster?

A conversion moves most bytes unchanged (whole tensors, row blocks, flat optimizer ranges) and takes an xxh3-128
checksum of each tensor for the manifest. This measures, on one ``--mib`` MiB file with a warm page cache:

- **read + write**: ``os.preadv`` into one reused 4 MiB buffer, xxh3-128 of the buffer, ``os.pwrite`` (reshard's
  way: the bytes cross into the process once, where the checksum reads them);
- **copy_file_range**: ``os.copy_file_range`` in 64 MiB calls, no checksum (the kernel copies between page caches,
  the way ``cp`` copies);
- **copy_file_range + mmap checksum**: the same, and xxh3-128 of the source through a read-only ``mmap``
  (``MAP_POPULATE``), as a checksum must read the bytes somewhere.

Each way runs ``--repeat`` rounds, interleaved, the destination removed and ``sync`` called before each. Prints
the median and the best of each: wall, user and system CPU seconds, and the ``fsync`` after it (not in the
wall).

    python bench/copy_paths.py [--mib 1024] [--repeat 7] [--tiny]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

_BUFFER = 4 << 20
_CALL = 64 << 20


def read_write(src: Path, dst: Path) -> str:
    size = src.stat().st_size
    fi, fo = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fo, size)
        view, digest, at = memoryview(bytearray(_BUFFER)), xxhash.xxh3_128(), 0
        while at < size:
            n = os.preadv(fi, [view[:min(_BUFFER, size - at)]], at)
            digest.update(view[:n])
            os.pwrite(fo, view[:n], at)
            at += n
        return digest.hexdigest()
    finally:
        os.close(fi)
        os.close(fo)


def _copy_range(fi: int, fo: int, at: int, n: int) -> None:
    done = 0
    while done < n:
        done += os.copy_file_range(fi, fo, n - done, at + done, at + done)


def copy_range(src: Path, dst: Path) -> str:
    size = src.stat().st_size
    fi, fo = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for at in range(0, size, _CALL):
            _copy_range(fi, fo, at, min(_CALL, size - at))
        return ""
    finally:
        os.close(fi)
        os.close(fo)


def copy_range_mmap(src: Path, dst: Path) -> str:
    size = src.stat().st_size
    fi, fo = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mapped = mmap.mmap(fi, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        digest = xxhash.xxh3_128()
        with memoryview(mapped) as view:
            for at in range(0, size, _CALL):
                n = min(_CALL, size - at)
                digest.update(view[at:at + n])
                _copy_range(fi, fo, at, n)
        mapped.close()
        return digest.hexdigest()
    finally:
        os.close(fi)
        os.close(fo)


WAYS: dict[str, Callable[[Path, Path], str]] = {
    "read + write, xxh3 of the buffer": read_write,
    "copy_file_range, no checksum": copy_range,
    "copy_file_range + xxh3 through mmap": copy_range_mmap,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="the file's size")
    ap.add_argument("--repeat", type=int, default=7, help="rounds, interleaved")
    ap.add_argument("--tiny", action="store_true", help="16 MiB, two rounds: a smoke test")
    args = ap.parse_args()
    if args.tiny:
        args.mib, args.repeat = 16, 2
    with tempfile.TemporaryDirectory(prefix="reshard-bench-", dir=os.environ.get("TMPDIR")) as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        block = os.urandom(1 << 20)  # the bytes' values do not matter to a copy: one random MiB, repeated
        with open(src, "wb") as f:
            for _ in range(args.mib):
                f.write(block)
        want = read_write(src, dst)  # and the page cache warm
        runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in WAYS}
        for _ in range(args.repeat):
            for name, way in WAYS.items():
                dst.unlink(missing_ok=True)
                os.sync()
                before, t0 = os.times(), time.perf_counter()
                got = way(src, dst)
                wall, after = time.perf_counter() - t0, os.times()
                fd = os.open(dst, os.O_RDONLY)
                t1 = time.perf_counter()
                os.fsync(fd)
                synced = time.perf_counter() - t1
                os.close(fd)
                if got not in ("", want) or dst.stat().st_size != src.stat().st_size:
                    raise SystemExit(f"{name}: the copy differs from its source")
                runs[name].append((wall, after.user - before.user, after.system - before.system, synced))
        print(f"one file of {args.mib} MiB, warm page cache, {args.repeat} rounds interleaved: median (best)\n")
        print("| way | wall s | user s | system s | fsync after s | wall vs read + write |")
        print("|---|---:|---:|---:|---:|---:|")
        base = statistics.median(r[0] for r in runs[next(iter(WAYS))])
        for name, rs in runs.items():
            cells = [f"{statistics.median(col):.2f} ({min(col):.2f})" for col in zip(*rs)]
            print(f"| {name} | {' | '.join(cells)} | {statistics.median(r[0] for r in rs) / base:.2f} |")


if __name__ == "__main__":
    main()
