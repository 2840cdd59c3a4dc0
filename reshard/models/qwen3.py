"""Qwen3 (``Qwen3ForCausalLM``): Llama with an RMSNorm of width ``head_dim`` on every q and k head
(``q_norm``, ``k_norm``, before RoPE), no biases, and an explicit ``head_dim`` that need not be h/heads
(``hd``: Megatron's ``kv_channels``). Small models tie the output projection to the embedding.

Megatron-core stores it as a Llama (``reshard.models.llama``) run with ``--qk-layernorm``: the norms are
``self_attention.q_layernorm`` / ``k_layernorm``, replicated over tp, and that flag is how a Megatron
checkpoint names a Qwen3. A sliding window is refused as for Qwen2.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from reshard.models import llama, qwen2
from reshard.models.family import Family

__all__ = ["FAMILY"]

TENSORS, REGISTRATION = llama.variant(qk_norm=True)


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Llama's config as a ``Qwen3Config`` (``head_dim`` explicit, no biases, no window)."""
    config = llama.config_from_sizes(sizes, dtypes)
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
                  use_sliding_window=False)
    return config


def megatron_args(sizes: Mapping[str, int], tied: bool) -> dict[str, Any]:
    """Llama's args with ``--qk-layernorm``."""
    return llama.megatron_args(sizes, tied) | {"qk_layernorm": True}


def is_megatron(args: Mapping[str, Any]) -> bool:
    """Whether a Megatron run's args describe a Qwen3: Llama-style with q/k norms, no biases, no window."""
    return (llama.is_dense(args) and bool(args.get("qk_layernorm")) and not args.get("add_qkv_bias")
            and args.get("window_size") is None)


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3ForCausalLM",),
    preamble=llama.PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    sizes=llama.SIZES,
    megatron=partial(llama.megatron, qk_norm=True),
    torch_dist=True,
    sizes_from_config=llama.sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=megatron_args,
    is_megatron=is_megatron,
    config_hints=llama.config_hints,
    args_from_config=qwen2.args_from_config,
)
