"""The first line of each benchmark's output: the machine, and the speeds on it that bound reshard's CPU work.

A conversion's CPU goes mostly to three things per byte: the xxh3-128 checksums (of every tensor read and of every
file written), the CRC-32 of every byte of a ``.pt`` file's zip records, and copies between buffers. Their speed on
one core, measured here on 64 MiB in memory (the best of 3), tells a slow library build or a slow machine apart from
a slow conversion, before any table does. The packages are named with their versions, and the CRC-32 by the
library reshard takes it from (zlib-ng where installed, else Python's zlib).

The measuring runs in a fresh interpreter: its 128 MiB of buffers would otherwise stay in the benchmark's own peak
resident memory, which a child it starts (by ``vfork`` and ``exec``) reports as part of its own ``ru_maxrss``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version


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
    """``machine: ...``: architecture, cores, Python, numpy, xxhash, torch (where this process imported it), and the
    speed on one core of xxh3-128, CRC-32 and a memory copy, measured in a fresh interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    line = subprocess.run([sys.executable, os.path.abspath(__file__)], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()
    torch = sys.modules.get("torch")
    return line.replace("; on one core:", f", torch {torch.__version__}; on one core:") if torch is not None else line


def _measure() -> str:
    import numpy as np
    import xxhash

    from reshard.io.zipdir import crc32

    data = np.arange(64 << 20, dtype=np.uint8)
    into = np.empty_like(data)
    np.copyto(into, data)  # its pages, faulted in before the copy is timed
    crc_lib = "zlib-ng" if crc32.__module__.startswith("zlib_ng") else "zlib"
    return (f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
            f"numpy {np.__version__}, xxhash {_version('xxhash')}; on one core: "
            f"xxh3-128 {_rate(xxhash.xxh3_128_digest, data):.1f} GB/s, CRC-32 ({crc_lib}) {_rate(crc32, data):.1f} GB/s, "
            f"copy {_rate(lambda d: np.copyto(into, d), data):.1f} GB/s")


if __name__ == "__main__":
    print(_measure())
