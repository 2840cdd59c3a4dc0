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

The layout is not stored; it is the one the torch format's ``distrib_optim.pt`` has,
bucket by bucket. The generated Megatron spec of the family with the distributed
optimizer (``megatron-<family>[-local]-distopt``, one item per bucket) gives each
bucket's fragments; the same family's ``-distopt-torch`` spec (the buckets coalesced,
each cut at its unpadded end) gives each bucket's unpadded length, which must equal the
stored ``per_bucket_numel_unpadded``. Both come from the spec language's ``flat``
statements, so the bucket rules live in one place. The bucketing inputs come from
``common.pt``'s ``args`` (``overlap_grad_reduce``, ``ddp_bucket_size``,
``transformer_impl``); bucket positions do not depend on the dp size, so the layouts are
resolved at dp 1.

Read so far: one grad buffer per group (one dtype pair, no virtual pipeline chunks), the
dense optimizer of a model with a torch_dist layout; other keys are refused by name.

Written (``bucket_target``, from the same resolution): each dp rank's shard of each bucket,
cut at the bucket's unpadded end, one chunk per parameter piece and one per gap, as
megatron-core 0.16's ``sharded_param_state_dp_reshardable`` saves them, with the bucket
counts at the target dp; ``dist_optim_target`` makes the target's items of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.core.layout import MASTER, PARAM, Fragment, Layout
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import MAX_COUNT, expect_int
from reshard.formats.dcp.reading import _storage
from reshard.formats.megatron.small import _capture
from reshard.formats.megatron.specs import _resolve, spec_name
from reshard.formats.specs import layout_spec
from reshard.io.bounds import brief
from reshard.io.dcp_metadata import DcpMetadata
from reshard.io.torch_read import read_torch_file
from reshard.models import Family

__all__ = ["MAIN_STATE", "PREFIX", "BucketChunk", "BucketSpace", "BucketTarget", "bucket_space", "bucket_target",
           "buffer_dtypes"]

PREFIX = "optimizer.distributed."
MAIN_STATE = "param"
"""The bucket tensors' name for the fp32 main params: reshard's ``MASTER``."""
_BUCKET_KEY = re.compile(r"optimizer\.distributed\.dp_group_idx_([0-9]{1,9})\.gbuf_idx_([0-9]{1,9})\.dtype_(\(.*\))"
                         r"\.bucket_idx_([0-9]{1,9})\.([A-Za-z_][A-Za-z0-9_]*)")
_OBJECT_KEY = re.compile(r"optimizer\.distributed\.dp_group_idx_([0-9]{1,9})\.([A-Za-z_]+)/shard_0_1")


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


def bucket_space(path: Path, md: DcpMetadata, args: Mapping[str, Any] | None, family: Family,
                 sizes: Mapping[str, int], topology: Topology) -> BucketSpace:
    """Decode the ``dp_reshardable`` keys of ``md`` into per-parameter fragments.

    ``sizes`` are the model's (from ``common.pt``'s args); ``topology`` gives tp and pp.

    Raises:
      CheckpointFormatError: no args, an unknown or unsupported key (another grad buffer,
        a group beyond tp * pp), a bucket count or ``per_bucket_numel_unpadded`` that differs
        from the layout's (naming the group, the bucket and both numbers), a stored length
        that differs from ``per_bucket_numel_unpadded``, or a missing bucket tensor.
    """
    where = path / ".metadata"
    if args is None:
        raise CheckpointFormatError(f"{path / 'common.pt'}: no args, so the distributed optimizer's bucket layout "
                                    "(bucket size, layer implementation) is unknown; the dp_reshardable optimizer "
                                    "state cannot be decoded")
    keys = [k for k in md.tensors if k.startswith(PREFIX)]
    parsed: dict[str, tuple[int, int, int, str]] = {}
    for key in keys:
        m = _BUCKET_KEY.fullmatch(key)
        if m is None:
            raise CheckpointFormatError(f"{where}: '{key}' is distributed-optimizer state reshard does not read "
                                        "(expected optimizer.distributed.dp_group_idx_I.gbuf_idx_G.dtype_D."
                                        "bucket_idx_B.<state>)")
        group, gbuf, bucket, state = int(m.group(1)), int(m.group(2)), int(m.group(4)), m.group(5)
        if gbuf:
            raise CheckpointFormatError(
                f"{where}: '{key}': a second grad buffer (another dtype pair, or a virtual pipeline chunk); "
                "reshard reads dp_reshardable state of one buffer per (tp, pp) group so far")
        if group >= topology.tp * topology.pp:
            raise CheckpointFormatError(f"{where}: '{key}': group {group}, but tp({topology.tp}) * pp({topology.pp}) "
                                        f"= {topology.tp * topology.pp} groups")
        parsed[key] = (group, bucket, md.tensors[key].size[0] if len(md.tensors[key].size) == 1 else -1, state)
    dp = expect_int(args.get("data_parallel_size") or 1, "args.data_parallel_size", str(where), lo=1, hi=MAX_COUNT)
    cp = expect_int(args.get("context_parallel_size") or 1, "args.context_parallel_size", str(where), lo=1,
                    hi=MAX_COUNT)
    r = _buckets(family, args, sizes, Topology(tp=topology.tp, pp=topology.pp, dp=dp, cp=cp))
    bucketed_name, bucket_size, per_group, unpadded = r.spec_name, r.bucket_size, r.per_group, r.unpadded
    stored = _stored_unpadded(path, md)
    layout = f"the layout ({bucketed_name}, bucket_size {bucket_size} from args.overlap_grad_reduce/ddp_bucket_size)"
    for group in sorted({g for g, _, _, _ in parsed.values()}):
        tp_pp = (group % topology.tp, group // topology.tp)
        counted, want = stored.get(group), unpadded.get(tp_pp, [])
        name = f"dp_group_idx_{group} (tp={tp_pp[0]}, pp={tp_pp[1]})"
        if counted is None:
            raise CheckpointFormatError(f"{where}: {name} has bucket tensors but no per_bucket_numel_unpadded")
        if len(counted) != len(want):
            raise CheckpointFormatError(f"{where}: {name} has {len(counted)} buckets in per_bucket_numel_unpadded, "
                                        f"{layout} has {len(want)}")
        for b, (computed, have) in enumerate(zip(want, counted, strict=True)):
            if computed != have:
                raise CheckpointFormatError(f"{where}: {name} bucket {b}: per_bucket_numel_unpadded says {have} "
                                            f"elements, {layout} gives {computed}")
    out: dict[str, tuple[Fragment, ...]] = {}
    for key, (group, bucket, length, state) in parsed.items():
        mine = per_group[(group % topology.tp, group // topology.tp)]
        if bucket >= len(mine):
            raise CheckpointFormatError(f"{where}: '{key}': bucket {bucket}, but the group has {len(mine)} buckets")
        if length != stored[group][bucket]:
            raise CheckpointFormatError(f"{where}: '{key}' is {list(md.tensors[key].size)}, per_bucket_numel_unpadded "
                                        f"says bucket {bucket} holds {stored[group][bucket]} elements")
        out[key] = tuple(mine[bucket])
    _require_every_bucket(parsed, per_group, topology, where)
    return BucketSpace(fragments=out, states={k: MASTER if s == MAIN_STATE else s for k, (_, _, _, s) in parsed.items()},
                       spec_name=bucketed_name, param_groups=_param_groups(path, md))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Buckets:
    """The buckets of every (tp, pp) group's one grad buffer, as the family's generated specs lay them out."""

    spec_name: str
    """The bucketed spec (``megatron-<family>[-local]-distopt``)."""
    bucket_size: int
    """Elements per bucket from the args (0: one bucket)."""
    sizes: Mapping[str, int]
    """The sizes the specs were resolved with (``vocab_div`` and ``bucket_size`` included)."""
    layout: Layout
    """The bucketed spec resolved at dp 1: per (tp, pp) and bucket, one item holding the whole bucket."""
    per_group: Mapping[tuple[int, int], list[list[Fragment]]]
    """Per (tp, pp), per bucket: its fragments, in elements from the bucket's start (state ``MASTER``)."""
    unpadded: Mapping[tuple[int, int], list[int]]
    """Per (tp, pp), each bucket's unpadded length (``per_bucket_numel_unpadded``)."""


def _buckets(family: Family, args: Mapping[str, Any], sizes: Mapping[str, int], topology: Topology) -> _Buckets:
    """Resolve the family's distributed-optimizer specs for ``args``' bucketing at ``topology``'s tp and pp.

    Bucket contents do not depend on dp (only the bucket-end padding does), so the layouts are resolved at
    dp 1; ``topology``'s dp and cp count only where the args leave the bucket size to the DDP default.
    """
    from reshard.formats.megatron.args import _bucket_size

    local = args.get("transformer_impl") == "local"
    tied = not args.get("untie_embeddings_and_output_weights", False)
    coalesced_name = spec_name(family, tied=tied, distopt=True, local=local)  # distrib_optim.pt's
    bucketed_name = coalesced_name.removesuffix("-torch")  # one item per bucket and dp rank
    bucket_size = _bucket_size(args, topology)
    rank_sizes = {**sizes, "vocab_div": int(args.get("make_vocab_size_divisible_by") or 128),
                  "bucket_size": bucket_size}
    topo = Topology(tp=topology.tp, pp=topology.pp)
    states = {"model": (PARAM,), "optim": (MASTER,)}
    bucketed = _resolve(layout_spec(bucketed_name), topo, rank_sizes, states)
    coalesced = _resolve(layout_spec(coalesced_name), topo, rank_sizes, states)
    per_group = _bucket_fragments(bucketed)
    return _Buckets(spec_name=bucketed_name, bucket_size=bucket_size, sizes=rank_sizes, layout=bucketed,
                    per_group=per_group, unpadded=_unpadded(per_group, coalesced))


def _bucket_fragments(layout: Layout) -> dict[tuple[int, int], list[list[Fragment]]]:
    """Per (tp, pp): per bucket, the fragments of its flat item (``optimizer.distributed.bucket_{b}.master``)."""
    out: dict[tuple[int, int], dict[int, list[Fragment]]] = {}
    for it in layout.items:
        if it.section == "optim" and it.chunk == 0:
            u = dict(it.unit)
            out.setdefault((u["tp"], u["pp"]), {})[int(it.key.split(".bucket_")[1].split(".")[0])] = []
    for f in layout.fragments:
        if f.item.section == "optim":
            u = dict(f.item.unit)
            out[(u["tp"], u["pp"])][int(f.item.key.split(".bucket_")[1].split(".")[0])].append(f)
    return {g: [by_b[b] for b in sorted(by_b)] for g, by_b in out.items()}


def _unpadded(per_group: Mapping[tuple[int, int], list[list[Fragment]]],
              coalesced: Layout) -> dict[tuple[int, int], list[int]]:
    """Per (tp, pp), each bucket's unpadded length: where the coalesced buffer puts the bucket's fragments.

    The coalesced item (``distrib_optim.master``) joins the buckets, each cut at its unpadded
    end; a bucket starts where the same fragment sits in it, minus its offset in the bucket.
    """
    at: dict[tuple[int, int], dict[tuple, int]] = {}
    total: dict[tuple[int, int], int] = {}
    for it, info in coalesced.items.items():
        if it.section == "optim" and it.chunk == 0:
            u = dict(it.unit)
            total[(u["tp"], u["pp"])] = info.shape[0]
    for f in coalesced.fragments:
        if f.item.section == "optim":
            u = dict(f.item.unit)
            at.setdefault((u["tp"], u["pp"]), {})[(f.tensor, f.box.offsets, f.box.lengths)] = f.offset
    out = {}
    for g, buckets in per_group.items():
        if not all(buckets):
            raise CheckpointFormatError(f"tp={g[0]}, pp={g[1]}: the layout has a bucket without parameters")
        starts = [at[g][(f.tensor, f.box.offsets, f.box.lengths)] - f.offset for f in (b[0] for b in buckets)]
        out[g] = [end - start for start, end in zip(starts, [*starts[1:], total[g]])]
    return out


def _stored_unpadded(path: Path, md: DcpMetadata) -> dict[int, list[int]]:
    """Per group, ``per_bucket_numel_unpadded`` of its one grad buffer, as stored."""
    out: dict[int, list[int]] = {}
    for key in md.byte_entries:
        m = _OBJECT_KEY.fullmatch(key)
        if m is None or m.group(2) != "per_bucket_numel_unpadded":
            continue
        value = _object(path, md, key)
        buffers = value[0] if isinstance(value, list) and len(value) == 1 else None
        one = buffers[0] if isinstance(buffers, list) and len(buffers) == 1 else None
        counts = next(iter(one.values())) if isinstance(one, Mapping) and len(one) == 1 else None
        if not isinstance(counts, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                   for n in counts):
            raise CheckpointFormatError(f"{path / '.metadata'}: '{key}' is {brief(value, 120)}; expected [[{{dtype "
                                        "pair: [elements per bucket]}]] for one grad buffer")
        out[int(m.group(1))] = counts
    return out


def _require_every_bucket(parsed: Mapping[str, tuple[int, int, int, str]],
                          per_group: Mapping[tuple[int, int], list[list[Fragment]]], topology: Topology,
                          where: Path) -> None:
    """Every group, bucket and state the checkpoint has a tensor of: all buckets of every group."""
    states = sorted({s for _, _, _, s in parsed.values()})
    have = {(g, b, s) for g, b, _, s in parsed.values()}
    for group in range(topology.tp * topology.pp):
        tp_pp = (group % topology.tp, group // topology.tp)
        for b in range(len(per_group.get(tp_pp, []))):
            for s in states:
                if (group, b, s) not in have:
                    raise CheckpointFormatError(
                        f"{where}: no tensor for dp_group_idx_{group} (tp={tp_pp[0]}, pp={tp_pp[1]}) bucket {b} "
                        f"state '{s}' (other buckets have one)")


def _object(path: Path, md: DcpMetadata, key: str) -> Any:
    s = _storage(path, md, key, None)
    file = path / s.relative_path
    if not file.is_file():
        raise CheckpointFormatError(f"{file}: missing or not a regular file (the metadata puts '{key}' there)")
    return read_torch_file(file, offset=s.offset, length=s.length)


def _param_groups(path: Path, md: DcpMetadata) -> list[dict[str, Any]] | None:
    """The param groups (Adam's ``step`` in each) of the first group's ``optimizer`` entry; None without one."""
    key = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
    if key not in md.byte_entries:
        return None
    value = _object(path, md, key)
    inner = value[0] if isinstance(value, list) and len(value) == 1 else None
    groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise CheckpointFormatError(f"{path / '.metadata'}: '{key}' is {brief(value, 120)}; expected "
                                    "[{'param_groups': [{...}, ...]}]")
    return [dict(_capture(g, f"{path}: {key}")) for g in groups]


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketChunk:
    """One DCP chunk of a ``dp_reshardable`` bucket tensor, as megatron-core's dp rank writes it."""

    key: str
    """The stored key without its state (``optimizer.distributed.dp_group_idx_I....bucket_idx_B``)."""
    group: int
    """The (tp, pp) group ``I`` (``pp_rank * tp + tp_rank``)."""
    dp: int
    """The dp rank that writes it."""
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
    """The grad buffer's (param dtype, grad dtype) torch names: ``("bfloat16", "float32")``."""
    per_bucket_numel: Mapping[int, list[int]]
    """Per group, each bucket's padded elements at the target dp."""
    per_bucket_numel_unpadded: Mapping[int, list[int]]
    """Per group, each bucket's unpadded elements (the bucket tensors' lengths)."""
    spec_name: str
    bucket_size: int


def buffer_dtypes(args: Mapping[str, Any]) -> tuple[str, str]:
    """The dense grad buffer's (param dtype, grad dtype) for a run's args (bf16/fp16 params; fp32 grads with
    ``accumulate_allreduce_grads_in_fp32``), as ``DistributedDataParallel`` keys its buffers."""
    param = "bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32"
    return param, "float32" if args.get("accumulate_allreduce_grads_in_fp32") else param


def bucket_target(family: Family, args: Mapping[str, Any], sizes: Mapping[str, int],
                  topology: Topology) -> BucketTarget:
    """Where megatron-core 0.16 puts each parameter's distributed-optimizer state in ``dp_reshardable``
    at ``topology`` (tp, pp, dp), for a run with ``args``' bucketing and precision.

    Per (tp, pp) group, bucket and dp rank ``r``: the rank's shard of the bucket,
    ``[r * L, (r + 1) * L)`` (``L`` the padded bucket over dp) cut at the bucket's unpadded end,
    split into one chunk per parameter piece and one per gap between them
    (``sharded_param_state_dp_reshardable``).

    Raises:
      CheckpointFormatError: a dp rank that owns no parameter of a bucket (megatron-core cannot save
        such a bucket: 'empty bucket encountered'), naming the group, bucket and rank; fp8 parameters
        (a second grad buffer); padded buckets for NCCL bus bandwidth.
    """
    for flag in ("fp8_param_gather", "ddp_pad_buckets_for_high_nccl_busbw"):
        if args.get(flag):
            raise CheckpointFormatError(f"args.{flag} is set: reshard writes dp_reshardable state of one grad buffer "
                                        "with the default bucket padding only")
    r = _buckets(family, args, sizes, topology)
    at_dp = _resolve(layout_spec(r.spec_name), Topology(tp=topology.tp, pp=topology.pp, dp=topology.dp),
                     r.sizes, {"model": (PARAM,), "optim": (MASTER,)})
    shard: dict[tuple[int, int, int], int] = {}  # (tp, pp, bucket) -> L
    for it, info in at_dp.items.items():
        if it.section == "optim" and dict(it.unit).get("dp") == 0:
            u = dict(it.unit)
            shard[(u["tp"], u["pp"], int(it.key.split(".bucket_")[1].split(".")[0]))] = info.shape[0]
    # A parameter keeps its row-major order in the buffer: it starts where a fragment of it sits, less that
    # fragment's offset in the parameter, and spans the whole parameter (rows that pad the vocabulary too).
    param_of = {(f.tensor, f.box.offsets, f.box.lengths, _tp_pp(f.item.unit)):
                (f.item.key, f.offset, r.layout.items[f.item].numel)
                for f in r.layout.fragments if f.item.section == "model"}
    dtypes = buffer_dtypes(args)
    chunks: list[BucketChunk] = []
    padded: dict[int, list[int]] = {}
    unpadded: dict[int, list[int]] = {}
    for (tp, pp), buckets in sorted(r.per_group.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        group = pp * topology.tp + tp
        unpadded[group] = list(r.unpadded[(tp, pp)])
        padded[group] = [shard[(tp, pp, b)] * topology.dp for b in range(len(buckets))]
        for b, frags in enumerate(buckets):
            size = r.unpadded[(tp, pp)][b]
            extents: dict[str, tuple[int, int]] = {}
            for f in frags:
                found = param_of.get((f.tensor, f.box.offsets, f.box.lengths, _tp_pp(f.item.unit)))
                if found is None:  # at dp 1 every fragment of a bucket is a whole model parameter's fragment
                    raise CheckpointFormatError(f"{r.spec_name}: {f} is no model parameter's fragment")
                name, in_param, numel = found
                extents[name] = (f.offset - in_param, f.offset - in_param + numel)
            key = f"{PREFIX}dp_group_idx_{group}.gbuf_idx_0.dtype_(torch.{dtypes[0]}, torch.{dtypes[1]})" \
                  f".bucket_idx_{b}"
            length = shard[(tp, pp, b)]
            for dp in range(topology.dp):
                lo, hi = dp * length, min((dp + 1) * length, size)
                if not any(s < hi and lo < e for s, e in extents.values()):
                    raise CheckpointFormatError(
                        f"{key}: dp rank {dp} of {topology.dp} owns no parameter of bucket {b} (elements "
                        f"[{lo}, {(dp + 1) * length}) of {size}); megatron-core cannot save or load such a bucket "
                        "('empty bucket encountered'): use a smaller dp or larger buckets")
                cuts = sorted({lo, hi} | {x for s, e in extents.values() for x in (s, e) if lo < x < hi})
                chunks += [BucketChunk(key=key, group=group, dp=dp, offset=a, length=z - a, size=size,
                                       fragments=tuple(frags)) for a, z in zip(cuts, cuts[1:])]
    return BucketTarget(chunks=tuple(chunks), dtypes=dtypes, per_bucket_numel=padded,
                        per_bucket_numel_unpadded=unpadded, spec_name=r.spec_name, bucket_size=r.bucket_size)


def _tp_pp(unit: tuple[tuple[str, int], ...]) -> tuple[int, int]:
    u = dict(unit)
    return u.get("tp", 0), u.get("pp", 0)
