"""Where a Megatron torch-format checkpoint's files are, and reading them.

The tracker file, the ``iter_XXXXXXX``/``release`` and ``mp_rank_*`` directories and
their file names (the layout on disk is in the package docstring); a rank file's object
tree (no tensor data, no pickled code run) and its model state dicts (``model`` or
``model0``, ``model1``, …; the legacy model's nested tree flattened with '/' and nested
again).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.core.layout import MASTER
from reshard.errors import CheckpointFormatError, ReshardError
from reshard.formats.base import read_tag
from reshard.io.bounds import brief
from reshard.io.torchfile import read_torch_file

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DISTOPT_FILE = "distrib_optim.pt"
CHECKPOINT_VERSION = 3.0

DISTOPT_MAIN = "param"
"""``distrib_optim.pt``'s key for the fp32 main params in each buffer: reshard's state ``MASTER`` (not ``PARAM``,
the model's own weights, which live in ``model_optim_rng.pt``)."""


def _buffer_key(state: str) -> str:
    """The ``distrib_optim.pt`` buffer key of an optimizer item state."""
    return DISTOPT_MAIN if state == MASTER else state


def _buffer_state(key: str) -> str:
    """The optimizer item state of a ``distrib_optim.pt`` buffer key."""
    return MASTER if key == DISTOPT_MAIN else key


@dataclass(slots=True)
class _Rank:
    tp: int
    pp: int
    ep: int
    path: Path  # model_optim_rng.pt
    obj: dict
    distopt: Any = None  # the distrib_optim.pt tree
    distopt_path: Path | None = None


def _read(path: Path, *, model: bool = True) -> Any:
    """A rank file's object tree (read_torch_file: no tensor data, no pickled code run)."""
    try:
        obj = read_torch_file(path)
    except ReshardError:
        raise
    except Exception as e:  # a malformed file must not surface as a bare traceback
        raise CheckpointFormatError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if model and not isinstance(obj, dict):
        raise CheckpointFormatError(f"{path}: holds a {type(obj).__name__}, expected a dict")
    if model and (key := next((k for k in obj if not isinstance(k, str)), None)) is not None:
        raise CheckpointFormatError(f"{path}: top-level key {brief(key, 60)} is not a string")
    return obj


def _iteration_dir(path: Path) -> tuple[Path, int | None, bool]:
    """The iteration directory to read, its iteration (None for release) and whether it is a release."""
    tracker = path / TRACKER
    if tracker.is_file():
        text = read_tag(tracker, "iteration number or 'release'")
        if text == "release":
            it_dir, iteration, release = path / "release", None, True
        elif re.fullmatch(r"[0-9]{1,15}", text):
            iteration, release = int(text), False
            it_dir = path / f"iter_{iteration:07d}"
        else:
            raise CheckpointFormatError(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}")
        if not it_dir.is_dir():
            raise CheckpointFormatError(f"{tracker} names {text}, but {it_dir} does not exist")
        return it_dir, iteration, release
    m = re.fullmatch(r"iter_([0-9]{7,})", path.name)
    if m and path.is_dir():
        return path, int(m.group(1)), False
    if path.name == "release" and path.is_dir():
        return path, None, True
    raise CheckpointFormatError(f"{path}: no {TRACKER} and not an iter_XXXXXXX directory")


def _rank_dir_name(tp: int, pp: int, pp_size: int, ep: int = 0, ep_size: int = 1) -> str:
    """``mp_rank_TT``, ``_PPP`` when pp > 1, then ``_EEE`` when ep > 1 (``get_checkpoint_name``)."""
    name = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return name + (f"_{ep:03d}" if ep_size > 1 else "")


def _rank0_file(it_dir: Path) -> Path:
    """The file of rank (tp 0, pp 0, ep 0), whatever the pp and ep suffixes (args tell which apply)."""
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        if (it_dir / name / MODEL_FILE).is_file():
            return it_dir / name / MODEL_FILE
    raise CheckpointFormatError(f"{it_dir}: missing rank file mp_rank_00/{MODEL_FILE} (nor mp_rank_00_000/)")


def _chunks(obj: dict, vpp: int, where: str) -> dict[int, Mapping[str, Any]]:
    if vpp == 1:
        if "model" not in obj:
            raise CheckpointFormatError(f"{where}: no 'model' state dict")
        return {0: obj["model"]}
    out = {c: obj[f"model{c}"] for c in range(vpp) if f"model{c}" in obj}
    if not out:
        raise CheckpointFormatError(f"{where}: no 'model0' … 'model{vpp - 1}' state dicts (vpp={vpp})")
    return out


def _flat_items(sd: Mapping[str, Any], where: Path, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """A state dict's entries, nested dicts (the legacy model's ``language_model`` tree) joined with '/'."""
    for key, value in sd.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{where}: state dict key {brief(key, 60)} (in '{prefix}') is not a string")
        if isinstance(value, Mapping):
            yield from _flat_items(value, where, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def _nested(sd: Mapping[str, Any]) -> OrderedDict:
    """The inverse of ``_flat_items``: 'a/b/c' keys as nested dicts, in first-seen order."""
    out: OrderedDict = OrderedDict()
    for key, value in sd.items():
        *path, last = key.split("/")
        node = out
        for part in path:
            node = node.setdefault(part, OrderedDict())
        node[last] = value
    return out


def _is_legacy(obj: Mapping[str, Any]) -> bool:
    """A legacy (non-mcore) model: its state dict is the nested ``language_model`` tree."""
    sd = obj.get("model", obj.get("model0"))
    return isinstance(sd, Mapping) and isinstance(sd.get("language_model"), Mapping)
