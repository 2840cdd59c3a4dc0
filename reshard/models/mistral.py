"""Mistral (``MistralForCausalLM``): Llama's tensors, and a ``sliding_window`` W on every layer when set.

Sizes and tensors are Llama's (an explicit ``head_dim`` ≠ h/heads, as in Mistral-Nemo, is ``hd``: Megatron's
``kv_channels``). Megatron-core stores it as a Llama (``reshard.models.llama``) run with ``--window-size W-1,0``
(megatron-core's bounds are inclusive, Hugging Face's query i sees keys ``i-W < j <= i``). That window is how a
Megatron checkpoint names a Mistral; without one its args are a Llama's, and only a carried ``config.json``
says Mistral (the two compute the same function then).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.models import llama
from reshard.models.family import Family

__all__ = ["FAMILY"]


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Llama's config as a ``MistralConfig``, without a window (``MistralConfig`` would default to 4096)."""
    config = llama.config_from_sizes(sizes, dtypes)
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    return config


def is_megatron(args: Mapping[str, Any]) -> bool:
    """Whether a Megatron run's args describe a Mistral: Llama-style with a causal window on every layer."""
    return (llama.is_dense(args) and not args.get("add_qkv_bias") and not args.get("qk_layernorm")
            and llama.megatron_window(args) is not None)


def config_hints(args: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's, and ``sliding_window`` from Megatron's ``window_size``."""
    return {**llama.config_hints(args), "sliding_window": llama.megatron_window(args)}


def args_from_config(config: Any) -> dict[str, Any]:
    """Llama's, and ``window_size`` (W - 1, 0) for a ``sliding_window`` W."""
    if not isinstance(config, Mapping):
        return {}
    return llama.args_from_config(config) | llama.window_args(config)


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    architectures=("MistralForCausalLM",),
    preamble=llama.PREAMBLE,
    tensors=llama.TENSORS,
    registration=llama.REGISTRATION,
    sizes=llama.SIZES,
    megatron=llama.megatron,
    torch_dist=True,
    sizes_from_config=llama.sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=llama.megatron_args,
    is_megatron=is_megatron,
    config_hints=config_hints,
    args_from_config=args_from_config,
)
