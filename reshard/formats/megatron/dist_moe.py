"""Megatron-core ``torch_dist`` of mixture-of-experts models (SequentialMLP experts), and the per-layer bytes
entries of every family's torch_dist.

How megatron-core 0.16 stores an MoE layer there (``SequentialMLP.sharded_state_dict``, ``TopKRouter``):

- each expert linear under one key for all layers and experts, ``decoder.layers.mlp.experts.experts.
  linear_fc1.weight``, global shape ``[layers, experts, ...]``: the expert number is a second stacked dim,
  numbered globally (ep rank ``r`` of ``ep`` writes experts ``r*E/ep ..``), so the layout does not depend on
  ep, and every expert-data-parallel replica of a chunk shares its box (``replica_id`` ``(pp, tp, edp rank)``);
  SwiGLU fc1 is one chunk per half and tp rank, as in dense layers;
- the router's weight (and bias) replicated over tp and ep: ``decoder.layers.mlp.router.weight``
  ``[layers, experts, h]``;
- each expert linear's ``_extra_state`` a bytes entry per (layer, expert):
  ``decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_{i}.{e}_{layers}.{experts}``;
- the pre-MLP norm as Transformer Engine's MoE layers keep it, ``decoder.layers.pre_mlp_layernorm.weight``,
  or as megatron-core's local layers key it, ``decoder.layers.mlp.linear_fc1.layer_norm_weight`` (their
  ``sharded_state_dict_keys_map``, the same for dense and MoE layers). A dense family's two are one layout, an
  MoE family's are two: ``mcore-dist-<family>`` and ``mcore-dist-<family>-local``, picked by ``common.pt``'s
  ``args.transformer_impl``.

Layers of several kinds (``--moe-layer-freq`` as a list: DeepSeek-V3's dense layers first) are keyed per
global layer (``decoder.layers.{n}.``: TransformerBlock's ``non_homogeneous_layers``; ``dist_layers``).
Grouped-GEMM experts (``--moe-grouped-gemm``) store other keys and are not read.

The distributed optimizer's ``dp_reshardable`` state of an MoE model (a ChainedOptimizer at ep > 1: the dense
optimizer's buckets, ``chained_0.``, and the expert optimizer's over the expert-data-parallel group,
``chained_1.``) is read and written by ``dist_optim`` and ``dist_optim_target``.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from typing import Any

from reshard.core.layout import Layout
from reshard.formats.dcp.reading import _Verbatim
from reshard.formats.megatron.dist_layers import layer_extra_states
from reshard.models import Family

__all__ = ["bucket_refusal", "extra_states", "is_local", "spec_name"]

_LINEAR = re.compile(r"(decoder\.layers\.(?![0-9]).*\.linear_[a-z0-9_]+)\.weight")  # stacked layers
_EXPERTS = ".experts.experts."


def is_local(args: Mapping[str, Any] | None) -> bool:
    """Whether a Megatron run's args build megatron-core's local layers (``--transformer-impl local``)."""
    return bool(args) and args.get("transformer_impl") == "local"


def spec_name(family: Family, tied: bool, local: bool = False, mtp: bool = False) -> str:
    """The generated torch_dist layout of ``family``: ``mcore-dist-<family>[-tied][-local][-mtp]``; ``-local`` only
    for a mixture of experts, the one kind of family whose local layers key a tensor otherwise; ``-mtp`` with
    multi-token-prediction layers (a family with ``hf_layers``)."""
    tie = "-tied" if tied and family.can_tie else ""
    return f"mcore-dist-{family.name}{tie}{'-local' if local and family.experts else ''}" \
        f"{'-mtp' if mtp and 'hf_layers' in family.sizes else ''}"


def extra_states(whole: Layout, sizes: Mapping[str, int]) -> list[_Verbatim]:
    """The ``_extra_state`` bytes entries megatron-core's layers save beside the global tensors ``whole``: one
    per linear module of each layer (and expert), ``[None]`` as megatron-core's local layers write it."""
    import torch

    buf = io.BytesIO()
    torch.save([None], buf)
    data = buf.getvalue()
    modules = list(dict.fromkeys(m.group(1) for it in whole.items if (m := _LINEAR.fullmatch(it.key))))
    layers, experts = int(sizes["layers"]), int(sizes.get("experts", 0))
    out = []
    for i in range(layers):
        for module in modules:
            if _EXPERTS in module:
                out += [_Verbatim(f"{module}._extra_state/shard_{i}.{e}_{layers}.{experts}", None, data)
                        for e in range(experts)]
            else:
                out.append(_Verbatim(f"{module}._extra_state/shard_{i}_{layers}", None, data))
    return out + layer_extra_states(whole, sizes, data)  # layers keyed one by one (dist_layers)


def bucket_refusal(keys: list[str]) -> str:
    """Why the distributed optimizer's bucket-space state ``keys`` is not read (a problem line of ``open``)."""
    return (f"optimizer state in the distributed optimizer's bucket space ({len(keys)} keys, e.g. '{keys[0]}') is "
            "read as dp_reshardable's tensors of a model of a known family only; save with "
            "--dist-ckpt-optim-fully-reshardable, or convert the weights alone")
