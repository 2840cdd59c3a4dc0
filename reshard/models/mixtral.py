"""Mixtral (``MixtralForCausalLM``): Llama attention, and in every layer a router and ``experts`` SwiGLU
experts (``w1`` gate, ``w3`` up, ``w2`` down) in place of the MLP. The output projection is never tied.

Sizes: those of Llama plus ``experts`` (``num_local_experts``); ``f`` is each expert's ffn size.

Megatron-core (``--num-experts E``, SequentialMLP experts, no ``--moe-grouped-gemm``): attention as
Llama's; an MoE layer's norm is its own ``pre_mlp_layernorm``, then the router (``[experts, h]``,
replicated over tp) and the rank's local experts, each a SwiGLU MLP split over tp like a dense one.
Experts are split over ep: rank e holds experts ``e*E/ep .. (e+1)*E/ep - 1`` as ``local_experts.0 ..
E/ep - 1``; everything else is replicated over ep. With ``--transformer-impl local`` the input norm is
a module of its own (``input_layernorm``) instead of Transformer Engine's fused ``layer_norm_weight``.
Grouped-GEMM experts (``--moe-grouped-gemm``) are the same tensors stored as ``reshard.models.moe_experts`` says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models import llama, moe_experts
from reshard.models.config import config_ints
from reshard.models.family import COLWISE, ROWWISE, Family, Tensor

__all__ = ["FAMILY", "config_from_sizes", "sizes_from_config"]

SIZES = (*llama.SIZES, "experts")

_LLAMA = {t.alias: t for t in llama.TENSORS}

TENSORS = (
    *(_LLAMA[a] for a in ("embed", "ln1", "q", "k", "v", "o", "ln2")),  # Llama's attention
    Tensor(name="model.layers.{i}.block_sparse_moe.gate.weight", alias="router", dims="experts h"),
    Tensor(name="model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight", alias="gate", dims="f h", tp=COLWISE),
    Tensor(name="model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight", alias="up", dims="f h", tp=COLWISE),
    Tensor(name="model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight", alias="down", dims="h f", tp=ROWWISE),
    _LLAMA["norm"],
    replace(_LLAMA["head"], untied_only=False),  # never tied
)

_BY = {t.alias: t for t in TENSORS}

MODULE = (
    *(_BY[a] for a in ("embed", "q", "k", "v", "o")),
    replace(_BY["router"], name="model.layers.{i}.mlp.gate.weight"),
    *moe_experts.module_tensors("model.layers.{i}.mlp.experts.", "f", _BY["gate"], _BY["up"], _BY["down"]),
    *(_BY[a] for a in ("ln1", "ln2", "norm", "head")),
)
"""transformers 5's ``MixtralForCausalLM``: the router and the fused experts under ``mlp`` (the files'
``block_sparse_moe``)."""

# MixtralDecoderLayer registers self_attn, block_sparse_moe (gate, then experts.N: w1, w2, w3), then its norms.
REGISTRATION = ("embed", "q", "k", "v", "o", "router", "gate", "down", "up", "ln1", "ln2", "norm", "head")

PREAMBLE = """\
let qpg = heads / g
index i < layers
index e < experts
"""


def megatron(*, tied: bool = False, local: bool = False, biases: bool = False, experts: str = "sequential",
             **attention: bool) -> str | None:
    """Megatron-core GPT with Mixtral-style MoE layers (untied output layer); ``attention`` as
    ``llama.attention_rules`` takes it (q/k norms for Qwen3-MoE); ``biases``: the router's and every expert
    linear's (``--add-bias-linear``: GPT-OSS), fc2's replicated over tp; ``experts``: how megatron-core stores
    them (``reshard.models.moe_experts``), None where it cannot."""
    at = "decoder.layers.{i/pp}.mlp."
    rules = moe_experts.expert_rules(at, "f", ("gate", "up", "down"), impl=experts,
                                     biases=("gate_bias", "up_bias", "down_bias") if biases else None)
    if tied or rules is None or (local and experts == "tegrouped"):
        return None
    return "\n".join([
        f"embedding.word_embeddings.weight -> embed @first = {llama.VOCAB}",
        *llama.attention_rules(local=local, **attention),
        "decoder.layers.{i/pp}.pre_mlp_layernorm.weight -> ln2 = h",
        f"{at}router.weight -> router = experts h",
        *([f"{at}router.bias -> router_bias = experts"] if biases else []),
        *rules,
        "decoder.final_layernorm.weight -> norm @last = h",
        f"output_layer.weight -> head @last = {llama.VOCAB}",
    ]) + "\n"


def refuse_tied(config: Mapping[str, Any], where: Path | str, family: str) -> None:
    """Refuse ``tie_word_embeddings`` for an MoE family whose layout stores its output projection."""
    if config.get("tie_word_embeddings"):
        raise CheckpointFormatError(f"{where}: tie_word_embeddings = true: the {family} layout stores its output "
                                    "projection (lm_head) of its own")


def sizes_from_config(config: Mapping[str, Any], where: Path | str = "config.json") -> dict[str, int]:
    """Llama's sizes plus ``experts`` (``num_local_experts``) from a ``MixtralConfig`` dict."""
    return llama.sizes_from_config(config, where) | config_ints(config, {"experts": "num_local_experts"}, (), where)


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Llama's config with the experts. The routing (``num_experts_per_tok``) is not in the weights: it comes
    from the source's config or Megatron's args, never from the sizes."""
    config = llama.config_from_sizes(sizes, dtypes)
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=sizes["experts"])
    return config


def is_moe(args: Mapping[str, Any]) -> bool:
    """SwiGLU experts (``--num-experts``), no biases but q/k/v's, no window, attention with q/k/v
    (``--multi-latent-attention`` is DeepSeek-V3's): the common args of the MoE families built on Llama."""
    return (bool(args.get("swiglu", False)) and bool(args.get("num_experts")) and not args.get("add_bias_linear")
            and args.get("window_size") is None and not args.get("window_attn_skip_freq")
            and not args.get("multi_latent_attention"))


def is_megatron(args: Mapping[str, Any]) -> bool:
    """Whether a Megatron run's args describe a Mixtral: SwiGLU experts without q/k norms (Qwen3-MoE's) or q/k/v
    biases, routed as Mixtral routes (softmax over the top k: ``--moe-router-pre-softmax`` is another model)."""
    return (is_moe(args) and not args.get("qk_layernorm") and not args.get("add_qkv_bias")
            and not args.get("moe_router_pre_softmax"))


def config_hints(args: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's, plus the experts and the routing (``--moe-router-topk``)."""
    return {**llama.config_hints(args), "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
            "num_local_experts": int(args["num_experts"]), "num_experts_per_tok": args.get("moe_router_topk")}


def megatron_moe_args(sizes: Mapping[str, int], config: Mapping[str, Any], hints: Mapping[str, Any],
                      where: Path | str) -> dict[str, Any]:
    """Megatron's MoE args: experts, their ffn size, and top-k routing from the config (or Megatron's hints)."""
    topk = config.get("num_experts_per_tok", hints.get("num_experts_per_tok"))
    if not isinstance(topk, int):
        raise CheckpointFormatError(f"{where}: a mixture-of-experts model without num_experts_per_tok in its "
                                    "config.json; Megatron's args need moe_router_topk")
    return {"num_experts": int(sizes["experts"]), "moe_router_topk": topk, "moe_ffn_hidden_size": int(sizes["f"]),
            "ffn_hidden_size": int(sizes["f"]), "moe_grouped_gemm": False,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0) or 0.0)}


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    architectures=("MixtralForCausalLM",),
    preamble=PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    module=MODULE,
    hf_order=("embed", "q", "k", "v", "o", "router", "gate", "down", "up", "ln1", "ln2", "norm", "head"),
    sizes=SIZES,
    can_tie=False,
    megatron=megatron,
    experts=True,
    torch_dist=True,
    sizes_from_config=sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=llama.megatron_args,
    is_megatron=is_megatron,
    config_hints=config_hints,
    args_from_config=llama.args_from_config,
    megatron_moe_args=megatron_moe_args,
)
