"""Gemma (``GemmaForCausalLM``), and what Gemma 2 and Gemma 3 share with it (``gemma2.py``, ``gemma3_text.py``).

Gemma is Llama's tensors computed differently: every RMSNorm multiplies by (1 + w), its weights stored
zero-centred; the embedding is scaled by √h; the gated MLP runs tanh GELU (``gelu_pytorch_tanh``; Gemma 1's
legacy ``hidden_act: "gelu"`` means it too); ``head_dim`` defaults to 256 whatever h / heads is (``hd``: Megatron's
``kv_channels``; the 2B model has one key/value head); and the output projection is the embedding, always (no
``lm_head`` is stored, and an untied config is refused). Gemma 2 and 3 add sandwich norms: there
``post_attention_layernorm`` normalises the attention's *output* before the residual add (alias ``post_attn``,
never Llama's pre-MLP ``ln2``), ``pre_feedforward_layernorm`` is the pre-MLP norm (``ln2``) and
``post_feedforward_layernorm`` normalises the MLP's output (``post_ffn``).

Megatron. Plain megatron-core cannot compute these models (no embedding scaling, no post norms, no soft-capping,
zero-centred norms only in Transformer Engine's layers), so their Megatron layout is Megatron-Bridge's: Llama's
Transformer Engine names (``reshard.models.llama``), the post norms inside the row-parallel linears
(``linear_proj.post_layernorm``, ``linear_fc2.post_layernorm``), the norms stored as they are
(``layernorm_zero_centered_gamma``), the output layer tied. The args record what megatron-core and Megatron-Bridge
use (``kv_channels``, gated tanh GELU, zero-centred gamma, windows, softmax scale, soft-caps), but no args say
"Gemma": the ``config.json`` reshard keeps beside the checkpoint does, and reading one back needs it. A layout of
megatron-core's local layers is refused (``PLAIN``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models import llama
from reshard.models.family import Family, Tensor

__all__ = ["FAMILY", "activation_args", "megatron", "megatron_args", "no_bidirectional", "scale_args",
           "sizes_from_config", "softcap_args", "variant", "window_args"]

HEAD_DIM = 256
"""``head_dim`` when a Gemma config does not give it (transformers' default for Gemma 1, 2 and 3)."""

PLAIN = ("embeddings scaled by sqrt(hidden_size) and (1 + w) RMSNorms stored zero-centred, which megatron-core "
         "holds only in Transformer Engine's layers: reshard writes Megatron-Bridge's layout, with its config.json")
"""What plain megatron-core cannot express of Gemma 1 (and so of 2 and 3)."""

_LLAMA = {t.alias: t for t in llama.TENSORS}

SANDWICH = (
    Tensor(name="model.layers.{i}.post_attention_layernorm.weight", alias="post_attn", dims="h", decay=False),
    Tensor(name="model.layers.{i}.pre_feedforward_layernorm.weight", alias="ln2", dims="h", decay=False),
    Tensor(name="model.layers.{i}.post_feedforward_layernorm.weight", alias="post_ffn", dims="h", decay=False),
)
"""Gemma 2/3's norms besides ``input_layernorm``: after attention, before and after the MLP."""


def variant(*, sandwich: bool, qk_norm: bool = False) -> tuple[tuple[Tensor, ...], tuple[str, ...]]:
    """A Gemma's tensors in checkpoint order and their registration order: Llama's without ``lm_head``, with the
    sandwich norms (Gemma 2/3) and per-head q/k norms (Gemma 3), registered as transformers does (attention, its
    q/k norms, MLP, then the layer's norms in order)."""
    by_alias = {t.alias: t for t in (*llama.TENSORS, *(SANDWICH if sandwich else ()), *llama.QK_NORMS)}
    attention = ("q", "k", "v", "o", *(("q_norm", "k_norm") if qk_norm else ()))
    post_attn, post_ffn = (("post_attn",), ("post_ffn",)) if sandwich else ((), ())
    order = ("embed", "ln1", *attention, *post_attn, "ln2", "gate", "up", "down", *post_ffn, "norm")
    registration = ("embed", *attention, "gate", "up", "down", "ln1", *post_attn, "ln2", *post_ffn, "norm")
    return tuple(by_alias[a] for a in order), registration


TENSORS, REGISTRATION = variant(sandwich=False)


def sizes_from_config(config: Mapping[str, Any], where: Path | str = "config.json") -> dict[str, int]:
    """Llama's sizes with ``head_dim`` 256 by default; an untied config is refused (reshard's Gemma families
    store no ``lm_head``)."""
    if config.get("tie_word_embeddings", True) is not True:
        raise CheckpointFormatError(f"{where}: tie_word_embeddings = {json.dumps(config.get('tie_word_embeddings'))}: "
                                    "Gemma's output projection is its embedding; an untied Gemma is not supported")
    return llama.sizes_from_config({**config, "head_dim": config.get("head_dim") or HEAD_DIM}, where)


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Llama's config as a ``GemmaConfig``: tanh GELU, epsilon 1e-6, tied."""
    config = llama.config_from_sizes(sizes, dtypes)
    config.update(architectures=["GemmaForCausalLM"], model_type="gemma", hidden_act="gelu_pytorch_tanh",
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
    return config


def megatron_args(sizes: Mapping[str, int], tied: bool = True) -> dict[str, Any]:
    """Llama's args as Megatron-Bridge's Gemma sets them: gated tanh GELU (``--openai-gelu``), zero-centred
    (1 + w) norms (``--apply-layernorm-1p``: ``layernorm_zero_centered_gamma``), epsilon 1e-6, tied."""
    return llama.megatron_args(sizes, True) | {
        "swiglu": False, "gated_linear_unit": True, "openai_gelu": True, "apply_layernorm_1p": True,
        "layernorm_zero_centered_gamma": True, "norm_epsilon": 1e-6}


def activation_args(config: Mapping[str, Any], key: str) -> dict[str, Any]:
    """Nothing, once the config's activation ``key`` is tanh GELU (Gemma 1's legacy ``gelu`` means it too);
    CheckpointFormatError naming any other."""
    act = config.get(key, "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu") or (act == "gelu" and key != "hidden_act"):
        raise CheckpointFormatError(f"{key} = {json.dumps(act)}: Megatron-Bridge's Gemma runs tanh GELU only "
                                    "(gelu_pytorch_tanh); converting would change the model")
    return {}


def window_args(config: Mapping[str, Any], pattern: int) -> dict[str, Any]:
    """Megatron's ``window_size`` (W - 1, 0) for ``sliding_window`` W, on the layers ``layer_types`` (or, in a 4.x
    config, every ``pattern``-th layer full, as transformers builds it) makes sliding: ``window_attn_skip_freq`` N
    when every N-th layer (1-based) is full, else one 1 (window) or 0 per layer."""
    layers = config.get("num_hidden_layers")
    types = config.get("layer_types")
    if types is None and isinstance(layers, int):
        pattern = config.get("sliding_window_pattern", pattern)
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise CheckpointFormatError(f"sliding_window_pattern = {json.dumps(pattern)}: expected a positive integer")
        types = ["full_attention" if (n + 1) % pattern == 0 else "sliding_attention" for n in range(layers)]
    if not isinstance(types, list) or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise CheckpointFormatError(f"layer_types = {json.dumps(types)}: expected sliding_attention or "
                                    "full_attention per layer")
    if "sliding_attention" not in types:
        return {"window_size": None}
    window = config.get("sliding_window", 4096)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointFormatError(f"sliding_window = {json.dumps(window)}: expected a positive integer")
    sliding = [t == "sliding_attention" for t in types]
    freq: int | list[int] | None = None
    if not all(sliding):
        freq = next((n for n in range(2, len(types) + 1)
                     if sliding == [(k + 1) % n != 0 for k in range(len(types))]), [int(s) for s in sliding])
    return {"window_size": (window - 1, 0), "window_attn_skip_freq": freq}


def _positive(config: Mapping[str, Any], key: str, default: Any) -> Any:
    value = config.get(key, default)
    if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or value <= 0):
        raise CheckpointFormatError(f"{key} = {json.dumps(value)}: expected a positive number or null")
    return value


def scale_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """The attention's ``softmax_scale``, ``query_pre_attn_scalar``^-1/2 (transformers' 256 by default), and the
    scalar itself (Megatron-Bridge's Gemma 2 field)."""
    scalar = _positive(config, "query_pre_attn_scalar", 256)
    if scalar is None:
        raise CheckpointFormatError("query_pre_attn_scalar = null: Gemma 2/3 scale attention by it")
    return {"query_pre_attn_scalar": scalar, "softmax_scale": scalar ** -0.5}


def softcap_args(config: Mapping[str, Any], defaults: tuple[float, float] | None) -> dict[str, Any]:
    """``attn_logit_softcapping`` and ``final_logit_softcapping`` (Megatron-Bridge's Gemma 2 fields, null: none;
    ``defaults`` transformers'), or, without ``defaults``, nothing: then a soft-cap is refused (Megatron-Bridge's
    Gemma 3 applies none)."""
    keys = ("attn_logit_softcapping", "final_logit_softcapping")
    caps = {k: _positive(config, k, None if defaults is None else d) for k, d in zip(keys, defaults or (0, 0))}
    if defaults is None:
        capped = [f"{k} = {json.dumps(v)}" for k, v in caps.items() if v is not None]
        if capped:
            raise CheckpointFormatError(f"{', '.join(capped)}: Megatron-Bridge's Gemma 3 applies no soft-capping; "
                                        "converting would change the model")
        return {}
    return caps


def no_bidirectional(config: Mapping[str, Any]) -> None:
    """Refuse bidirectional attention (an encoder's: EmbeddingGemma), which no Megatron GPT computes."""
    if config.get("use_bidirectional_attention"):
        raise CheckpointFormatError(f"use_bidirectional_attention = "
                                    f"{json.dumps(config['use_bidirectional_attention'])}: a Megatron GPT attends "
                                    "causally; converting would change the model")


def args_from_config(config: Any) -> dict[str, Any]:
    """Llama's (epsilon, RoPE), with the activation checked."""
    if not isinstance(config, Mapping):
        return {}
    no_bidirectional(config)
    return llama.args_from_config(config) | activation_args(config, "hidden_act")


def megatron(*, tied: bool = True, local: bool = False, qk_norm: bool = False, post_norms: bool = False) -> str | None:
    """Megatron-Bridge's Gemma: Llama's Transformer Engine layout, tied, with Gemma 3's q/k norms and Gemma 2/3's
    post norms; none in local layers (their norms cannot be zero-centred)."""
    return None if local or not tied else llama.megatron(tied=True, qk_norm=qk_norm, post_norms=post_norms)


FAMILY = Family(
    name="gemma",
    model_types=("gemma",),
    architectures=("GemmaForCausalLM",),
    preamble=llama.PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    torch_dist=True,
    sizes=llama.SIZES,
    tied_default=True,
    can_tie=False,
    megatron=megatron,
    sizes_from_config=sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=megatron_args,
    is_megatron=None,
    config_hints=llama.config_hints,
    args_from_config=args_from_config,
    plain_megatron=f"model_type 'gemma': {PLAIN}",
)
