"""Where one conversion's wall time goes: planning, reads, checksums, CRC-32, writes, fsync, and the rest.

Converts a generated checkpoint of ``convert_memory.py`` with one worker, in this process: by default its
Megatron checkpoint (tp=2,pp=2 with the distributed optimizer, about 2.6 GiB) to tp=1,pp=4; with ``--source hf``
its Hugging Face Llama (1.92 GiB of bf16 safetensors) to Megatron tp=2,pp=2, whose row-split weights take half of
each row. Every system call and checksum that moves bytes is timed where it is made and on which thread:

- the main thread plans, reads the source (``os.preadv``), gathers each window's runs and takes the
  per-tensor checksums (xxh3-128);
- the session's writer thread (``reshard-write``) takes the file checksums and the zip CRC-32s and hands
  each window to the kernel (``os.pwrite``), a window's whole pages on the file's direct-write thread
  (``reshard-direct``), while the writer takes its checksum;
- its sync thread (``reshard-sync``) ``fsync``s each file once it is closed, while the next one is written,
  and records it in the resume journal.

Prints one table: seconds per step and thread, its share of the wall time, and the CPU time the thread spent in
it (user and system: a step bound by the processor shows CPU near its seconds, one waiting on the disk far
below); what a thread spends outside the timed calls is its "rest" (Python per window and per tensor, numpy
copies, waiting on the other thread). With ``--cold`` the page cache is dropped first (root).

    python bench/breakdown.py [--source megatron|hf] [--scale 1.0] [--cold] [--keep DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from convert_memory import CASES, TARGET_FORMAT, generate, sizes_for  # noqa: E402
from rank_load import drop_caches  # noqa: E402


def _kind(name: str) -> str:
    return "writer" if name.startswith("reshard-write") else "sync" if name.startswith("reshard-sync") \
        else "direct" if name.startswith("reshard-direct") else "main"


class Timers:
    """Seconds and CPU seconds per (thread, step), summed from every call wrapped by ``wrap``; and each kind of
    thread's whole CPU time (``thread_cpu``: the conversion's threads as they end, the main thread's as
    ``main`` adds it)."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.cpu: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.thread_cpu: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def add(self, step: str, seconds: float, cpu: float) -> None:
        thread = _kind(threading.current_thread().name)
        with self._lock:
            self.seconds[thread, step] += seconds
            self.cpu[thread, step] += cpu
            self.calls[thread, step] += 1

    def wrap(self, step: str, fn):
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(step, time.perf_counter() - t0, time.thread_time() - c0)
        return timed

    def ended(self, name: str, cpu: float) -> None:
        with self._lock:
            self.thread_cpu[_kind(name)] += cpu


def instrument(timers: Timers) -> None:
    """Time every byte-moving call a conversion makes, in this process only."""
    import xxhash

    import reshard.io.checksum as checksum
    import reshard.io.torch_write as torch_write

    for name, step in (("preadv", "read"), ("pread", "read"), ("pwrite", "write"), ("write", "write"),
                       ("fsync", "fsync")):
        setattr(os, name, timers.wrap(step, getattr(os, name)))
    torch_write.crc32 = timers.wrap("CRC-32 (zip records)", torch_write.crc32)
    real = xxhash.xxh3_128
    step = "xxh3-128 (manifest checksums)"

    class TimedHash:
        def __init__(self, *args) -> None:
            self._h = real(*args)

        def update(self, data) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            self._h.update(data)
            timers.add(step, time.perf_counter() - t0, time.thread_time() - c0)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

        def digest(self) -> bytes:
            return self._h.digest()

        def reset(self) -> None:
            self._h.reset()

        def copy(self) -> TimedHash:
            out = TimedHash()
            out._h = self._h.copy()
            return out

    xxhash.xxh3_128 = TimedHash
    checksum._digest = timers.wrap(step, checksum._digest)  # a file's blocks, one call each
    run = threading.Thread.run

    def counted(thread: threading.Thread) -> None:  # a thread's whole CPU time, read on it as it ends
        try:
            run(thread)
        finally:
            timers.ended(thread.name, time.thread_time())

    threading.Thread.run = counted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", choices=("megatron", "hf"), default="megatron", help="the generated checkpoint")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the layer count (1.0: about 2.6 GiB)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before the conversion (root)")
    ap.add_argument("--keep", type=Path, help="write under this directory and keep the files")
    ap.add_argument("--tiny", action="store_true", help="a checkpoint of a few MiB (a smoke test)")
    args = ap.parse_args()
    source_topo, target, _ = CASES[args.source]
    fmt = TARGET_FORMAT.get(args.source)
    base = args.keep or Path(tempfile.mkdtemp(prefix="reshard-bench-", dir=os.environ.get("TMPDIR")))
    src, dst = base / "src", base / "dst"
    shutil.rmtree(dst, ignore_errors=True)
    try:
        generate(src, sizes_for(args.scale, args.tiny), args.source)
        import reshard

        reshard.plan(src, to=target, format=fmt)  # imports and first-use costs out of the measurement
        timers = Timers()
        instrument(timers)
        os.sync()
        if args.cold:
            drop_caches()
        first: list[tuple[float, float]] = []
        t0, c0 = time.perf_counter(), time.thread_time()
        result = reshard.convert(src, dst, to=target, format=fmt, workers=1,
                                 progress=lambda done, total: first or first.append((time.perf_counter(),
                                                                                      time.thread_time())))
        wall = time.perf_counter() - t0
        timers.ended("main", time.thread_time() - c0)
        planning, planning_cpu = (first[0][0] - t0, first[0][1] - c0) if first else (0.0, 0.0)
        into = f"{'Hugging Face' if args.source == 'hf' else 'Megatron'} {source_topo} -> " \
               f"{'Megatron ' if fmt else ''}{target}"
        table(timers, wall, (planning, planning_cpu), result.bytes_read, result.bytes_written, into, args.cold)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def table(timers: Timers, wall: float, planning: tuple[float, float], read: int, written: int, title: str,
          cold: bool) -> None:
    s = timers.seconds
    planning, planning_cpu = planning
    print(f"{title}, one worker, {'page cache dropped' if cold else 'warm page cache'}: "
          f"{read / 2**30:.2f} GiB read, {written / 2**30:.2f} GiB written in {wall:.2f} s\n")
    print("| thread | step | seconds | share of wall | CPU s | calls | rate |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print(f"| main | open, plan and lay out the files (until the first byte) | {planning:.2f} | {planning / wall:.0%} "
          f"| {planning_cpu:.2f} | | |")
    for thread in ("main", "writer", "direct", "sync"):
        timed = timed_cpu = 0.0
        for (t, step), sec in sorted(s.items(), key=lambda kv: -kv[1]):
            if t != thread:
                continue
            timed += sec
            timed_cpu += timers.cpu[t, step]
            nbytes = read if step == "read" else written if step in ("write",) else None
            rate = f"{nbytes / sec / 1e9:.1f} GB/s" if nbytes and sec else ""
            print(f"| {thread} | {step} | {sec:.2f} | {sec / wall:.0%} | {timers.cpu[t, step]:.2f} | "
                  f"{timers.calls[t, step]:,} | {rate} |")
        busy = planning if thread == "main" else 0.0
        rest = wall - timed - busy
        rest_cpu = timers.thread_cpu[thread] - timed_cpu - (planning_cpu if thread == "main" else 0.0)
        what = {"main": "gathering runs into windows, Python per window and tensor, waiting on the other threads",
                "writer": "idle: waiting for the next window or for its direct write, or not started",
                "direct": "idle: waiting for the next direct write, or not started",
                "sync": "idle: waiting for the next closed file, or not started"}[thread]
        print(f"| {thread} | rest: {what} | {rest:.2f} | {rest / wall:.0%} | {rest_cpu:.2f} | | |")
    cpu = sum(timers.thread_cpu.values())
    print(f"| | **wall** | **{wall:.2f}** | 100% | {cpu:.2f} | | {written / wall / 1e9:.2f} GB/s written |")


if __name__ == "__main__":
    main()
