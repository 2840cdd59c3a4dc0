"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama with biases on q, k and v (always; the config has no field for
them). Small models tie the output projection to the embedding, and then store no ``lm_head``.

Megatron-core stores it as a Llama (``reshard.models.llama``) run with ``--add-qkv-bias``: ``linear_qkv.bias``
is fused per query group like the weight (``[q_bias: qpg hd | k_bias: hd | v_bias: hd]`` per group), and that
flag is how a Megatron checkpoint names a Qwen2. A sliding window (``use_sliding_window``, on the layers from
``max_window_layers`` on) is refused: reshard writes Megatron's window on every layer or none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models import llama
from reshard.models.family import Family

__all__ = ["FAMILY", "no_window"]

TENSORS, REGISTRATION = llama.variant(qkv_bias=True)


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Llama's config as a ``Qwen2Config`` (no window)."""
    config = llama.config_from_sizes(sizes, dtypes)
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
    return config


def megatron_args(sizes: Mapping[str, int], tied: bool) -> dict[str, Any]:
    """Llama's args with ``--add-qkv-bias``."""
    return llama.megatron_args(sizes, tied) | {"add_qkv_bias": True}


def is_megatron(args: Mapping[str, Any]) -> bool:
    """Whether a Megatron run's args describe a Qwen2: Llama-style with q/k/v biases, no q/k norms, no window."""
    return (llama.is_dense(args) and bool(args.get("add_qkv_bias")) and not args.get("qk_layernorm")
            and args.get("window_size") is None)


def no_window(config: Mapping[str, Any]) -> None:
    """Refuse a Qwen config whose sliding window reaches any layer (``layer_types`` in transformers 5, else
    ``use_sliding_window`` with ``max_window_layers`` below the layer count)."""
    types = config.get("layer_types")
    sliding = any(t == "sliding_attention" for t in types) if isinstance(types, list) else (
        bool(config.get("use_sliding_window"))
        and (config.get("max_window_layers") or 0) < (config.get("num_hidden_layers") or 0))
    if sliding:
        fields = ", ".join(f"{k} = {json.dumps(config.get(k))}" for k in
                           ("use_sliding_window", "sliding_window", "max_window_layers") if k in config)
        raise CheckpointFormatError(f"{fields}: a sliding window on some layers only; reshard writes Megatron's "
                                    "window on every layer or none, so the model would change")


def args_from_config(config: Any) -> dict[str, Any]:
    """Llama's; a sliding window is refused (``no_window``)."""
    if not isinstance(config, Mapping):
        return {}
    no_window(config)
    return llama.args_from_config(config)


FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    architectures=("Qwen2ForCausalLM",),
    preamble=llama.PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    sizes=llama.SIZES,
    megatron=partial(llama.megatron, qkv_bias=True),
    megatron_legacy=partial(llama.megatron_legacy, qkv_bias=True),
    torch_dist=True,
    sizes_from_config=llama.sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=megatron_args,
    is_megatron=is_megatron,
    config_hints=llama.config_hints,
    args_from_config=args_from_config,
)
