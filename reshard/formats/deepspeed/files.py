"""The files of a DeepSpeed ZeRO-1/2 checkpoint: their names, finding them, and reading and writing one.

A save dir holds ``latest`` (the tag) and the tag dir; ``open`` takes either. The tag dir holds a
model file per model-parallel rank (``mp_rank_{mp:02d}_model_states.pt``), an optimizer file per
(model-parallel, dp) rank (``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``) and,
under the pipeline engine, a file per layer (``layer_{idx:02d}[-model_{tp:02d}]-model_states.pt``).
MoE expert files are refused. A Hugging Face ``config.json`` is looked for in the tag dir, the save
dir and its parent. Also here: the entries of a model file that the ZeRO-1/2 and ZeRO-3 readers both
check (``param_shapes``, ``ds_config.zero_optimization``). ZeRO-3's file names are in ``zero3``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.execution.session import WriteSession
from reshard.formats.base import Fill, Target, expect_shape, name_of, read_json, read_tag
from reshard.formats.deepspeed.state import Scalar, _Sources
from reshard.io.bounds import brief
from reshard.io.torchfile import TorchFileWriter, read_torch_file

_MODEL_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_LAYER_FILE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")
_REFUSED_FILES = (
    (re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_\d+_mp_rank_\d+_optim_states\.pt"),
     "DeepSpeed MoE checkpoints (expert files) are not supported"),
)


def model_file(mp: int) -> str:
    """The model file of model-parallel rank ``mp`` (``pp * tp_size + tp`` under a pipeline)."""
    return f"mp_rank_{mp:02d}_model_states.pt"


def optim_file(mp: int, dp: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"


def layer_file(layer: int, tp: int | None) -> str:
    """A pipeline layer's weights; ``tp`` None under a topology without a model axis."""
    return f"layer_{layer:02d}{'' if tp is None else f'-model_{tp:02d}'}-model_states.pt"


@dataclass(frozen=True, slots=True)
class _Files:
    root: Path
    """The save dir, which holds ``latest``."""
    tag: str
    tag_dir: Path
    model: tuple[Path, ...]
    """Per model-parallel rank (the tp rank, or ``pp * tp_size + tp`` under a pipeline)."""
    optim: tuple[tuple[Path, ...], ...]
    """Per model-parallel rank, the optimizer files found (dp order)."""
    bf16_names: bool
    layers: Mapping[tuple[int, int | None], Path] = dataclasses.field(default_factory=dict)
    """A pipeline's layer files: (layer index, tp rank or None) -> path; empty without a pipeline."""


def _locate(path: Path) -> tuple[Path, str, Path]:
    """(save dir, tag, tag dir) of a save dir with ``latest``, or of a tag dir itself."""
    latest = path / "latest"
    if latest.is_file():
        tag = read_tag(latest)
        if not (path / tag).is_dir():
            raise CheckpointFormatError(f"{latest}: names tag '{tag}' but {path / tag} is not a directory")
        return path, tag, path / tag
    if path.is_dir() and any(_MODEL_FILE.fullmatch(p.name) for p in path.iterdir()):
        return path.parent, path.name, path
    raise CheckpointFormatError(f"{path}: not a DeepSpeed checkpoint (no 'latest' file, no mp_rank_XX_model_states.pt)")


def _find_files(path: Path) -> _Files:
    root, tag, tag_dir = _locate(path)
    names = sorted(p.name for p in tag_dir.iterdir())
    for pattern, reason in _REFUSED_FILES:
        if any(pattern.fullmatch(n) for n in names):
            raise CheckpointFormatError(f"{tag_dir}: {reason}")
    tps = sorted(int(m.group(1)) for n in names if (m := _MODEL_FILE.fullmatch(n)))
    if tps != list(range(len(tps))):
        missing = next(t for t in range(len(tps) + 1) if t not in set(tps))
        raise CheckpointFormatError(f"{tag_dir}: missing {model_file(missing)} (there is a {model_file(tps[-1])})")
    optim: dict[int, dict[int, str]] = {t: {} for t in tps}
    prefixes = set()
    for n in names:
        if m := _OPTIM_FILE.fullmatch(n):
            prefixes.add(bool(m.group(1)))
            if int(m.group(3)) not in optim:
                raise CheckpointFormatError(f"{tag_dir / n}: an optimizer file of mp rank {m.group(3)}, "
                                            "which has no model file")
            optim[int(m.group(3))][int(m.group(2))] = n
    if not prefixes:
        raise CheckpointFormatError(f"{tag_dir}: no *zero_pp_rank_*_optim_states.pt files "
                                    "(saved without a ZeRO optimizer?)")
    if len(prefixes) > 1:
        raise CheckpointFormatError(f"{tag_dir}: both bf16_zero_pp_rank_* and zero_pp_rank_* files; "
                                    "remove the stale set")
    layers: dict[tuple[int, int | None], Path] = {}
    for n in names:
        if m := _LAYER_FILE.fullmatch(n):
            layers[(int(m.group(1)), None if m.group(2) is None else int(m.group(2)))] = tag_dir / n
    if len({tp is None for _, tp in layers}) > 1:
        raise CheckpointFormatError(f"{tag_dir}: both layer_XX-model_YY-model_states.pt and "
                                    "layer_XX-model_states.pt files; remove the stale set")
    return _Files(root=root, tag=tag, tag_dir=tag_dir, model=tuple(tag_dir / model_file(t) for t in tps),
                  optim=tuple(tuple(tag_dir / optim[t][d] for d in sorted(optim[t])) for t in tps),
                  bf16_names=prefixes.pop(), layers=layers)


def _read(path: Path) -> dict[str, Any]:
    tree = read_torch_file(path)
    if not isinstance(tree, dict):
        raise CheckpointFormatError(f"{path}: holds a {type(tree).__name__}, not a DeepSpeed checkpoint dict")
    if (key := next((k for k in tree if not isinstance(k, str)), None)) is not None:
        raise CheckpointFormatError(f"{path}: top-level key {brief(key, 60)} is not a string")
    return tree


def _get(tree: Any, key: str, where: Path, kind: type | tuple[type, ...] | None = None) -> Any:
    """``tree[key]``, which must exist (and be a ``kind``, when given)."""
    if not isinstance(tree, Mapping) or key not in tree:
        raise CheckpointFormatError(f"{where}: no '{key}' (not a DeepSpeed ZeRO checkpoint file?)")
    if kind is not None and not isinstance(tree[key], kind):
        raise CheckpointFormatError(f"{where}: '{key}' is a {type(tree[key]).__name__} "
                                    f"({brief(tree[key], 60)}), not what a DeepSpeed checkpoint holds there")
    return tree[key]


def _zero_config(model_states: Mapping, where: Path) -> Mapping:
    """``ds_config.zero_optimization`` (empty when absent), which a target rewrites: each a mapping if there."""
    config = model_states.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    if not isinstance(config, Mapping | None) or not isinstance(zero, Mapping | None):
        raise CheckpointFormatError(f"{where}: ds_config is {brief(config, 80)}; expected a mapping whose "
                                    "zero_optimization, if any, is a mapping")
    return zero or {}


def _param_shapes(tree: Any, path: Path) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``param_shapes``: per param group, (name, shape) in flat-buffer order."""
    groups = _get(tree, "param_shapes", path)
    if not isinstance(groups, list) or not groups or not all(isinstance(g, Mapping) for g in groups):
        raise CheckpointFormatError(f"{path}: param_shapes is {brief(groups, 80)}; was the checkpoint saved with "
                                    "ZeRO?")
    return [[(name_of(k), expect_shape(v, f"param_shapes[{g}]['{name_of(k)}']", path)) for k, v in group.items()]
            for g, group in enumerate(groups)]


def _write_file(path: Path, tree: Any, sources: _Sources, fill: Fill, target: Target, session: WriteSession) -> None:
    """One torch file, each item's bytes streamed from ``fill`` through the write session."""
    with TorchFileWriter(path, tree, open_file=session.open) as writer:
        for key in writer.entries:
            src, numel = sources[key]
            if isinstance(src, Scalar):
                writer.write(key, src.data)
                continue
            session.stream_item(fill, src, numel, target.dtypes[src], lambda data, key=key: writer.write(key, data),
                                at=writer.entries[key][0])


def _config_file(files: _Files) -> Path | None:
    return next((p for d in (files.tag_dir, files.root, files.root.parent) if (p := d / "config.json").is_file()), None)


def config_path(tag_dir: Path, root: Path) -> Path:
    """The ``config.json`` a checkpoint's identity is read from (``read_identity(tag_dir, root, root.parent)``), or
    where it would be: named in messages about it."""
    found = (p for d in (tag_dir, root, root.parent) if (p := d / "config.json").is_file())
    return next(found, tag_dir / "config.json")


def _hf_config(files: _Files) -> dict[str, Any]:
    config = read_json(path) if (path := _config_file(files)) else {}
    return config if isinstance(config, dict) else {}
