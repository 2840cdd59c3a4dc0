"""``load``: what one rank of a new topology holds, read straight from the old checkpoint.

A load costs that rank's bytes: it plans only the rank's items (the plan proven
as a whole conversion's is), allocates its tensors once (on the CPU, views of
one block of memory), and fills them in place window by window on a few threads (reads and copies release the GIL), with
coalesced reads (``RANK_LOAD``): nearby runs of one source file are read as
one span, through every gap of up to 16 KiB (the other ranks' parts of a
row-split weight's rows) and through larger ones while they add at most a
quarter to the rank's bytes.

On a device other than the CPU, each window is filled into a host staging
buffer (pinned, where the device is CUDA) and copied to the tensor on the
device, the copy of one window overlapping the filling of the next. Filling is
the same code on every device; only the last copy differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.api.planning import _collector_paused, _plan
from reshard.api.sinks import HostSink, StagedSink, fill_threads, run_windows, sink_for
from reshard.core.dtypes import itemsize
from reshard.core.layout import PARAM, Item
from reshard.core.topology import Topology
from reshard.errors import ReshardError
from reshard.execution.coalescing import RANK_LOAD
from reshard.execution.executor import ByteReader, PlanFill, uint_dtype

__all__ = ["RankState", "load"]

_WINDOW = 16 << 20
"""Bytes of one tensor filled as one task (larger tensors are cut into windows of this size)."""

@dataclass(slots=True)
class RankState:
    """What one rank holds under a new topology: its stored items, as torch tensors."""

    topology: Topology
    rank: int
    tensors: dict[Item, Any]
    bytes_read: int
    reads: int = 0
    """Read calls made (each one positioned read of one span of a source file)."""

    def state_dict(self, state: str = PARAM, *, section: str | None = None, chunk: int = 0) -> dict[str, Any]:
        """The items of one state (and section, chunk) by key, e.g. the model's state dict."""
        return {it.key: t for it, t in self.tensors.items()
                if it.state == state and it.chunk == chunk and (section is None or it.section == section)}


def load(src: str | Path, *, to: str | Topology, rank: int, format: str | None = None, spec: str | None = None,
         sizes: Mapping[str, int] | None = None, device: Any = None, threads: int | None = None) -> RankState:
    """Load what ``rank`` holds when ``src`` is resharded to topology ``to``, reading only its bytes.

    Called inside each rank of a job whose topology differs from the
    checkpoint's. Tensors come back as torch tensors in the destination
    format's stored shapes and dtypes (model weights under state ``param``,
    optimizer states under their own names).

    Args:
      device: where the tensors are made (a ``torch.device`` or its name, e.g. ``"cuda:0"``); default the CPU.
      threads: how many threads fill the tensors (default: 2, at most the usable cores).

    Raises:
      ReshardError: a rank outside the topology, an unknown or unavailable device, or any error of
        opening, planning or reading the checkpoint.

    >>> mine = load("ckpt/", to="tp=4,pp=1", rank=3)      # doctest: +SKIP
    >>> mine.state_dict("param")["embedding.word_embeddings.weight"].shape  # doctest: +SKIP
    """
    import torch

    dev = _device(torch, device)
    threads = fill_threads(threads)
    with _collector_paused():
        report = _plan(src, to, format, spec, sizes, None, None, rank=rank)
    items = report.target.layout.items
    dtypes = {it: report.target.dtypes.get(it, "uint8") for it in items}
    with ByteReader() as reader:
        fill = PlanFill(report.plan, report.source.where, reader, dtypes=dtypes, coalescing=RANK_LOAD)
        sink = _sink(torch, dev, threads)
        flat = dict(zip(items, sink.allocate([info.numel * itemsize(dtypes[it]) for it, info in items.items()])))
        step = {it: max(1, _WINDOW // itemsize(dtypes[it])) for it in items}
        tasks = [(it, lo, min(info.numel, lo + step[it])) for it, info in items.items()
                 for lo in range(0, info.numel, step[it])]

        def task(job: tuple[Item, int, int]) -> None:
            it, lo, hi = job
            size = itemsize(dtypes[it])
            with sink.window(flat[it], lo * size, hi * size) as out:
                fill.fill_into(it, lo, hi, out.view(uint_dtype(dtypes[it])))

        fill.fit_gaps(tasks)
        try:
            run_windows(task, tasks, threads)
        except BaseException:
            sink.finish(quiet=True)  # no copy left writing into tensors nobody will get
            raise
        sink.finish()
        bytes_read, reads = reader.bytes_read, reader.reads
    tensors = {it: flat[it].view(getattr(torch, dtypes[it])).reshape(info.shape) for it, info in items.items()}
    return RankState(topology=report.target.topology, rank=rank, tensors=tensors, bytes_read=bytes_read, reads=reads)


def _sink(torch: Any, dev: Any, threads: int) -> HostSink | StagedSink:
    """Where windows are filled (``reshard.api.sinks``)."""
    return sink_for(torch, dev, threads, _WINDOW)


def _device(torch: Any, device: Any) -> Any:
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as e:
        raise ReshardError(f"device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ReshardError(f"device {device!r}: CUDA is not available here")
    return dev
