"""A torch_dist target's distributed-optimizer state, written ``dp_reshardable`` as megatron-core 0.16 saves it.

``dist_optim.bucket_target`` says where each bucket's chunks are; this module turns them
into the target's items (one per chunk and state: ``param`` for the fp32 main params,
``exp_avg``, ``exp_avg_sq``; gap chunks hold zeros, which megatron-core never reads),
and the bytes entries of each (tp, pp) group: ``optimizer`` (``[{'param_groups': [...]}]``,
Adam's ``step`` in every group), ``per_bucket_numel`` and ``per_bucket_numel_unpadded``
(``[[{(param dtype, grad dtype): [elements per bucket]}]]``). ``common.pt`` gets the
sharding type megatron-core's loader reads (``content_metadata``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from reshard.core.layout import MASTER, PARAM, Fragment, Item, ItemInfo, chunk_fragments
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import Source
from reshard.formats.dcp.layouts import _Chunk
from reshard.formats.dcp.reading import _Verbatim
from reshard.formats.megatron.dist_optim import MAIN_STATE, PREFIX, bucket_target
from reshard.formats.megatron.param_groups import _default_param_groups
from reshard.formats.megatron.state import KEY, TORCH_DIST_KEY, MegatronState, TorchDistState
from reshard.io.dcp_metadata import DcpChunk
from reshard.models import Family

__all__ = ["CONTENT_METADATA", "optimizer_target"]

SHARDING = "dp_reshardable"
CONTENT_METADATA = {"distrib_optim_sharding_type": SHARDING, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}
"""What megatron-core's trainer saves as ``common.pt['content_metadata']`` and reads back on load."""


def optimizer_target(source: Source, family: Family, args: Mapping[str, Any], sizes: Mapping[str, int],
                     topology: Topology) -> tuple[dict[Item, ItemInfo], list[Fragment], dict[Item, _Chunk],
                                                  list[_Verbatim], dict[str, Any]]:
    """The items, fragments, DCP chunks, bytes entries and ``common.pt`` entries of the optimizer state.

    ``args`` are the target's (their ``overlap_grad_reduce`` / ``ddp_bucket_size`` set the buckets,
    ``bf16`` / ``accumulate_allreduce_grads_in_fp32`` the buffer's dtypes): the resumed run must use the same.

    Raises:
      CheckpointFormatError: no fp32 main params in the source, a mixture-of-experts model (a second,
        expert buffer), virtual pipeline chunks (a buffer per chunk), or what ``bucket_target`` refuses.
    """
    import torch

    states = [s for s in source.layout.states if s != PARAM]
    if MASTER not in states:
        raise CheckpointFormatError(f"the distributed optimizer stores fp32 main params (state '{MASTER}'), which "
                                    f"{source.path} lacks (it has {', '.join(states)})")
    if family.experts:
        raise CheckpointFormatError(f"{source.path}: a {family.name} model: dp_reshardable state of expert buffers "
                                    "is not written yet")
    if topology.vpp > 1:
        raise CheckpointFormatError(f"{topology}: with virtual pipeline chunks each chunk has a grad buffer of its "
                                    "own; dp_reshardable state of several buffers is not written yet")
    states = [MASTER, *sorted(set(states) - {MASTER})]
    bt = bucket_target(family, args, sizes, topology)
    items: dict[Item, ItemInfo] = {}
    fragments: list[Fragment] = []
    chunks: dict[Item, _Chunk] = {}
    for c in bt.chunks:
        rank = topology.rank(tp=c.group % topology.tp, pp=c.group // topology.tp, dp=c.dp)
        base = Item("model", (("rank", rank),), 0, MASTER, f"{c.key}@{c.offset}")
        cut = chunk_fragments(list(c.fragments), (c.size,), (c.offset,), (c.length,), base)
        for state in states:
            key = f"{c.key}.{MAIN_STATE if state == MASTER else state}"
            item = Item("model", (("rank", rank),), 0, state, f"{key}@{c.offset}")
            mine = [replace(f, state=state, item=item) for f in cut]
            items[item] = ItemInfo(shape=(c.length,), mapped=sum(math.prod(f.box.lengths) for f in mine),
                                   rule=bt.spec_name)
            fragments.extend(mine)
            chunks[item] = _Chunk(key, DcpChunk((c.offset,), (c.length,)), (c.size,), rank, item)

    def saved(obj: object) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    pair = tuple(getattr(torch, d) for d in bt.dtypes)
    groups = saved([{"param_groups": _param_groups(source, args)}])
    entries = []
    for g in sorted(bt.per_bucket_numel):
        at = f"{PREFIX}dp_group_idx_{g}"
        entries += [_Verbatim(f"{at}.optimizer/shard_0_1", None, groups),
                    _Verbatim(f"{at}.per_bucket_numel/shard_0_1", None, saved([[{pair: bt.per_bucket_numel[g]}]])),
                    _Verbatim(f"{at}.per_bucket_numel_unpadded/shard_0_1", None,
                              saved([[{pair: bt.per_bucket_numel_unpadded[g]}]]))]
    common = {"optimizer": {"param_state_sharding_type": SHARDING}, "content_metadata": dict(CONTENT_METADATA)}
    return items, fragments, chunks, entries, common


def _param_groups(source: Source, args: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The source optimizer's param groups (a torch_dist or torch-format Megatron run's), else a fresh run's;
    Adam's step in every group, as ``DistributedOptimizer.state_dict`` puts it."""
    dist = source.extra.get(TORCH_DIST_KEY) if source.format == "mcore-dist" else None
    meg = source.extra.get(KEY) if source.format == "megatron" else None
    groups: list[dict[str, Any]] = []
    step: Any = None
    if isinstance(dist, TorchDistState) and dist.param_groups:
        groups = [dict(g) for g in dist.param_groups]
    elif isinstance(meg, MegatronState) and meg.optimizer.param_groups:
        if meg.optimizer.expert_param_groups:
            raise CheckpointFormatError(f"{source.path}: an expert optimizer's param groups; dp_reshardable state "
                                        "of expert buffers is not written yet")
        groups = [dict(g) for g in meg.optimizer.param_groups]
        step = meg.optimizer.step.value() if meg.optimizer.step is not None else None
    if not groups:
        try:
            groups = _default_param_groups(args)
        except KeyError as e:
            raise CheckpointFormatError(f"{source.path}: no optimizer param groups, and the args lack {e} to make a "
                                        "fresh run's") from None
    known = next((g["step"] for g in groups if "step" in g), None)
    step = known if known is not None else step if step is not None else \
        float(source.progress.step or source.progress.iteration or 0)
    for k, g in enumerate(groups):
        g["step"] = step
        bad = _not_plain(g)
        if bad is not None:
            raise CheckpointFormatError(f"{source.path}: optimizer param group {k} holds {bad}; reshard writes param "
                                        "groups of plain values only")
    return groups


def _not_plain(obj: Any) -> str | None:
    """The type name of the first value that is not None, a bool, number, string, tuple, list or dict."""
    if obj is None or type(obj) in (bool, int, float, str):
        return None
    if type(obj) in (tuple, list):
        return next((b for b in map(_not_plain, obj) if b is not None), None)
    if type(obj) is dict:
        return next((b for b in map(_not_plain, [*obj.keys(), *obj.values()]) if b is not None), None)
    return type(obj).__name__
