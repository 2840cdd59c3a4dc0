"""Expert tensor parallelism (``--expert-tensor-parallel-size``, etp) other than tp in the torch format.

megatron-core splits the routed experts over etp ranks instead of tp: the expert rank generator orders
``etp, ep, edp, pp`` (fastest first) with ``edp = world / (etp * ep * pp)``, the dense one ``tp, dp, pp``
(``parallel_state.initialize_model_parallel``). Megatron-LM's ``save_checkpoint`` writes ``model_optim_rng.pt``
on the ranks of expert-data-parallel rank 0, into ``mp_rank_TT[_PPP]_EEE`` named by their *dense* tp rank and
their ep rank; the rank file thus holds that rank's dense tp shard and its etp shard of ep rank E's experts. Those
are the ranks ``g = e * etp + k`` (k the etp rank) below ``etp * ep`` of every stage, with dense tp rank
``g % tp``: where etp divides tp, the directory of tp rank t and ep rank e holds etp rank ``t % etp`` (the
layouts' ``-etp`` option), and exists where ``t // etp == e % (tp / etp)`` (tp=2, ep=2, etp=1:
``mp_rank_00_000`` and ``mp_rank_01_001``; tp=4, ep=2, etp=2: ``mp_rank_00_000``, ``mp_rank_01_000``,
``mp_rank_02_001``, ``mp_rank_03_001``). Every rank loads the directory of its own (tp, ep) ranks, which is one
of those, holding its own etp shard, where ``etp * ep`` is a multiple of tp.

Supported: etp dividing tp with ``etp * ep`` a multiple of tp, and etp = tp. Other etp are refused: above tp,
ranks of different etp rank would write one directory.
"""

from __future__ import annotations

from types import MappingProxyType

from reshard.core.layout import Layout
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError

__all__ = ["check_etp", "dense_holder", "etp_ranks", "expert_tp", "holds_dense_buffers", "own_etp", "restrict"]


def expert_tp(topo: Topology) -> int:
    """The experts' tensor parallelism: the topology's etp, else tp."""
    return topo.etp if topo.etp is not None else topo.tp


def own_etp(topo: Topology) -> bool:
    """Whether ``topo``'s experts have a tensor parallelism of their own (an etp other than tp)."""
    return topo.etp is not None and topo.etp != topo.tp


def check_etp(topo: Topology, where: str, *, moe: bool) -> None:
    """Raise unless the torch format can hold ``topo``'s expert tensor parallelism (``where`` names the args or
    the topology)."""
    if not own_etp(topo):
        return
    etp = f"expert_tensor_parallel_size={topo.etp}"
    if not moe:
        raise CheckpointFormatError(f"{where}: {etp} differs from tensor_model_parallel_size={topo.tp}, but the "
                                    "model has no experts")
    if topo.tp % topo.etp:
        raise CheckpointFormatError(
            f"{where}: {etp} does not divide tensor_model_parallel_size={topo.tp}: Megatron-LM's torch format names "
            "each rank directory by its dense tp rank, so ranks of different etp rank would write the same one")
    if (topo.etp * topo.ep) % topo.tp:
        raise CheckpointFormatError(
            f"{where}: {etp} times expert_model_parallel_size={topo.ep} is {topo.etp * topo.ep}, not a multiple of "
            f"tensor_model_parallel_size={topo.tp}: Megatron-LM's torch format, written by expert-data-parallel "
            "rank 0 only, would hold no rank directory for some tp ranks' dense weights or experts")


def etp_ranks(topo: Topology) -> list[tuple[int, int, int]]:
    """The (tp, pp, ep) rank directories Megatron-LM's torch format holds at ``topo``, in the reader's order."""
    if not own_etp(topo):
        return [(t, p, e) for p in range(topo.pp) for e in range(topo.ep) for t in range(topo.tp)]
    return [(g % topo.tp, p, g // topo.etp) for p in range(topo.pp) for g in range(topo.etp * topo.ep)]


def dense_holder(topo: Topology, t: int) -> int:
    """The ep rank whose ``distrib_optim.pt`` holds tp rank ``t``'s dense optimizer buffers: its writer is the
    dense data-parallel rank 0, global rank t of the stage (``save_parameter_state``), ep rank ``t // etp``."""
    return t // expert_tp(topo)


def holds_dense_buffers(topo: Topology, e: int) -> bool:
    """Whether the ``distrib_optim.pt`` of ep rank ``e`` holds the dense optimizer's buffers (``dense_holder``):
    ep rank 0's at etp = tp, at etp = 1 those of ep ranks below tp."""
    return e < topo.tp // expert_tp(topo)


def restrict(layout: Layout, topo: Topology) -> Layout:
    """``layout`` with the items of the units (tp, pp, ep) Megatron-LM saves at ``topo`` only; the others are
    replicas (dense weights of another ep rank, experts of another tp rank of the same etp rank) that no rank
    directory holds."""
    if not own_etp(topo):
        return layout
    keep = set(etp_ranks(topo))

    def kept(unit: tuple[tuple[str, int], ...]) -> bool:
        u = dict(unit)
        return (u.get("tp", 0), u.get("pp", 0), u.get("ep", 0)) in keep

    items = {it: info for it, info in layout.items.items() if kept(it.unit)}
    order = {name: its for name, its in layout.order.items() if all(kept(it.unit) for it in its)}
    return Layout(topology=layout.topology, tensors=layout.tensors, items=MappingProxyType(items),
                  fragments=tuple(f for f in layout.fragments if kept(f.item.unit)), order=MappingProxyType(order))
