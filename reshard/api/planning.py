"""Open a checkpoint, choose the target layout, and plan: the first three steps of every entry point."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from operator import attrgetter, mul
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from reshard.core.collector import collector_paused as _collector_paused
from reshard.core.dtypes import itemsize
from reshard.core.layout import MASTER, PARAM, Item, Layout, common_views, with_state_alias
from reshard.core.planner import Plan
from reshard.core.planner import plan as make_plan
from reshard.core.topology import Topology, parse_topology
from reshard.core.units import parse_size
from reshard.errors import PlanError, ReshardError
from reshard.execution.executor import destination_dtypes
from reshard.formats import detect_format, get_format
from reshard.formats.base import Source, Target
from reshard.formats.module_view import module_tied, view_layout, view_source
from reshard.formats.specs import source_family
from reshard.io.location import UrlPath, as_path
from reshard.io.smallfiles import Located

__all__ = ["PlanReport", "open_checkpoint", "plan"]


def open_checkpoint(path: str | Path | UrlPath, *, spec: str | None = None,
                    sizes: Mapping[str, int] | None = None) -> Source:
    """Detect a checkpoint's format and read its metadata (no tensor data); ``path`` may be an fsspec URL."""
    path = as_path(path)
    with _collector_paused():
        return view_source(detect_format(path).open(path, spec=spec, sizes=sizes))

def _topology(to: str | Topology | None, default: Topology) -> Topology:
    if to is None:
        return default
    return parse_topology(to) if isinstance(to, str) else to

def _target(source: Source, to: str | Topology | None, format: str | None, spec: str | None,
            max_shard_size: int | str | None = None, vocab_pad: str | None = None,
            dist_optim: str | None = None) -> Target:
    fmt = get_format(format or source.format)
    same = fmt.name == source.format
    topology = _topology(to, source.topology if same else Topology())
    if same and isinstance(to, str) and "zero" not in _keys(to):
        # A new layout keeps the source's optimizer sharding unless the user names another.
        topology = dataclasses.replace(topology, zero=source.topology.zero)
    if vocab_pad is not None and fmt.name != "megatron":
        raise ReshardError(f"vocab_pad applies to the megatron format (its padded vocabulary), not {fmt.name}")
    if dist_optim is not None and fmt.name != "mcore-dist":
        raise ReshardError(f"dist_optim applies to the mcore-dist format (the distributed optimizer's torch_dist "
                           f"state), not {fmt.name}")
    target = fmt.target(source, topology, spec=spec, **({"vocab_pad": vocab_pad} if vocab_pad else {}),
                        **({"dist_optim": dist_optim} if dist_optim else {}))
    if source.module_names and (family := source_family(source)) is not None:
        # A target laid out from the source's own records (DeepSpeed's param_shapes) names the module's tensors.
        tied = module_tied(family, source.model.config)
        target.layout = view_layout(target.layout, family, target.sizes, source.path, tied) or target.layout
    if max_shard_size is not None:
        if target.format != "hf":
            raise ReshardError(f"max_shard_size applies to the hf format (safetensors shards), not {target.format}")
        parse_size(max_shard_size, "max_shard_size")  # a bad size fails before anything is read
        target.max_shard_size = max_shard_size
    return target

def _keys(text: str) -> set[str]:
    return {part.split("=", 1)[0].strip() for part in text.split(",") if "=" in part}

@dataclass(frozen=True, slots=True)
class PlanReport:
    """A plan and what it means: per destination file, bytes and sources; independent work units."""

    source: Source
    target: Target
    plan: Plan
    dropped_states: tuple[str, ...]
    """Source states the destination format does not hold (e.g. optimizer state going to hf)."""
    dst_files: Mapping[Item, Path]
    """The destination file (relative to the destination directory) of each destination item."""

    _names: dict[Path, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Each source file's name as ``src_file`` gives it, worked out once per file."""
    _made: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """``files()`` (and the sums per file it is made from) and ``summary()``, each worked out once (a conversion's
    resume header and manifest both need them)."""

    def src_file(self, item: Item) -> str:
        return self._src_name(self.source.where[item].path)

    def _src_name(self, path: Path) -> str:
        name = self._names.get(path)
        if name is None:
            name = str(path.relative_to(self.source.path)) if path.is_relative_to(self.source.path) else str(path)
            self._names[path] = name
        return name

    def dst_file(self, item: Item) -> str:
        return str(self.dst_files[item])

    def needed_bytes(self, files: Collection[str] | None = None) -> int:
        """Bytes the copies move (what a conversion reads at least), into just ``files`` if given."""
        if not self.dst_files and files is None:  # a plan of one rank's items (``load``) names no files
            return sum(self._copy_bytes(self._located()))
        keep = None if files is None else set(files)
        return sum(row[0] for name, row in self._per_file().items() if keep is None or name in keep)

    def files(self) -> list[dict[str, Any]]:
        """Per destination file: the bytes the copies move into it, their count, and the source files they read."""
        if "files" not in self._made:
            self._made["files"] = [{"destination": k, "bytes": b, "copies": n, "sources": sorted(srcs)}
                                   for k, (b, n, srcs) in sorted(self._per_file().items())]
        return [dict(row, sources=list(row["sources"])) for row in self._made["files"]]

    def _per_file(self) -> dict[str, tuple[int, int, set[str]]]:
        """Per destination file: the bytes the copies move into it, their count, and the source files they read.

        A plan of 100,000 small tensors has as many copies: their bytes are summed per file by numpy, and files
        are told apart by their ``Path`` object's ``id`` (``Path`` hashes in Python code; a file's items share one,
        mostly), then merged by name."""
        if "per_file" not in self._made:
            located = self._located()
            dst_paths = list(map(self.dst_files.__getitem__, map(attrgetter("dst"), self.plan.copies)))
            src_paths = list(map(attrgetter("path"), located))
            dst_first, dst_of = self._distinct(dst_paths)
            src_first, src_of = self._distinct(src_paths)
            sizes = np.zeros(len(dst_first), np.int64)
            np.add.at(sizes, dst_of, np.fromiter(self._copy_bytes(located), np.int64, len(located)))
            counts = np.bincount(dst_of, minlength=len(dst_first))
            per: dict[str, tuple[int, int, set[str]]] = {}
            for first, size, count in zip(dst_first.tolist(), sizes.tolist(), counts.tolist()):
                name = str(dst_paths[first])
                old_size, old_count, sources = per.get(name) or (0, 0, set())
                per[name] = (old_size + size, old_count + count, sources)
            for pair in np.unique(dst_of * len(src_first) + src_of).tolist():
                dst, src = divmod(pair, len(src_first))
                per[str(dst_paths[dst_first[dst]])][2].add(self._src_name(src_paths[src_first[src]]))
            self._made["per_file"] = per
        return self._made["per_file"]

    @staticmethod
    def _distinct(objects: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Where each distinct object (by ``id``) first appears in ``objects``, and which one each element is."""
        ids = np.fromiter(map(id, objects), np.uint64, len(objects))
        _, first, which = np.unique(ids, return_index=True, return_inverse=True)
        return first, which.astype(np.int64)

    def _located(self) -> list[Located]:
        """Where each copy's source item is, in plan order."""
        return list(map(self.source.where.__getitem__, map(attrgetter("src"), self.plan.copies)))

    def _copy_bytes(self, located: list[Located]) -> Iterator[int]:
        """Per copy, in plan order, the bytes it moves; ``located``: where each copy's source item is."""
        dtypes = list(map(attrgetter("dtype"), located))
        itemsizes = {dtype: itemsize(dtype) for dtype in set(dtypes)}
        return map(mul, map(math.prod, map(attrgetter("lengths"), self.plan.copies)), map(itemsizes.__getitem__, dtypes))

    def summary(self) -> dict[str, int]:
        """The plan's ``summary()``, worked out once."""
        if "summary" not in self._made:
            self._made["summary"] = self.plan.summary()
        return dict(self._made["summary"])

    def work_units(self) -> list[tuple[list[str], list[str]]]:
        return self.plan.work_units(self.src_file, self.dst_file)

    def to_json(self, workers: int | str | None = None, *, units: bool = True) -> dict[str, Any]:
        """The report as JSON; with ``workers`` (a count, or ``"auto"``), also the byte share of each worker
        a conversion with that many would start (``reshard.api.workers``); without ``units``, no independent
        work units (a connected-components pass over every copy that a manifest does not keep)."""
        shares = {} if workers is None else {"workers": self.worker_shares(workers)}
        work = {"work_units": [{"sources": s, "destinations": d} for s, d in self.work_units()]} if units else {}
        return {
            "source": {"path": str(self.source.path), "format": self.source.format, "topology": str(self.source.topology),
                       "spec": self.source.spec_name},
            "destination": {"format": self.target.format, "topology": str(self.target.topology), "spec": self.target.spec_name},
            "summary": self.summary(),
            "dropped_states": list(self.dropped_states),
            "files": self.files(),
            **work,
            **shares,
        }

    def worker_shares(self, workers: int | str = "auto") -> dict[str, Any]:
        """The destination files and bytes each of ``workers`` workers writes, and the largest share over the mean."""
        from reshard.api.workers import share_table, worker_count

        files = sorted({str(f) for f in self.dst_files.values()})
        return share_table(self, worker_count(self, workers, files))

def _nothing_lost(source: Source, target: Target) -> None:
    """Fail closed when the target has no place for a tensor the source holds (in a state the target keeps):
    a conversion never drops a tensor silently (an adapter, a value head, an unknown buffer)."""
    kept = set(target.layout.states)
    placed = {(f.tensor, f.state) for f in target.layout.fragments}
    # Tensors without elements are held by items alone (no fragment): every state the target keeps one in.
    kept |= {it.state for it, info in target.layout.items.items() if info.tensor is not None}
    placed |= {(info.tensor, it.state) for it, info in target.layout.items.items() if info.tensor is not None}
    # A target that keeps a tensor's fp32 master but not its weights (ZeRO-3) makes the weights from the master.
    placed |= {(t, PARAM) for t, s in placed if s == MASTER}
    lost: dict[tuple[str, str], Item] = {}
    for f in source.layout.fragments:
        if not f.fill and f.state in kept and f.item in source.where and (f.tensor, f.state) not in placed \
                and not source.layout.tensors[f.tensor].blob:
            lost.setdefault((f.tensor, f.state), f.item)
    for it, info in source.layout.items.items():
        if info.tensor is not None and it.state in kept and it in source.where and (info.tensor, it.state) not in placed:
            lost.setdefault((info.tensor, it.state), it)
    if lost:
        shown = [f"'{name}' [{state}] in {source.where[item].path}" for (name, state), item in list(lost.items())[:10]]
        more = f"\n  ... and {len(lost) - 10} more" if len(lost) > 10 else ""
        raise PlanError(f"the {target.format} layout '{target.spec_name}' has no place for {len(lost)} tensor(s) of the "
                        f"source, which would be lost:\n  " + "\n  ".join(shown) + more +
                        "\n(a tensor outside the model family's layout: convert to a format that keeps every "
                        "tensor by name, or give a spec that places it)")


def plan(src: str | Path, *, to: str | Topology | None = None, format: str | None = None, spec: str | None = None,
         sizes: Mapping[str, int] | None = None, max_shard_size: int | str | None = None,
         vocab_pad: str | None = None, dist_optim: str | None = None) -> PlanReport:
    """What converting ``src`` to topology ``to`` (in ``format``) moves where, without reading tensor data.

    >>> report = plan("ckpt/", to="tp=1,pp=4")   # doctest: +SKIP
    >>> report.plan.summary()["copies"]          # doctest: +SKIP
    """
    with _collector_paused():
        return _plan(src, to, format, spec, sizes, max_shard_size, vocab_pad, dist_optim=dist_optim)


def _plan(src: str | Path, to: str | Topology | None, format: str | None, spec: str | None,
          sizes: Mapping[str, int] | None, max_shard_size: int | str | None, vocab_pad: str | None,
          dist_optim: str | None = None,
          rank: int | None = None) -> PlanReport:
    """The plan of a conversion; with ``rank``, of just the items that rank of the target holds (what
    ``load`` reads), validated as a whole plan is, and naming no destination files (none is written)."""
    source = open_checkpoint(src, sizes=sizes)
    target = _target(source, to, format, spec, max_shard_size, vocab_pad, dist_optim)
    held = set(source.layout.states)
    source.layout, target.layout = common_views(source.layout, target.layout)
    trained = {f.tensor for f in source.layout.fragments if f.state not in (PARAM, MASTER)}
    weights = {f.item for f in source.layout.fragments if f.state == PARAM and (not trained or f.tensor in trained)}
    if MASTER in target.layout.states and MASTER not in source.layout.states and all(
            source.where[it].dtype == "float32" for it in weights if it in source.where):
        # fp32 weights with no separate master copy (FSDP2, fp32 runs) are the master copy: of the trained
        # params (those with optimizer state; when none has, those the target keeps a master of), not of frozen
        # params or buffers.
        mastered = {f.tensor for f in target.layout.fragments if f.state == MASTER}
        source.layout = with_state_alias(source.layout, PARAM, MASTER, only=trained or mastered)
    elif PARAM in target.layout.states and MASTER in source.layout.states:
        # Trained params stored only as fp32 masters (DeepSpeed ZeRO-3, beside frozen params' weights): the
        # masters are their weights, as zero_to_fp32 reads them.
        source.layout = with_state_alias(source.layout, MASTER, PARAM)
    _nothing_lost(source, target)
    if rank is not None:
        target.layout = _rank_layout(target.layout, target.topology, rank)
    p = make_plan(source.layout, target.layout)
    p.validate()
    target.dtypes = destination_dtypes(p, source.where)
    dropped = tuple(sorted(held - set(target.layout.states)))
    files = get_format(target.format).files_of(target) if rank is None else {}
    return PlanReport(source=source, target=target, plan=p, dropped_states=dropped, dst_files=files)


def _rank_layout(layout: Layout, topo: Topology, rank: int) -> Layout:
    """``layout`` cut down to the items rank ``rank`` of ``topo`` holds: those whose unit is its coordinates."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < topo.world_size:
        raise ReshardError(f"rank {rank} is outside world_size {topo.world_size} of {topo}")
    coords = topo.coords(rank)
    items = {it: info for it, info in layout.items.items() if all(coords.get(a) == c for a, c in it.unit)}
    order = {k: kept for k, v in layout.order.items() if (kept := tuple(it for it in v if it in items))}
    return Layout(topology=layout.topology, tensors=layout.tensors, items=MappingProxyType(items),
                  fragments=tuple(f for f in layout.fragments if f.item in items), order=order)
