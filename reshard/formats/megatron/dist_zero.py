"""The distributed optimizer's older torch_dist bucket formats: which one a checkpoint holds, and
``dp_zero_gather_scatter`` decoded per parameter.

Megatron-core's ``DistributedOptimizer.sharded_state_dict`` saves the optimizer state in one of
several sharding types; ``common.pt['content_metadata']['distrib_optim_sharding_type']`` (0.13+)
or else ``common.pt['optimizer']['param_state_sharding_type']`` names it, and the keys tell it
apart where neither does (``sharding_type``). Besides ``dp_reshardable`` (``dist_optim``),
``fully_reshardable`` (``dist_full``) and ``fully_sharded_model_space`` (``model_space``):

- ``dp_zero_gather_scatter`` (0.6-0.16; the 0.8-0.14 trainer's type with
  ``--no-ckpt-fully-parallel-save``): per model-parallel group ``I`` (``pp_rank * tp + tp_rank``)
  one bytes entry ``optimizer.distributed.dp_group_idx_{I}.param_state/shard_0_1``, written by the
  group's dp rank 0: ``torch.save`` of ``[d]``, where ``d`` is exactly the torch format's
  ``distrib_optim.pt`` dict (``{'buckets_coalesced': True, 0: {(param_dtype, grad_dtype):
  {'param'|'exp_avg'|'exp_avg_sq': fp32 [numel_unpadded], 'numel_unpadded': n}}}``: every bucket of
  the grad buffer cut at its unpadded end, joined). Its tensors are read in place inside the
  ``.distcp`` file, through reshard's restricted unpickler; the dict is checked by the torch
  format's own reader and placed by the family's ``-distopt-torch`` spec, bucket by bucket as
  ``dist_optim`` lays the buckets out from the args. The step and param groups are in
  ``optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1``, as for ``dp_reshardable``.
- ``fully_sharded_bucket_space`` (0.6-0.14): ``dp_reshardable``'s keys, but each bucket tensor is
  the *padded* world buffer, which megatron-core's torch_dist strategy (0.8+) stores reformulated
  as ``[dp, L]`` (``L`` = padded bucket / dp; row ``r`` is dp rank ``r``'s shard), each piece a chunk
  ``(r, start)`` of ``(1, length)``; the bucket-end padding is stored (arbitrary bytes, never
  read). ``dist_optim.bucket_space`` decodes it with ``padded``; ``flat_chunk`` gives a chunk's
  place in the bucket.

Read as ``dp_reshardable`` is: a mixture of experts' dense and expert optimizers (``chained_K.``), one grad buffer
per model chunk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reshard.core.layout import Fragment, Item, ItemInfo
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import MAX_COUNT, Located, expect_int
from reshard.formats.dcp.reading import _storage
from reshard.formats.megatron.dist_optim import (
    DENSE,
    BucketSpace,
    _buckets,
    _buffer,
    _expert_parallel,
    _groups,
    _object,
    _param_groups,
    _ranks,
    is_bucket_key,
)
from reshard.formats.megatron.files import _buffer_key, _Rank
from reshard.formats.megatron.reader import _Reader
from reshard.formats.megatron.small import _contiguous_offset
from reshard.io.bounds import brief
from reshard.io.dcp_metadata import DcpChunk, DcpMetadata
from reshard.models import Family

__all__ = ["BUCKET_SPACE", "ZERO", "ZeroState", "flat_chunk", "sharding_type", "zero_state"]

ZERO = "dp_zero_gather_scatter"
BUCKET_SPACE = "fully_sharded_bucket_space"
_ZERO_KEY = re.compile(r"(chained_[0-9]{1,9}\.)?optimizer\.distributed\.dp_group_idx_([0-9]{1,9})\.param_state"
                       r"/shard_0_1")


def sharding_type(common: Mapping[str, Any], md: DcpMetadata) -> str | None:
    """The distributed optimizer's torch_dist sharding type: ``content_metadata``'s
    ``distrib_optim_sharding_type``, else the optimizer's ``param_state_sharding_type`` (one optimizer),
    else what the keys show (None: no distributed-optimizer state)."""
    content = common.get("content_metadata")
    if isinstance(content, Mapping) and isinstance(content.get("distrib_optim_sharding_type"), str):
        return content["distrib_optim_sharding_type"]
    optimizer = common.get("optimizer")
    if isinstance(optimizer, Mapping) and isinstance(optimizer.get("param_state_sharding_type"), str):
        return optimizer["param_state_sharding_type"]
    if any(_ZERO_KEY.fullmatch(k) for k in md.byte_entries):
        return ZERO
    bucket = [t for k, t in md.tensors.items() if is_bucket_key(k)]
    if bucket:
        return BUCKET_SPACE if len(bucket[0].size) == 2 else "dp_reshardable"
    if any(k.startswith("optimizer.state.fp32_param.") for k in md.tensors):
        return "fully_sharded_model_space"
    return "fully_reshardable" if any(k.startswith("optimizer.state.") for k in md.tensors) else None


def flat_chunk(space: BucketSpace | None, key: str, size: tuple[int, ...],
               chunk: DcpChunk) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A stored chunk of a bucket tensor as (shape, offsets, sizes) of the 1-D bucket: a padded key's ``[dp, L]``
    chunk ``(r, start)`` of ``(1, n)`` is elements ``r * L + start`` on (elements from the bucket's start)."""
    if space is None or key not in space.padded:
        return size, chunk.offsets, chunk.sizes
    rows, row = size
    return (rows * row,), (chunk.offsets[0] * row + chunk.offsets[1],), (chunk.sizes[1],)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroState:
    """``dp_zero_gather_scatter`` state: one item per group and state, the whole coalesced buffer."""

    space: BucketSpace
    """No bucket tensors; the layout's spec name and the param groups (Adam's ``step`` in each)."""
    items: Mapping[Item, ItemInfo]
    fragments: tuple[Fragment, ...]
    where: Mapping[Item, Located]
    """Each item's tensor, in place inside its ``.distcp`` file."""


def zero_state(path: Path, md: DcpMetadata, args: Mapping[str, Any] | None, family: Family,
               sizes: Mapping[str, int], topology: Topology) -> ZeroState:
    """Decode every ``[chained_K.]dp_group_idx_{I}.param_state`` entry of ``md`` into per-parameter fragments.

    A mixture of experts at ep > 1 has two optimizers: ``chained_0.`` the dense params' (groups numbered in the
    tp-pp group), ``chained_1.`` the experts' (numbered in the expert tp-ep-pp group), as ``dp_reshardable``'s
    (``dist_optim._buffer``); at ep 1, one. With virtual pipeline chunks an entry's dict holds one buffer per
    model chunk.

    Raises:
      CheckpointFormatError: no args, other chained optimizers than the run's, a group beyond the model-parallel
        ranks or a missing one, an entry that is not ``[distrib_optim.pt's dict]`` (as the torch format's reader
        checks it: ``buckets_coalesced``, one buffer per model chunk, 1-D fp32 states, ``numel_unpadded``), or a
        buffer whose length differs from the layout's (naming the key, the file and both numbers).
    """
    where = path / ".metadata"
    if args is None:
        raise CheckpointFormatError(f"{path / 'common.pt'}: no args, so the distributed optimizer's bucket layout "
                                    f"(bucket size, layer implementation) is unknown; the {ZERO} optimizer state "
                                    "cannot be decoded")
    ep, etp = _expert_parallel(args, family, where)
    chains = (0, 1) if ep > 1 else (None,)
    topology = Topology(tp=topology.tp, pp=topology.pp, ep=ep, dp=ep * (etp or 1), etp=etp)
    entries: dict[tuple[int | None, int], str] = {}
    for key in md.byte_entries:
        m = _ZERO_KEY.fullmatch(key)
        if m is None:
            continue
        chain = None if m.group(1) is None else int(m.group(1)[len("chained_"):-1])
        if chain not in chains:
            raise CheckpointFormatError(
                f"{where}: '{key}': at expert parallelism {ep} megatron-core saves "
                f"{'a dense (chained_0.) and an expert (chained_1.) optimizer' if ep > 1 else 'one, unprefixed'}")
        group = int(m.group(2))
        groups = _groups(topology, chain)
        if group >= groups:
            raise CheckpointFormatError(f"{where}: '{key}': group {group}, but the optimizer has {groups} "
                                        f"model-parallel ranks ({_ranks(topology, chain)})")
        entries[(chain, group)] = key
    for chain in chains:
        missing = [g for g in range(_groups(topology, chain)) if (chain, g) not in entries]
        if missing:
            prefix = "" if chain is None else f"chained_{chain}."
            raise CheckpointFormatError(
                f"{where}: no '{prefix}optimizer.distributed.dp_group_idx_{missing[0]}.param_state' ({ZERO}: one "
                f"per model-parallel rank, {_groups(topology, chain)} at {_ranks(topology, chain)})")
    dp, cp = (expect_int(args.get(f"{a}_parallel_size") or 1, f"args.{a}_parallel_size", str(where), lo=1,
                         hi=MAX_COUNT) for a in ("data", "context"))
    r = _buckets(family, args, sizes, topology, Topology(tp=topology.tp, pp=topology.pp, dp=dp, cp=cp))
    items: dict[Item, ItemInfo] = {}
    fragments: list[Fragment] = []
    located: dict[Item, Located] = {}
    for (chain, group), key in sorted(entries.items(), key=lambda e: (e[0][0] or 0, e[0][1])):
        file = path / _storage(path, md, key, None).relative_path
        _, tp, pp, _, _ = _buffer(chain, group, topology)
        per_chunk = _decoded(path, md, key, file, tp, pp, r.vpp)
        for chunk in range(r.vpp):
            buffer = _buffer(chain, group, topology, chunk)
            buckets, unpadded = r.per_group[buffer], r.unpadded[buffer]
            starts = [sum(unpadded[:b]) for b in range(len(unpadded))]
            for state, ref in per_chunk[chunk].items():
                shown = f"'{key}' [0][{chunk}][{_buffer_key(state)}]"
                if ref.shape != (sum(unpadded),):
                    raise CheckpointFormatError(
                        f"{file}: {shown} holds {list(ref.shape)} elements; the layout ({r.spec_name}, bucket_size "
                        f"{r.bucket_size} from args.overlap_grad_reduce/ddp_bucket_size) gives buckets of "
                        f"{unpadded} unpadded elements, {sum(unpadded)} in all")
                item = Item("model", (), 0, state, f"{key}[{chunk}][{_buffer_key(state)}]")
                mine = [replace(f, item=item, state=state, offset=f.offset + start)
                        for start, frags in zip(starts, buckets, strict=True) for f in frags]
                items[item] = ItemInfo(shape=tuple(ref.shape), mapped=sum(math.prod(f.box.lengths) for f in mine),
                                       rule=r.spec_name)
                fragments.extend(mine)
                located[item] = Located(ref.path, _contiguous_offset(ref, f"{file}: {shown}"), "float32")
    space = BucketSpace(fragments={}, states={}, spec_name=r.spec_name, param_groups=_param_groups(path, md))
    return ZeroState(space=space, items=items, fragments=tuple(fragments), where=located)


def _decoded(path: Path, md: DcpMetadata, key: str, file: Path, tp: int, pp: int,
             vpp: int) -> list[dict[str, Any]]:
    """One ``param_state`` entry's states per model chunk (reshard's names -> TensorRef), checked as the torch
    format's reader checks ``distrib_optim.pt`` (a dense or an expert optimizer's dict alike)."""
    value = _object(path, md, key)
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], Mapping):
        raise CheckpointFormatError(f"{file}: '{key}' is {brief(value, 120)}; expected [distrib_optim.pt's dict] "
                                    f"({ZERO})")
    chunks = {"model": {}} if vpp == 1 else {f"model{c}": {} for c in range(vpp)}
    rank = _Rank(tp, pp, 0, file, chunks, distopt=value[0], distopt_path=Path(f"{file}: '{key}' [0]"))
    reader = _Reader({(tp, pp, 0): rank}, Topology(vpp=vpp), "", False, 0)
    reader._distributed(rank)
    return [reader.per_param[(tp, pp, 0)][(c, DENSE)] for c in range(vpp)]
