"""The distributed optimizer's ``dp_reshardable`` state in a torch_dist checkpoint, decoded per parameter.

Megatron-core 0.15+ saves the ``DistributedOptimizer``'s state by default in its own
bucket space (``DistributedOptimizer.sharded_param_state_dp_reshardable``): per
(tp, pp) group ``I`` (``pp_rank * tp + tp_rank``), grad buffer ``G``, dtype pair ``D``
(``(torch.bfloat16, torch.float32)``), bucket ``B`` and state one 1-D fp32 tensor::

    optimizer.distributed.dp_group_idx_{I}.gbuf_idx_{G}.dtype_{D}.bucket_idx_{B}.{param|exp_avg|exp_avg_sq}

of the bucket's unpadded length: element ``x`` is element ``x`` of the bucket's world
buffer (params in reverse registration order, each starting at a multiple of 64
elements, the 64-alignment gaps included, the bucket-end padding dropped). Each dp rank
writes the DCP chunks of its shard of it, one per parameter piece and one per gap; gap
chunks hold whatever memory held (``torch.empty``) and are never read. ``param`` is the
fp32 main copy (reshard's ``MASTER``). Beside them, bytes entries of the group:
``per_bucket_numel`` and ``per_bucket_numel_unpadded`` (a list over grad buffers of
``{dtype pair: [elements per bucket]}``) and ``optimizer`` (``[{'param_groups': [...]}]``,
each group with the Adam ``step``).

A mixture of experts at ep > 1 has two distributed optimizers (megatron-core's
``ChainedOptimizer``, whose dp_reshardable keys always carry ``chained_{k}.``):
``chained_0.`` the dense params' buffer, sharded over dp, groups numbered as above (every
ep rank holds the same one); ``chained_1.`` the experts' (``allreduce`` False), a buffer of
their own with buckets of their own, sharded over the expert-data-parallel group (each
bucket padded to ``lcm(edp, 128)``), groups numbered by rank in the expert etp-ep-pp group,
``etp_rank + etp * (ep_rank + ep * pp_rank)`` (etp: tp unless the run gives its own), each with its own
``per_bucket_numel[_unpadded]`` and ``optimizer`` entries. At ep 1 the experts are dense params: one optimizer, no prefix.

The layout is not stored; it is the one the torch format's ``distrib_optim.pt`` has,
bucket by bucket. The generated Megatron spec of the family with the distributed
optimizer (``megatron-<family>[-local][-ep]-distopt``, one item per bucket and dp rank,
``-ep`` a dense and an expert section) gives each bucket's fragments; the same family's
``-distopt-torch`` spec (the buckets coalesced, each cut at its unpadded end) gives each
bucket's unpadded length, which must equal the stored ``per_bucket_numel_unpadded``. Both
come from the spec language's ``flat`` statements, so the bucket rules live in one place.
The bucketing inputs come from ``common.pt``'s ``args`` (``overlap_grad_reduce``,
``ddp_bucket_size``, ``transformer_impl``, ``expert_model_parallel_size``); bucket
positions do not depend on the dp size, so the layouts are resolved at dp and edp 1.

With virtual pipeline chunks (``args.virtual_pipeline_model_parallel_size``) each model chunk
has its own grad buffers, and an optimizer numbers them in chunk order: ``gbuf_idx_{c}`` is
model chunk ``c`` (one dtype pair), the group numbers stay those of the (tp, pp[, ep]) rank,
``per_bucket_numel[_unpadded]`` list one ``{dtype pair: [...]}`` per chunk, and only chunk 0
of pp rank 0 has several buckets (``specs._resolve``). The chunks' layers are the family's
spec resolved at the args' vpp (and uneven stages).

Read so far: one grad buffer per optimizer, group and model chunk (one dtype pair), experts
split over tp like dense layers (``expert_tensor_parallel_size`` = tp); other keys are
refused by name. ``dist_optim_target`` writes the same layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reshard.core.layout import MASTER, PARAM, Fragment, Item, Layout
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, SpecError, TopologyError
from reshard.formats.base import MAX_COUNT, expect_int
from reshard.formats.dcp.reading import _storage
from reshard.formats.megatron.common_state import common_where
from reshard.formats.megatron.dist_moe import bucket_experts
from reshard.formats.megatron.etp import expert_tp, own_etp
from reshard.formats.megatron.small import _capture
from reshard.formats.megatron.specs import _resolve, spec_name
from reshard.formats.specs import layout_spec
from reshard.io.bounds import brief
from reshard.io.dcp_metadata import DcpMetadata
from reshard.io.torch_read import read_torch_file
from reshard.models import Family

__all__ = ["DENSE", "EXPERT", "MAIN_STATE", "PREFIX", "Buffer", "BucketSpace", "bucket_space", "is_bucket_key"]

PREFIX = "optimizer.distributed."
MAIN_STATE = "param"
"""The bucket tensors' name for the fp32 main params: reshard's ``MASTER``."""
_CHAINED = r"(?:chained_([0-9]{1,9})\.)?"
_BUCKET_KEY = re.compile(_CHAINED + r"optimizer\.distributed\.dp_group_idx_([0-9]{1,9})\.gbuf_idx_([0-9]{1,9})"
                         r"\.dtype_(\(.*\))\.bucket_idx_([0-9]{1,9})\.([A-Za-z_][A-Za-z0-9_]*)")
_OBJECT_KEY = re.compile(_CHAINED + r"optimizer\.distributed\.dp_group_idx_([0-9]{1,9})\.([A-Za-z_]+)/shard_0_1")
_BUCKET_ITEM = re.compile(r"optimizer\.distributed\.(?:expert_)?bucket_([0-9]+)\.")
DENSE, EXPERT = "optim", "expert_optim"
"""The sections of the family's distributed-optimizer specs: the dense buffer's and (ep > 1) the experts'."""


def is_bucket_key(key: str) -> bool:
    """Whether a stored key is the distributed optimizer's bucket-space state (a ChainedOptimizer's ``chained_{k}.``
    included)."""
    return key.startswith(PREFIX) or re.match(r"chained_[0-9]{1,9}\." + re.escape(PREFIX), key) is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketSpace:
    """Every stored bucket tensor's fragments, in its own coordinates (elements from the bucket's start)."""

    fragments: Mapping[str, tuple[Fragment, ...]]
    """Stored key -> the fragments of the logical tensors it holds."""
    states: Mapping[str, str]
    """Stored key -> its state (``MASTER`` for ``param``, the optimizer's own name otherwise)."""
    spec_name: str
    """The generated Megatron spec whose flat buffers gave the layout."""
    param_groups: list[dict[str, Any]] | None
    """The first group's optimizer param groups (``step`` included), None if not saved."""
    padded: frozenset[str] = frozenset()
    """Stored keys of ``fully_sharded_bucket_space``: the padded bucket as ``[dp, L]`` (``dist_zero.flat_chunk``)."""


Buffer = tuple[str, int, int, int, int]
"""One grad buffer of a model-parallel rank: (section, tp, pp, ep, model chunk) of the family's
distributed-optimizer spec. Each virtual pipeline chunk has grad buffers of its own; an optimizer numbers the
buffers of its chunks in chunk order (``gbuf_idx``), one per chunk for one dtype pair."""


def _buffer(chain: int | None, group: int, topology: Topology, chunk: int = 0) -> Buffer:
    """The buffer a (chained) optimizer's ``dp_group_idx`` holds for a model chunk. The dense optimizer (the only
    one, or ``chained_0``) numbers its groups by rank in the tp-pp group, ``pp_rank * tp + tp_rank`` (every ep rank
    holds the same dense buffer: ep 0's); the expert optimizer (``chained_1``, ep > 1) by rank in the expert
    etp-ep-pp group, ``etp_rank + etp * (ep_rank + ep * pp_rank)``: at etp = tp the tp unit's buffer, at etp = 1
    tp unit 0's of the ``-etp`` layouts (every tp unit holds the same whole experts), at another etp (below or
    above tp) that of the tp = etp layout ``_buckets`` resolves for the experts."""
    tp = topology.tp
    if chain == 1:
        etp = expert_tp(topology)
        return EXPERT, group % etp, group // (etp * topology.ep), group // etp % topology.ep, chunk
    return DENSE, group % tp, group // tp, 0, chunk


def _groups(topology: Topology, chain: int | None) -> int:
    """How many model-parallel groups a (chained) optimizer numbers: tp * pp, the experts' etp * ep * pp."""
    if chain == 1:
        return expert_tp(topology) * topology.ep * topology.pp
    return topology.tp * topology.pp


def _describe(prefix: str, group: int, buffer: Buffer) -> str:
    section, tp, pp, ep, chunk = buffer
    where = f"tp={tp}, pp={pp}" + (f", ep={ep}, the expert buffer" if section == EXPERT else "")
    return f"{prefix}dp_group_idx_{group}" + (f".gbuf_idx_{chunk} ({where}, model chunk {chunk})" if chunk else
                                              f" ({where})")


def bucket_space(path: Path, md: DcpMetadata, args: Mapping[str, Any] | None, family: Family,
                 sizes: Mapping[str, int], topology: Topology, *, padded: bool = False) -> BucketSpace:
    """Decode the ``dp_reshardable`` keys of ``md`` into per-parameter fragments.

    ``sizes`` are the model's (from ``common.pt``'s args); ``topology`` gives tp and pp, the args ep.
    A mixture of experts at ep > 1 has two optimizers (megatron-core's ChainedOptimizer): ``chained_0.``
    the dense params' buffer, ``chained_1.`` the experts' (their own buckets, sharded over the
    expert-data-parallel group); at ep 1 the experts are in the one dense buffer. ``padded``: megatron-core
    0.6-0.14's ``fully_sharded_bucket_space``, each bucket tensor the padded bucket stored as ``[dp, L]``
    (``dist_zero``).

    Raises:
      CheckpointFormatError: no args, an unknown or unsupported key (another grad buffer, a group beyond the
        model-parallel ranks, a third chained optimizer, an expert tensor parallelism the model cannot be split by), a
        bucket count
        or ``per_bucket_numel_unpadded`` that differs from the layout's (naming the buffer, the bucket and both
        numbers), a stored length that differs from ``per_bucket_numel_unpadded``, or a missing bucket tensor.
    """
    where = path / ".metadata"
    if args is None:
        raise CheckpointFormatError(f"{common_where(path)}: no args, so the distributed optimizer's bucket layout "
                                    "(bucket size, layer implementation) is unknown; the dp_reshardable optimizer "
                                    "state cannot be decoded")
    ep, etp = _expert_parallel(args, family, where)
    topology = Topology(tp=topology.tp, pp=topology.pp, ep=ep, dp=ep * (etp or 1), etp=etp)
    keys = [k for k in md.tensors if is_bucket_key(k)]
    parsed: dict[str, tuple[str, int, Buffer, int, str]] = {}  # key -> (prefix, group, buffer, bucket, state)
    chains = {m.group(1) for k in keys if (m := _BUCKET_KEY.fullmatch(k))}
    want_chains = {"0", "1"} if ep > 1 else {None}
    if keys and chains != want_chains:
        have = " and ".join(f"chained_{c}" if c else "unchained" for c in sorted(chains, key=str))
        raise CheckpointFormatError(
            f"{where}: the distributed optimizer's state is under {have} keys (e.g. '{keys[0]}'); at expert "
            f"parallelism {ep} megatron-core saves "
            f"{'a dense (chained_0.) and an expert (chained_1.) optimizer' if ep > 1 else 'one, unprefixed'}"
            " (several dense optimizers, one per model chunk, are not read)")
    vpp = _pipeline(args, topology.pp, sizes, where)[0]
    for key in keys:
        m = _BUCKET_KEY.fullmatch(key)
        if m is None:
            raise CheckpointFormatError(f"{where}: '{key}' is distributed-optimizer state reshard does not read "
                                        "(expected [chained_K.]optimizer.distributed.dp_group_idx_I.gbuf_idx_G."
                                        "dtype_D.bucket_idx_B.<state>)")
        chain, group, gbuf, bucket, state = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(5)), m.group(6)
        if gbuf >= vpp:
            raise CheckpointFormatError(
                f"{where}: '{key}': grad buffer {gbuf}, but the run has {vpp} model chunk{'s' * (vpp > 1)} "
                "(args.virtual_pipeline_model_parallel_size) of one buffer each; reshard reads dp_reshardable state "
                "of one dtype pair per chunk (no fp8 parameters)")
        chain_no = None if chain is None else int(chain)
        groups = _groups(topology, chain_no)
        if group >= groups:
            raise CheckpointFormatError(f"{where}: '{key}': group {group}, but the optimizer has {groups} "
                                        f"model-parallel ranks ({_ranks(topology, chain_no)})")
        parsed[key] = (f"chained_{chain}." if chain is not None else "", group,
                       _buffer(chain_no, group, topology, gbuf), bucket, state)
    dp = expect_int(args.get("data_parallel_size") or 1, "args.data_parallel_size", str(where), lo=1, hi=MAX_COUNT)
    cp = expect_int(args.get("context_parallel_size") or 1, "args.context_parallel_size", str(where), lo=1,
                    hi=MAX_COUNT)
    r = _buckets(family, args, sizes, topology, Topology(tp=topology.tp, pp=topology.pp, dp=dp, cp=cp),
                 f"{where}: '{keys[0]}'")
    stored = _stored_unpadded(path, md)
    layout = f"the layout ({r.spec_name}, bucket_size {r.bucket_size} from args.overlap_grad_reduce/ddp_bucket_size)"
    for prefix, group, buffer in sorted({(p, g, b) for p, g, b, _, _ in parsed.values()}):
        per_chunk, want = stored.get((prefix, group)), r.unpadded.get(buffer, [])
        name = _describe(prefix, group, buffer)
        if per_chunk is None:
            raise CheckpointFormatError(f"{where}: {name} has bucket tensors but no per_bucket_numel_unpadded")
        if len(per_chunk) != vpp:
            raise CheckpointFormatError(f"{where}: {prefix}dp_group_idx_{group}'s per_bucket_numel_unpadded lists "
                                        f"{len(per_chunk)} grad buffers; the run has {vpp} model chunks of one each")
        counted = per_chunk[buffer[4]]
        if len(counted) != len(want):
            raise CheckpointFormatError(f"{where}: {name} has {len(counted)} buckets in per_bucket_numel_unpadded, "
                                        f"{layout} has {len(want)}")
        for b, (computed, have) in enumerate(zip(want, counted, strict=True)):
            if computed != have:
                raise CheckpointFormatError(f"{where}: {name} bucket {b}: per_bucket_numel_unpadded says {have} "
                                            f"elements, {layout} gives {computed}")
    out: dict[str, tuple[Fragment, ...]] = {}
    for key, (prefix, group, buffer, bucket, state) in parsed.items():
        mine = r.per_group[buffer]
        if bucket >= len(mine):
            raise CheckpointFormatError(f"{where}: '{key}': bucket {bucket}, but the buffer has {len(mine)} buckets")
        size, unpadded = md.tensors[key].size, stored[(prefix, group)][buffer[4]][bucket]
        if padded:
            div = math.lcm(dp * cp, 128, 2 ** 16 if args.get("ddp_pad_buckets_for_high_nccl_busbw") else 1)
            if prefix or tuple(size) != (dp * cp, -(-unpadded // div) * div // (dp * cp)):
                raise CheckpointFormatError(
                    f"{where}: '{key}' is {list(size)}; fully_sharded_bucket_space stores bucket {bucket} "
                    f"({unpadded} elements, padded to a multiple of {div}) as [dp * cp, padded / (dp * cp)] = "
                    f"[{dp * cp}, {-(-unpadded // div) * div // (dp * cp)}]"
                    + (" (of one optimizer only: chained ones are not read)" if prefix else ""))
        elif len(size) != 1 or size[0] != unpadded:
            raise CheckpointFormatError(f"{where}: '{key}' is {list(size)}, per_bucket_numel_unpadded "
                                        f"says bucket {bucket} holds {unpadded} elements")
        out[key] = tuple(mine[bucket])
    _require_every_bucket(parsed, r.per_group, topology, vpp, where)
    return BucketSpace(fragments=out, states={k: MASTER if v[4] == MAIN_STATE else v[4] for k, v in parsed.items()},
                       spec_name=r.spec_name, param_groups=_param_groups(path, md),
                       padded=frozenset(parsed) if padded else frozenset())


def _expert_parallel(args: Mapping[str, Any], family: Family, where: Path) -> tuple[int, int | None]:
    """The run's ep (1 for a dense family) and its expert tensor parallelism where it is not tp (None: tp); that
    is 1 (the experts whole, their buffers laid out by the ``-etp`` layouts) or another (the expert buffers laid
    out at tp = etp, above or below tp)."""
    if not family.experts:
        return 1, None
    ep = expect_int(args.get("expert_model_parallel_size") or 1, "args.expert_model_parallel_size", str(where), lo=1,
                    hi=MAX_COUNT)
    etp, tp = args.get("expert_tensor_parallel_size"), args.get("tensor_model_parallel_size") or 1
    if ep == 1 or etp is None or etp == tp:
        return ep, None
    if type(etp) is not int or etp < 1:
        raise CheckpointFormatError(f"{where}: args.expert_tensor_parallel_size is {brief(etp)}, not a positive "
                                    "integer")
    return ep, etp


def _ranks(topology: Topology, chain: int | None) -> str:
    """The parallel degrees a (chained) optimizer's groups are numbered over, for errors."""
    if chain != 1:
        return f"tp {topology.tp}, pp {topology.pp}"
    return f"etp {expert_tp(topology)}, ep {topology.ep}, pp {topology.pp}"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Buckets:
    """The buckets of every grad buffer, as the family's generated specs lay them out."""

    spec_name: str
    """The bucketed spec (``megatron-<family>[-local][-ep]-distopt``)."""
    bucket_size: int
    """Elements per bucket from the args (0: one bucket)."""
    sizes: Mapping[str, int]
    """The sizes the specs were resolved with (``vocab_div`` and ``bucket_size`` included)."""
    layout: Layout
    """The bucketed spec resolved at dp 1 (and edp 1): per buffer and bucket, one item holding the whole bucket (at
    an etp neither 1 nor tp, the dense buffers' resolution: the experts' buffers come from one at tp = etp)."""
    per_group: Mapping[Buffer, list[list[Fragment]]]
    """Per buffer, per bucket: its fragments, in elements from the bucket's start (state ``MASTER``)."""
    unpadded: Mapping[Buffer, list[int]]
    """Per buffer, each bucket's unpadded length (``per_bucket_numel_unpadded``)."""
    vpp: int = 1
    """Model chunks per pipeline stage (``args.virtual_pipeline_model_parallel_size``): grad buffers per optimizer."""
    stages: tuple[int, ...] | None = None
    """Layers per virtual stage, None when even (``Topology.stages``)."""
    expert_layout: Layout | None = None
    """At an etp neither 1 nor tp, the bucketed spec resolved at tp = etp, whose expert buffers ``per_group``
    holds; None otherwise (``layout`` holds every buffer)."""


def _buckets(family: Family, args: Mapping[str, Any], sizes: Mapping[str, int], topology: Topology,
             run: Topology, where: str = "args") -> _Buckets:
    """Resolve the family's distributed-optimizer specs for ``args``' bucketing at ``topology``'s tp, pp and ep.

    Bucket contents do not depend on dp (only the bucket-end padding does), so the layouts are resolved with dp
    and edp 1 (cp stands in for ep, which must divide dp * cp); ``run``'s dp and cp count only where the args
    leave the bucket size to the DDP default. The experts' params are those of the args' expert module
    (``dist_moe.bucket_experts``: SequentialMLP's or GroupedMLP's; TEGroupedMLP's refused, ``where`` named).
    """
    from reshard.formats.megatron.args import _bucket_size

    if family.experts and topology.etp not in (None, 1, topology.tp):
        # The expert buffers hold the experts alone (at ep > 1): laid out as at tp = etp, the dense ones at tp.
        dense = _buckets(family, args, sizes, replace(topology, etp=None), run, where)
        try:
            experts = _buckets(family, args, sizes, replace(topology, tp=topology.etp, etp=None), run, where)
        except (SpecError, TopologyError) as e:
            raise CheckpointFormatError(f"{where}: the experts' buffers at expert_tensor_parallel_size "
                                        f"{topology.etp} are those of a run at tp {topology.etp}, which this model "
                                        f"cannot have: {e}") from None

        def mixed(d: Mapping[Buffer, Any], x: Mapping[Buffer, Any]) -> dict[Buffer, Any]:
            return {**{b: v for b, v in d.items() if b[0] != EXPERT}, **{b: v for b, v in x.items() if b[0] == EXPERT}}
        return replace(dense, per_group=mixed(dense.per_group, experts.per_group),
                       unpadded=mixed(dense.unpadded, experts.unpadded), expert_layout=experts.layout)
    local = args.get("transformer_impl") == "local"
    tied = not args.get("untie_embeddings_and_output_weights", False)
    coalesced_name = spec_name(family, tied=tied, distopt=True, ep=topology.ep, local=local,  # distrib_optim.pt's
                               experts=bucket_experts(family, args, where), etp=own_etp(topology))
    bucketed_name = coalesced_name.removesuffix("-torch")  # one item per bucket and dp rank
    bucket_size = _bucket_size(args, run)
    rank_sizes = {**sizes, "vocab_div": int(args.get("make_vocab_size_divisible_by") or 128),
                  "bucket_size": bucket_size, **({"etp": topology.etp} if own_etp(topology) else {})}
    vpp, stages = _pipeline(args, topology.pp, sizes, where)
    topo = Topology(tp=topology.tp, pp=topology.pp, ep=topology.ep, cp=topology.ep, vpp=vpp, stages=stages)
    states = {"model": (PARAM,), "optim": (MASTER,), "expert_optim": (MASTER,)}
    bucketed = _resolve(layout_spec(bucketed_name), topo, rank_sizes, states)
    coalesced = _resolve(layout_spec(coalesced_name), topo, rank_sizes, states)
    per_group = _bucket_fragments(bucketed)
    return _Buckets(spec_name=bucketed_name, bucket_size=bucket_size, sizes=rank_sizes, layout=bucketed,
                    per_group=per_group, unpadded=_unpadded(per_group, coalesced), vpp=vpp, stages=stages)


def _pipeline(args: Mapping[str, Any], pp: int, sizes: Mapping[str, int],
              where: Path | str) -> tuple[int, tuple[int, ...] | None]:
    """The run's virtual pipeline chunks per stage and layers per virtual stage (None: even), from its args."""
    from reshard.formats.megatron.args import _pipeline_from_args

    return _pipeline_from_args(args, pp, int(sizes["layers"]), str(where))


def _buffer_of(item: Item) -> Buffer:
    u = dict(item.unit)
    return item.section, u["tp"], u["pp"], u.get("ep", 0), item.chunk


def _bucket_item(item: Item) -> int:
    """The bucket a flat item of the bucketed spec holds (``optimizer.distributed.[expert_]bucket_{b}.<state>``)."""
    return int(_BUCKET_ITEM.match(item.key).group(1))


def _bucket_fragments(layout: Layout) -> dict[Buffer, list[list[Fragment]]]:
    """Per buffer: per bucket, the fragments of its flat item (``optimizer.distributed.[expert_]bucket_{b}.master``)."""
    out: dict[Buffer, dict[int, list[Fragment]]] = {}
    for it in layout.items:
        if it.section in (DENSE, EXPERT):
            out.setdefault(_buffer_of(it), {})[_bucket_item(it)] = []
    for f in layout.fragments:
        if f.item.section in (DENSE, EXPERT):
            out[_buffer_of(f.item)][_bucket_item(f.item)].append(f)
    return {g: [by_b[b] for b in sorted(by_b)] for g, by_b in out.items()}


def _unpadded(per_group: Mapping[Buffer, list[list[Fragment]]], coalesced: Layout) -> dict[Buffer, list[int]]:
    """Per buffer, each bucket's unpadded length: where the coalesced buffer puts the bucket's fragments.

    The coalesced item (``[expert_]distrib_optim.master``) joins the buckets, each cut at its unpadded
    end; a bucket starts where the same fragment sits in it, minus its offset in the bucket.
    """
    at: dict[Buffer, dict[tuple, int]] = {}
    total: dict[Buffer, int] = {}
    for it, info in coalesced.items.items():
        if it.section in (DENSE, EXPERT):
            total[_buffer_of(it)] = info.shape[0]
    for f in coalesced.fragments:
        if f.item.section in (DENSE, EXPERT):
            at.setdefault(_buffer_of(f.item), {})[(f.tensor, f.box.offsets, f.box.lengths)] = f.offset
    out = {}
    for g, buckets in per_group.items():
        if not all(buckets):
            raise CheckpointFormatError(f"{g[0]} tp={g[1]}, pp={g[2]}, ep={g[3]}: the layout has a bucket without "
                                        "parameters")
        starts = [at[g][(f.tensor, f.box.offsets, f.box.lengths)] - f.offset for f in (b[0] for b in buckets)]
        out[g] = [end - start for start, end in zip(starts, [*starts[1:], total[g]])]
    return out


def _stored_unpadded(path: Path, md: DcpMetadata) -> dict[tuple[str, int], list[list[int]]]:
    """Per (``chained_{k}.`` prefix or "", group), ``per_bucket_numel_unpadded`` of each of its grad buffers (one
    per model chunk), as stored."""
    out: dict[tuple[str, int], list[list[int]]] = {}
    for key in md.byte_entries:
        m = _OBJECT_KEY.fullmatch(key)
        if m is None or m.group(3) != "per_bucket_numel_unpadded":
            continue
        value = _object(path, md, key)
        buffers = value[0] if isinstance(value, list) and len(value) == 1 else None
        per_chunk = [next(iter(one.values())) if isinstance(one, Mapping) and len(one) == 1 else None
                     for one in (buffers if isinstance(buffers, list) and buffers else [None])]
        if not all(isinstance(counts, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                    for n in counts) for counts in per_chunk):
            raise CheckpointFormatError(f"{path / '.metadata'}: '{key}' is {brief(value, 120)}; expected [[{{dtype "
                                        "pair: [elements per bucket]}, ...]]: one grad buffer per model chunk")
        out[(f"chained_{m.group(1)}." if m.group(1) is not None else "", int(m.group(2)))] = per_chunk
    return out


def _require_every_bucket(parsed: Mapping[str, tuple[str, int, Buffer, int, str]],
                          per_group: Mapping[Buffer, list[list[Fragment]]], topology: Topology, vpp: int,
                          where: Path) -> None:
    """Every buffer, bucket and state the checkpoint has a tensor of: all buckets of every optimizer's groups and
    model chunks."""
    states = sorted({v[4] for v in parsed.values()})
    have = {(prefix, g, buffer[4], b, s) for prefix, g, buffer, b, s in parsed.values()}
    for chain in [None] if topology.ep == 1 else [0, 1]:
        prefix = "" if chain is None else f"chained_{chain}."
        for group, chunk in ((g, c) for g in range(_groups(topology, chain)) for c in range(vpp)):
            buffer = _buffer(chain, group, topology, chunk)
            for b in range(len(per_group.get(buffer, []))):
                for s in states:
                    if (prefix, group, chunk, b, s) not in have:
                        raise CheckpointFormatError(f"{where}: no tensor for {_describe(prefix, group, buffer)} "
                                                    f"bucket {b} state '{s}' (other buckets have one)")


def _object(path: Path, md: DcpMetadata, key: str) -> Any:
    s = _storage(path, md, key, None)
    file = path / s.relative_path
    if not file.is_file():
        raise CheckpointFormatError(f"{file}: missing or not a regular file (the metadata puts '{key}' there)")
    return read_torch_file(file, offset=s.offset, length=s.length)


def _param_groups(path: Path, md: DcpMetadata) -> list[dict[str, Any]] | None:
    """The param groups (Adam's ``step`` in each) of the (dense) first group's ``optimizer`` entry; None without
    one."""
    key = next((k for k in (f"{c}optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1" for c in ("", "chained_0."))
                if k in md.byte_entries), None)
    if key is None:
        return None
    value = _object(path, md, key)
    inner = value[0] if isinstance(value, list) and len(value) == 1 else None
    groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise CheckpointFormatError(f"{path / '.metadata'}: '{key}' is {brief(value, 120)}; expected "
                                    "[{'param_groups': [{...}, ...]}]")
    return [dict(_capture(g, f"{path}: {key}")) for g in groups]
