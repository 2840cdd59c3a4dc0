"""The first line of each benchmark's output: the machine, and the speeds on it that bound reshard's CPU work.

A conversion's CPU goes mostly to three things per byte: the xxh3-128 checksums (of every tensor read and of every
file written), the CRC-32 of every byte of a ``.pt`` file's zip records, and copies between buffers. Their speed on
one core, measured here on 64 MiB in memory (the best of 3), tells a slow library build or a slow machine apart from
a slow conversion, before any table does. The packages are named with their versions, and the CRC-32 by the
library reshard takes it from (zlib-ng where installed, else Python's zlib).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version

import numpy as np
import xxhash


def _rate(fn, data) -> float:
    """GB/s of ``fn(data)``, the best of 3."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        fn(data)
        best = min(best, time.perf_counter() - t0)
    return len(data) / best / 1e9


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def describe() -> str:
    """``machine: ...``: architecture, cores, Python, numpy, xxhash, torch (where imported already), and the speed
    on one core of xxh3-128, CRC-32 and a memory copy."""
    from reshard.io.zipdir import crc32

    data = np.arange(64 << 20, dtype=np.uint8)
    into = np.empty_like(data)
    np.copyto(into, data)  # its pages, faulted in before the copy is timed
    crc_lib = "zlib-ng" if crc32.__module__.startswith("zlib_ng") else "zlib"
    torch = sys.modules.get("torch")
    return (f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
            f"numpy {np.__version__}, xxhash {_version('xxhash')}"
            f"{f', torch {torch.__version__}' if torch is not None else ''}; on one core: "
            f"xxh3-128 {_rate(xxhash.xxh3_128_digest, data):.1f} GB/s, CRC-32 ({crc_lib}) {_rate(crc32, data):.1f} GB/s, "
            f"copy {_rate(lambda d: np.copyto(into, d), data):.1f} GB/s")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    print(describe())
