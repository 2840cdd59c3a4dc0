"""Expert tensor parallelism (``--expert-tensor-parallel-size``, etp) other than tp in the torch format.

megatron-core splits the routed experts over etp ranks instead of tp: the expert rank generator orders
``etp, ep, edp, pp`` (fastest first) with ``edp = world / (etp * ep * pp)``, the dense one ``tp, dp, pp``
(``parallel_state.initialize_model_parallel``). Megatron-LM's ``save_checkpoint`` writes ``model_optim_rng.pt``
on the ranks of expert-data-parallel rank 0, into ``mp_rank_TT[_PPP]_EEE`` named by their *dense* tp rank and
their ep rank; the rank file thus holds that rank's dense tp shard and its etp shard of ep rank E's experts. At
etp = 1 these are global ranks ``pp_rank * world / pp + r`` for ``r < ep``: rank r holds tp shard ``r % tp``
and the whole experts of ep rank r, so only ``ep`` of the tp * ep rank directories exist (tp=2, ep=2:
``mp_rank_00_000`` and ``mp_rank_01_001``). Every rank loads the directory of its own (tp, ep) ranks, which is
one of those when ``ep`` is a multiple of tp.

Supported: etp = 1 with ``ep`` a multiple of tp (the layouts' ``-etp1`` option: experts whole on every tp unit,
only the saved units kept), or etp = tp. Other etp are refused.
"""

from __future__ import annotations

from types import MappingProxyType

from reshard.core.layout import Layout
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError

__all__ = ["check_etp", "etp_ranks", "expert_tp", "holds_dense_buffers", "restrict", "whole_experts"]


def expert_tp(topo: Topology) -> int:
    """The experts' tensor parallelism: the topology's etp, else tp."""
    return topo.etp if topo.etp is not None else topo.tp


def whole_experts(topo: Topology) -> bool:
    """Whether ``topo``'s experts are whole on every tp rank while tp > 1 (etp = 1)."""
    return topo.etp is not None and topo.etp != topo.tp


def check_etp(topo: Topology, where: str, *, moe: bool) -> None:
    """Raise unless the torch format can hold ``topo``'s expert tensor parallelism (``where`` names the args or
    the topology)."""
    if not whole_experts(topo):
        return
    etp = f"expert_tensor_parallel_size={topo.etp}"
    if not moe:
        raise CheckpointFormatError(f"{where}: {etp} differs from tensor_model_parallel_size={topo.tp}, but the "
                                    "model has no experts")
    if topo.etp != 1:
        raise CheckpointFormatError(
            f"{where}: {etp} with tensor_model_parallel_size={topo.tp}: experts split over an expert tensor "
            "parallelism other than 1 or tp are not supported")
    if topo.ep % topo.tp:
        raise CheckpointFormatError(
            f"{where}: {etp} with expert_model_parallel_size={topo.ep} not a multiple of "
            f"tensor_model_parallel_size={topo.tp}: Megatron-LM's torch format would save no rank directory for "
            "some tp ranks' dense weights (written by expert-data-parallel rank 0 only)")


def etp_ranks(topo: Topology) -> list[tuple[int, int, int]]:
    """The (tp, pp, ep) rank directories Megatron-LM's torch format holds at ``topo``, in the reader's order."""
    if not whole_experts(topo):
        return [(t, p, e) for p in range(topo.pp) for e in range(topo.ep) for t in range(topo.tp)]
    return [(r % topo.tp, p, r) for p in range(topo.pp) for r in range(topo.ep)]


def holds_dense_buffers(topo: Topology, e: int) -> bool:
    """Whether the ``distrib_optim.pt`` of ep rank ``e`` holds the dense optimizer's buffers: its writer is dense
    data-parallel rank 0 (``save_parameter_state``), the ep rank 0 file's at etp = tp, at etp = 1 those of ep
    ranks below tp (global rank e, dense dp rank e // tp)."""
    return e < topo.tp if whole_experts(topo) else e == 0


def restrict(layout: Layout, topo: Topology) -> Layout:
    """``layout`` with the items of the units (tp, pp, ep) Megatron-LM saves at ``topo`` only; the others are
    replicas (dense weights of another ep rank, whole experts of another tp rank) that no rank directory holds."""
    if not whole_experts(topo):
        return layout
    keep = set(etp_ranks(topo))

    def kept(unit: tuple[tuple[str, int], ...]) -> bool:
        u = dict(unit)
        return (u.get("tp", 0), u.get("pp", 0), u.get("ep", 0)) in keep

    items = {it: info for it, info in layout.items.items() if kept(it.unit)}
    order = {name: its for name, its in layout.order.items() if all(kept(it.unit) for it in its)}
    return Layout(topology=layout.topology, tensors=layout.tensors, items=MappingProxyType(items),
                  fragments=tuple(f for f in layout.fragments if kept(f.item.unit)), order=MappingProxyType(order))
