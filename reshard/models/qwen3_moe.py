"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (an RMSNorm of width ``head_dim`` on every q and k
head, no biases, explicit ``head_dim``) and in every layer a router (``mlp.gate``) and ``experts`` SwiGLU
experts (``mlp.experts.{e}.gate_proj``, ``up_proj``, ``down_proj``, each of width ``moe_intermediate_size``)
in place of the MLP. The output projection is stored (a tied one is refused).

Sizes: those of Llama plus ``experts`` (``num_experts`` in hub configs, ``num_local_experts`` in those
transformers 5 writes); ``f`` is each expert's width (``moe_intermediate_size``).

Routing: softmax over all experts, the top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``.
Megatron-core's ``--moe-router-pre-softmax`` is the unrenormalised form, so it is ``not norm_topk_prob``.

Megatron-core stores it as Mixtral (``reshard.models.mixtral``: SequentialMLP experts split over ep, the
router replicated) with ``--qk-layernorm``; experts with q/k norms are how a Megatron checkpoint names a
Qwen3-MoE. Dense layers among the MoE ones (``mlp_only_layers``, ``decoder_sparse_step`` > 1) are refused:
the layout has experts in every layer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models import llama, mixtral, moe_experts, qwen2, qwen3
from reshard.models.family import COLWISE, ROWWISE, Family, Tensor

__all__ = ["FAMILY", "config_from_sizes", "sizes_from_config"]

_QWEN3 = {t.alias: t for t in qwen3.TENSORS}

TENSORS = (
    *(_QWEN3[a] for a in ("embed", "ln1", "q", "k", "v", "o", "q_norm", "k_norm", "ln2")),  # Qwen3's attention
    Tensor(name="model.layers.{i}.mlp.gate.weight", alias="router", dims="experts h"),
    Tensor(name="model.layers.{i}.mlp.experts.{e}.gate_proj.weight", alias="gate", dims="f h", tp=COLWISE),
    Tensor(name="model.layers.{i}.mlp.experts.{e}.up_proj.weight", alias="up", dims="f h", tp=COLWISE),
    Tensor(name="model.layers.{i}.mlp.experts.{e}.down_proj.weight", alias="down", dims="h f", tp=ROWWISE),
    _QWEN3["norm"],
    {t.alias: t for t in mixtral.TENSORS}["head"],  # the output projection, never tied
)

_BY = {t.alias: t for t in TENSORS}

MODULE = (
    *(_BY[a] for a in ("embed", "q", "k", "v", "o", "q_norm", "k_norm")),
    *moe_experts.module_tensors("model.layers.{i}.mlp.experts.", "f", _BY["gate"], _BY["up"], _BY["down"]),
    *(_BY[a] for a in ("router", "ln1", "ln2", "norm", "head")),
)
"""transformers 5's ``Qwen3MoeForCausalLM``: the fused experts, registered before the router."""

# Qwen3MoeDecoderLayer registers self_attn (q, k, v, o, q_norm, k_norm), mlp (gate, then experts.N: gate_proj,
# up_proj, down_proj, in transformers 4's per-expert modules), then its norms.
REGISTRATION = ("embed", "q", "k", "v", "o", "q_norm", "k_norm", "router", "gate", "up", "down", "ln1", "ln2",
                "norm", "head")

EXPERT_KEYS = ("num_experts", "num_local_experts")
"""The expert count's spellings: hub configs (transformers 4) and those transformers 5 writes."""


def _experts(config: Mapping[str, Any], where: Path | str) -> int:
    """The expert count in either spelling; both given must agree."""
    given = {k: config[k] for k in EXPERT_KEYS if config.get(k) is not None}
    if not given:
        raise CheckpointFormatError(f"{where}: 'num_experts' (or 'num_local_experts') is missing")
    bad = [f"{k} = {json.dumps(v)}" for k, v in given.items()
           if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad or len(set(given.values())) > 1:
        why = "must be a positive integer" if bad else "disagree"
        raise CheckpointFormatError(f"{where}: {', '.join(bad or (f'{k} = {v}' for k, v in given.items()))}: {why}")
    return next(iter(given.values()))


def _every_layer_moe(config: Mapping[str, Any], where: Path | str) -> None:
    """Refuse dense layers among the MoE ones: the family's layout (and Megatron's one layer spec) has experts
    in every layer."""
    dense = config.get("mlp_only_layers")
    if dense not in (None, []):
        raise CheckpointFormatError(f"{where}: mlp_only_layers = {json.dumps(dense)}: dense MLP layers among the "
                                    "mixture-of-experts ones; reshard lays out experts in every layer")
    step = config.get("decoder_sparse_step", 1)
    if step not in (None, 1):
        raise CheckpointFormatError(f"{where}: decoder_sparse_step = {json.dumps(step)}: dense MLP layers between "
                                    "the mixture-of-experts ones; reshard lays out experts in every layer")
    mixtral.refuse_tied(config, where, "Qwen3-MoE")


def sizes_from_config(config: Mapping[str, Any], where: Path | str = "config.json") -> dict[str, int]:
    """Llama's sizes with ``f`` the experts' width (``moe_intermediate_size``), plus ``experts``.

    Raises:
      CheckpointFormatError: a size is missing or invalid; dense layers or a tied output projection (named
        with the field and its value).
    """
    _every_layer_moe(config, where)
    sizes = llama.sizes_from_config(config, where, f_key="moe_intermediate_size")
    return sizes | {"experts": _experts(config, where)}


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Qwen3's config as a ``Qwen3MoeConfig``: experts in every layer, counted as ``num_experts`` (the spelling
    transformers 4 reads, and 5 too). The routing (``num_experts_per_tok``, ``norm_topk_prob``) is not in the
    weights: it comes from the source's config or Megatron's args, never from the sizes."""
    config = qwen3.config_from_sizes(sizes, dtypes)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=sizes["experts"],
                  moe_intermediate_size=sizes["f"], decoder_sparse_step=1, mlp_only_layers=[])
    return config


def is_megatron(args: Mapping[str, Any]) -> bool:
    """Whether a Megatron run's args describe a Qwen3-MoE: SwiGLU experts with q/k norms, no biases."""
    return mixtral.is_moe(args) and bool(args.get("qk_layernorm")) and not args.get("add_qkv_bias")


def config_hints(args: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's, plus the experts and the routing (``--moe-router-topk``; ``norm_topk_prob`` is the opposite of
    ``--moe-router-pre-softmax``)."""
    return {**llama.config_hints(args), "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": int(args["num_experts"]), "num_experts_per_tok": args.get("moe_router_topk"),
            "norm_topk_prob": not args.get("moe_router_pre_softmax", False)}


def megatron_moe_args(sizes: Mapping[str, int], config: Mapping[str, Any], hints: Mapping[str, Any],
                      where: Path | str) -> dict[str, Any]:
    """Mixtral's MoE args, with ``--moe-router-pre-softmax`` unless the config renormalises the top k
    (``norm_topk_prob``, false when absent as in ``Qwen3MoeConfig``)."""
    norm = config.get("norm_topk_prob", hints.get("norm_topk_prob", False))
    if not isinstance(norm, bool):
        raise CheckpointFormatError(f"{where}: norm_topk_prob = {json.dumps(norm)}: expected true or false")
    return mixtral.megatron_moe_args(sizes, config, hints, where) | {"moe_router_pre_softmax": not norm}


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM",),
    preamble=mixtral.PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    module=MODULE,
    sizes=mixtral.SIZES,
    can_tie=False,
    megatron=partial(mixtral.megatron, qk_norm=True),
    experts=True,
    torch_dist=True,
    sizes_from_config=sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=qwen3.megatron_args,
    is_megatron=is_megatron,
    config_hints=config_hints,
    args_from_config=qwen2.args_from_config,
    megatron_moe_args=megatron_moe_args,
)
