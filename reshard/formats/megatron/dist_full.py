"""The distributed optimizer's ``fully_reshardable`` torch_dist state: written, and checked when read.

Megatron-core 0.15+ saves the ``DistributedOptimizer``'s state ``fully_reshardable`` when the
trainer runs with ``--dist-ckpt-optim-fully-reshardable``
(``DistributedOptimizer.sharded_param_state_fully_reshardable``): per model parameter and state
one fp32 tensor::

    optimizer.state.{param|exp_avg|exp_avg_sq}.<model key>

with the model tensor's global shape, chunks and replica ids, so that it splits over tp, pp and
dp exactly like the weight (``param`` is the fp32 main copy, reshard's ``MASTER``). Nothing of
the grad buffers is stored: megatron-core loads it at any tp, pp, dp and bucketing. Adam's step
and the param groups are plain common state: ``common.pt['optimizer']`` is
``{'optimizer': {'param_groups': [...]}, 'param_state_sharding_type': 'fully_reshardable'}``,
and ``common.pt['content_metadata']`` carries the sharding type, which the trainer's load reads.

Written (``full_target``): one item per weight chunk and state, each the weight's chunk under
the state's key, written by the same rank.

Checked when read (``check_buckets``): every megatron-core release up to 0.19.0 saves this
format wrong when a grad buffer has several buckets. It gathers the buffer's state into one
tensor with each bucket's end padding removed, then cuts each parameter out of it at its
offset in the *padded* buffer; a parameter in bucket ``b`` gets the values that sit as many
elements further on as the buckets before ``b`` were padded (the next parameters', gaps',
zeros past the end). Bucket 0, and one-bucket buffers (no ``overlap_grad_reduce``), are right.
Nothing in the files records the release, so the check lays the buckets out from the args
(as the ``dp_reshardable`` reader does) and, when a bucket after a padded one exists, compares
the fp32 main copy of that bucket's largest parameter with its weight. Training keeps the weight
the main copy in the weight's dtype, bit for bit; the bug leaves the main copy equal to the weight
shifted by the padding, which is refused. (Main params unlike the weights either way, as in
hand-made checkpoints, tell nothing and pass.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from reshard.core.layout import MASTER, PARAM, Fragment, Item, ItemInfo
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import MAX_COUNT, Located, Source, expect_int
from reshard.formats.dcp.layouts import _Chunk
from reshard.formats.megatron.common_state import common_where
from reshard.formats.megatron.dist_derived import optimizer_state, stored_key
from reshard.io.location import read_at
from reshard.models import Family

__all__ = ["CONTENT_METADATA", "FULL", "SHARDINGS", "check_buckets", "full_target", "sharding_of"]

FULL = "fully_reshardable"
SHARDINGS = ("dp_reshardable", FULL)
"""The distributed optimizer's torch_dist formats reshard writes; the first is megatron-core 0.15+'s default."""
CONTENT_METADATA = {"distrib_optim_sharding_type": FULL, "distrib_optim_fully_reshardable_mem_efficient": False,
                    "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""``common.pt['content_metadata']`` as megatron-core 0.16's trainer saves it with
``--dist-ckpt-optim-fully-reshardable`` (``_build_sharded_state_dict_metadata``)."""


def sharding_of(args: Mapping[str, Any], requested: str | None) -> str:
    """The format to write: ``requested``, else the one the target args ask the trainer for
    (``dist_ckpt_optim_fully_reshardable``, carried from a source run that used it), else the default."""
    if requested is None:
        return FULL if args.get("dist_ckpt_optim_fully_reshardable") else SHARDINGS[0]
    if requested not in SHARDINGS:
        raise CheckpointFormatError(f"dist_optim '{requested}': expected one of {', '.join(SHARDINGS)}")
    return requested


def full_target(source: Source, family: Family, args: dict[str, Any], weights: Mapping[Item, ItemInfo],
                fragments: list[Fragment], chunks: Mapping[Item, _Chunk]
                ) -> tuple[dict[Item, ItemInfo], list[Fragment], dict[Item, _Chunk], dict[str, Any]]:
    """The items, fragments, DCP chunks and ``common.pt`` entries of ``fully_reshardable`` state: for each
    weight chunk (``weights``, ``fragments``, ``chunks``: the target's model items) and each optimizer state
    of the source, the same chunk under ``optimizer.state.<state>.<key>``, fp32. Sets the args' flag.

    A mixture of experts at ep > 1 has megatron-core's two chained optimizers, a dense and an expert one: the
    state keys are the same (``chained_optim_avoid_prefix``), ``common.pt['optimizer']`` holds one entry per
    optimizer (``{0: dense, 1: experts}``, the experts' param groups with ``is_expert_parallel``). Megatron-core
    0.16.1 resumes that only at ep > 1 again: a run of one optimizer (ep 1) hands the two entries to its
    optimizer as they are (``ChainedOptimizer.load_state_dict``, optimizer.py:1216-1219, then KeyError
    'optimizer' in ``DistributedOptimizer.load_state_dict``, distrib_optimizer.py:755), and the reverse
    likewise; at ep 1 the experts are dense params and the state is written as a dense model's.

    Raises:
      CheckpointFormatError: no fp32 main params in the source, or param groups that are not plain values.
    """
    from reshard.formats.megatron.dist_optim_target import _param_groups
    from reshard.formats.megatron.param_groups import _expert_groups
    from reshard.formats.megatron.specs import _is_expert

    states = [s for s in source.layout.states if s != PARAM]
    if MASTER not in states:
        raise CheckpointFormatError(f"the distributed optimizer stores fp32 main params (state '{MASTER}'), which "
                                    f"{source.path} lacks (it has {', '.join(states)})")
    states = [MASTER, *sorted(set(states) - {MASTER})]
    of_item: dict[Item, list[Fragment]] = {}
    for f in fragments:
        if f.state == PARAM:
            of_item.setdefault(f.item, []).append(f)
    items: dict[Item, ItemInfo] = {}
    frags: list[Fragment] = []
    out_chunks: dict[Item, _Chunk] = {}
    for weight, info in weights.items():
        c = chunks[weight]
        for state in states:
            key = stored_key(c.key, state)
            item = Item(weight.section, weight.unit, weight.chunk, state, f"{key}@{weight.key.partition('@')[2]}")
            frags.extend(replace(f, state=state, item=item) for f in of_item.get(weight, ()))
            items[item] = info
            out_chunks[item] = replace(c, key=key, writer=item)
    args["dist_ckpt_optim_fully_reshardable"] = True
    chained = bool(family.experts) and int(args.get("expert_model_parallel_size") or 1) > 1
    dense, expert = _param_groups(source, args, chained)
    if chained and not expert:  # expert params are linear weights (>= 2-D) and biases, whatever their stacked dims
        expert = _expert_groups(dense, [(c.key, c.size) for c in chunks.values() if _is_expert(c.key)],
                                f"{source.path}: optimizer")
    groups = [dense, expert] if chained else [dense]
    entries = [{"optimizer": {"param_groups": g}, "param_state_sharding_type": FULL} for g in groups]
    common = {"optimizer": dict(enumerate(entries)) if chained else entries[0],
              "content_metadata": dict(CONTENT_METADATA)}
    return items, frags, out_chunks, common


def check_buckets(path: Path, args: Mapping[str, Any] | None, family: Family, sizes: Mapping[str, int],
                  topology: Topology, items: Mapping[Item, ItemInfo], fragments: list[Fragment],
                  where: Mapping[Item, Located]) -> None:
    """Refuse ``fully_reshardable`` state that megatron-core saved from offsets shifted by bucket padding.

    ``items``, ``fragments`` and ``where`` are the source's, read so far (``fully_reshardable`` keys
    included). Nothing is checked without args or with one bucket per buffer: those files are right.

    Raises:
      CheckpointFormatError: the main copy of a parameter in a bucket after a padded one is its weight
        shifted by the padding before the bucket, naming the key, the bucket and the shift.
    """
    full = stored_key("", MASTER)  # the main params' key prefix
    if not args or not args.get("overlap_grad_reduce") or not any(it.key.startswith(full) for it in items):
        return
    from reshard.formats.megatron.dist_optim import _buckets

    dp = expect_int(args.get("data_parallel_size") or 1, "args.data_parallel_size", str(common_where(path)),
                    lo=1, hi=MAX_COUNT)
    cp = expect_int(args.get("context_parallel_size") or 1, "args.context_parallel_size", str(common_where(path)),
                    lo=1, hi=MAX_COUNT)
    ep = expect_int(args.get("expert_model_parallel_size") or 1, "args.expert_model_parallel_size",
                    str(common_where(path)), lo=1, hi=MAX_COUNT) if family.experts else 1
    r = _buckets(family, args, sizes, Topology(tp=topology.tp, pp=topology.pp, ep=ep),
                 Topology(tp=topology.tp, pp=topology.pp, dp=dp, cp=cp), f"{common_where(path)}: args")
    nccl = 2 ** 16 if args.get("ddp_pad_buckets_for_high_nccl_busbw") else 1
    for buffer, buckets in sorted(r.per_group.items()):
        section, tp, pp = buffer[:3]
        expert = section != "optim"  # sharded over the expert data-parallel group: dp * cp / ep ranks
        div = math.lcm((dp * cp) // ep if expert else dp * cp, 128, nccl)
        shift = 0
        for b, (frags, unpadded) in enumerate(zip(buckets, r.unpadded[buffer], strict=True)):
            if shift:
                name = f"the {'expert ' if expert else ''}grad buffer of tp={tp}, pp={pp}"
                _compare(path, max(frags, key=lambda f: math.prod(f.box.lengths)).tensor, f"bucket {b} of {name}",
                         shift, items, fragments, where)
                return  # the writer's behaviour shows in one parameter
            shift += -(-unpadded // div) * div - unpadded


def _compare(path: Path, tensor: str, bucket: str, shift: int, items: Mapping[Item, ItemInfo],
             fragments: list[Fragment], where: Mapping[Item, Located]) -> None:
    """The first stored chunk of ``tensor``'s main copy against the weight chunk at the same offsets: equal, or
    the weight shifted by ``shift`` elements (refused)."""
    by_key = {it.key: it for it in items}
    mains = sorted({f.item for f in fragments if f.tensor == tensor and f.state == MASTER and f.item in where},
                   key=lambda it: it.key)
    for main in mains:
        key, _, at = main.key.partition("@")
        weight = by_key.get(f"{optimizer_state(key)[1]}@{at}")
        if weight is None or weight not in where:
            continue
        numel = math.prod(items[main].shape)
        have, want = _values(where[main], numel, key), _values(where[weight], numel, weight.key)
        if not want.dtype.is_floating_point:
            continue
        if have.to(want.dtype).equal(want) or numel <= shift or not have[:-shift].to(want.dtype).equal(want[shift:]):
            return  # right, or unlike the weights in a way the check cannot tell apart
        raise CheckpointFormatError(
            f"{path}: '{key}' (chunk at [{at}]) is corrupt: its fp32 main params are its weights shifted by {shift} "
            f"elements (element i holds element i + {shift}). The parameter lies in {bucket} "
            f"(args.overlap_grad_reduce, ddp_bucket_size), after buckets padded by {shift} elements in all; "
            "megatron-core releases up to 0.19.0 save fully_reshardable state of such parameters from offsets "
            f"{shift} elements too far on (the values of later parameters, zeros at the end), so the main params "
            "and Adam moments of every parameter past the first padded bucket are lost and reshard does not "
            "carry them. The weights are intact (megatron-core loads them with --no-load-optim); to keep the "
            "optimizer state, save the run again as dp_reshardable (the default) or with one bucket per buffer")


def _values(loc: Located, numel: int, key: str):
    """``numel`` elements stored at ``loc``, as a 1-D torch tensor."""
    import torch

    dtype = getattr(torch, loc.dtype)
    size = numel * torch.empty((), dtype=dtype).element_size()
    data = read_at(loc.path, loc.offset, size)
    if len(data) != size:
        raise CheckpointFormatError(f"{loc.path}: '{key}' ends {size - len(data)} bytes past the end of the file")
    return torch.frombuffer(bytearray(data), dtype=dtype)
