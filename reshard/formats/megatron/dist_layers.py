"""Megatron-core ``torch_dist`` of models whose layers are keyed one by one: DeepSeek-V3 (dense layers, then MoE
layers), and the multi-token-prediction (MTP) block.

How megatron-core 0.16 stores them (``TransformerBlock.sharded_state_dict``: ``moe_layer_freq`` a list makes the
layers ``non_homogeneous_layers``; ``MultiTokenPredictionBlock.sharded_state_dict``), as its own save of a
DeepSeek-V3 shows:

- every layer under its global number, with no stacked layers dim: ``decoder.layers.{n}.input_layernorm.weight``
  ``[h]``, ``decoder.layers.{n}.self_attention.linear_q_down_proj.weight`` ``[ql, h]``; the MTP layers as
  ``mtp.layers.{k}.`` (``enorm``, ``hnorm``, ``eh_proj``, ``transformer_layer.*``, ``final_layernorm``), ``k``
  from 0;
- a SequentialMLP's experts stacked on a leading dim, numbered globally:
  ``decoder.layers.{n}.mlp.experts.experts.linear_fc1.weight`` ``[experts, 2 fe, h]``; the shared experts, the
  router's weight and its ``expert_bias`` buffer as tensors of their own in each MoE layer;
- MLA's norms: in Transformer Engine's layers the up projections' fused ``layer_norm_weight``; megatron-core's
  local MLA layers map no key (no ``sharded_state_dict_keys_map``), so their ``q_layernorm``, ``kv_layernorm``,
  ``input_layernorm`` and a dense layer's ``pre_mlp_layernorm`` keep their module names;
- each linear module's ``_extra_state`` one bytes entry per layer, ``<module>._extra_state/shard_0_1``, and per
  expert, ``.../experts.experts.linear_fc1._extra_state/shard_{e}_{experts}``.

The layout itself is the family's Megatron layout with each tensor whole (``reshard.formats.specs``:
``mcore-dist-<family>[-local][-mtp]``, named by ``dist_moe.spec_name``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from reshard.core.layout import Layout
from reshard.formats.dcp.reading import _Verbatim

__all__ = ["layer_extra_states", "mtp_layers", "with_mtp"]

_LAYER_LINEAR = re.compile(r"((?:decoder|mtp)\.layers\.[0-9]+\.(?:.*\.)?(?:linear_[a-z0-9_]+|eh_proj))\.weight")
_MTP_LAYER = re.compile(r"mtp\.layers\.([0-9]+)\.")
_EXPERTS = ".experts.experts."


def mtp_layers(keys: Iterable[str]) -> int:
    """How many MTP layers the stored keys hold (``mtp.layers.{k}.``, ``k`` from 0)."""
    found = {int(m.group(1)) for k in keys if (m := _MTP_LAYER.match(k))}
    return max(found) + 1 if found else 0


def layer_extra_states(whole: Layout, sizes: Mapping[str, int], data: bytes) -> list[_Verbatim]:
    """The ``_extra_state`` bytes entries (each ``data``) of the linear modules keyed per layer in the global
    tensors ``whole``: one per module, one per expert of an expert linear."""
    experts = int(sizes.get("experts", 0))
    modules = dict.fromkeys(m.group(1) for it in whole.items if (m := _LAYER_LINEAR.fullmatch(it.key)))
    out = []
    for module in modules:
        shards = [f"{e}_{experts}" for e in range(experts)] if _EXPERTS in module else ["0_1"]
        out += [_Verbatim(f"{module}._extra_state/shard_{s}", None, data) for s in shards]
    return out


def with_mtp(sizes: Mapping[str, int], keys: Iterable[str]) -> dict[str, int]:
    """``sizes`` (read from a ``config.json``, which counts no MTP layer in ``hf_layers``) with ``hf_layers``
    counting the MTP layers the stored keys hold; as they are for a family without MTP layers."""
    out = dict(sizes)
    if "hf_layers" in out:
        out["hf_layers"] = int(out["layers"]) + mtp_layers(keys)
    return out
