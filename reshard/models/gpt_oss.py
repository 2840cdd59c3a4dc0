"""GPT-OSS (``GptOssForCausalLM``): grouped-query attention with q/k/v/o biases and a learned sink logit per
head (``self_attn.sinks``), a sliding window on every other layer from the first, yarn RoPE, and in every layer
a router with a bias and ``experts`` clamped SwiGLU experts with biases. The output projection is stored.

Hugging Face stores the experts fused, input-major: ``mlp.experts.gate_up_proj`` [experts, h, 2f] with gate
and up interleaved on the last dim (g0, u0, g1, u1, ...), its bias [experts, 2f] alike, ``down_proj``
[experts, f, h] and its bias [experts, h]. The logical tensors are per expert in ``[out, in]`` orientation
under Qwen3-MoE's names; the orientation is the format's, never read from a shape (``down_proj`` is square in
the released models).

Megatron-core stores it as Mixtral (``reshard.models.mixtral``) with ``--add-bias-linear --add-qkv-bias``
(router and expert biases, ``linear_proj.bias``), ``--softmax-type learnable`` (the sinks are
``core_attention.softmax_offset``, split over tp by head), ``--quick-geglu`` with ``glu_linear_offset`` 1 and
``activation_func_clamp_value`` = ``swiglu_limit``, ``window_size`` (W - 1, 0) with ``window_attn_skip_freq``
2, and yarn (``position_embedding_type`` yarn and the ``yarn_*`` fields GPTModel reads). Those args are how a
Megatron checkpoint names a GPT-OSS.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models import llama, mixtral
from reshard.models.config import config_ints
from reshard.models.family import Family, Tensor

__all__ = ["FAMILY", "config_from_sizes", "sizes_from_config"]

_BASE = {t.alias: replace(t, tp=None) for t in (*llama.TENSORS, *llama.QKV_BIASES)}  # GPT-OSS's tp plan: none


def _bias(alias: str, name: str, dims: str) -> Tensor:
    return Tensor(name=name, alias=alias, dims=dims, decay=False)


_EXPERT = "model.layers.{i}.mlp.experts."
_GATE = Tensor(name=_EXPERT + "{e}.gate_proj.weight", alias="gate", dims="f h")
_UP = Tensor(name=_EXPERT + "{e}.up_proj.weight", alias="up", dims="f h")
_DOWN = Tensor(name=_EXPERT + "{e}.down_proj.weight", alias="down", dims="h f")

TENSORS = (
    _BASE["embed"], _BASE["ln1"],
    _bias("sinks", "model.layers.{i}.self_attn.sinks", "(g qpg)"),
    *(_BASE[a] for a in ("q", "q_bias", "k", "k_bias", "v", "v_bias", "o")),
    _bias("o_bias", "model.layers.{i}.self_attn.o_proj.bias", "h"),
    _BASE["ln2"],
    Tensor(name="model.layers.{i}.mlp.router.weight", alias="router", dims="experts h"),
    _bias("router_bias", "model.layers.{i}.mlp.router.bias", "experts"),
    Tensor(name=_EXPERT + "gate_up_proj", alias="gate_up", dims="{e} h (f [gate: () | up: ()])", parts=(_GATE, _UP)),
    Tensor(name=_EXPERT + "gate_up_proj_bias", alias="gate_up_bias", dims="{e} (f [gate_bias: () | up_bias: ()])",
           decay=False, parts=(_bias("gate_bias", _EXPERT + "{e}.gate_proj.bias", "f"),
                               _bias("up_bias", _EXPERT + "{e}.up_proj.bias", "f"))),
    Tensor(name=_EXPERT + "down_proj", alias="down_t", dims="{e} f [down: h]", parts=(_DOWN,)),
    Tensor(name=_EXPERT + "down_proj_bias", alias="down_bias_t", dims="{e} [down_bias: h]", decay=False,
           parts=(_bias("down_bias", _EXPERT + "{e}.down_proj.bias", "h"),)),
    _BASE["norm"],
    replace(_BASE["head"], untied_only=False),  # never tied
)

# GptOssDecoderLayer registers self_attn (sinks, q, k, v, o with their biases), mlp (router, experts), then its
# norms.
REGISTRATION = ("embed", "sinks", "q", "q_bias", "k", "k_bias", "v", "v_bias", "o", "o_bias", "router",
                "router_bias", "gate_up", "gate_up_bias", "down_t", "down_bias_t", "ln1", "ln2", "norm", "head")

DEFAULTS: dict[str, Any] = {
    "sliding_window": 128, "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "attention_bias": True,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
}
"""What ``GptOssConfig`` assumes where a config.json leaves a field out (its ``layer_types`` default alternates,
sliding first)."""

QUICK_GELU_ALPHA = 1.702
"""The sigmoid's slope in megatron-core's ``quick_gelu``: the only ``swiglu_alpha`` its args can express."""

YARN = (("factor", "yarn_rotary_scaling_factor"), ("original_max_position_embeddings",
                                                   "yarn_original_max_position_embeddings"),
        ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"))
"""Hugging Face yarn fields <-> the ``yarn_*`` fields GPTModel reads; ``truncate`` is
``yarn_correction_range_round_to_int``, and megatron-core's ``yarn_mscale`` 1 / ``yarn_mscale_all_dim`` 0 give
Hugging Face's default attention factor (0.1 ln(factor) + 1)."""

MEGATRON_YARN_MSCALE = {"yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0}


def _field(config: Mapping[str, Any], key: str) -> Any:
    """A config field, or GptOssConfig's default where the config leaves it out."""
    return config.get(key, DEFAULTS.get(key))


def _layer_types(config: Mapping[str, Any], layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return types


def sizes_from_config(config: Mapping[str, Any], where: Path | str = "config.json") -> dict[str, int]:
    """Llama's sizes (``f`` the experts' width, ``intermediate_size``) plus ``experts`` (``num_local_experts``).

    Raises:
      CheckpointFormatError: a size is missing or invalid, the output projection tied, quantized experts, or no
        biases (``attention_bias`` false: their tensors would be absent).
    """
    mixtral.refuse_tied(config, where, "GPT-OSS")
    quantized = config.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method") if isinstance(quantized, Mapping) else quantized
        raise CheckpointFormatError(f"{where}: quantization_config.quant_method = {json.dumps(method)}: quantized "
                                    "experts (MXFP4 blocks and scales); reshard lays out unquantized weights only")
    if _field(config, "attention_bias") is not True:
        raise CheckpointFormatError(f"{where}: attention_bias = {json.dumps(config.get('attention_bias'))}: the "
                                    "GPT-OSS layout has q/k/v/o biases")
    return llama.sizes_from_config(config, where) | config_ints(config, {"experts": "num_local_experts"}, (), where)


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Llama's config as a ``GptOssConfig`` with its defaults written out (window, alternating layers, yarn,
    clamp). The routing (``num_experts_per_tok``) comes from the source's config or Megatron's args."""
    config = llama.config_from_sizes(sizes, dtypes)
    config.update(architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_local_experts=sizes["experts"],
                  layer_types=_layer_types({}, int(sizes["layers"])), **json.loads(json.dumps(DEFAULTS)))
    return config


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rope_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron's yarn args for the config's RoPE (GptOssConfig's yarn where it has none); unscaled RoPE as
    Llama's. Refuses other types and yarn fields megatron-core's args do not carry."""
    given = config.get("rope_parameters") is not None or config.get("rope_scaling") is not None
    field, rope = llama.rope_of(config if given else {"rope_parameters": DEFAULTS["rope_parameters"]})
    if rope["rope_type"] != "yarn":
        return llama.rope_args(config) | {"position_embedding_type": "rope"}
    extra = sorted(set(rope) - {"rope_type", "type", "rope_theta", "truncate", *(hf for hf, _ in YARN)})
    if extra:
        raise CheckpointFormatError(f"{field}: yarn with {', '.join(f'{k} = {json.dumps(rope[k])}' for k in extra)}; "
                                    "reshard writes megatron-core's yarn factor, original length and betas only")
    bad = [hf for hf, _ in YARN if not _number(rope.get(hf))]
    if bad or not isinstance(rope.get("truncate", True), bool) or not _number(rope.get("rope_theta")):
        what = ", ".join(f"{k} = {json.dumps(rope.get(k))}" for k in (*bad, "truncate", "rope_theta"))
        raise CheckpointFormatError(f"{field}: yarn needs numbers for its factor, original length, betas and "
                                    f"rope_theta, and truncate true or false ({what})")
    return {"position_embedding_type": "yarn", "rotary_base": rope["rope_theta"],
            **{meg: rope[hf] for hf, meg in YARN}, **MEGATRON_YARN_MSCALE,
            "yarn_correction_range_round_to_int": rope.get("truncate", True)}


def _window_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """``window_size`` (W - 1, 0) with ``window_attn_skip_freq`` 2 for alternating layers (sliding first), the
    window on every layer, or none; other patterns refused."""
    layers = config.get("num_hidden_layers")
    types = _layer_types(config, layers if isinstance(layers, int) else 0)
    window = _field(config, "sliding_window")
    if not isinstance(types, list) or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise CheckpointFormatError(f"layer_types = {json.dumps(types)}: expected sliding_attention and "
                                    "full_attention entries")
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return {"window_size": None}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointFormatError(f"sliding_window = {json.dumps(window)}: expected a positive integer")
    if all(sliding):
        return {"window_size": (window - 1, 0)}
    if sliding != [i % 2 == 0 for i in range(len(types))]:
        raise CheckpointFormatError(f"layer_types = {json.dumps(types)}: megatron-core alternates a window "
                                    "from the first layer (window_attn_skip_freq 2) or puts it on every layer")
    return {"window_size": (window - 1, 0), "window_attn_skip_freq": 2}


def args_from_config(config: Any) -> dict[str, Any]:
    """Megatron args for a GPT-OSS ``config.json``: Llama's (epsilon, positions), yarn, the window pattern and
    the experts' clamp.

    Raises:
      CheckpointFormatError: RoPE, a window pattern or an activation megatron-core cannot express, named with
        the field and its value.
    """
    if not isinstance(config, Mapping):
        return {}
    alpha, limit = _field(config, "swiglu_alpha"), _field(config, "swiglu_limit")
    if alpha != QUICK_GELU_ALPHA:
        raise CheckpointFormatError(f"swiglu_alpha = {json.dumps(alpha)}: megatron-core's quick_gelu has slope "
                                    f"{QUICK_GELU_ALPHA} only")
    if not _number(limit) or limit <= 0:
        raise CheckpointFormatError(f"swiglu_limit = {json.dumps(limit)}: expected a positive number")
    base = {meg: config.get(hf) for hf, meg in llama.HF_MEGATRON if hf != "rope_theta"}
    base = {k: v for k, v in base.items() if _number(v)}
    return base | _rope_args(config) | _window_args(config) | {"activation_func_clamp_value": float(limit)}


def megatron_args(sizes: Mapping[str, int], tied: bool) -> dict[str, Any]:
    """Llama's args with GPT-OSS's attention (biases, sinks) and experts' activation (``--quick-geglu``, linear
    half offset by 1)."""
    return llama.megatron_args(sizes, tied) | {
        "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0, "add_bias_linear": True,
        "add_qkv_bias": True, "softmax_type": "learnable"}


def is_megatron(args: Mapping[str, Any]) -> bool:
    """Whether a Megatron run's args describe a GPT-OSS: quick-GeGLU experts with biases and learned sinks."""
    return (bool(args.get("quick_geglu")) and bool(args.get("num_experts")) and bool(args.get("add_bias_linear"))
            and bool(args.get("add_qkv_bias")) and args.get("softmax_type") == "learnable"
            and args.get("glu_linear_offset") == 1.0 and not args.get("qk_layernorm")
            and not args.get("moe_router_pre_softmax"))


def config_hints(args: Mapping[str, Any]) -> dict[str, Any]:
    """What a GPT-OSS ``config.json`` takes from a Megatron run's args: Llama's, RoPE (yarn), the window pattern,
    the clamp, the experts and the routing."""
    hints = llama.config_hints(args)
    theta = hints.pop("rope_theta", None)
    if args.get("position_embedding_type") == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta, **{hf: args.get(meg) for hf, meg in YARN},
                "truncate": bool(args.get("yarn_correction_range_round_to_int"))}
    else:
        rope = {"rope_type": "default", "rope_theta": theta}
    layers = int(args.get("num_layers") or 0)
    window = llama.megatron_window(args)
    skip = args.get("window_attn_skip_freq")
    types = ["full_attention" if window is None or (skip == 2 and i % 2) else "sliding_attention"
             for i in range(layers)]
    hints.update(model_type="gpt_oss", architectures=["GptOssForCausalLM"], rope_parameters=rope,
                 sliding_window=window, layer_types=types, num_local_experts=int(args["num_experts"]),
                 num_experts_per_tok=args.get("moe_router_topk"))
    if _number(args.get("activation_func_clamp_value")):
        hints["swiglu_limit"] = args["activation_func_clamp_value"]
    return hints


FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    architectures=("GptOssForCausalLM",),
    preamble=mixtral.PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    sizes=mixtral.SIZES,
    can_tie=False,
    megatron=partial(mixtral.megatron, biases=True, qkv_bias=True, sinks=True, o_bias=True),
    experts=True,
    torch_dist=True,
    sizes_from_config=sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=megatron_args,
    is_megatron=is_megatron,
    config_hints=config_hints,
    args_from_config=args_from_config,
    megatron_moe_args=mixtral.megatron_moe_args,
)
