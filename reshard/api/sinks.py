"""Where a load's windows are filled: in place in host memory, or through staging buffers to a device.

``reshard.load`` and ``reshard.torch.load_into`` read a rank's bytes window by window. On the CPU a window is
the tensor's own bytes (``HostSink``). On another device (``StagedSink``) it is filled into a host staging buffer
and copied from there to the tensor, the copy of one window running while the next ones are filled; a buffer is
filled again only once its last copy is done. Only the copies differ between devices:

- ``CudaCopies``: pinned buffers, copies on a stream of their own that first waits for the work the current
  stream had queued on the tensors' memory, each marked by an event;
- ``ThreadCopies``: copies on a thread of their own, each marked by its future. A CPU device staged this way
  runs every step of the CUDA path but the CUDA calls, which is how the tests check it.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from reshard.errors import ReshardError

__all__ = ["CudaCopies", "HostSink", "StagedSink", "ThreadCopies", "copies_for", "fill_threads", "run_windows",
           "sink_for", "usable_cores"]

THREADS = 2
"""Threads filling windows at once, by default (at most the cores this process may use). Measured on a
2-core machine, rank 3 of tp=2,pp=2 from a 595 MiB Hugging Face checkpoint (148 MiB, warm cache):
see bench/rank_load.py."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def fill_threads(threads: int | None) -> int:
    """The threads a load fills its windows on: ``threads``, checked, or by default ``THREADS`` at most the cores
    this process may use."""
    if threads is None:
        return max(1, min(THREADS, usable_cores()))
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ReshardError(f"threads must be an integer of at least 1, got {threads!r}")
    return threads


def run_windows(task: Any, tasks: list, threads: int) -> None:
    """``task`` over ``tasks``, on ``threads`` threads (reads, copies and casts release the GIL); the first error
    stops what has not started."""
    if threads == 1 or len(tasks) <= 1:
        for t in tasks:
            task(t)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reshard-load") as pool:
        futures = [pool.submit(task, t) for t in tasks]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


class HostSink:
    """Tensors filled where they live, in host memory: a window is the tensor's own bytes."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def allocate(self, sizes: list[int]) -> list[Any]:
        """Flat byte tensors of ``sizes``: views of one block of memory, each at a multiple of 64 bytes."""
        # numpy asks the kernel for huge pages for large arrays, and torch does not: reading into fresh
        # 4 KiB pages faults on each one, which made reading into a torch.empty tensor 3.5 times slower. One
        # block for all (not one array per tensor) is huge pages throughout: a 0.5 GiB load 0.15 s, not 0.18.
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + -(-n // 64) * 64)
        block = np.empty(starts[-1], dtype=np.uint8)
        return [self.torch.from_numpy(block[a:a + n]) for a, n in zip(starts, sizes)]

    @contextmanager
    def window(self, flat: Any, lo: int, hi: int) -> Iterator[np.ndarray]:
        """Bytes ``[lo, hi)`` of the flat byte tensor ``flat``, to fill."""
        yield flat[lo:hi].numpy()

    def finish(self, *, quiet: bool = False) -> None:
        pass


class CudaCopies:
    """Host-to-device copies on a CUDA stream of their own, from pinned buffers, without waiting for them."""

    pinned = True

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch, self.device = torch, device
        self.stream = torch.cuda.Stream(device)

    def after(self) -> None:
        """Copies from now on start after the work queued so far on the device's current stream: the caching
        allocator may have handed the tensors memory that stream still reads or writes."""
        self.stream.wait_stream(self.torch.cuda.current_stream(self.device))

    def copy(self, dst: Any, src: Any) -> Any:
        with self.torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = self.torch.cuda.Event()
            done.record(self.stream)
        return done

    @staticmethod
    def wait(done: Any) -> None:
        done.synchronize()

    def finish(self, *, quiet: bool = False) -> None:
        try:
            self.stream.synchronize()
        except Exception:
            if not quiet:
                raise


class ThreadCopies:
    """Copies on a thread of their own, as asynchronous as CUDA's: for a device without a copy stream, and for
    the tests of the staged path on the CPU. ``finish`` waits for every copy and raises the first failure."""

    pinned = False

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-copy")
        self.pending: list[Future] = []

    def after(self) -> None:
        pass

    def copy(self, dst: Any, src: Any) -> Future:
        done = self.pool.submit(_copy, dst, src)
        self.pending.append(done)
        return done

    @staticmethod
    def wait(done: Future) -> None:
        done.result()

    def finish(self, *, quiet: bool = False) -> None:
        try:
            for done in self.pending:
                if quiet:
                    done.exception()  # waits, and leaves the failure to the error already on its way
                else:
                    done.result()
        finally:
            self.pending.clear()
            self.pool.shutdown(wait=True)


def _copy(dst: Any, src: Any) -> None:
    import torch  # imported already: the tensors are torch's

    with torch.no_grad():  # grad mode is per thread: a module's tensors are copied into as the caller would
        dst.copy_(src)


class StagedSink:
    """Tensors on a device, filled through host staging buffers of ``window`` bytes each.

    One buffer per filling thread and two whose copies are in flight: a window takes a free buffer (waiting
    for its last copy first), is filled in it, and hands it to ``copies`` without waiting.
    """

    def __init__(self, torch: Any, device: Any, threads: int, window: int, copies: CudaCopies | ThreadCopies) -> None:
        self.torch, self.device, self.copies = torch, device, copies
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(threads + 2):
            self.free.put((torch.empty(window, dtype=torch.uint8, pin_memory=copies.pinned), None))

    def allocate(self, sizes: list[int]) -> list[Any]:
        out = [self.torch.empty(n, dtype=self.torch.uint8, device=self.device) for n in sizes]
        self.ready()
        return out

    def ready(self) -> None:
        """Order the copies after the work queued so far on the tensors (made here, or a module's own)."""
        self.copies.after()

    @contextmanager
    def window(self, flat: Any, lo: int, hi: int, dtype: Any = None) -> Iterator[np.ndarray]:
        """A staging buffer for ``hi - lo`` bytes, to fill, copied into ``flat[lo:hi]`` once filled. With ``dtype``,
        ``flat`` is a tensor of another dtype (a module's own) and ``lo``/``hi`` count its elements: the bytes are
        read as ``dtype`` and cast by the copy."""
        buf, done = self.free.get()
        try:
            if done is not None:
                self.copies.wait(done)  # the buffer's previous copy has read it
                done = None
            size = (hi - lo) * (dtype.itemsize if dtype is not None else 1)
            staging = buf[:size]
            yield staging.numpy()
            done = self.copies.copy(flat[lo:hi], staging if dtype is None else staging.view(dtype))
        finally:
            self.free.put((buf, done))

    def finish(self, *, quiet: bool = False) -> None:
        """Wait for every copy; ``quiet``: on the way out of another error, raise none of theirs."""
        self.copies.finish(quiet=quiet)


def sink_for(torch: Any, device: Any, threads: int, window: int) -> HostSink | StagedSink:
    """The sink for tensors on ``device``: in place on the CPU, staged elsewhere."""
    if device.type == "cpu":
        return HostSink(torch)
    return StagedSink(torch, device, threads, window, copies_for(torch, device))


def copies_for(torch: Any, device: Any) -> CudaCopies | ThreadCopies:
    """CUDA's copies where ``device`` is CUDA, else a thread's."""
    return CudaCopies(torch, device) if device.type == "cuda" else ThreadCopies()
