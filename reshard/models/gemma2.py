"""Gemma 2 (``Gemma2ForCausalLM``): Gemma (``reshard.models.gemma``) with sandwich norms
(``post_attention_layernorm`` on the attention's output, ``pre_feedforward_layernorm`` and
``post_feedforward_layernorm`` around the MLP), attention logits soft-capped (``attn_logit_softcapping`` c:
s <- c * tanh(s / c)) and scaled by ``query_pre_attn_scalar``^-1/2, final logits soft-capped
(``final_logit_softcapping``), and a ``sliding_window`` on alternate layers (``layer_types``, layer 0 sliding).

Megatron-Bridge's layout (``Gemma2Bridge``): Gemma's, with ``linear_proj.post_layernorm`` <- post_attention_layernorm
and ``linear_fc2.post_layernorm`` <- post_feedforward_layernorm. Its args add ``softmax_scale`` (and Bridge's
``query_pre_attn_scalar``), both soft-caps, and ``window_size`` (W - 1, 0) with ``window_attn_skip_freq`` 2 (1-based
odd layers sliding).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from reshard.models import gemma, llama
from reshard.models.family import Family

__all__ = ["FAMILY", "PLAIN"]

TENSORS, REGISTRATION = gemma.variant(sandwich=True)

PLAIN = ("attn_logit_softcapping and final_logit_softcapping, post_attention_layernorm and "
         f"post_feedforward_layernorm on the sublayers' outputs, {gemma.PLAIN}")
"""What plain megatron-core cannot express of Gemma 2 (and 3)."""


def config_from_sizes(sizes: Mapping[str, int], dtypes: Any = ()) -> dict[str, Any]:
    """Gemma's config as a ``Gemma2Config`` with transformers' defaults spelled out (soft-caps 50 and 30, window
    4096 on alternate layers, ``query_pre_attn_scalar`` 256)."""
    config = gemma.config_from_sizes(sizes, dtypes)
    del config["hidden_act"]
    config.update(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_activation="gelu_pytorch_tanh",
                  query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                  sliding_window=4096)
    return config


def args_from_config(config: Any) -> dict[str, Any]:
    """Gemma's, the attention scale, the soft-caps and the alternating window."""
    if not isinstance(config, Mapping):
        return {}
    gemma.no_bidirectional(config)
    return (llama.args_from_config(config) | gemma.activation_args(config, "hidden_activation")
            | gemma.scale_args(config) | gemma.softcap_args(config, (50.0, 30.0)) | gemma.window_args(config, 2))


FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    architectures=("Gemma2ForCausalLM",),
    preamble=llama.PREAMBLE,
    tensors=TENSORS,
    registration=REGISTRATION,
    torch_dist=True,
    sizes=llama.SIZES,
    tied_default=True,
    can_tie=False,
    megatron=partial(gemma.megatron, post_norms=True),
    sizes_from_config=gemma.sizes_from_config,
    config_from_sizes=config_from_sizes,
    megatron_args=gemma.megatron_args,
    is_megatron=None,
    config_hints=llama.config_hints,
    args_from_config=args_from_config,
    plain_megatron=f"model_type 'gemma2': {PLAIN}",
)
