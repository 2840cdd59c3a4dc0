"""A conversion split over the ranks of a torchrun job: ``torchrun … -m reshard convert SRC DST --to …``.

torch.distributed (gloo, on the CPU) is the engine; there is no other coordinator. Rank 0 plans and
validates once and sets up the partial directory (or takes it over, for ``resume``). One ``scatter``
then gives each rank its byte-balanced share of the destination files, with the plan's copies into
them (``reshard.api.workers``; a file larger than a fair share split between ranks, each fsyncing its part
before rank 0 finishes the file). Every rank, rank 0 included, writes its share into the shared partial
directory on a thread. Meanwhile its main thread joins an ``all_reduce`` of the bytes written, the shares
finished and the shares failed, four times a second. Rank 0 reports the sum as progress, and a failure
anywhere stops every rank within one window. A ``gather`` then brings the checksums to rank 0, which
writes the files that hold no items and the manifest and renames the directory into place. It
broadcasts the outcome, so every rank returns or raises alike.

A rank that dies breaks the group. The others see the broken collective at once (the dead peer's
connection closes), or after the group's timeout for a rank that hangs. They fail with ``RankLost``,
and nothing is committed: the journaled files stay for ``resume``, with any number of ranks. A rank that
reports an error fails the conversion with that error, as one process would.

Every rank must see the source and the destination at the same paths: a shared filesystem, with the
same working directory on every host for relative paths.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from reshard.errors import ReshardError
from reshard.execution.manifest import file_record
from reshard.execution.workers import Share, ShareResult, WorkerLost, _names, dumps, write_share

__all__ = ["HEARTBEAT_SECONDS", "TIMEOUT", "RankLost", "Ranks", "join_ranks", "launched_rank"]

TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rank waits for the others: to join (every rank must call ``convert``), in a collective while
rank 0 opens and plans the source (7.5 s for a 405B-shaped plan), and for a rank that hangs. A rank that
dies is noticed at once, and while writing the ranks meet four times a second, so no wait grows with the
checkpoint. A gloo process group that the caller initialized keeps its own timeout."""

HEARTBEAT_SECONDS = 0.25
"""How often the ranks exchange progress and failures while they write."""


class RankLost(WorkerLost):
    """The process group failed: a rank died or stopped answering. Nothing was committed, and the files
    finished so far are kept for ``resume``."""


class _Stopped(Exception):
    """Another rank failed: this rank stops writing at its next window."""


def launched_rank() -> int:
    """This process's rank in the torchrun job that started it (``RANK``); 0 outside one."""
    return _env_int("RANK") or 0


def join_ranks(distributed: bool | None) -> Ranks | None:
    """The ranks a conversion is split over, joining torch.distributed (gloo) if need be; None: this
    process converts alone.

    ``distributed=None`` follows the environment: a torchrun job of more than one rank (``WORLD_SIZE``),
    or a process group of more than one rank that the caller initialized. ``True`` requires one of them;
    ``False`` ignores both.
    """
    if distributed is False:
        return None
    known = sys.modules.get("torch.distributed")
    if not (known is not None and known.is_available() and known.is_initialized()):
        size = _env_int("WORLD_SIZE")
        if size is None:
            if distributed:
                raise ReshardError("distributed=True, but this process is not in a torchrun job (no WORLD_SIZE in "
                                   "its environment) and torch.distributed is not initialized: start it with torchrun")
            return None
        if size <= 1 and not distributed:
            return None
    import torch.distributed as dist

    owns = ""
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend="gloo", timeout=TIMEOUT)
        except (RuntimeError, ValueError, TimeoutError) as e:
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise ReshardError(f"cannot join the torchrun job's process group at {where} as rank "
                               f"{os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}: {e}; under "
                               f"torchrun every rank calls convert, with the same arguments (distributed=False "
                               f"converts in this process alone)") from None
        owns = "world"
    if dist.get_world_size() <= 1 and not distributed:
        if owns:
            dist.destroy_process_group()
        return None
    group = None
    if "gloo" not in str(dist.get_backend()):  # e.g. a training job's nccl group: CPU tensors need gloo
        group = dist.new_group(backend="gloo", timeout=TIMEOUT)
        owns = "group"
    ranks = Ranks(rank=dist.get_rank(), size=dist.get_world_size(),
                  local_size=max(1, _env_int("LOCAL_WORLD_SIZE") or 1), group=group, owns=owns)
    try:  # every rank is here: a process group the caller made may hold ranks that never call convert
        dist.monitored_barrier(group=group, timeout=TIMEOUT, wait_all_ranks=True)
    except RuntimeError as e:
        ranks.__exit__()
        raise ReshardError(f"rank {ranks.rank} of {ranks.size}: not every rank called convert ({_first_line(e)}): "
                           f"across ranks every rank calls convert, with the same arguments (distributed=False "
                           f"converts in this process alone)") from None
    return ranks


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ReshardError(f"{name}={text!r} in the environment is not an integer (torchrun sets it)") from None


class Ranks:
    """The ranks of one conversion, and the steps they take together.

    Rank 0 runs the conversion inside ``leading()`` and hands the shares out with ``run_shares``; every
    other rank calls ``follow()``. Used as a context manager, it leaves torch.distributed as it found it.
    """

    def __init__(self, *, rank: int, size: int, local_size: int, group: Any = None, owns: str = "") -> None:
        self.rank = rank
        self.size = size
        self.local_size = local_size
        """The ranks on this host (``LOCAL_WORLD_SIZE``): they share its memory budget."""
        self._group = group
        self._owns = owns
        self._stage = "setup"  # rank 0: then "writing" once the shares are out, "finishing" once results are in

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        if self._owns == "world":
            dist.destroy_process_group()
        elif self._owns == "group":
            dist.destroy_process_group(self._group)

    # --- rank 0 ----------------------------------------------------------------------------------

    @contextmanager
    def leading(self) -> Iterator[None]:
        """Rank 0's conversion: however it ends (returning early, failing while planning, committing or
        not), the other ranks are told, so none waits for a step that will not come."""
        try:
            yield
        except BaseException as e:
            if not isinstance(e, RankLost):  # a broken group carries no message
                self._tell(str(e) if isinstance(e, ReshardError) else f"{type(e).__name__}: {e}")
            raise
        else:
            self._tell(None)

    def _tell(self, error: str | None) -> None:
        """Tell the other ranks how rank 0's conversion ended (``error``: its message; None: it succeeded),
        at the step they wait in. While the shares are written, there is nothing to tell: the ranks step
        together, and an error is in the steps."""
        try:
            if self._stage == "setup":  # nothing was handed out: the conversion ended before writing
                self._scatter([("finished", None) if error is None else ("error", error)] * self.size)
                if error is not None:
                    return
            if self._stage in ("setup", "finishing"):
                self._broadcast(("committed", None) if error is None else ("error", error))
        except RankLost:
            if error is None:
                raise

    def run_shares(self, shares: Sequence[Share], progress: Callable[[int], None] | None = None) -> list[ShareResult]:
        """Rank 0: give rank ``k`` the share ``shares[k]`` (ranks past the last share get none), write
        share 0 here, and return every share's result in order; ``progress(nbytes)`` counts all ranks.

        Raises:
          ReshardError: the first error a rank reported, naming the rank and its files.
          RankLost: a rank died or stopped answering.
        """
        if len(shares) > self.size:
            raise ValueError(f"{len(shares)} shares for {self.size} ranks")
        blobs = [dumps(s) for s in shares] + [None] * (self.size - len(shares))
        self._stage = "writing"
        self._scatter([("share", b) for b in blobs])
        outcomes = self._gather(_wire(self._write_in_step(shares[0] if shares else None, progress)))
        self._stage = "finishing"
        for k, (kind, value) in enumerate(outcomes):
            what = f"rank {k} of {self.size}" + (f", writing {_names(shares[k].files)}" if k < len(shares) else "")
            if kind == "error":
                raise ReshardError(f"{value} ({what})")
            if kind == "bug":
                raise RuntimeError(f"{what} failed:\n{value}")
        return [pickle.loads(value) for _, value in outcomes[:len(shares)]]

    # --- the other ranks ------------------------------------------------------------------------

    def follow(self) -> tuple[ShareResult | None, dict[str, dict[str, Any]]]:
        """A rank other than 0: write the share rank 0 sends, and end as rank 0's conversion ends. The
        result of this rank's share (None when it had none), and the files it wrote with their sizes and
        checksums (as the manifest records them, taken here before rank 0 moves them).

        Raises:
          ReshardError: rank 0's error (rank 0 reports it).
          RankLost: a rank died or stopped answering.
        """
        kind, value = self._scatter(None)
        if kind == "error":
            raise ReshardError(value)
        outcome: tuple[str, Any] = ("done", None)
        records = {}
        if kind == "share":
            share = None if value is None else pickle.loads(value)
            outcome = self._write_in_step(share, None)
            if share is not None and outcome[0] == "done":
                records = {f: file_record(share.out / f, d) for f, d in outcome[1].files.items()}
            self._gather(_wire(outcome))
        verdict, message = self._broadcast(None)
        if verdict == "error":
            raise ReshardError(message)
        return (outcome[1] if outcome[0] == "done" else None), records

    # --- every rank -----------------------------------------------------------------------------

    def _write_in_step(self, share: Share | None, progress: Callable[[int], None] | None) -> tuple[str, Any]:
        """Write ``share`` on a thread while stepping with the other ranks. This rank's outcome:
        ``("done", ShareResult | None)``, ``("error", message)``, ``("bug", traceback)`` or
        ``("stopped", None)`` (another rank failed first)."""
        import torch
        import torch.distributed as dist

        written = [0]
        stop, finished = threading.Event(), threading.Event()
        outcome: list[tuple[str, Any]] = [("done", None)]

        def tick(nbytes: int) -> None:
            if stop.is_set():
                raise _Stopped
            written[0] += nbytes

        def work() -> None:
            try:
                if share is not None:
                    outcome[0] = ("done", write_share(share, progress=tick))
            except BaseException as e:
                if stop.is_set():
                    outcome[0] = ("stopped", None)
                elif isinstance(e, ReshardError):
                    outcome[0] = ("error", str(e))
                else:
                    outcome[0] = ("bug", traceback.format_exc())
            finally:
                finished.set()

        thread = threading.Thread(target=work, name=f"reshard-rank-{self.rank}", daemon=True)
        thread.start()
        reported = 0
        try:
            while True:
                finished.wait(HEARTBEAT_SECONDS)
                done = finished.is_set()
                state = torch.tensor([written[0], int(done), int(done and outcome[0][0] != "done")], dtype=torch.int64)
                self._collective(dist.all_reduce, state, group=self._group)
                total, finished_ranks, failed_ranks = state.tolist()
                if progress is not None and total > reported:
                    progress(total - reported)
                    reported = total
                if failed_ranks or finished_ranks == self.size:
                    break
        finally:
            stop.set()  # another rank failed, or this one is interrupted: stop at the next window
            thread.join()
        return outcome[0]

    def _scatter(self, objects: list | None) -> Any:
        import torch.distributed as dist

        out = [None]
        self._collective(dist.scatter_object_list, out, objects if self.rank == 0 else None, src=0, group=self._group)
        return out[0]

    def _gather(self, obj: Any) -> list:
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        self._collective(dist.gather_object, obj, out, dst=0, group=self._group)
        return out or []

    def _broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        self._collective(dist.broadcast_object_list, box, src=0, group=self._group)
        return box[0]

    def _collective(self, op: Callable, *args: Any, **kwargs: Any) -> None:
        try:
            op(*args, **kwargs)
        except RuntimeError as e:  # torch's DistBackendError among them: a peer's connection closed, or a timeout
            raise RankLost(f"rank {self.rank} of {self.size}: the conversion's process group failed "
                           f"({_first_line(e)}): a rank died or stopped answering. Nothing was committed; the files "
                           f"finished so far are kept: the same command with --resume (resume=True) continues, with "
                           f"any number of ranks") from None


def _wire(outcome: tuple[str, Any]) -> tuple[str, Any]:
    """An outcome as the gather carries it: a result as ``dumps`` bytes (its read-only mappings travel)."""
    kind, value = outcome
    return (kind, dumps(value)) if kind == "done" else outcome


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
