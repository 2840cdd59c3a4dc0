"""OLMo 2 (``Olmo2ForCausalLM``): Llama's attention and MLP in a pure post-norm block,
h = x + post_attention_layernorm(attn(x)), out = h + post_feedforward_layernorm(mlp(h)) (no input or pre-MLP norm),
with RMSNorms of q and k over the whole projection, all heads together (``q_norm`` of width heads * head_dim,
``k_norm`` of width kv_heads * head_dim), before the head split and RoPE. No biases; the output projection is
stored unless ``tie_word_embeddings``.

Hugging Face, DCP and DeepSpeed hold it by its tensor names. DCP's tensor-parallel plan is transformers':
q, k, v split by rows with their outputs gathered (``colwise_gather_output``), so the full-width q/k norms act
on whole projections and are replicated over tp like every norm; o and the MLP split as Llama's.

Megatron cannot hold it: megatron-core's ``qk_layernorm`` normalises each head over head_dim (a different
function), its layers have no post-norm slots, and Megatron-Bridge has no OLMo 2 bridge. A Megatron target is
refused (``PLAIN``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.models import llama
from reshard.models.family import Family, Tensor

__all__ = ["FAMILY"]

_LLAMA = {t.alias: t for t in llama.TENSORS}

TENSORS = (
    *(_LLAMA[a] for a in ("embed", "q", "k", "v", "o")),
    Tensor(name="model.layers.{i}.self_attn.q_norm.weight", alias="q_norm", dims="(g qpg hd)", decay=False),
    Tensor(name="model.layers.{i}.self_attn.k_norm.weight", alias="k_norm", dims="(g hd)", decay=False),
    Tensor(name="model.layers.{i}.post_attention_layernorm.weight", alias="post_attn", dims="h", decay=False),
    *(_LLAMA[a] for a in ("gate", "up", "down")),
    Tensor(name="model.layers.{i}.post_feedforward_layernorm.weight", alias="post_ffn", dims="h", decay=False),
    *(_LLAMA[a] for a in ("norm", "head")),
)

REGISTRATION = ("embed", "q", "k", "v", "o", "q_norm", "k_norm", "gate", "up", "down", "post_attn", "post_ffn",
                "norm", "head")

PLAIN = ("model_type 'olmo2': q_norm and k_norm normalise the whole q and k projections (width heads * head_dim, "
         "not megatron-core's per-head qk_layernorm over head_dim), and post_attention_layernorm / "
         "post_feedforward_layernorm norm the sublayers' outputs with no norm before them; neither megatron-core "
         "nor a Megatron-Bridge bridge computes that")
"""Why Megatron cannot hold OLMo 2."""


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Llama's config as an ``Olmo2Config``."""
    config = llama.config_from_sizes(sizes, dtypes)
    config.update(architectures=["Olmo2ForCausalLM"], model_type="olmo2")
    return config


FAMILY = Family(
    name="olmo2",
    model_types=("olmo2",),
    architectures=("Olmo2ForCausalLM",),
    preamble=llama.PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    sizes=llama.SIZES,
    sizes_from_config=llama.sizes_from_config,
    config_from_sizes=config_from_sizes,
    plain_megatron=PLAIN,
)
