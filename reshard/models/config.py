"""Reading sizes from a Hugging Face config dict, for every family."""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.io.fields import check_sizes
from reshard.models import known_family
from reshard.models.family import Family

__all__ = ["config_ints", "config_sizes", "hf_config", "require_sizes"]


def config_ints(config: Mapping[str, Any], keys: Mapping[str, str], optional: tuple[str, ...],
                where: Path | str) -> dict[str, int]:
    """Size variable -> value of the required config ``keys``; every missing or non-positive one listed at once
    (the ``optional`` keys are checked when present)."""
    bad = [f"'{k}' is missing" for k in keys.values() if config.get(k) is None]
    for k in (*keys.values(), *optional):
        v = config.get(k)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            bad.append(f"'{k}' must be a positive integer, got {json.dumps(v)}")
    if bad:
        raise CheckpointFormatError(f"{where}: " + "; ".join(bad))
    return {var: int(config[k]) for var, k in keys.items()}


def require_sizes(sizes: Mapping[str, int], keys: tuple[str, ...], what: str) -> None:
    """CheckpointFormatError naming the ``keys`` missing from ``sizes`` that building ``what`` needs."""
    missing = [k for k in keys if k not in sizes]
    if missing:
        raise CheckpointFormatError(f"cannot build {what}: model sizes {', '.join(missing)} are unknown")


def config_sizes(config: Any, where: Path | str, *, tensors: int | None = None) -> dict[str, int]:
    """The model sizes a ``config.json`` gives when a known family claims it, else none (a config of another
    model is still carried, for its identity, by ``reshard.formats.identity``); ``tensors`` bounds the layer
    and expert counts (each stores one tensor at least)."""
    family = known_family(config) if isinstance(config, dict) else None
    if family is None:
        return {}
    counts = None if tensors is None else dict.fromkeys(("layers", "experts"), tensors)
    return check_sizes(family.sizes_from_config(config, where), where, counts=counts)


def hf_config(family: Family, sizes: Mapping[str, int], dtypes: Any = (), *, carried: Any = None,
              hints: Mapping[str, Any] | None = None, tied: bool | None = None) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint of ``family``: the source's own when it carries one of
    this family (the dtype set to the most common of ``dtypes``), else one built from the sizes and the
    source's ``hints`` (Megatron's args: epsilon, rope base, positions, routing); the tying as written."""
    if isinstance(carried, Mapping) and carried.get("model_type") in family.model_types:
        config = copy.deepcopy(dict(carried))
        common = Counter(dtypes).most_common(1)
        if common:
            config.pop("torch_dtype", None)
            config["dtype"] = common[0][0]
    else:
        config = family.config_from_sizes(sizes, dtypes)
        config.update(hints or {})
    if family.experts and not isinstance(config.get("num_experts_per_tok"), int):
        raise CheckpointFormatError("a mixture-of-experts model without its config.json (the number of experts each "
                                    "token is routed to is not in the weights); put it beside the source")
    if tied is not None and family.can_tie:
        config["tie_word_embeddings"] = tied
    return config
