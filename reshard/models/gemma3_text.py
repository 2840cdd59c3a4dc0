"""Gemma 3, text only (``Gemma3ForCausalLM``, ``model_type: gemma3_text``): Gemma 2 (``reshard.models.gemma2``)
with a (1 + w) RMSNorm of width ``head_dim`` on every q and k head (``q_norm``, ``k_norm``), no soft-capping
(the fields are null; a value is refused), five sliding layers to one full (``layer_types``; 4.x:
``sliding_window_pattern`` 6), and two RoPE tables: base 10000 on sliding layers, 1e6 (optionally linearly
scaled) on full ones (``rope_parameters`` per layer type; 4.x: ``rope_local_base_freq``, ``rope_theta``,
``rope_scaling``).

Megatron-Bridge's layout (``Gemma3ModelBridge``): Gemma 2's, with ``self_attention.q_layernorm`` /
``k_layernorm`` <- ``q_norm`` / ``k_norm`` (zero-centred too, replicated over tp). Its args add ``qk_layernorm``,
``rotary_base`` as (local, global) and ``rope_scaling_factor`` (linear, global layers) as Bridge's provider keeps
them, and ``window_size`` (W - 1, 0) with ``window_attn_skip_freq`` 6.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models import gemma, gemma2, llama
from reshard.models.family import Family

__all__ = ["FAMILY"]

TENSORS, REGISTRATION = gemma.variant(sandwich=True, qk_norm=True)

THETA = {"sliding_attention": 10000.0, "full_attention": 1e6}
"""transformers' RoPE bases per layer type when a config gives none."""


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Gemma 2's config as a ``Gemma3TextConfig``: no soft-caps, and its window pattern and RoPE bases spelled out."""
    config = gemma2.config_from_sizes(sizes, dtypes)
    config.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", attn_logit_softcapping=None,
                  final_logit_softcapping=None,
                  layer_types=["full_attention" if (n + 1) % 6 == 0 else "sliding_attention"
                               for n in range(sizes["layers"])],
                  rope_parameters={t: {"rope_type": "default", "rope_theta": v} for t, v in THETA.items()})
    return config


def megatron_args(sizes: Mapping[str, int], tied: bool = True) -> dict[str, Any]:
    """Gemma's args with ``--qk-layernorm``."""
    return gemma.megatron_args(sizes, tied) | {"qk_layernorm": True}


def rope_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """``rotary_base`` (local, global) and, for linear scaling of the global layers, ``rope_scaling_factor``.

    Raises:
      CheckpointFormatError: another RoPE type, or scaling on the sliding layers, named with its value.
    """
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping) or not set(params) <= set(THETA):
            raise CheckpointFormatError(f"rope_parameters = {json.dumps(params)}: expected one object per layer "
                                        f"type ({', '.join(THETA)})")
        field, per_type = "rope_parameters", {t: dict(params.get(t) or {}) for t in THETA}
    else:  # transformers 4.x: the global layers' scaling in rope_scaling
        scaling = config.get("rope_scaling") or {}
        if not isinstance(scaling, Mapping):
            raise CheckpointFormatError(f"rope_scaling = {json.dumps(scaling)}: expected an object or null")
        per_type = {"sliding_attention": {"rope_theta": config.get("rope_local_base_freq", THETA["sliding_attention"])},
                    "full_attention": {**scaling, "rope_theta": config.get("rope_theta", THETA["full_attention"])}}
        field = "rope_scaling"
    out: dict[str, Any] = {}
    for layer_type, rope in per_type.items():
        kind = rope.get("rope_type") or rope.get("type") or "default"
        where = f"{field}.{layer_type}" if field == "rope_parameters" else field
        if kind == "linear" and layer_type == "full_attention":
            factor = rope.get("factor")
            if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
                raise CheckpointFormatError(f"{where}.factor = {json.dumps(factor)}: linear scaling needs a positive "
                                            "factor")
            out["rope_scaling_factor"] = float(factor)
        elif kind != "default":
            raise CheckpointFormatError(f"{where}.rope_type = {json.dumps(kind)}: Megatron-Bridge's Gemma 3 scales "
                                        "only the full layers' RoPE, linearly; converting would change the model")
        theta = rope.get("rope_theta", THETA[layer_type])
        if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
            raise CheckpointFormatError(f"{where}.rope_theta = {json.dumps(theta)}: expected a positive number")
    out["rotary_base"] = tuple(per_type[t].get("rope_theta", THETA[t]) for t in THETA)
    return out


def args_from_config(config: Any) -> dict[str, Any]:
    """Gemma 2's without soft-caps, the q/k norms, two RoPE bases and the 5:1 window."""
    if not isinstance(config, Mapping):
        return {}
    gemma.no_bidirectional(config)
    plain = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    return (llama.args_from_config(plain) | gemma.activation_args(config, "hidden_activation")
            | gemma.scale_args(config) | gemma.softcap_args(config, None) | gemma.window_args(config, 6)
            | rope_args(config))


FAMILY = Family(
    name="gemma3_text",
    model_types=("gemma3_text",),
    architectures=("Gemma3ForCausalLM",),
    preamble=llama.PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    torch_dist=True,
    sizes=llama.SIZES,
    tied_default=True,
    can_tie=False,
    megatron=partial(gemma.megatron, qk_norm=True, post_norms=True),
    sizes_from_config=gemma.sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=megatron_args,
    is_megatron=None,
    config_hints=llama.config_hints,
    args_from_config=args_from_config,
    plain_megatron=f"model_type 'gemma3_text': a RoPE base per layer type, {gemma2.PLAIN}",
)
