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

Grouped-GEMM experts (``--moe-grouped-gemm``) store the same keys and global shapes:

- the legacy ``GroupedMLP`` (``--moe-use-legacy-grouped-gemm``, or the local layers) turns ``weight1``
  ``[h, E/ep * 2f/tp]`` into ``[E/ep, 2f/tp, h]`` and saves each half as one chunk of all its local experts,
  ``[1, E/ep, f/tp, h]`` at ``(i, ep_rank * E/ep, half * f + tp_rank * f/tp, 0)`` of the same
  ``linear_fc1.weight`` ``[layers, experts, 2f, h]``, and ``weight2`` as ``[1, E/ep, h, f/tp]`` of
  ``linear_fc2.weight`` ``[layers, experts, h, f]`` (``replica_id`` ``(0, 0, edp rank)``), plus one
  ``_extra_state`` bytes entry per expert under SequentialMLP's keys (holding None). Only the chunking differs,
  which DCP reads either way: the weights are read with SequentialMLP's layout, and megatron-core's GroupedMLP
  loads what reshard writes (SequentialMLP's chunks). Its grad buffers hold ``weight1`` and ``weight2``, so the
  distributed optimizer's bucket space is the ``-grouped`` Megatron layout's (``bucket_experts``); the layout is
  named ``mcore-dist-<family>[-local]-grouped`` (the same rules), which also sets a target's args.
- ``TEGroupedMLP`` (Transformer Engine) keys each local expert's ``weight{e}`` as SequentialMLP's expert
  (``TEGroupedLinear._sharded_state_dict_grouped``: one chunk per expert, SwiGLU halves apart), so its weights
  are ``mcore-dist-<family>``'s; its bucket space (every fc1 before any fc2) is refused.

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
from reshard.errors import CheckpointFormatError
from reshard.formats.dcp.reading import _Verbatim
from reshard.formats.megatron.dist_layers import layer_extra_states
from reshard.models import Family
from reshard.models.moe_experts import args_for, impl_from_args

__all__ = ["bucket_experts", "bucket_refusal", "experts_args", "extra_states", "is_grouped", "is_local", "spec_name"]

_LINEAR = re.compile(r"(decoder\.layers\.(?![0-9]).*\.linear_[a-z0-9_]+)\.weight")  # stacked layers
_EXPERTS = ".experts.experts."


def is_local(args: Mapping[str, Any] | None) -> bool:
    """Whether a Megatron run's args build megatron-core's local layers (``--transformer-impl local``)."""
    return bool(args) and args.get("transformer_impl") == "local"


def spec_name(family: Family, tied: bool, local: bool = False, mtp: bool = False, grouped: bool = False) -> str:
    """The generated torch_dist layout of ``family``: ``mcore-dist-<family>[-tied][-local][-mtp][-grouped]``;
    ``-local`` only for a mixture of experts, the one kind of family whose local layers key a tensor otherwise;
    ``-mtp`` with multi-token-prediction layers (a family with ``hf_layers``); ``-grouped`` for GroupedMLP experts
    (the same tensors; the args and the optimizer's buckets differ)."""
    tie = "-tied" if tied and family.can_tie else ""
    return f"mcore-dist-{family.name}{tie}{'-local' if local and family.experts else ''}" \
        f"{'-mtp' if mtp and 'hf_layers' in family.sizes else ''}{'-grouped' if grouped and family.experts else ''}"


def is_grouped(args: Mapping[str, Any] | None) -> bool:
    """Whether a Megatron run's args build the legacy GroupedMLP experts (``reshard.models.moe_experts``)."""
    return bool(args) and impl_from_args(args) == "grouped"


def experts_args(args: Mapping[str, Any], grouped: bool) -> dict[str, bool]:
    """The args' expert flags to change for a target whose layout says GroupedMLP (``grouped``) or not: none where
    the args agree (TEGroupedMLP's stay for a layout without ``-grouped``: the same tensors)."""
    return {} if is_grouped(args) == grouped else args_for("grouped" if grouped else "sequential")


def bucket_experts(family: Family, args: Mapping[str, Any], where: str) -> str:
    """How the experts' params sit in the distributed optimizer's grad buffers for a run with ``args``:
    ``sequential`` or ``grouped`` (the ``experts`` of ``megatron.specs.spec_name``).

    Raises:
      CheckpointFormatError: TEGroupedMLP experts, naming ``where`` (the stored key and file) and why.
    """
    impl = impl_from_args(args) if family.experts else "sequential"
    if impl == "tegrouped":
        raise CheckpointFormatError(
            f"{where}: the distributed optimizer's buckets of TEGroupedMLP experts (args.moe_grouped_gemm without "
            "moe_use_legacy_grouped_gemm, transformer_impl "
            f"{args.get('transformer_impl')!r}) are not laid out by reshard: Transformer Engine's GroupedLinear "
            "registers every local expert's linear_fc1 weight before any linear_fc2, an order the generated "
            "layouts do not give; the weights are SequentialMLP's keys and read as such: convert the weights "
            "alone, or save with --dist-ckpt-optim-fully-reshardable and one bucket (no --overlap-grad-reduce)")
    return impl


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
