"""Which model a Megatron checkpoint holds: what its run's args describe, and the identity carried beside it.

Megatron keeps no Hugging Face ``config.json``; reshard writes the one a source carried (with its
``generation_config.json`` and tokenizer files) beside every Megatron checkpoint it makes, in the save
directory, and reads it back from there or the directory above (``reshard.formats.identity``). The
args still say what the model is: a carried config must name the family they describe, and one that
names another model is an error, never a choice between the two. Where the args describe no family
reshard knows, a carried config of a known family says which it is.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.formats.base import ModelMeta, Source
from reshard.formats.identity import CONFIG_NAME, read_identity
from reshard.io.bounds import brief
from reshard.io.location import as_path
from reshard.models import FAMILIES, Family, family_for_megatron_args, known_family, megatron_family_of_config

__all__ = ["agreed_family", "args_shown", "carried_identity", "read_carried", "unknown_model"]


def read_carried(*dirs: Path) -> tuple[ModelMeta, Path | None]:
    """The identity in the first of ``dirs`` holding a ``config.json``, and that file (None when none has one)."""
    where = next((as_path(d) / CONFIG_NAME for d in dirs if (as_path(d) / CONFIG_NAME).is_file()), None)
    return read_identity(*dirs), where


def args_shown(args: Mapping[str, Any]) -> str:
    """What Megatron's args say about the architecture, as an error shows it."""
    return (f"swiglu={args.get('swiglu')}, normalization={args.get('normalization')}, "
            f"position_embedding_type={args.get('position_embedding_type')}, num_experts={args.get('num_experts')}")


def agreed_family(args: Mapping[str, Any] | None, model: ModelMeta, args_where: Path | str,
                  config_where: Path | None, *, spec: str | None = None) -> Family | None:
    """The family of a Megatron checkpoint: the one its ``args`` describe, which a carried ``config.json`` must
    name too, unless the config's own Megatron args describe the same family (a Phi-3's are a Llama's, and the
    config decides); the config's family when the args describe none (or are absent); None when neither knows. With
    a ``spec``, the spec lays the checkpoint out, and a config of another model than the args' is the user's
    to vouch for.

    Raises:
      CheckpointFormatError: the config's ``model_type`` is not of the family the args describe (no spec given).
    """
    by_args = family_for_megatron_args(args) if args else None
    config = model.config
    if not isinstance(config, dict):
        return by_args
    by_config = known_family(config)
    if by_args is None or config.get("model_type") in by_args.model_types or spec is not None:
        return by_args or by_config
    if by_config is not None and _same_megatron(by_config, config, config_where) is by_args:
        return by_config  # Megatron's args are the same for both (a Mistral without a window is a Llama there)
    named = f"the {by_config.name} family" if by_config else "no model family reshard knows"
    raise CheckpointFormatError(
        f"{config_where}: model_type {brief(config.get('model_type'), 60)} names {named}, but the args in "
        f"{args_where} describe a {by_args.name} model ({args_shown(args)}); which one this checkpoint holds is "
        "not reshard's guess to make: remove the config.json of the other model, or give a spec")


def _same_megatron(family: Family, config: dict, where: Path | None) -> Family | None:
    """The family Megatron's args for ``config`` describe, None when the config cannot be Megatron's."""
    try:
        return megatron_family_of_config(family, config, str(where))
    except CheckpointFormatError:
        return None


def unknown_model(where: Path, args: Mapping[str, Any], tp: int, first: tuple[str, tuple[int, ...]] | None) -> str:
    """Why a torch-format checkpoint of a model no family describes cannot be laid out (and what to pass)."""
    stored = "" if first is None else (
        f"which dimension of '{first[0]}' ({list(first[1])} in this file, at tensor_model_parallel_size={tp}) "
        "the tensor-parallel ranks split, if any, is recorded nowhere. ")
    return (f"{where}: the args describe no model family reshard knows ({args_shown(args)}), and Megatron's "
            f"torch format stores tensor-parallel shards without their split dimensions: {stored}Pass --spec <file> "
            f"with this model's layout, or put the model's Hugging Face config.json of a known family "
            f"({', '.join(FAMILIES)}) beside the checkpoint")


def carried_identity(source: Source, family: Family | None) -> ModelMeta:
    """What a Megatron target keeps of the source's identity: the ``config.json``, ``generation_config.json``
    and tokenizer files it carried (none is built: Megatron's args say what a config would), and its family."""
    config = source.model.config
    return replace(source.model, family=family.name if family is not None else source.model.family,
                   config=copy.deepcopy(config) if isinstance(config, dict) else None,
                   generation_config=copy.deepcopy(source.model.generation_config),
                   files=dict(source.model.files), hints=dict(source.model.hints))
