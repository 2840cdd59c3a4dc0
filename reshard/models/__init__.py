"""Model families: one module per family (``llama.py``, ``mistral.py``, ``qwen2.py``, ...), listed here.

A family holds everything reshard knows about one kind of model: its logical tensors with their
Hugging Face names and shapes, how its config gives their sizes and how sizes give a config, which
tensors a tensor-parallel plan splits, the order its modules register their parameters, how
Megatron stores it, and how it is recognized (``model_type``, ``architectures``). The formats derive
their layouts from it (``reshard.formats.specs``); ``specs/README.md`` says how to add one.

A model is never guessed: a config whose ``model_type`` no family claims is refused by name.

A Megatron checkpoint names its family by its args alone (``family_for_megatron_args``): each family's
``is_megatron`` asks for exactly what marks it (Qwen2: ``add_qkv_bias``; Qwen3: ``qk_layernorm``; Mistral:
``window_size``; Mixtral: ``num_experts``; Qwen3-MoE: ``num_experts`` with ``qk_layernorm``; GPT-OSS:
``quick_geglu`` with ``softmax_type`` learnable; DeepSeek-V3: ``multi_latent_attention`` with ``num_experts``, which
the other families' checks exclude), so at most one family matches. A family whose args are another's (Phi-3's
are a Llama's or a Mistral's, a Mistral without a window a Llama's) is never chosen by args: with no carried
``config.json`` the checkpoint reads as the family whose args match exactly, which computes the same function;
with one, the config decides when its own Megatron args describe the same family (``megatron_family_of_config``).
A family whose Megatron layout is Megatron-Bridge's (Gemma, Gemma 2, Gemma 3: ``Family.plain_megatron``) has no
``is_megatron``: args cannot say it, and only its carried ``config.json`` does.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models.family import Family

__all__ = ["FAMILIES", "Family", "family_for_config", "family_for_megatron_args", "get_family", "known_family",
           "megatron_family_of_config"]

FAMILIES = {
    "llama": "reshard.models.llama",
    "mistral": "reshard.models.mistral",
    "qwen2": "reshard.models.qwen2",
    "qwen3": "reshard.models.qwen3",
    "phi3": "reshard.models.phi3",
    "mixtral": "reshard.models.mixtral",
    "qwen3_moe": "reshard.models.qwen3_moe",
    "gpt_oss": "reshard.models.gpt_oss",
    "deepseek_v3": "reshard.models.deepseek_v3",
    "deepseek_v3_noqlora": "reshard.models.deepseek_v3_noqlora",
    "gemma": "reshard.models.gemma",
    "gemma2": "reshard.models.gemma2",
    "gemma3_text": "reshard.models.gemma3_text",
    "olmo2": "reshard.models.olmo2",
    "gpt2": "reshard.models.gpt2",
}
"""Family name -> module defining ``FAMILY``."""


def get_family(name: str) -> Family:
    """The family ``name``; CheckpointFormatError listing the known ones otherwise."""
    module = FAMILIES.get(name)
    if module is None:
        raise CheckpointFormatError(f"unknown model family '{name}' (known: {', '.join(FAMILIES)})")
    return importlib.import_module(module).FAMILY


def known_family(config: Mapping[str, Any]) -> Family | None:
    """The family whose ``model_types`` include the config's ``model_type`` and which ``accepts`` it, or None."""
    model_type = config.get("model_type")
    return next((get_family(n) for n in FAMILIES
                 if model_type in get_family(n).model_types and get_family(n).accepts(config)), None)


def family_for_config(config: Mapping[str, Any], where: str = "config.json") -> Family:
    """The family whose ``model_types`` include the config's ``model_type``; never the nearest one."""
    family = known_family(config)
    if family is not None:
        return family
    model_type = config.get("model_type")
    known = ", ".join(dict.fromkeys(t for n in FAMILIES for t in get_family(n).model_types))
    raise CheckpointFormatError(f"{where}: model_type {model_type!r} is not a model family reshard knows "
                                f"(known: {known}); converting it as another family would change the model")


def family_for_megatron_args(args: Mapping[str, Any]) -> Family | None:
    """The family a Megatron run's args describe exactly (SwiGLU, experts, positions, norm, biases, q/k norms,
    window), or None."""
    for name in FAMILIES:
        family = get_family(name)
        if family.is_megatron is not None and family.is_megatron(args):
            return family
    return None


def megatron_family_of_config(family: Family, config: Mapping[str, Any], where: str = "config.json") -> Family | None:
    """The family that the Megatron args of ``config`` (a config of ``family``) describe: ``family`` itself, or
    the one whose args it shares (a Phi-3's are a Llama's, or a Mistral's with a window).

    Raises:
      CheckpointFormatError: the config has a field Megatron's args cannot express.
    """
    if family.megatron_args is None:
        return None
    sizes = family.sizes_from_config(config, where)
    tied = family.config_ties(config)
    args = family.megatron_args(sizes, tied) | family.args_from_config(config)
    if family.megatron_moe_args is not None:
        args |= family.megatron_moe_args(sizes, config, {}, where)
    return family_for_megatron_args(args)
