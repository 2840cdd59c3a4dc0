"""Model families: one module per family (``llama.py``, ``mixtral.py``, ``gpt2.py``), listed here.

A family holds everything reshard knows about one kind of model: its logical tensors with their
Hugging Face names and shapes, how its config gives their sizes and how sizes give a config, which
tensors a tensor-parallel plan splits, the order its modules register their parameters, how
Megatron stores it, and how it is recognized (``model_type``, ``architectures``). The formats derive
their layouts from it (``reshard.formats.specs``); ``specs/README.md`` says how to add one.

A model is never guessed: a config whose ``model_type`` no family claims is refused by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.models.family import Family

__all__ = ["FAMILIES", "Family", "family_for_config", "family_for_megatron_args", "get_family", "known_family"]

FAMILIES = {
    "llama": "reshard.models.llama",
    "mixtral": "reshard.models.mixtral",
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
    """The family whose ``model_types`` include the config's ``model_type``, or None."""
    model_type = config.get("model_type")
    return next((get_family(n) for n in FAMILIES if model_type in get_family(n).model_types), None)


def family_for_config(config: Mapping[str, Any], where: str = "config.json") -> Family:
    """The family whose ``model_types`` include the config's ``model_type``; never the nearest one."""
    family = known_family(config)
    if family is not None:
        return family
    model_type = config.get("model_type")
    known = ", ".join(t for n in FAMILIES for t in get_family(n).model_types)
    raise CheckpointFormatError(f"{where}: model_type {model_type!r} is not a model family reshard knows "
                                f"(known: {known}); converting it as another family would change the model")


def family_for_megatron_args(args: Mapping[str, Any]) -> Family | None:
    """The family a Megatron run's args describe (SwiGLU, experts, positions, norm), or None."""
    for name in FAMILIES:
        family = get_family(name)
        if family.is_megatron is not None and family.is_megatron(args):
            return family
    return None
