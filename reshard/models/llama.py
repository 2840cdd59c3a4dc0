"""Llama (``LlamaForCausalLM``): grouped-query attention, SwiGLU MLP, RMSNorm, no biases, rotary positions.

Sizes: ``h`` hidden, ``heads`` attention heads, ``g`` key/value heads (query groups), ``hd`` head dim,
``f`` ffn (intermediate), ``vocab``, ``layers``. The output projection ``lm_head`` is stored unless
``tie_word_embeddings``.

Megatron-core stores q, k and v fused per query group (``linear_qkv``, ``[q: qpg hd | k: hd | v: hd]``
per group, tp splitting the groups), gate and up fused (``linear_fc1``, ``[gate | up]``, each split over
tp), the input norms inside the following linear (Transformer Engine's ``layer_norm_weight``) and the
vocabulary padded to a multiple of ``vocab_div * tp``. Its rules follow megatron-core's registration
order, which the distributed optimizer's buffers follow in reverse: Attention registers
``linear_proj`` before SelfAttention adds ``linear_qkv``.
"""

from __future__ import annotations

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


def megatron(*, tied: bool = False, local: bool = False) -> str | None:
    """Megatron-core GPT in Llama style (``--swiglu --normalization RMSNorm``, no biases), Transformer Engine
    layers (no layout yet for ``--transformer-impl local``)."""
    if local:
        return None
    head = "output_layer.weight -> embed @lastonly" if tied else "output_layer.weight -> head @last"
    return f"""\
embedding.word_embeddings.weight -> embed @first = {VOCAB}
decoder.layers.{{i/pp}}.self_attention.linear_proj.weight -> o = h (g qpg hd)/tp
decoder.layers.{{i/pp}}.self_attention.linear_qkv.layer_norm_weight -> ln1 = h
decoder.layers.{{i/pp}}.self_attention.linear_qkv.weight = (g/tp [q: qpg hd | k: hd | v: hd]) h
decoder.layers.{{i/pp}}.mlp.linear_fc1.layer_norm_weight -> ln2 = h
decoder.layers.{{i/pp}}.mlp.linear_fc1.weight = [gate: f/tp | up: f/tp] h
decoder.layers.{{i/pp}}.mlp.linear_fc2.weight -> down = h f/tp
decoder.final_layernorm.weight -> norm @last = h
{head} = {VOCAB}
"""


# Megatron-LM's legacy GPTModel: the nested ``language_model`` state dict ('/' marks a level of nesting).
MEGATRON_LEGACY = f"""\
language_model/embedding/word_embeddings/weight -> embed @first = {VOCAB}
language_model/encoder/layers.{{i/pp}}.input_norm.weight -> ln1 = h
language_model/encoder/layers.{{i/pp}}.self_attention.query_key_value.weight = (g/tp [q: qpg hd | k: hd | v: hd]) h
language_model/encoder/layers.{{i/pp}}.self_attention.dense.weight -> o = h (g qpg hd)/tp
language_model/encoder/layers.{{i/pp}}.post_attention_norm.weight -> ln2 = h
language_model/encoder/layers.{{i/pp}}.mlp.dense_h_to_4h.weight = [gate: f/tp | up: f/tp] h
language_model/encoder/layers.{{i/pp}}.mlp.dense_4h_to_h.weight -> down = h f/tp
language_model/encoder/final_norm.weight -> norm @last = h
language_model/output_layer/weight -> head @last = {VOCAB}
"""

# Megatron-core's torch_dist: whole global tensors, layers stacked on a leading dim, the vocabulary
# padded to ``vpad`` rows.
TORCH_DIST = """\
embedding.word_embeddings.weight -> embed = (vocab~vpad) h
decoder.layers.self_attention.linear_qkv.layer_norm_weight -> ln1 = {i} h
decoder.layers.self_attention.linear_qkv.weight = {i} (g [q: qpg hd | k: hd | v: hd]) h
decoder.layers.self_attention.linear_proj.weight -> o = {i} h (g qpg hd)
decoder.layers.mlp.linear_fc1.layer_norm_weight -> ln2 = {i} h
decoder.layers.mlp.linear_fc1.weight = {i} [gate: f | up: f] h
decoder.layers.mlp.linear_fc2.weight -> down = {i} h f
decoder.final_layernorm.weight -> norm = h
output_layer.weight -> head = (vocab~vpad) h
"""


def sizes_from_config(config: Mapping[str, Any], where: Path | str = "config.json") -> dict[str, int]:
    """h, heads, g, hd, f, vocab, layers from a ``LlamaConfig`` dict.

    ``g`` defaults to ``heads`` (no GQA) and ``hd`` to ``h // heads``, as ``LlamaConfig`` does. Raises
    CheckpointFormatError listing every missing or non-positive key.
    """
    keys = {k: v for k, v in CONFIG_KEYS.items() if k not in ("g", "hd")}
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
        "rotary_base": 10000, "norm_epsilon": 1e-5,
        "rotary_interleaved": False, "normalization": "RMSNorm", "swiglu": True, "squared_relu": False,
        "add_bias_linear": False, "add_qkv_bias": False, "apply_layernorm_1p": False,
        "untie_embeddings_and_output_weights": not tied, "vocab_size": int(sizes["vocab"]),
        "make_vocab_size_divisible_by": int(sizes.get("vocab_div", 128)), "tokenizer_type": None,
        "num_experts": None, "expert_model_parallel_size": 1,
    }


def is_megatron(args: Mapping[str, Any]) -> bool:
    """Whether a Megatron run's args describe a Llama: SwiGLU, no experts."""
    return bool(args.get("swiglu", False)) and not args.get("num_experts")


def config_hints(args: Mapping[str, Any]) -> dict[str, Any]:
    """What a Llama ``config.json`` takes from a Megatron run's args: epsilon, rope base, positions, tying."""
    hints: dict[str, Any] = {"tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False)}
    for hf, meg in HF_MEGATRON:
        value = args.get(meg)
        if isinstance(value, int | float) and not isinstance(value, bool):
            hints[hf] = value
    return hints


def args_from_config(config: Any) -> dict[str, Any]:
    """Megatron args for a Llama ``config.json`` (the source's, carried): the inverse of ``config_hints``."""
    if not isinstance(config, Mapping):
        return {}
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), Mapping) else {}
    if (rope.get("rope_type") or "default") != "default" or config.get("rope_scaling"):
        raise CheckpointFormatError(f"rope scaling ({rope.get('rope_type') or config.get('rope_scaling')}) has no "
                                    "Megatron args reshard can write yet; the weights would convert, the model would not")
    values = {"rms_norm_eps": config.get("rms_norm_eps"), "rope_theta": rope.get("rope_theta", config.get("rope_theta")),
              "max_position_embeddings": config.get("max_position_embeddings")}
    return {meg: values[hf] for hf, meg in HF_MEGATRON if isinstance(values[hf], int | float)}


FAMILY = Family(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM",),
    preamble=PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    sizes=SIZES,
    megatron=megatron,
    megatron_legacy=MEGATRON_LEGACY,
    torch_dist=TORCH_DIST,
    sizes_from_config=sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=megatron_args,
    is_megatron=is_megatron,
    config_hints=config_hints,
    args_from_config=args_from_config,
)
