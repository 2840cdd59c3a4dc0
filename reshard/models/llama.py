"""Llama (``LlamaForCausalLM``): grouped-query attention, SwiGLU MLP, RMSNorm, no biases, rotary positions.

Sizes: ``h`` hidden, ``heads`` attention heads, ``g`` key/value heads (query groups), ``hd`` head dim,
``f`` ffn (intermediate), ``vocab``, ``layers``. The output projection ``lm_head`` is stored unless
``tie_word_embeddings``.

Megatron-core stores q, k and v fused per query group (``linear_qkv``, ``[q: qpg hd | k: hd | v: hd]``
per group, tp splitting the groups), gate and up fused (``linear_fc1``, ``[gate | up]``, each split over
tp), the input norms inside the following linear (Transformer Engine's ``layer_norm_weight``; modules of
their own, ``input_layernorm`` and ``pre_mlp_layernorm``, with ``--transformer-impl local``) and the
vocabulary padded to a multiple of ``vocab_div * tp``. Its rules follow megatron-core's registration
order, which the distributed optimizer's buffers follow in reverse: Attention registers
``linear_proj`` before SelfAttention adds ``linear_qkv``.

The pieces here are shared by the families built on Llama (Mistral, Qwen2, Qwen3, Phi-3, Mixtral): the
tensors with q/k/v biases or q/k norms (``variant``), the Megatron rules (``megatron``,
``attention_rules``), the args, and the RoPE and window fields of a config both ways (``rope_args``,
``window_args``, ``config_hints``), each refusing what Megatron cannot express by the field and its value.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models.config import config_ints, require_sizes
from reshard.models.family import COLWISE, ROWWISE, Family, Tensor

__all__ = ["FAMILY", "config_from_sizes", "sizes_from_config"]

SIZES = ("h", "heads", "g", "hd", "f", "vocab", "layers")

CONFIG_KEYS = {"h": "hidden_size", "heads": "num_attention_heads", "g": "num_key_value_heads", "hd": "head_dim",
               "f": "intermediate_size", "vocab": "vocab_size", "layers": "num_hidden_layers"}
"""Size -> its ``LlamaConfig`` key (``g`` and ``hd`` optional: they default to ``heads`` and ``h // heads``)."""

TENSORS = (
    Tensor(name="model.embed_tokens.weight", alias="embed", dims="vocab h"),
    Tensor(name="model.layers.{i}.input_layernorm.weight", alias="ln1", dims="h", decay=False),
    Tensor(name="model.layers.{i}.self_attn.q_proj.weight", alias="q", dims="(g qpg hd) h", tp=COLWISE),
    Tensor(name="model.layers.{i}.self_attn.k_proj.weight", alias="k", dims="(g hd) h", tp=COLWISE),
    Tensor(name="model.layers.{i}.self_attn.v_proj.weight", alias="v", dims="(g hd) h", tp=COLWISE),
    Tensor(name="model.layers.{i}.self_attn.o_proj.weight", alias="o", dims="h (g qpg hd)", tp=ROWWISE),
    Tensor(name="model.layers.{i}.post_attention_layernorm.weight", alias="ln2", dims="h", decay=False),
    Tensor(name="model.layers.{i}.mlp.gate_proj.weight", alias="gate", dims="f h", tp=COLWISE),
    Tensor(name="model.layers.{i}.mlp.up_proj.weight", alias="up", dims="f h", tp=COLWISE),
    Tensor(name="model.layers.{i}.mlp.down_proj.weight", alias="down", dims="h f", tp=ROWWISE),
    Tensor(name="model.norm.weight", alias="norm", dims="h", decay=False),
    Tensor(name="lm_head.weight", alias="head", dims="vocab h", untied_only=True),
)

# A decoder layer registers self_attn (q, k, v, o), mlp (gate, up, down), then its two norms.
REGISTRATION = ("embed", "q", "k", "v", "o", "gate", "up", "down", "ln1", "ln2", "norm", "head")

PREAMBLE = """\
let qpg = heads / g
index i < layers
"""

VOCAB = "(vocab~(vocab_div*tp))/tp h"
"""The padded, tp-split vocabulary of Megatron's embedding and output layer."""

# Optional pieces of Llama-style attention, named by the Megatron rules below: q/k/v biases (Qwen2) and
# per-head RMSNorms of q and k (Qwen3).
QKV_BIASES = (
    Tensor(name="model.layers.{i}.self_attn.q_proj.bias", alias="q_bias", dims="(g qpg hd)", tp=COLWISE, decay=False),
    Tensor(name="model.layers.{i}.self_attn.k_proj.bias", alias="k_bias", dims="(g hd)", tp=COLWISE, decay=False),
    Tensor(name="model.layers.{i}.self_attn.v_proj.bias", alias="v_bias", dims="(g hd)", tp=COLWISE, decay=False),
)
QK_NORMS = (
    Tensor(name="model.layers.{i}.self_attn.q_norm.weight", alias="q_norm", dims="hd", decay=False),
    Tensor(name="model.layers.{i}.self_attn.k_norm.weight", alias="k_norm", dims="hd", decay=False),
)


def variant(*, qkv_bias: bool = False, qk_norm: bool = False,
            tensors: tuple[Tensor, ...] = TENSORS) -> tuple[tuple[Tensor, ...], tuple[str, ...]]:
    """Llama's tensors (or ``tensors`` with Llama's aliases) in checkpoint order, and their registration order,
    with q/k/v biases after their weights and q/k norms after ``o_proj``, where transformers registers them."""
    by_alias = {t.alias: t for t in (*tensors, *QKV_BIASES, *QK_NORMS)}
    attention = ("q", "q_bias", "k", "k_bias", "v", "v_bias") if qkv_bias else ("q", "k", "v")
    attention += ("o", "q_norm", "k_norm") if qk_norm else ("o",)
    present = [a for a in ("embed", "ln1", *attention, "ln2", "gate", "up", "down", "norm", "head") if a in by_alias]
    registration = ("embed", *attention, "gate", "up", "down", "ln1", "ln2", "norm", "head")
    return tuple(by_alias[a] for a in present), tuple(a for a in registration if a in by_alias)


def attention_rules(*, local: bool, qkv_bias: bool = False, qk_norm: bool = False, sinks: bool = False,
                    o_bias: bool = False, post_norm: bool = False) -> list[str]:
    """Megatron-core's rules for one Llama-style attention block and its input norm, in registration order:
    the norm is ``input_layernorm`` of its own with ``--transformer-impl local``, else fused into
    ``linear_qkv`` (Transformer Engine's ``layer_norm_weight``, registered after ``linear_proj``). ``sinks``:
    a learned softmax offset per head (``--softmax-type learnable``), registered with the core attention
    before ``linear_proj``; ``o_bias``: ``linear_proj``'s bias (``--add-bias-linear``), replicated over tp;
    ``post_norm``: a norm of the attention's output inside ``linear_proj`` (Megatron-Bridge's
    ``TERowParallelLinearLayerNorm``: ``post_layernorm``, registered after the linear's weight)."""
    at = "decoder.layers.{i/pp}."
    ln1 = (f"{at}input_layernorm.weight -> ln1 = h" if local else
           f"{at}self_attention.linear_qkv.layer_norm_weight -> ln1 = h")
    proj = [f"{at}self_attention.core_attention.softmax_offset -> sinks = (g/tp qpg)"] if sinks else []
    proj.append(f"{at}self_attention.linear_proj.weight -> o = h (g qpg hd)/tp")
    if o_bias:
        proj.append(f"{at}self_attention.linear_proj.bias -> o_bias = h")
    if post_norm:
        proj.append(f"{at}self_attention.linear_proj.post_layernorm.weight -> post_attn = h")
    rules = [ln1, *proj] if local else [*proj, ln1]
    rules.append(f"{at}self_attention.linear_qkv.weight = (g/tp [q: qpg hd | k: hd | v: hd]) h")
    if qkv_bias:
        rules.append(f"{at}self_attention.linear_qkv.bias = (g/tp [q_bias: qpg hd | k_bias: hd | v_bias: hd])")
    if qk_norm:
        rules += [f"{at}self_attention.q_layernorm.weight -> q_norm = hd",
                  f"{at}self_attention.k_layernorm.weight -> k_norm = hd"]
    return rules


def megatron(*, tied: bool = False, local: bool = False, qkv_bias: bool = False, qk_norm: bool = False,
             post_norms: bool = False) -> str:
    """Megatron-core GPT in Llama style (``--swiglu --normalization RMSNorm``, no biases but ``--add-qkv-bias``,
    ``--qk-layernorm``), Transformer Engine layers or ``--transformer-impl local``; ``post_norms``: norms of the
    attention's and the MLP's outputs inside ``linear_proj`` and ``linear_fc2`` (Megatron-Bridge's Gemma 2/3:
    ``post_attn``, ``post_ffn``)."""
    at = "decoder.layers.{i/pp}."
    ln2 = f"{at}pre_mlp_layernorm.weight -> ln2 = h" if local else f"{at}mlp.linear_fc1.layer_norm_weight -> ln2 = h"
    head = "output_layer.weight -> embed @lastonly" if tied else "output_layer.weight -> head @last"
    return "\n".join([
        f"embedding.word_embeddings.weight -> embed @first = {VOCAB}",
        *attention_rules(local=local, qkv_bias=qkv_bias, qk_norm=qk_norm, post_norm=post_norms),
        ln2,
        f"{at}mlp.linear_fc1.weight = [gate: f/tp | up: f/tp] h",
        f"{at}mlp.linear_fc2.weight -> down = h f/tp",
        *([f"{at}mlp.linear_fc2.post_layernorm.weight -> post_ffn = h"] if post_norms else []),
        "decoder.final_layernorm.weight -> norm @last = h",
        f"{head} = {VOCAB}",
    ]) + "\n"


# Megatron-LM's legacy GPTModel: the nested ``language_model`` state dict ('/' marks a level of nesting).
def megatron_legacy(tied: bool = False, qkv_bias: bool = False) -> str:
    """Megatron-LM's legacy GPTModel in Llama style (``--use-legacy-models``): the ``language_model`` tree, q/k/v
    of a query group together (their biases with ``--add-qkv-bias``), SwiGLU's halves stacked; a tied output
    layer is the embedding, which the last stage keeps a copy of (``word_embeddings_for_head``) when it is not
    the first."""
    at = "language_model/encoder/layers.{i/pp}."
    head = f"word_embeddings_for_head/weight -> embed @lastonly = {VOCAB}" if tied else \
        f"language_model/output_layer/weight -> head @last = {VOCAB}"
    return "\n".join([
        f"language_model/embedding/word_embeddings/weight -> embed @first = {VOCAB}",
        f"{at}input_norm.weight -> ln1 = h",
        f"{at}self_attention.query_key_value.weight = (g/tp [q: qpg hd | k: hd | v: hd]) h",
        *([f"{at}self_attention.query_key_value.bias = (g/tp [q_bias: qpg hd | k_bias: hd | v_bias: hd])"]
          if qkv_bias else []),
        f"{at}self_attention.dense.weight -> o = h (g qpg hd)/tp",
        f"{at}post_attention_norm.weight -> ln2 = h",
        f"{at}mlp.dense_h_to_4h.weight = [gate: f/tp | up: f/tp] h",
        f"{at}mlp.dense_4h_to_h.weight -> down = h f/tp",
        "language_model/encoder/final_norm.weight -> norm @last = h",
        head,
    ]) + "\n"


def sizes_from_config(config: Mapping[str, Any], where: Path | str = "config.json", *,
                      f_key: str = CONFIG_KEYS["f"]) -> dict[str, int]:
    """h, heads, g, hd, f, vocab, layers from a ``LlamaConfig`` dict (``f`` from ``f_key``: an MoE family's
    expert width).

    ``g`` defaults to ``heads`` (no GQA) and ``hd`` to ``h // heads``, as ``LlamaConfig`` does. Raises
    CheckpointFormatError listing every missing or non-positive key.
    """
    keys = {k: v for k, v in (CONFIG_KEYS | {"f": f_key}).items() if k not in ("g", "hd")}
    sizes = config_ints(config, keys, (CONFIG_KEYS["g"], CONFIG_KEYS["hd"]), where)
    sizes["g"] = int(config.get("num_key_value_heads") or sizes["heads"])
    sizes["hd"] = int(config.get("head_dim") or sizes["h"] // sizes["heads"])
    return sizes


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """A minimal ``LlamaConfig`` dict for model ``sizes``; other fields keep transformers' defaults.

    ``dtype`` is the most common of ``dtypes`` (transformers 5's name for ``torch_dtype``);
    ``rms_norm_eps`` is 1e-5 (Llama 2/3 and Megatron's default).
    """
    require_sizes(sizes, ("h", "f", "heads", "g", "hd", "layers", "vocab"), "a Llama config.json")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": sizes["h"],
        "intermediate_size": sizes["f"],
        "num_attention_heads": sizes["heads"],
        "num_key_value_heads": sizes["g"],
        "head_dim": sizes["hd"],
        "num_hidden_layers": sizes["layers"],
        "vocab_size": sizes["vocab"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    common = Counter(dtypes).most_common(1)
    if common:
        config["dtype"] = common[0][0]
    return config


# Hugging Face config keys <-> Megatron args, for what changes the model's outputs.
HF_MEGATRON = (("rms_norm_eps", "norm_epsilon"), ("rope_theta", "rotary_base"),
               ("max_position_embeddings", "max_position_embeddings"))

MEGATRON_LLAMA3 = {"low_freq_factor": 1, "high_freq_factor": 4, "original_max_position_embeddings": 8192}
"""The llama3 RoPE scaling constants megatron-core hard-codes (``RotaryEmbedding._apply_scaling``); its args
carry only the factor (``--use-rope-scaling --rope-scaling-factor``)."""


def megatron_args(sizes: Mapping[str, int], tied: bool) -> dict[str, Any]:
    """The Megatron args of a Llama of ``sizes`` (``--swiglu --normalization RMSNorm``, rotary, no biases)."""
    h, heads = int(sizes["h"]), int(sizes["heads"])
    g = int(sizes.get("g", heads))
    return {
        "num_layers": int(sizes["layers"]), "hidden_size": h, "ffn_hidden_size": int(sizes["f"]),
        "num_attention_heads": heads, "group_query_attention": g != heads, "num_query_groups": g,
        "kv_channels": int(sizes.get("hd", h // heads)),
        "max_position_embeddings": sizes.get("max_position_embeddings"),
        "position_embedding_type": "rope", "add_position_embedding": False, "use_rotary_position_embeddings": True,
        "rotary_base": 10000, "norm_epsilon": 1e-5, "rotary_percent": 1.0, "use_rope_scaling": False,
        "rotary_interleaved": False, "normalization": "RMSNorm", "swiglu": True, "squared_relu": False,
        "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": False, "window_size": None,
        "apply_layernorm_1p": False,
        "untie_embeddings_and_output_weights": not tied, "vocab_size": int(sizes["vocab"]),
        "make_vocab_size_divisible_by": int(sizes.get("vocab_div", 128)), "tokenizer_type": None,
        "num_experts": None, "expert_model_parallel_size": 1,
    }


def is_dense(args: Mapping[str, Any]) -> bool:
    """Llama-style Megatron args: SwiGLU, no experts, no biases but q/k/v's, every layer alike, q/k/v attention
    (not ``--multi-latent-attention``)."""
    return (bool(args.get("swiglu", False)) and not args.get("num_experts") and not args.get("add_bias_linear")
            and not args.get("window_attn_skip_freq") and not args.get("multi_latent_attention"))


def is_megatron(args: Mapping[str, Any]) -> bool:
    """Whether a Megatron run's args describe a Llama: Llama-style, and nothing that marks another family (q/k/v
    biases: Qwen2; q/k norms: Qwen3; a sliding window: Mistral)."""
    return (is_dense(args) and not args.get("add_qkv_bias") and not args.get("qk_layernorm")
            and args.get("window_size") is None)


def megatron_window(args: Mapping[str, Any]) -> int | None:
    """The Hugging Face ``sliding_window`` W of Megatron's ``window_size`` (W - 1, 0) (bounds inclusive), None
    without a window or with one Hugging Face has no name for."""
    window = args.get("window_size")
    if not isinstance(window, tuple | list) or len(window) != 2 or not all(
            isinstance(w, int) and not isinstance(w, bool) for w in window) or window[0] < 0 or window[1] != 0:
        return None
    return window[0] + 1


def config_hints(args: Mapping[str, Any]) -> dict[str, Any]:
    """What a Llama ``config.json`` takes from a Megatron run's args: epsilon, rope base and scaling, positions,
    tying (in transformers 4's spelling, which 5 reads too)."""
    hints: dict[str, Any] = {"tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False)}
    for hf, meg in HF_MEGATRON:
        value = args.get(meg)
        if isinstance(value, int | float) and not isinstance(value, bool):
            hints[hf] = value
    if args.get("use_rope_scaling"):
        hints["rope_scaling"] = {"rope_type": "llama3", "factor": float(args.get("rope_scaling_factor", 8.0)),
                                 **MEGATRON_LLAMA3}
    return hints


def rope_of(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The config field holding RoPE, and its fields, in either spelling: transformers 5's ``rope_parameters``
    (``rope_type`` and ``rope_theta`` inside) or 4.x's ``rope_scaling`` (type as ``type`` or ``rope_type``)
    beside a top-level ``rope_theta`` and ``partial_rotary_factor``. ``rope_type`` is ``default`` unscaled."""
    field = "rope_parameters" if config.get("rope_parameters") is not None else "rope_scaling"
    given = config.get(field)
    if given is not None and not isinstance(given, Mapping):
        raise CheckpointFormatError(f"{field} is {json.dumps(given)}, expected an object or null")
    rope = {k: config[k] for k in ("rope_theta", "partial_rotary_factor") if config.get(k) is not None}
    rope.update(given or {})
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return field, rope


def rope_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron's args for a config's RoPE: the base, and llama3 scaling with megatron-core's constants.

    Raises:
      CheckpointFormatError: a RoPE type or setting Megatron's args cannot express, named with its value
        (other llama3 constants, linear, dynamic, yarn, longrope/su, partial rotary).
    """
    field, rope = rope_of(config)
    kind, out = rope["rope_type"], {}
    partial = rope.get("partial_rotary_factor", 1)
    if partial != 1:
        inside = isinstance(config.get(field), Mapping) and "partial_rotary_factor" in config[field]
        raise CheckpointFormatError(f"{field + '.' if inside else ''}partial_rotary_factor = {json.dumps(partial)}: "
                                    "reshard writes no "
                                    "--rotary-percent yet, and Megatron would rotate every dim of each head")
    if kind == "llama3":
        bad = [f"{k} = {json.dumps(rope.get(k))}" for k, v in MEGATRON_LLAMA3.items() if rope.get(k) != v]
        if bad:
            fixed = ", ".join(f"{k} {v}" for k, v in MEGATRON_LLAMA3.items())
            raise CheckpointFormatError(f"{field}: llama3 scaling with {', '.join(bad)}; megatron-core fixes {fixed} "
                                        "(only the factor is an arg), so the model would change")
        factor = rope.get("factor")
        if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
            raise CheckpointFormatError(f"{field}.factor = {json.dumps(factor)}: llama3 scaling needs a positive "
                                        "factor")
        out.update(use_rope_scaling=True, rope_scaling_factor=float(factor))
    elif kind != "default":
        raise CheckpointFormatError(f"{field}.rope_type = {json.dumps(kind)}: Megatron's args express RoPE "
                                    "unscaled or llama3-scaled only (reshard writes no other); converting would "
                                    "change the model")
    theta = rope.get("rope_theta")
    if isinstance(theta, int | float) and not isinstance(theta, bool):
        out["rotary_base"] = theta
    return out


def window_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron's ``window_size`` (W - 1, 0) for a ``sliding_window`` W on every layer (Mistral, Phi-3)."""
    window = config.get("sliding_window")
    if window is None:
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointFormatError(f"sliding_window = {json.dumps(window)}: expected a positive integer or null")
    types = config.get("layer_types")
    if isinstance(types, list) and any(t != "sliding_attention" for t in types):
        raise CheckpointFormatError(f"layer_types = {json.dumps(types)}: a window on some layers only; reshard "
                                    "writes Megatron's window on every layer")
    return {"window_size": (window - 1, 0)}


def args_from_config(config: Any) -> dict[str, Any]:
    """Megatron args for a Llama ``config.json`` (the source's, carried): the inverse of ``config_hints``.

    Raises:
      CheckpointFormatError: RoPE Megatron cannot express (``rope_args``).
    """
    if not isinstance(config, Mapping):
        return {}
    out = {meg: config.get(hf) for hf, meg in HF_MEGATRON if hf != "rope_theta"}
    out = {k: v for k, v in out.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return out | rope_args(config)


FAMILY = Family(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    preamble=PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    sizes=SIZES,
    megatron=megatron,
    megatron_legacy=megatron_legacy,
    torch_dist=True,
    sizes_from_config=sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=megatron_args,
    is_megatron=is_megatron,
    config_hints=config_hints,
    args_from_config=args_from_config,
)
