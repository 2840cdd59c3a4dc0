"""A torch_dist target's distributed-optimizer state, written ``dp_reshardable`` as megatron-core 0.16 saves it.

``bucket_target`` says where each bucket's chunks are (the layout ``dist_optim`` reads,
resolved at the target's tp, pp, ep and dp): per buffer (the dense one; at ep > 1 also the
experts', ``chained_1.``), group, model chunk (``gbuf_idx``: one buffer per virtual pipeline
chunk), bucket and data-parallel rank ``r`` (dp for the dense
buffer, edp for the experts'), the rank's shard of the bucket, ``[r * L, (r + 1) * L)``
(``L`` the padded bucket over the ranks) cut at the bucket's unpadded end, split into one
chunk per parameter piece and one per gap between them
(``sharded_param_state_dp_reshardable``). ``optimizer_target`` turns them into the
target's items (one per chunk and state: ``param`` for the fp32 main params,
``exp_avg``, ``exp_avg_sq``; gap chunks hold zeros, which megatron-core never reads),
and the bytes entries of each group: ``optimizer`` (``[{'param_groups': [...]}]``,
Adam's ``step`` in every group), ``per_bucket_numel`` and ``per_bucket_numel_unpadded``
(``[[{(param dtype, grad dtype): [elements per bucket]}, ...]]``, one dict per model chunk). ``common.pt`` gets the
sharding type megatron-core's loader reads (``content_metadata``; per chained optimizer
at ep > 1).

Experts at expert tensor parallelism 1 (``etp=1`` in the topology, ep > 1) are whole on every tp rank: the
expert optimizer numbers its groups over ep and pp alone (``ep_rank + ep * pp_rank``), its buffers come from the
``-etp`` layouts, and each is split over the expert data-parallel group of ``tp * dp * cp / ep`` ranks, rank
``ep_rank + ep * (edp_rank + edp * pp_rank)`` (the expert rank generator's order at etp 1). At another etp, below
or above tp (2 at tp 4 or at tp 1), the expert buffers are those of a tp = etp run, numbered ``etp_rank + etp *
(ep_rank + ep * pp_rank)`` and split over ``tp * dp * cp / (etp * ep)`` ranks, rank ``etp_rank + etp * (ep_rank +
ep * (edp_rank + edp * pp_rank))``. An etp other than tp at ep 1, or in another rank order, is refused.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from reshard.core.layout import MASTER, PARAM, Fragment, Item, ItemInfo, Layout, chunk_fragments
from reshard.core.topology import DEFAULT_ORDER, Topology
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.formats.base import Source
from reshard.formats.dcp.layouts import _Chunk
from reshard.formats.dcp.reading import _Verbatim
from reshard.formats.megatron.dist_optim import DENSE, EXPERT, MAIN_STATE, PREFIX, _bucket_item, _buckets, _buffer_of
from reshard.formats.megatron.etp import expert_tp
from reshard.formats.megatron.param_groups import _default_param_groups, _expert_groups
from reshard.formats.megatron.specs import _is_expert, _resolve
from reshard.formats.megatron.state import KEY, TORCH_DIST_KEY, MegatronState, TorchDistState
from reshard.formats.specs import layout_spec
from reshard.io.dcp_metadata import DcpChunk
from reshard.models import Family

__all__ = ["CONTENT_METADATA", "BucketChunk", "BucketTarget", "bucket_target", "buffer_dtypes", "optimizer_target"]

SHARDING = "dp_reshardable"
CONTENT_METADATA = {"distrib_optim_sharding_type": SHARDING, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}
"""What megatron-core's trainer saves as ``common.pt['content_metadata']`` and reads back on load."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketChunk:
    """One DCP chunk of a ``dp_reshardable`` bucket tensor, as megatron-core's data-parallel rank writes it."""

    key: str
    """The stored key without its state (``[chained_K.]optimizer.distributed.dp_group_idx_I....bucket_idx_B``)."""
    rank: int
    """The global rank that writes it."""
    offset: int
    """Elements from the bucket's start."""
    length: int
    """Elements."""
    size: int
    """The bucket tensor's length: the bucket's unpadded elements."""
    fragments: tuple[Fragment, ...]
    """The whole bucket's fragments (state ``MASTER``, elements from its start); none fall in a gap chunk."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketTarget:
    """The ``dp_reshardable`` state a torch_dist target writes: its chunks and each group's bucket counts."""

    chunks: tuple[BucketChunk, ...]
    dtypes: tuple[str, str]
    """The grad buffers' (param dtype, grad dtype) torch names: ``("bfloat16", "float32")``."""
    per_bucket_numel: Mapping[str, list[list[int]]]
    """Per group (``[chained_K.]optimizer.distributed.dp_group_idx_I``), per model chunk (grad buffer), each
    bucket's padded elements."""
    per_bucket_numel_unpadded: Mapping[str, list[list[int]]]
    """Per group and model chunk, each bucket's unpadded elements (the bucket tensors' lengths)."""
    experts: frozenset[str]
    """The expert optimizer's groups (ep > 1)."""
    expert_params: tuple[tuple[str, tuple[int, ...]], ...]
    """The expert buffers' parameters (stored key, shape), for the expert optimizer's param groups."""
    spec_name: str
    bucket_size: int


def buffer_dtypes(args: Mapping[str, Any]) -> tuple[str, str]:
    """The grad buffers' (param dtype, grad dtype) for a run's args (bf16/fp16 params; fp32 grads with
    ``accumulate_allreduce_grads_in_fp32``), as ``DistributedDataParallel`` keys its buffers."""
    param = "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"
    return param, "float32" if args.get("accumulate_allreduce_grads_in_fp32") else param


def bucket_target(family: Family, args: Mapping[str, Any], sizes: Mapping[str, int],
                  topology: Topology) -> BucketTarget:
    """Where megatron-core 0.16 puts each parameter's distributed-optimizer state in ``dp_reshardable``
    at ``topology`` (tp, pp, dp, ep), for a run with ``args``' bucketing and precision.

    Raises:
      CheckpointFormatError: a data-parallel rank that owns no parameter of a bucket (megatron-core cannot
        save such a bucket: 'empty bucket encountered'), naming the group, bucket and rank; fp8 parameters
        (a second grad buffer); padded buckets for NCCL bus bandwidth.
    """
    for flag in ("fp8_param_gather", "ddp_pad_buckets_for_high_nccl_busbw"):
        if args.get(flag):
            raise CheckpointFormatError(f"args.{flag} is set: reshard writes dp_reshardable state of one grad buffer "
                                        "with the default bucket padding only")
    ep = topology.ep if family.experts else 1
    tp = topology.tp
    etp = expert_tp(topology) if family.experts else tp
    whole = etp == 1 and tp > 1  # etp = 1: every tp unit holds the same whole experts
    if etp != tp and ep == 1:
        raise TopologyError(f"etp({topology.etp}) with tp({tp}) at ep({topology.ep}): reshard writes dp_reshardable "
                            "state of experts split over an etp other than tp at ep > 1 only (at ep 1 the experts "
                            "sit in the dense buffers, which reshard does not lay out at another etp)")
    if etp != tp and topology.order != DEFAULT_ORDER:
        raise TopologyError(f"etp({etp}) with tp({tp}) and order '{topology.order}': megatron-core's expert ranks "
                            f"follow the default order '{DEFAULT_ORDER}' there, which reshard writes only")
    r = _buckets(family, args, sizes, Topology(tp=tp, pp=topology.pp, ep=ep, dp=ep * etp,
                                               etp=etp if etp != tp else None), topology)
    # The expert buffers are split over the expert data-parallel group of tp * dp * cp / (etp * ep) ranks (the
    # expert rank generator's etp, ep, edp, pp over the same ranks as the dense tp, cp, dp, pp). At another etp
    # than tp, the dense buckets' shards are those of the same buffers at ep 1 (ep need not divide dp * cp there),
    # the experts' those of a run at tp = etp (or the -etp layout at tp) with edp * ep / cp data-parallel ranks.
    edp = topology.edp if family.experts else topology.dp * topology.cp
    shard: dict[tuple, int] = {}  # (buffer, bucket) -> L
    for dp, at_tp, at_ep, sections in (
            (topology.dp, tp, ep if etp == tp else 1, (DENSE, EXPERT) if etp == tp else (DENSE,)),
            *(((edp * ep // topology.cp, tp if whole else etp, ep, (EXPERT,)),) if etp != tp else ())):
        at_dp = _resolve(layout_spec(r.spec_name), Topology(tp=at_tp, pp=topology.pp, dp=dp, cp=topology.cp, ep=at_ep,
                                                            vpp=r.vpp, stages=r.stages), r.sizes,
                         {"model": (PARAM,), DENSE: (MASTER,), EXPERT: (MASTER,)})
        for it, info in at_dp.items.items():
            u = dict(it.unit)
            if it.section in sections and u.get("dp", u.get("edp")) == 0:
                shard[(_buffer_of(it), _bucket_item(it))] = info.shape[0]
    # A parameter keeps its row-major order in the buffer: it starts where a fragment of it sits, less that
    # fragment's offset in the parameter, and spans the whole parameter (rows that pad the vocabulary too).
    def params(layout: Layout) -> dict[tuple, tuple[str, int, int]]:
        return {(f.tensor, f.box.offsets, f.box.lengths, _buffer_of(f.item)[1:]):
                (f.item.key, f.offset, layout.items[f.item].numel)
                for f in layout.fragments if f.item.section == "model"}
    dense_params = params(r.layout)
    param_of = {DENSE: dense_params, EXPERT: params(r.expert_layout) if r.expert_layout else dense_params}
    writers = {}  # (buffer section, tp, pp, ep, data-parallel rank) -> the global rank (of every model chunk)
    for rank in range(topology.world_size):
        c = topology.coords(rank)
        writers.setdefault((DENSE, c["tp"], c["pp"], 0, c["dp"]), rank)
        writers.setdefault((EXPERT, c["etp"], c["pp"], c["ep"], c["edp"]), rank)
    dtypes = buffer_dtypes(args)
    chunks: list[BucketChunk] = []
    padded: dict[str, list[int]] = {}
    unpadded: dict[str, list[int]] = {}
    experts: set[str] = set()
    for buffer, buckets in sorted(r.per_group.items()):
        section, t, p, e, chunk = buffer
        if section == DENSE and e:
            continue  # every ep rank holds the same dense buffer: ep 0's is the one laid out
        expert = section == EXPERT
        if expert and whole and t:
            continue  # whole experts: every tp unit holds the same expert buffer, numbered by ep and pp alone
        group = t + etp * (e + ep * p) if expert else p * tp + t
        base = f"{f'chained_{int(expert)}.' if ep > 1 else ''}{PREFIX}dp_group_idx_{group}"
        ranks = edp if expert else topology.dp
        # per group: each model chunk's buffer (gbuf_idx), in chunk order
        unpadded.setdefault(base, [[] for _ in range(r.vpp)])[chunk] = list(r.unpadded[buffer])
        padded.setdefault(base, [[] for _ in range(r.vpp)])[chunk] = [shard[(buffer, b)] * ranks
                                                                      for b in range(len(buckets))]
        if expert:
            experts.add(base)
        for b, frags in enumerate(buckets):
            size = r.unpadded[buffer][b]
            extents: dict[str, tuple[int, int]] = {}
            for f in frags:
                found = param_of[section].get((f.tensor, f.box.offsets, f.box.lengths, buffer[1:]))
                if found is None:  # at dp 1 every fragment of a bucket is a whole model parameter's fragment
                    raise CheckpointFormatError(f"{r.spec_name}: {f} is no model parameter's fragment")
                name, in_param, numel = found
                extents[name] = (f.offset - in_param, f.offset - in_param + numel)
            key = f"{base}.gbuf_idx_{chunk}.dtype_(torch.{dtypes[0]}, torch.{dtypes[1]}).bucket_idx_{b}"
            length = shard[(buffer, b)]
            for d in range(ranks):
                lo, hi = d * length, min((d + 1) * length, size)
                if not any(s < hi and lo < end for s, end in extents.values()):
                    raise CheckpointFormatError(
                        f"{key}: {'expert-' if expert else ''}dp rank {d} of {ranks} owns no parameter of bucket {b} "
                        f"(elements [{lo}, {(d + 1) * length}) of {size}); megatron-core cannot save or load such a "
                        "bucket ('empty bucket encountered'): use a smaller dp or larger buckets")
                cuts = sorted({lo, hi} | {x for s, end in extents.values() for x in (s, end) if lo < x < hi})
                chunks += [BucketChunk(key=key, rank=writers[(section, t, p, e, d)], offset=a, length=z - a,
                                       size=size, fragments=tuple(frags)) for a, z in zip(cuts, cuts[1:])]
    expert_params = tuple(dict.fromkeys((it.key, info.shape) for it, info in r.layout.items.items()
                                        if it.section == "model" and ep > 1 and _is_expert(it.key)))
    return BucketTarget(chunks=tuple(chunks), dtypes=dtypes, per_bucket_numel=padded,
                        per_bucket_numel_unpadded=unpadded, experts=frozenset(experts), expert_params=expert_params,
                        spec_name=r.spec_name, bucket_size=r.bucket_size)


def optimizer_target(source: Source, family: Family, args: Mapping[str, Any], sizes: Mapping[str, int],
                     topology: Topology) -> tuple[dict[Item, ItemInfo], list[Fragment], dict[Item, _Chunk],
                                                  list[_Verbatim], dict[str, Any]]:
    """The items, fragments, DCP chunks, bytes entries and ``common.pt`` entries of the optimizer state.

    ``args`` are the target's (their ``overlap_grad_reduce`` / ``ddp_bucket_size`` set the buckets,
    ``bf16`` / ``accumulate_allreduce_grads_in_fp32`` the buffers' dtypes): the resumed run must use the same.

    Raises:
      CheckpointFormatError: no fp32 main params in the source, or what ``bucket_target`` refuses.
    """
    import torch

    states = [s for s in source.layout.states if s != PARAM]
    if MASTER not in states:
        raise CheckpointFormatError(f"the distributed optimizer stores fp32 main params (state '{MASTER}'), which "
                                    f"{source.path} lacks (it has {', '.join(states)})")
    states = [MASTER, *sorted(set(states) - {MASTER})]
    bt = bucket_target(family, args, sizes, topology)
    items: dict[Item, ItemInfo] = {}
    fragments: list[Fragment] = []
    chunks: dict[Item, _Chunk] = {}
    for c in bt.chunks:
        base = Item("model", (("rank", c.rank),), 0, MASTER, f"{c.key}@{c.offset}")
        cut = chunk_fragments(list(c.fragments), (c.size,), (c.offset,), (c.length,), base)
        for state in states:
            key = f"{c.key}.{MAIN_STATE if state == MASTER else state}"
            item = Item("model", (("rank", c.rank),), 0, state, f"{key}@{c.offset}")
            mine = [replace(f, state=state, item=item) for f in cut]
            items[item] = ItemInfo(shape=(c.length,), mapped=sum(math.prod(f.box.lengths) for f in mine),
                                   rule=bt.spec_name)
            fragments.extend(mine)
            chunks[item] = _Chunk(key, DcpChunk((c.offset,), (c.length,)), (c.size,), c.rank, item)

    def saved(obj: object) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    pair = tuple(getattr(torch, d) for d in bt.dtypes)
    dense, expert = _param_groups(source, args, bool(bt.experts))
    if bt.experts and not expert:
        expert = _expert_groups(dense, list(bt.expert_params), f"{source.path}: optimizer")
    entries = []
    for at in sorted(bt.per_bucket_numel):
        entries += [_Verbatim(f"{at}.optimizer/shard_0_1", None,
                              saved([{"param_groups": expert if at in bt.experts else dense}])),
                    _Verbatim(f"{at}.per_bucket_numel/shard_0_1", None,
                              saved([[{pair: n} for n in bt.per_bucket_numel[at]]])),
                    _Verbatim(f"{at}.per_bucket_numel_unpadded/shard_0_1", None,
                              saved([[{pair: n} for n in bt.per_bucket_numel_unpadded[at]]]))]
    kind = {"param_state_sharding_type": SHARDING}
    common = {"optimizer": {0: kind, 1: dict(kind)} if bt.experts else kind, "content_metadata": dict(CONTENT_METADATA)}
    return items, fragments, chunks, entries, common


def _param_groups(source: Source, args: Mapping[str, Any],
                  chained: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The source optimizer's param groups (a torch_dist or torch-format Megatron run's), else a fresh run's, and
    with ``chained`` (an expert optimizer beside the dense one) a torch-format source's expert optimizer's ([]
    where the source has none); Adam's step in every group, as ``DistributedOptimizer.state_dict`` puts it."""
    dist = source.extra.get(TORCH_DIST_KEY) if source.format == "mcore-dist" else None
    meg = source.extra.get(KEY) if source.format == "megatron" else None
    groups: list[dict[str, Any]] = []
    expert: list[dict[str, Any]] = []
    step: Any = None
    if isinstance(dist, TorchDistState) and dist.param_groups:
        groups = [dict(g) for g in dist.param_groups]
    elif isinstance(meg, MegatronState) and meg.optimizer.param_groups:
        groups = [dict(g) for g in meg.optimizer.param_groups]
        expert = [dict(g) for g in meg.optimizer.expert_param_groups or []] if chained else []
        step = meg.optimizer.step.value() if meg.optimizer.step is not None else None
    if not groups:
        try:
            groups = _default_param_groups(args)
        except KeyError as e:
            raise CheckpointFormatError(f"{source.path}: no optimizer param groups, and the args lack {e} to make a "
                                        "fresh run's") from None
    known = next((g["step"] for g in groups + expert if "step" in g), None)
    step = known if known is not None else step if step is not None else \
        float(source.progress.step or source.progress.iteration or 0)
    for k, g in enumerate(groups + expert):
        g["step"] = step
        bad = _not_plain(g)
        if bad is not None:
            raise CheckpointFormatError(f"{source.path}: optimizer param group {k} holds {bad}; reshard writes param "
                                        "groups of plain values only")
    return groups, expert


def _not_plain(obj: Any) -> str | None:
    """The type name of the first value that is not None, a bool, number, string, tuple, list or dict."""
    if obj is None or type(obj) in (bool, int, float, str):
        return None
    if type(obj) in (tuple, list):
        return next((b for b in map(_not_plain, obj) if b is not None), None)
    if type(obj) is dict:
        return next((b for b in map(_not_plain, [*obj.keys(), *obj.values()]) if b is not None), None)
    return type(obj).__name__
