"""The non-tensor state of a DeepSpeed checkpoint: everything in its files but the resharded tensors.

Read off a source's files into templates, 0-d tensors held by value as ``Scalar``s
(``_template``, ``_optim_template``); carried to a target at another ZeRO stage (``_carry``);
synthesized for a run that never had one (``synthesize_extra``: what DeepSpeed 0.19.8 writes);
and put back into a file's tree for writing (``_with_scalars``). Also the DeepSpeed classes the
files pickle, written as ``Opaque`` calls without importing DeepSpeed: ``ZeroStageEnum``,
``fragment_address`` and ``LossScaler``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from reshard.core.layout import Item
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.io.location import read_at
from reshard.io.torch_types import SmallTensor
from reshard.io.torchfile import Opaque, TensorRef, TensorSpec

DS_VERSION = "0.19.8"
"""The DeepSpeed release whose files ``synthesize_extra`` imitates."""
_FRAGMENT = ("deepspeed.utils.tensor_fragment", "fragment_address")
_ZERO_STAGE = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
_LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")


Scalar = SmallTensor
"""A 0-d tensor carried by value (Adam's ``step``); ``(0,)``-shaped for ZeRO-3's empty module placeholders."""


class DsOptimizer(str, Enum):
    """The DeepSpeed optimizer that saved a ZeRO-1/2 checkpoint: each lays out its flat partitions its own way."""

    ZERO = "zero"
    """DeepSpeedZeroOptimizer (``stage_1_and_2.py``): its state dict names a ``zero_stage``; the master
    partition is saved without its padding, which is counted on each partition it falls in."""
    BF16 = "bf16"
    """BF16_Optimizer (``bf16_optimizer.py``, bf16 ZeRO-1 with fp32 gradient accumulation): no stage, the
    master partition saved whole, all padding counted on the last rank."""

    def __str__(self) -> str:  # the value, as a plain str would print (3.12 prints the member's name otherwise)
        return self.value


@dataclass(slots=True, kw_only=True)
class DeepSpeedExtra:
    """Everything in the files but the resharded tensors: what ``write`` needs besides ``fill``.

    ``model_states`` and ``optim_states`` are the object trees of one model file (without
    ``module``) and of dp rank 0's optimizer file, with the flat tensors taken out and 0-d
    tensors held as ``Scalar``. ``write`` refills them per rank and recomputes whatever
    depends on the topology.
    """

    tag: str
    """The tag directory's name, and the content of ``latest``."""
    zero_stage: int
    """1 or 2."""
    optimizer: DsOptimizer
    """DeepSpeedZeroOptimizer or BF16_Optimizer."""
    bf16_names: bool
    """Optimizer files are named ``bf16_zero_pp_rank_*`` (the engine had bf16 enabled)."""
    elastic: bool
    """``base_optimizer_state`` is a list of per-group states without padding (``elastic_checkpoint``)."""
    model_states: dict[str, Any]
    optim_states: dict[str, Any]
    module_order: tuple[str, ...] = ()
    """Key order of the source's ``module``; keys it lacks follow in the spec's order."""
    synthesized: bool = False
    """Made by ``synthesize_extra``: ``write`` sets the bf16 file names and config from the target's dtypes."""
    layer_model_axis: bool = True
    """Pipeline layer files name their tp rank (``layer_XX-model_YY-``; a topology with a model axis)."""
    empty_layers: tuple[int, ...] = ()
    """The pipeline layers whose files hold nothing (parameterless layer modules): written empty again."""


def _is_flat(value: Any) -> bool:
    return isinstance(value, TensorRef) and len(value.shape) >= 1


def _map_tree(x: Any, fn: Callable[[Any], Any]) -> Any:
    """A copy of the containers of ``x`` (keeping dict subclasses and ``Opaque``) with ``fn`` applied to each child."""
    if isinstance(x, dict):
        out = copy.copy(x)
        for k, v in x.items():
            out[k] = fn(v)
        return out
    if type(x) in (list, tuple):
        return type(x)(fn(v) for v in x)
    if isinstance(x, Opaque):
        return dataclasses.replace(x, args=fn(x.args), state=fn(x.state), listitems=fn(x.listitems),
                                   dictitems=fn(x.dictitems))
    return x


def _template(tree: Mapping, path: Path, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """``tree`` without the ``drop`` keys and with 0-d tensors read into ``Scalar``s; other tensors are refused."""

    def walk(x: Any) -> Any:
        if isinstance(x, TensorRef):
            if x.shape != ():
                raise CheckpointFormatError(f"{path}: holds a {list(x.shape)} tensor outside the state "
                                            "reshard reshards")
            data = read_at(path, x.data_offset, x.nbytes)
            if len(data) != x.nbytes:
                raise CheckpointFormatError(f"{path}: ends inside a scalar tensor")
            return Scalar(x.dtype, (), data)
        return _map_tree(x, walk)

    return {k: walk(v) for k, v in tree.items() if k not in drop}


def _without_fragments(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A model file's tree with ``frozen_param_fragments`` emptied (the key kept in place: the order is the
    file's); a write refills it from the target's layout."""
    out = dict(tree)
    if isinstance(out.get("frozen_param_fragments"), Mapping):
        out["frozen_param_fragments"] = OrderedDict()
    return out


def _optim_template(tree: Mapping, path: Path) -> dict[str, Any]:
    """An optimizer file's tree with its flat tensors taken out (``write`` puts each rank's back)."""

    def lean(group: Mapping) -> dict:
        return {k: v for k, v in group.items() if not _is_flat(v)}

    osd = dict(tree["optimizer_state_dict"], single_partition_of_fp32_groups=[], param_slice_mappings=[])
    base = osd["base_optimizer_state"]
    if isinstance(base, Mapping):
        osd["base_optimizer_state"] = dict(base, state={g: lean(s) for g, s in base.get("state", {}).items()})
    else:
        osd["base_optimizer_state"] = [lean(s) for s in base]
    return _template(dict(tree, optimizer_state_dict=osd), path)


def _carry(extra: DeepSpeedExtra, stage: int, groups: int, spec_name: str) -> DeepSpeedExtra:
    """A DeepSpeed source's carried state, for a target at ZeRO ``stage`` with ``groups`` param groups."""
    base = extra.optim_states["optimizer_state_dict"]["base_optimizer_state"]
    had = len(base.get("param_groups", ())) if isinstance(base, Mapping) else len(base)
    if had != groups:
        raise CheckpointFormatError(f"spec '{spec_name}' has {groups} param groups but the source's optimizer "
                                    f"had {had}; their hyperparameters cannot be carried (use the source's spec)")
    if stage == extra.zero_stage:
        return extra
    if extra.optimizer == DsOptimizer.BF16:
        raise TopologyError("a BF16_Optimizer checkpoint (bf16 ZeRO-1, fp32 gradient accumulation) "
                            f"cannot become ZeRO stage {stage}")
    model_states, optim_states = copy.deepcopy(extra.model_states), copy.deepcopy(extra.optim_states)
    optim_states["optimizer_state_dict"]["zero_stage"] = _zero_stage(stage)
    for key in ("frozen_param_shapes", "frozen_param_fragments"):  # saved from stage 2 on (partition_gradients)
        if key in model_states:
            model_states[key] = OrderedDict() if stage >= 2 else None
    return dataclasses.replace(extra, zero_stage=stage, model_states=model_states, optim_states=optim_states)


def _ds_config(config: Any, dp: int, stage: int) -> Any:
    if not isinstance(config, Mapping):
        return copy.deepcopy(config)
    config = copy.deepcopy(dict(config))
    micro, gas = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
    if "train_batch_size" in config and isinstance(micro, int) and isinstance(gas, int):
        config["train_batch_size"] = micro * gas * dp
    if isinstance(zero := config.get("zero_optimization"), Mapping) and "stage" in zero:
        config["zero_optimization"] = {**zero, "stage": stage}
    return config


def _zero_stage(stage: int) -> Opaque:
    """``ZeroStageEnum(stage)``: an enum, pickled as a call with its value."""
    return Opaque(*_ZERO_STAGE, (stage,), None)


def _fragment_address(numel: int, start: int) -> Opaque:
    """``fragment_address(numel, start)``: a dataclass, pickled with NEWOBJ and its ``__dict__``."""
    return Opaque(*_FRAGMENT, (), {"numel": numel, "start": start}, newobj=True)


_Sources = dict[Any, tuple[Item | Scalar, int]]
"""Per ``TensorSpec`` key: the item (or scalar) that fills it, and how many elements."""


def _with_scalars(tree: Mapping, sources: _Sources) -> dict[str, Any]:
    """A copy of ``tree`` with each ``Scalar`` as a ``TensorSpec`` leaf, recorded in ``sources``."""

    def walk(x: Any) -> Any:
        if isinstance(x, Scalar):
            key = ("scalar", len(sources))
            sources[key] = (x, math.prod(x.shape))
            return TensorSpec(x.dtype, x.shape, key)
        return _map_tree(x, walk)

    return {k: walk(v) for k, v in tree.items()}


def synthesize_extra(*, groups: int = 1, dtype: str = "bfloat16", zero_stage: int = 2,
                     states: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), global_steps: int = 1,
                     micro_batch: int = 1, accumulation: int = 1, dp: int = 1, lr: float = 1e-3,
                     weight_decay: tuple[float, ...] | None = None, tag: str | None = None,
                     ds_version: str = DS_VERSION) -> DeepSpeedExtra:
    """The non-tensor state DeepSpeed 0.19.8 writes, for a run that never had one.

    It imitates ``deepspeed.initialize`` with a client ``torch.optim.Adam`` (one param
    group per flat buffer, ``weight_decay`` per group, default 0), the config
    ``{"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps":
    accumulation, "zero_optimization": {"stage": zero_stage}, "bf16": {"enabled": dtype ==
    "bfloat16"}}``, no lr scheduler, and ``global_steps`` optimizer steps (Adam's ``step``,
    no skipped steps) seeing ``global_steps * micro_batch * accumulation * dp`` samples,
    saved under the tag ``global_step{global_steps}``. DeepSpeedZeroOptimizer only (not
    BF16_Optimizer), bf16 or fp32 (fp16's dynamic loss scaler has more state).

    >>> synthesize_extra(global_steps=5).tag
    'global_step5'
    """
    if dtype not in ("bfloat16", "float32"):
        raise CheckpointFormatError(f"synthesize_extra: dtype '{dtype}' is not supported (bfloat16 or float32)")
    if zero_stage not in (1, 2):
        raise CheckpointFormatError(f"synthesize_extra: ZeRO stage {zero_stage} is not supported (1 or 2)")
    decay = weight_decay if weight_decay is not None else (0,) * groups
    if len(decay) != groups:
        raise CheckpointFormatError(f"synthesize_extra: {len(decay)} weight_decay values for {groups} param groups")
    bf16 = dtype == "bfloat16"
    ds_config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
                 "zero_optimization": {"stage": zero_stage}, "bf16": {"enabled": bf16}}
    frozen: OrderedDict | None = OrderedDict() if zero_stage >= 2 else None  # saved from stage 2 on
    model_states: dict[str, Any] = {
        "buffer_names": [], "optimizer": None, "param_shapes": [], "frozen_param_shapes": frozen, "shared_params": {},
        "frozen_param_fragments": copy.copy(frozen), "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
        "skipped_steps": 0, "global_steps": global_steps,
        "global_samples": global_steps * micro_batch * accumulation * dp,
        "dp_world_size": dp, "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config, "ds_version": ds_version,
    }
    step = Scalar("float32", (), struct.pack("<f", global_steps))
    param_groups = [{"lr": lr, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": decay[g], "amsgrad": False,
                     "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                     "decoupled_weight_decay": False, "params": [g]} for g in range(groups)]
    osd = {
        "loss_scaler": Opaque(*_LOSS_SCALER, (), {"cur_scale": 1.0, "dynamic": False}, newobj=True),
        "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
        "base_optimizer_state": {"state": {g: {"step": step} for g in range(groups)} if states else {},
                                 "param_groups": param_groups},
        "single_partition_of_fp32_groups": [], "zero_stage": _zero_stage(zero_stage), "group_paddings": [],
        "param_alignment_paddings": [], "partition_count": [], "ds_version": ds_version, "param_slice_mappings": [],
    }
    return DeepSpeedExtra(tag=tag or f"global_step{global_steps}", zero_stage=zero_stage, optimizer=DsOptimizer.ZERO,
                          bf16_names=bf16, elastic=False, model_states=model_states, synthesized=True,
                          optim_states={"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": ds_version})


def _with_bf16(extra: DeepSpeedExtra, bf16: bool) -> DeepSpeedExtra:
    """Synthesized state for bf16 training (``bf16_`` file names, ``"bf16": {"enabled": true}``) or not."""
    model_states, optim_states = copy.deepcopy(extra.model_states), copy.deepcopy(extra.optim_states)
    for tree in (model_states, optim_states):
        tree["ds_config"]["bf16"] = {"enabled": bf16}
    return dataclasses.replace(extra, bf16_names=bf16, model_states=model_states, optim_states=optim_states)
