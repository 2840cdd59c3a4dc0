"""A model's identity on disk: its Hugging Face ``config.json``, ``generation_config.json`` and tokenizer
files, read from beside a checkpoint and written beside every converted one.

Hugging Face checkpoints hold them in their own directory; the transformers Trainer leaves them beside a
DeepSpeed checkpoint; reshard writes them beside every DCP, DeepSpeed, UCP and Megatron checkpoint it
makes, so that after any chain of conversions the Hugging Face output loads with ``from_pretrained``
and tokenizes as the original did. Nothing here interprets a config: which family a config names is
``reshard.models``' business, and a config no family claims travels just the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.formats.base import ModelMeta
from reshard.io.location import as_path
from reshard.io.smallfiles import read_json

__all__ = ["CONFIG_NAME", "GENERATION_CONFIG_NAME", "TOKENIZER_FILES", "read_identity", "write_identity"]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")
"""The files ``AutoTokenizer.save_pretrained`` writes (by tokenizer kind), carried verbatim."""

_FILE_LIMIT = 256 << 20  # the largest tokenizer file carried (real ones are under 40 MB)


def read_identity(*dirs: Path) -> ModelMeta:
    """The model identity in the first of ``dirs`` holding a ``config.json``: the config (any model type),
    the generation config and the tokenizer files beside it. Empty when no directory has a config."""
    for d in dirs:
        config_path = as_path(d) / CONFIG_NAME
        if not config_path.is_file():
            continue
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise CheckpointFormatError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
        generation = as_path(d) / GENERATION_CONFIG_NAME
        gen = read_json(generation) if generation.is_file() else None
        if gen is not None and not isinstance(gen, dict):
            raise CheckpointFormatError(f"{generation}: expected a JSON object, got {type(gen).__name__}")
        files: dict[str, bytes] = {}
        for name in TOKENIZER_FILES:
            p = as_path(d) / name
            if p.is_file():
                if p.stat().st_size > _FILE_LIMIT:
                    raise CheckpointFormatError(f"{p}: {p.stat().st_size} bytes, more than a tokenizer file holds")
                files[name] = p.read_bytes()
        return ModelMeta(config=config, generation_config=gen, files=files)
    return ModelMeta()


def _json_text(value: Mapping[str, Any]) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def write_identity(out: Path, model: ModelMeta, config: Mapping[str, Any] | None = None) -> list[Path]:
    """Write ``config`` (else ``model.config``), the generation config and the tokenizer files into ``out``;
    the paths written, relative to ``out``."""
    config = model.config if config is None else config
    written: list[Path] = []
    if config is not None:
        (Path(out) / CONFIG_NAME).write_text(_json_text(config), encoding="utf-8")
        written.append(Path(CONFIG_NAME))
    if model.generation_config is not None:
        (Path(out) / GENERATION_CONFIG_NAME).write_text(_json_text(model.generation_config), encoding="utf-8")
        written.append(Path(GENERATION_CONFIG_NAME))
    for name, data in model.files.items():
        if name not in TOKENIZER_FILES:  # never a path: names come from the fixed list above
            raise CheckpointFormatError(f"{name!r} is not a tokenizer file reshard carries")
        (Path(out) / name).write_bytes(data)
        written.append(Path(name))
    return written
