"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-latent attention (MLA), the first ``first_k_dense_replace``
layers with a dense SwiGLU MLP and the rest with a sigmoid-scored, group-limited router (``mlp.gate``, whose
``e_score_correction_bias`` is a persistent fp32 buffer that biases the choice of experts only), ``experts``
routed SwiGLU experts and ``n_shared_experts`` shared ones fused into one MLP. The output projection is stored.

Sizes: ``h``, ``heads``, ``vocab``, ``layers``, ``hf_layers`` (with the MTP layers); MLA's ``ql`` (``q_lora_rank``), ``kvl`` (``kv_lora_rank``),
``nope`` (``qk_nope_head_dim``), ``rope`` (``qk_rope_head_dim``), ``vd`` (``v_head_dim``); ``f`` the dense
MLP's width (``intermediate_size``), ``fe`` each expert's (``moe_intermediate_size``), ``shared``
(``n_shared_experts``: the shared MLP is ``fe * shared`` wide), ``experts`` (``n_routed_experts``) and
``dense`` (``first_k_dense_replace``). The dense layers are ``index d in i < dense``, the MoE layers
``index m in i from dense``: two blocks of rules, so every pipeline stage keeps its layers in order.

Megatron-core (``--multi-latent-attention``, ``MLATransformerConfig``): ``linear_q_down_proj`` <- ``q_a_proj``,
``linear_q_up_proj`` <- ``q_b_proj`` (its ``layer_norm_weight`` <- ``q_a_layernorm`` in Transformer Engine's
layers), ``linear_kv_down_proj`` <- ``kv_a_proj_with_mqa``, ``linear_kv_up_proj`` <- ``kv_b_proj`` (with
``kv_a_layernorm``), ``linear_proj`` <- ``o_proj``; the row orders inside them are the same in both. The up
projections are split over tp by head, ``linear_proj`` by its input; the down projections are replicated
(``TELinear``, duplicated) or, with ``--transformer-impl local``, split on their output
(``ColumnParallelLinear``), the norms then modules of their own (``q_layernorm``, ``kv_layernorm``). The input
norm is ``input_layernorm`` in both. Dense layers store their MLP as Llama's; MoE layers a
``pre_mlp_layernorm``, ``mlp.router.weight`` and ``mlp.router.expert_bias`` (a buffer, in no optimizer),
SequentialMLP experts over ep as Mixtral's, and ``mlp.shared_experts.linear_fc1`` / ``linear_fc2``. In
megatron-core's torch_dist the layers, of two kinds, are keyed one by one by their global number
(``decoder.layers.{n}.``, not stacked): ``mcore-dist-deepseek_v3`` is derived from this layout as every family's is.

Without the queries' compression (``q_lora_rank`` null: ``self_attn.q_proj``, Megatron's ``linear_q_proj``,
split by head over tp) the model is the family ``deepseek_v3_noqlora``, the same in all else: a config of
``model_type`` deepseek_v3 is one or the other by its ``q_lora_rank``, Megatron's args by theirs.

Multi-token-prediction (MTP) layers follow the decoder's (``model.layers.{layers}.*``, the size ``hf_layers``
counting both; ``reshard.models.deepseek_layout``): carried under their own names, and in Megatron as
megatron-core's MTP block (``--mtp-num-layers``) on the last stage.

Refused, naming the field: quantized weights (``quantization_config``: FP8 blocks with ``*_scale_inv``),
``rope_interleave`` false, ``attention_bias``, routing megatron-core computes differently (``norm_topk_prob``
false with top-k > 1, a group score of other than the top 2), and yarn fields it does not carry.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models import deepseek_layout as layout
from reshard.models import llama, mixtral
from reshard.models.config import config_ints, require_sizes
from reshard.models.family import Family

__all__ = ["FAMILY", "config_from_sizes", "family", "sizes_from_config"]

SIZES = ("h", "heads", "ql", "kvl", "nope", "rope", "vd", "f", "fe", "shared", "experts", "dense", "vocab",
         "layers", "hf_layers")

CONFIG_KEYS = {"h": "hidden_size", "heads": "num_attention_heads", "ql": "q_lora_rank", "kvl": "kv_lora_rank",
               "nope": "qk_nope_head_dim", "rope": "qk_rope_head_dim", "vd": "v_head_dim",
               "f": "intermediate_size", "fe": "moe_intermediate_size", "shared": "n_shared_experts",
               "dense": "first_k_dense_replace", "vocab": "vocab_size", "layers": "num_hidden_layers"}
"""Size -> its ``DeepseekV3Config`` key (``experts``: ``n_routed_experts``, or ``num_local_experts``)."""

MTP_KEY = "num_nextn_predict_layers"
"""The config key counting the MTP layers (transformers' ``num_mtp_layers``)."""

BUFFERS = (*layout.BUFFER_ALIASES, *(layout.MTP_PREFIX + a for a in layout.BUFFER_ALIASES))

NOQLORA = "deepseek_v3_noqlora"
"""The family of DeepSeek-V3 models without the queries' compression (``q_lora_rank`` null)."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _refuse(where: Path | str, field: str, value: Any, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{f'{where}: ' if where else ''}{field} = {json.dumps(value)}: {why}")


def sizes_from_config(config: Mapping[str, Any], where: Path | str = "config.json", *,
                      q_lora: bool = True) -> dict[str, int]:
    """The sizes from a ``DeepseekV3Config`` dict (``q_lora``: of the family with the queries' compression).

    ``hf_layers`` is ``layers``: the MTP layers the config declares (``num_nextn_predict_layers``) are not in every
    checkpoint (transformers saves none), so a Hugging Face checkpoint counts the ones its files hold
    (``reshard.formats.hf``) and a Megatron one its ``mtp_num_layers``.

    Raises:
      CheckpointFormatError: a size missing or invalid, or a model this layout does not hold: quantized weights, a
        tied output projection, no dense or no MoE layer, no shared expert, ``q_lora_rank`` null (set, for the
        family without the compression).
    """
    mixtral.refuse_tied(config, where, "DeepSeek-V3")
    quantized = config.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, Mapping) else quantized
        raise _refuse(where, "quantization_config.quant_method", method,
                      "quantized weights (FP8 blocks with *_scale_inv scales); reshard lays out unquantized "
                      "weights only: dequantize them first")
    if q_lora != (config.get("q_lora_rank") is not None):
        raise _refuse(where, "q_lora_rank", config.get("q_lora_rank"), (
            "queries without compression (self_attn.q_proj) are the family " + NOQLORA) if q_lora else (
            "queries compressed (q_a_proj, q_a_layernorm, q_b_proj) are the family deepseek_v3"))
    mtp = config.get(MTP_KEY)
    if mtp is not None and (not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0):
        raise _refuse(where, MTP_KEY, mtp, "expected a number of layers (0 or more)")
    keys = {k: v for k, v in CONFIG_KEYS.items() if q_lora or k != "ql"}
    experts_key = "n_routed_experts" if config.get("n_routed_experts") is not None else "num_local_experts"
    sizes = config_ints(config, keys | {"experts": experts_key}, (), where)
    if sizes["dense"] >= sizes["layers"]:
        raise _refuse(where, "first_k_dense_replace", sizes["dense"], f"no mixture-of-experts layer among "
                      f"num_hidden_layers = {sizes['layers']}; reshard lays out dense layers, then MoE layers")
    return sizes | {"hf_layers": sizes["layers"]}


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = (), *, q_lora: bool = True) -> dict[str, Any]:
    """A ``DeepseekV3Config`` dict for the sizes, its MTP layers those after the decoder's (``hf_layers``); the
    routing (``num_experts_per_tok``, groups, scaling) comes from the source's config or Megatron's args."""
    require_sizes(sizes, SIZES if q_lora else _without_ql(SIZES), "a DeepSeek-V3 config.json")
    config = llama.config_from_sizes({"g": sizes["heads"], "hd": sizes["rope"], **sizes}, dtypes)
    for k in ("head_dim", "num_key_value_heads"):
        config.pop(k)
    config.update({key: int(sizes[var]) for var, key in CONFIG_KEYS.items() if var in sizes})
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=config.get(
        "q_lora_rank"), num_key_value_heads=sizes["heads"], n_routed_experts=sizes["experts"], rms_norm_eps=1e-6,
        norm_topk_prob=True, rope_interleave=True, attention_bias=False,
        **{MTP_KEY: int(sizes["hf_layers"]) - int(sizes["layers"])})
    return config


def _without_ql(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in names if n != "ql")


# --- Megatron args ------------------------------------------------------------------------------------

MLA_YARN = (("factor", "rotary_scaling_factor"), ("original_max_position_embeddings",
                                                  "original_max_position_embeddings"),
            ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"))
"""Hugging Face yarn fields <-> ``MLATransformerConfig``'s (which MLA reads, not GPTModel's ``yarn_*``)."""

MLA_UNSCALED = {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
"""MLA without yarn: ``MLATransformerConfig``'s defaults (factor 40, yarn) would change the model."""


def megatron_args(sizes: Mapping[str, int], tied: bool) -> dict[str, Any]:
    """Llama's args with MLA (``--multi-latent-attention``, the ranks and head dims, ``q_lora_rank`` None without
    the queries' compression; ``qk_layernorm`` is MLA's q/kv latent norms), the experts' layer pattern and widths,
    and the MTP layers (``mtp_num_layers``, None without)."""
    layers, dense = int(sizes["layers"]), int(sizes["dense"])
    mtp = int(sizes.get("hf_layers", layers)) - layers
    return llama.megatron_args({"g": sizes["heads"], "hd": sizes["h"] // sizes["heads"], **sizes}, tied) | {
        "multi_latent_attention": True, "qk_layernorm": True,
        "q_lora_rank": int(sizes["ql"]) if "ql" in sizes else None,
        "kv_lora_rank": int(sizes["kvl"]), "qk_head_dim": int(sizes["nope"]),
        "qk_pos_emb_head_dim": int(sizes["rope"]), "v_head_dim": int(sizes["vd"]), "norm_epsilon": 1e-6,
        "num_experts": int(sizes["experts"]), "moe_ffn_hidden_size": int(sizes["fe"]),
        "moe_shared_expert_intermediate_size": int(sizes["fe"]) * int(sizes["shared"]),
        "moe_layer_freq": [0] * dense + [1] * (layers - dense), "moe_grouped_gemm": False,
        "mtp_num_layers": mtp or None, **MLA_UNSCALED}


def sizes_from_args(args: Mapping[str, Any], arg: Callable[..., int]) -> dict[str, int]:
    """The sizes Megatron's args give beyond Llama's (``arg(name)`` reads one, refusing a bad value): MLA's,
    ``ql`` where the queries are compressed, the experts', ``hf_layers`` with the MTP layers."""
    fe, shared = arg("moe_ffn_hidden_size"), arg("moe_shared_expert_intermediate_size")
    freq = args.get("moe_layer_freq")
    layers = arg("num_layers")
    if not isinstance(freq, list | tuple) or len(freq) != layers or any(v not in (0, 1) for v in freq) \
            or list(freq) != sorted(freq) or 0 not in freq or 1 not in freq:
        raise CheckpointFormatError(f"args.moe_layer_freq = {json.dumps(freq)}: expected {layers} entries, dense "
                                    "layers (0) first and then mixture-of-experts layers (1)")
    if shared % fe:
        raise CheckpointFormatError(f"args.moe_shared_expert_intermediate_size = {shared} is not a multiple of "
                                    f"moe_ffn_hidden_size = {fe}: no whole number of shared experts")
    mtp = arg("mtp_num_layers") if args.get("mtp_num_layers") else 0
    ql = {"ql": arg("q_lora_rank")} if args.get("q_lora_rank") is not None else {}
    return ql | {"kvl": arg("kv_lora_rank"), "nope": arg("qk_head_dim"), "rope": arg("qk_pos_emb_head_dim"),
                 "vd": arg("v_head_dim"), "f": arg("ffn_hidden_size"), "fe": fe, "shared": shared // fe,
                 "dense": list(freq).count(0), "hf_layers": layers + mtp}


def is_megatron(args: Mapping[str, Any], *, q_lora: bool = True) -> bool:
    """Whether a Megatron run's args describe a DeepSeek-V3: MLA with SwiGLU experts, no biases; the queries
    compressed (``q_lora_rank`` set) or not (``q_lora``)."""
    return (bool(args.get("multi_latent_attention")) and bool(args.get("swiglu")) and bool(args.get("num_experts"))
            and not args.get("add_bias_linear") and not args.get("add_qkv_bias")
            and (args.get("q_lora_rank") is not None) == q_lora)


def _rope_args(config: Mapping[str, Any], where: Path | str) -> dict[str, Any]:
    """MLA's RoPE args: unscaled, or yarn with every field megatron-core's MLA reads."""
    field, rope = llama.rope_of(config)
    if rope.get("partial_rotary_factor", 1) != 1:
        raise _refuse(where, f"{field}.partial_rotary_factor", rope["partial_rotary_factor"],
                      "MLA rotates the whole qk_rope_head_dim")
    theta = rope.get("rope_theta")
    base = {"rotary_base": theta} if _number(theta) else {}
    if rope["rope_type"] == "default":
        return base | MLA_UNSCALED
    if rope["rope_type"] != "yarn":
        raise _refuse(where, f"{field}.rope_type", rope["rope_type"], "megatron-core's MLA has RoPE unscaled or "
                      "yarn only")
    extra = sorted(set(rope) - {"rope_type", "type", "rope_theta", "truncate", "mscale", "mscale_all_dim",
                                *(hf for hf, _ in MLA_YARN)})
    if extra:
        raise _refuse(where, f"{field}.{extra[0]}", rope[extra[0]], "megatron-core's MLA yarn has a factor, an "
                      "original length, betas, mscale and mscale_all_dim only")
    bad = [hf for hf, _ in MLA_YARN if not _number(rope.get(hf))]
    if bad:
        raise _refuse(where, f"{field}.{bad[0]}", rope.get(bad[0]), "MLA's yarn needs a number")
    if rope.get("truncate", True) is not True:
        raise _refuse(where, f"{field}.truncate", rope.get("truncate"), "megatron-core's MLA rounds yarn's "
                      "correction range to integers (truncate true) only")
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if all_dim and not mscale:
        raise _refuse(where, f"{field}.mscale", mscale, "with mscale_all_dim set, transformers scales the "
                      "rotary embedding by yarn's default factor but megatron-core's MLA by mscale / "
                      "mscale_all_dim")
    # transformers uses mscale and mscale_all_dim together or not at all (then yarn's default factor: mscale 1)
    scale = {"mscale": float(mscale), "mscale_all_dim": float(all_dim)} if mscale and all_dim else \
        {"mscale": 1.0, "mscale_all_dim": 0.0}
    return base | {"rope_type": "yarn", **{meg: rope[hf] for hf, meg in MLA_YARN}} | scale


def _field(config: Mapping[str, Any], key: str, default: Any) -> Any:
    value = config.get(key)
    return default if value is None else value


def args_from_config(config: Any) -> dict[str, Any]:
    """Megatron args for a DeepSeek-V3 ``config.json``: epsilon, positions, MLA's RoPE.

    Raises:
      CheckpointFormatError: what MLA in megatron-core computes differently, named with the field and value.
    """
    if not isinstance(config, Mapping):
        return {}
    where = ""  # the caller names the file
    if _field(config, "rope_interleave", True) is not True:
        raise _refuse(where, "rope_interleave", config["rope_interleave"], "megatron-core's MLA rotates the "
                      "rope dims interleaved (de-interleaving them first), as rope_interleave true does")
    if config.get("attention_bias"):
        raise _refuse(where, "attention_bias", config["attention_bias"], "megatron-core's MLA projections have "
                      "no biases")
    act = _field(config, "hidden_act", "silu")
    if act != "silu":
        raise _refuse(where, "hidden_act", act, "the layout's Megatron MLPs are SwiGLU (silu)")
    out = {meg: config.get(hf) for hf, meg in llama.HF_MEGATRON if hf != "rope_theta"}
    out = {k: v for k, v in out.items() if _number(v)}
    return out | _rope_args(config, where)


def megatron_moe_args(sizes: Mapping[str, int], config: Mapping[str, Any], hints: Mapping[str, Any],
                      where: Path | str) -> dict[str, Any]:
    """Megatron's routing args: sigmoid scores, the correction bias for the choice, group-limited top k, the
    scaling factor; megatron-core renormalises the top k (``norm_topk_prob``) whenever k > 1.

    Raises:
      CheckpointFormatError: routing megatron-core computes differently, named with the field and value.
    """
    def get(key: str, default: Any = None) -> Any:
        value = config.get(key, hints.get(key))
        return default if value is None else value

    topk = get("num_experts_per_tok")
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise _refuse(where, "num_experts_per_tok", topk, "Megatron's args need moe_router_topk, a positive "
                      "integer")
    norm = get("norm_topk_prob", True)
    if norm is not True and topk > 1:
        raise _refuse(where, "norm_topk_prob", norm, "megatron-core's sigmoid router renormalises the top k "
                      "scores whenever k > 1")
    groups, group_topk = get("n_group", 1), get("topk_group", 1)
    for key, value in (("n_group", groups), ("topk_group", group_topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(where, key, value, "expected a positive integer")
    if groups > 1 and topk // group_topk != 2:
        raise _refuse(where, "topk_group", group_topk, f"transformers scores a group by its top 2 experts, "
                      f"megatron-core by its top num_experts_per_tok // topk_group = {topk // group_topk}")
    scaling = get("routed_scaling_factor", 1.0)
    if not _number(scaling):
        raise _refuse(where, "routed_scaling_factor", scaling, "expected a number")
    return {"moe_router_topk": topk, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_pre_softmax": True, "moe_router_dtype": "fp32",
            "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": group_topk if groups > 1 else None,
            "moe_router_topk_scaling_factor": float(scaling), "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0}


def config_hints(args: Mapping[str, Any]) -> dict[str, Any]:
    """What a DeepSeek-V3 ``config.json`` takes from a Megatron run's args: epsilon, positions, MLA's RoPE, the
    routing."""
    hints = llama.config_hints(args)
    theta = hints.pop("rope_theta", None)
    hints.pop("rope_scaling", None)
    if args.get("rope_type", "yarn") == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta, **{hf: args.get(meg) for hf, meg in MLA_YARN},
                "mscale": args.get("mscale", 1.0), "mscale_all_dim": args.get("mscale_all_dim", 0.0)}
    else:
        rope = {"rope_type": "default", "rope_theta": theta}
    groups = args.get("moe_router_num_groups") or 1
    return hints | {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "rope_parameters": rope,
        "num_experts_per_tok": args.get("moe_router_topk"), "n_group": groups,
        "topk_group": (args.get("moe_router_group_topk") or 1) if groups > 1 else 1,
        "routed_scaling_factor": args.get("moe_router_topk_scaling_factor") or 1.0, "norm_topk_prob": True}


def family(*, q_lora: bool) -> Family:
    """The DeepSeek-V3 family with the queries' compression (``deepseek_v3``) or without (``deepseek_v3_noqlora``)."""
    tensors = layout.layer_tensors(q_lora) + layout.mtp_tensors(q_lora)
    return Family(
        name="deepseek_v3" if q_lora else NOQLORA,
        model_types=("deepseek_v3",),
        accepts=lambda config: (config.get("q_lora_rank") is not None) == q_lora,
        architectures=("DeepseekV3ForCausalLM",),
        preamble=layout.preamble(),
        tensors=tensors,
        registration=layout.registration(q_lora),
        module=layout.module_tensors(q_lora),
        buffers=BUFFERS,
        sizes=SIZES if q_lora else _without_ql(SIZES),
        can_tie=False,
        megatron=partial(layout.megatron, q_lora=q_lora),
        experts=True,
        torch_dist=True,
        sizes_from_config=partial(sizes_from_config, q_lora=q_lora),
        config_from_sizes=partial(config_from_sizes, q_lora=q_lora),
        megatron_args=megatron_args,
        sizes_from_args=sizes_from_args,
        is_megatron=partial(is_megatron, q_lora=q_lora),
        config_hints=config_hints,
        args_from_config=args_from_config,
        megatron_moe_args=megatron_moe_args,
    )


FAMILY = family(q_lora=True)
