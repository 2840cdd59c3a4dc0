"""``load``: what one rank of a new topology holds, read straight from the old checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.api.planning import plan
from reshard.core.layout import PARAM, Item
from reshard.core.topology import Topology
from reshard.errors import ReshardError
from reshard.execution.executor import ByteReader, PlanFill

__all__ = ["RankState", "load"]


@dataclass(slots=True)
class RankState:
    """What one rank holds under a new topology: its stored items, as torch tensors."""

    topology: Topology
    rank: int
    tensors: dict[Item, Any]
    bytes_read: int

    def state_dict(self, state: str = PARAM, *, section: str | None = None, chunk: int = 0) -> dict[str, Any]:
        """The items of one state (and section, chunk) by key, e.g. the model's state dict."""
        return {it.key: t for it, t in self.tensors.items()
                if it.state == state and it.chunk == chunk and (section is None or it.section == section)}

def load(src: str | Path, *, to: str | Topology, rank: int, format: str | None = None, spec: str | None = None,
         sizes: Mapping[str, int] | None = None) -> RankState:
    """Load what ``rank`` holds when ``src`` is resharded to topology ``to``, reading only its bytes.

    Called inside each rank of a job whose topology differs from the
    checkpoint's. Tensors come back as torch tensors in the destination
    format's stored shapes and dtypes (model weights under state ``param``,
    optimizer states under their own names).

    >>> mine = load("ckpt/", to="tp=4,pp=1", rank=3)      # doctest: +SKIP
    >>> mine.state_dict("param")["embedding.word_embeddings.weight"].shape  # doctest: +SKIP
    """
    import torch

    report = plan(src, to=to, format=format, spec=spec, sizes=sizes)
    topo = report.target.topology
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < topo.world_size:
        raise ReshardError(f"rank {rank} is outside world_size {topo.world_size} of {topo}")
    coords = topo.coords(rank)
    mine = [it for it in report.target.layout.items if all(coords.get(a) == c for a, c in it.unit)]
    out: dict[Item, Any] = {}
    with ByteReader() as reader:
        fill = PlanFill(report.plan, report.source.where, reader)
        dtypes = fill.dtypes
        for it in mine:
            info = report.target.layout.items[it]
            dtype = dtypes[it]
            buf = bytearray(fill(it, 0, info.numel)) if info.numel else bytearray()
            t = torch.frombuffer(buf, dtype=getattr(torch, dtype)) if buf else torch.empty(0, dtype=getattr(torch, dtype))
            out[it] = t.reshape(info.shape)
        read = reader.bytes_read
    return RankState(topology=topo, rank=rank, tensors=out, bytes_read=read)
