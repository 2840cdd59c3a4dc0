"""The model sizes of a DeepSpeed checkpoint: given, else from a Hugging Face ``config.json`` beside
it, else what the Llama tensor shapes in ``param_shapes`` tell (which cannot tell heads from head dim).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from reshard.errors import CheckpointFormatError
from reshard.formats.base import check_sizes, given_sizes
from reshard.formats.deepspeed.files import _config_file, _Files, _hf_config
from reshard.models import llama
from reshard.models.config import config_sizes


def _llama_sizes(files: _Files, shapes: list[list[tuple[str, tuple[int, ...]]]],
                 override: Mapping[str, int] | None, params: int) -> dict[str, int]:
    """Model sizes: ``override``, else a Hugging Face config.json, else what Llama tensor shapes tell; each
    checked, and the layer count at most ``params`` (the params in the model files' param_shapes)."""
    by_name = {k: s for group in shapes for k, s in group}
    sizes: dict[str, int] = {}
    if len(embed := by_name.get("model.embed_tokens.weight", ())) == 2:
        sizes["vocab"], sizes["h"] = embed
    if layers := {int(m.group(1)) for k in by_name if (m := re.match(r"model\.layers\.([0-9]{1,9})\.", k))}:
        sizes["layers"] = max(layers) + 1
    if gate := by_name.get("model.layers.0.mlp.gate_proj.weight"):
        sizes["f"] = gate[0]
    counts = {"layers": params}  # each layer holds a param at least
    config = _hf_config(files)
    found = config_sizes(config, _config_file(files) or files.tag_dir, tensors=params)  # a family's config
    if not found:  # a config without a model_type: read as a Llama's
        found = {name: config[key] for name, key in llama.CONFIG_KEYS.items() if config.get(key) is not None}
    sizes.update(check_sizes(found, _config_file(files), counts=counts) if found else {})
    sizes.update(given_sizes(override))
    q, k = by_name.get("model.layers.0.self_attn.q_proj.weight"), by_name.get("model.layers.0.self_attn.k_proj.weight")
    if q and k and len(q) == 2 and len(k) == 2:
        if "hd" not in sizes and "heads" not in sizes:
            places = ", ".join(str(p) for p in (files.tag_dir, files.root, files.root.parent))
            raise CheckpointFormatError(
                f"{files.tag_dir}: the attention head layout cannot be told from tensor shapes alone "
                f"(q_proj has {q[0]} rows, k_proj {k[0]}): give sizes heads=N (and hd, g if not hidden/heads), "
                f"or put the model's config.json in one of: {places}")
        if "hd" not in sizes:
            sizes["hd"] = q[0] // sizes["heads"]
        if sizes["hd"] < 1:
            raise CheckpointFormatError(f"{files.model[0]}: q_proj has {q[0]} rows for {sizes['heads']} heads")
        sizes.setdefault("heads", q[0] // sizes["hd"])
        sizes.setdefault("g", k[0] // sizes["hd"])
    elif "hd" not in sizes and "h" in sizes and "heads" in sizes:
        sizes["hd"] = sizes["h"] // sizes["heads"]  # Hugging Face's default head_dim
    return check_sizes(sizes, f"{files.model[0]}: param_shapes", counts=counts)


def _shape_sizes(sizes: dict[str, int], shapes: Mapping[str, tuple[int, ...]], where: Path) -> None:
    """Fill in the Llama sizes the tensor shapes tell (given ``heads`` or ``hd``, for the attention layout)."""
    if len(embed := shapes.get("model.embed_tokens.weight", ())) == 2:
        sizes.setdefault("vocab", embed[0])
        sizes.setdefault("h", embed[1])
    layers = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.") and n.split(".")[2].isdecimal()}
    if layers:
        sizes.setdefault("layers", max(layers) + 1)
    if gate := shapes.get("model.layers.0.mlp.gate_proj.weight"):
        sizes.setdefault("f", gate[0])
    q, k = shapes.get("model.layers.0.self_attn.q_proj.weight"), shapes.get("model.layers.0.self_attn.k_proj.weight")
    if q and k and ("heads" in sizes or "hd" in sizes):
        sizes.setdefault("hd", q[0] // sizes["heads"] if "heads" in sizes else sizes["hd"])
        if sizes["hd"] < 1:
            raise CheckpointFormatError(f"{where}: q_proj.weight has {q[0]} rows for {sizes['heads']} heads")
        sizes.setdefault("heads", q[0] // sizes["hd"])
        sizes.setdefault("g", k[0] // sizes["hd"])
