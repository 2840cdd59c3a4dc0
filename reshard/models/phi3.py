"""Phi-3 (``Phi3ForCausalLM``): Llama's computation with two tensors Hugging Face stores fused:
``qkv_proj`` = [q; k; v] whole (all q heads, then all k heads, then all v heads: not per query group) and
``gate_up_proj`` = [gate; up]. A ``sliding_window`` W applies to every layer when set.

The logical tensors are the unfused parts under Llama's names and aliases (``q``, ``k``, ``v``, ``gate``,
``up``); each fused tensor is a concatenation of them (``Tensor.parts``), so every format reads and writes
the fusion as it stores it. Megatron-core stores them as a Llama (``reshard.models.llama``): ``linear_qkv``
interleaved per query group, ``linear_fc1`` as [gate_r; up_r] per tp rank, a window as ``--window-size
W-1,0``. Its args are therefore a Llama's (or a Mistral's, with a window): a Megatron checkpoint is a Phi-3
only by its carried ``config.json``. longrope/su RoPE scaling and ``partial_rotary_factor`` != 1 are refused
(``reshard.models.llama.rope_args``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.models import llama, mistral
from reshard.models.family import COLWISE, Family, Tensor

__all__ = ["FAMILY"]

_LLAMA = {t.alias: t for t in llama.TENSORS}

TENSORS = (
    *(_LLAMA[a] for a in ("embed", "ln1")),
    Tensor(name="model.layers.{i}.self_attn.qkv_proj.weight", alias="qkv", dims="[q: g qpg hd | k: g hd | v: g hd] h",
           tp=COLWISE, parts=tuple(_LLAMA[a] for a in ("q", "k", "v"))),
    *(_LLAMA[a] for a in ("o", "ln2")),
    Tensor(name="model.layers.{i}.mlp.gate_up_proj.weight", alias="gate_up", dims="[gate: f | up: f] h", tp=COLWISE,
           parts=(_LLAMA["gate"], _LLAMA["up"])),
    *(_LLAMA[a] for a in ("down", "norm", "head")),
)

# Phi3Attention registers o_proj before qkv_proj.
REGISTRATION = ("embed", "o", "qkv", "gate_up", "down", "ln1", "ln2", "norm", "head")


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Llama's config as a ``Phi3Config``: no window, and no padding token (``Phi3Config`` defaults to 32000,
    which a smaller vocabulary cannot hold)."""
    config = llama.config_from_sizes(sizes, dtypes)
    config.update(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=None, pad_token_id=None)
    return config


FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    architectures=("Phi3ForCausalLM",),
    preamble=llama.PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    sizes=llama.SIZES,
    megatron=llama.megatron,
    torch_dist=True,
    sizes_from_config=llama.sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=llama.megatron_args,
    is_megatron=None,
    config_hints=mistral.config_hints,
    args_from_config=mistral.args_from_config,
)
