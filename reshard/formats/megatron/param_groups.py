"""The optimizer's param groups as Megatron builds them.

The default weight-decay split (a group with ``wd_mult`` 1, one with ``wd_mult`` 0 for
biases and 1-D params), which group each parameter belongs to, in ``named_parameters``
order, and the groups of a fresh run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.io.bounds import brief


def _no_wd(key: str, shape: tuple[int, ...]) -> bool:
    """Megatron's default no-weight-decay rule: biases and 1-D params (get_standard_config_overrides)."""
    return len(shape) == 1 or key.endswith(".bias")


def _group_is_no_wd(group: Mapping[str, Any], where: str, g: int) -> bool:
    if isinstance(group.get("wd_mult"), int | float) and not isinstance(group["wd_mult"], bool):
        return float(group["wd_mult"]) == 0.0
    if "wd_mult" in group:
        raise CheckpointFormatError(f"{where}: param group {g} has wd_mult {brief(group['wd_mult'], 40)}, "
                                    "not a number")
    raise CheckpointFormatError(f"{where}: param group {g} has no 'wd_mult'; cannot tell which parameters it holds")


def _assign_groups(groups: Sequence[Mapping[str, Any]], params: list[tuple[str, tuple[int, ...]]],
                   where: str) -> list[list[int]]:
    """Per param group, the indices into ``params`` (named_parameters order) it holds, in order."""
    kinds = [_group_is_no_wd(g, where, k) for k, g in enumerate(groups)]
    if kinds.count(True) > 1 or kinds.count(False) > 1:
        raise CheckpointFormatError(
            f"{where}: {len(groups)} optimizer param groups; only Megatron's default weight-decay split "
            "(one group with wd_mult 1, one with wd_mult 0) is supported yet")
    out: list[list[int]] = [[] for _ in groups]
    for k, (key, shape) in enumerate(params):
        nowd = _no_wd(key, shape)
        if nowd not in kinds:
            raise CheckpointFormatError(f"{where}: no param group for '{key}' (wd_mult {'0' if nowd else '1'})")
        out[kinds.index(nowd)].append(k)
    for g, members in enumerate(out):
        listed = groups[g].get("params")
        if listed is not None and not isinstance(listed, list):
            raise CheckpointFormatError(f"{where}: param group {g}'s 'params' is {brief(listed, 60)}, not a list")
        if listed is not None and len(listed) != len(members):
            raise CheckpointFormatError(
                f"{where}: param group {g} lists {len(listed)} parameters, the model has {len(members)} "
                f"{'without' if kinds[g] else 'with'} weight decay")
    return out



def _expert_groups(groups: Sequence[Mapping[str, Any]], expert_params: list[tuple[str, tuple[int, ...]]],
                   where: str) -> list[dict[str, Any]]:
    """The expert optimizer's param groups as megatron-core makes them beside the dense ones (ep > 1): the dense
    groups that would hold one of ``expert_params`` (stored key, shape), with ``is_expert_parallel`` set."""
    classes = {_no_wd(k, shape) for k, shape in expert_params}
    return [{**g, "is_expert_parallel": True} for k, g in enumerate(groups) if _group_is_no_wd(g, where, k) in classes]


def _default_param_groups(args: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The optimizer's param groups as Megatron builds them: weight-decayed params, then the rest (wd_mult 0).

    Keys in the order a real state dict has them: Megatron's (``_get_param_groups``), then
    torch AdamW's defaults; ``weight_decay`` as the scheduler sets it (``wd * wd_mult``).
    """
    def group(wd_mult: float) -> dict[str, Any]:
        return {
            "is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": args["lr"], "min_lr": args["min_lr"],
            "lr": args["lr"], "betas": (args["adam_beta1"], args["adam_beta2"]), "eps": args["adam_eps"],
            "weight_decay": args["weight_decay"] * wd_mult, "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
        }
    return [group(1.0), group(0.0)]
