"""The non-tensor state Megatron checkpoints carry, as typed objects in ``Source.extra``/``Target.extra``.

A ``megatron`` (torch-format) source or target holds one ``MegatronState`` under
``extra["megatron"]`` (``KEY``): args, iteration, the optimizer's structure
(``MegatronOptimizer``), rng states, ``_extra_state`` values, and on a target
each rank's model state dict order. An ``mcore-dist`` (torch_dist) source or
target holds one ``TorchDistState`` under ``extra["torch_dist"]``
(``TORCH_DIST_KEY``). Both have ``args``; ``carried_args`` reads them from
either kind of source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from reshard.errors import CheckpointFormatError
from reshard.formats.base import Source, Target
from reshard.formats.megatron.files import CHECKPOINT_VERSION
from reshard.io.torch_types import SmallTensor

if TYPE_CHECKING:
    from reshard.formats.dcp.reading import _Verbatim

__all__ = ["KEY", "TORCH_DIST_KEY", "MegatronOptimizer", "MegatronState", "OptimizerKind", "TorchDistState",
           "carried_args", "state_of"]

KEY = "megatron"
"""Where a ``megatron`` source or target keeps its ``MegatronState`` in ``extra``."""
TORCH_DIST_KEY = "torch_dist"
"""Where an ``mcore-dist`` source or target keeps its ``TorchDistState`` in ``extra``."""


class OptimizerKind(str, Enum):
    """Which Megatron optimizer saved (or is to save) the optimizer state."""

    DISTRIBUTED = "distributed"
    """``DistributedOptimizer``: param groups in the rank file, the states in ``distrib_optim.pt``'s buffers."""
    FP16 = "fp16"
    """``Float16OptimizerWithFloat16Params``: fp32 main params (``fp32_from_fp16_params``) and torch's state dict."""
    FP32 = "fp32"
    """``FP32Optimizer``: torch's state dict itself, no main params."""

    def __str__(self) -> str:  # f"{kind}" is the value on every Python (3.12 changed (str, Enum)'s format)
        return self.value


@dataclass(slots=True, kw_only=True)
class MegatronOptimizer:
    """The optimizer state dict's structure besides its per-parameter tensors (which are layout items).

    On a source: what the rank files hold (``kind`` None: no optimizer was saved). On a
    target: what ``write`` writes (``kind`` None: no optimizer). ``write_fixture_extra``
    leaves ``kind`` None and lets ``target`` choose it from the layout's states.
    """

    kind: OptimizerKind | None = None
    """Which optimizer; None for none."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """The (dense) optimizer's param groups without their ``params`` index lists, in order."""
    expert_param_groups: list[dict[str, Any]] | None = None
    """The expert optimizer's param groups (MoE at ep > 1: a ``ChainedOptimizer`` of [dense, expert]); else None."""
    grad_scaler: Any = None
    """The ``grad_scaler`` state dict (SmallTensors for its tensors), when ``has_grad_scaler``."""
    has_grad_scaler: bool = False
    """The optimizer state dict has a ``grad_scaler`` entry (it may be None)."""
    step: SmallTensor | None = None
    """Every parameter's ``step`` (fp16/fp32 optimizers: one 0-d tensor, the same for all); None if none."""
    state_keys: list[str] = field(default_factory=list)
    """The per-parameter state's key order (``step``, ``exp_avg``, ...) of the fp16/fp32 optimizer."""
    buffer_dtypes: tuple[str, str] | None = None
    """``distrib_optim.pt``'s (param_dtype, grad_dtype) buffer key; a target writes its grad dtype again."""
    opt_states: list[str] = field(default_factory=list)
    """Target only: the per-parameter states written, ``MASTER`` first (a source's layout says its own)."""


@dataclass(slots=True, kw_only=True)
class MegatronState:
    """A Megatron torch-format checkpoint's non-tensor state (``extra["megatron"]``).

    Read by ``MegatronFormat.open`` from rank (tp 0, pp 0, ep 0) (rng states from every
    rank), made by ``MegatronFormat.target`` for ``write``, or synthesized for a fresh
    run by ``write_fixture_extra``.
    """

    args: dict[str, Any]
    """The ``argparse.Namespace`` attributes, as a dict (a target's are updated for its topology)."""
    iteration: int | None = 0
    """The iteration; None for a release source (a target then writes 0 and ``release``)."""
    release: bool = False
    """The checkpoint is in ``release/``, the tracker says ``release``."""
    checkpoint_version: Any = CHECKPOINT_VERSION
    """The file's ``checkpoint_version`` (3.0 today)."""
    top_keys: list[str] = field(default_factory=list)
    """The rank file's top-level keys in order (a target writes its entries in this order)."""
    other: dict[str, Any] = field(default_factory=dict)
    """Top-level entries not otherwise known (``num_floating_point_operations_so_far``, ``rerun_state_machine``)."""
    opt_param_scheduler: Any = None
    """``OptimizerParamScheduler.state_dict()``, or None."""
    optimizer: MegatronOptimizer = field(default_factory=MegatronOptimizer)
    """The optimizer's structure; ``optimizer.kind`` None when there is none."""
    rng_state: dict[tuple[int, int, int], Any] = field(default_factory=dict)
    """Per (tp, pp, ep) rank, its ``rng_state`` (a list of ``get_rng_state`` dicts)."""
    extra_state: dict[str, dict[int, Any]] = field(default_factory=dict)
    """Source: per ``_extra_state`` key (global layer and expert numbers), per tp rank, its value."""
    model_order: dict[tuple[int, int, int, int], list[tuple[str, Any]]] | None = None
    """Target only: per (tp, pp, ep, chunk), the model state dict's entries in order (key, Item or ``_Extra``)."""


@dataclass(slots=True, kw_only=True)
class TorchDistState:
    """A megatron-core torch_dist checkpoint's non-tensor state (``extra["torch_dist"]``).

    On a source: ``common.pt``'s ``args`` and the ``_extra_state`` bytes entries. On a
    target: what ``write`` puts into ``common.pt``, and the bytes entries (in the
    ``DcpWrite``) come along there.
    """

    args: dict[str, Any] = field(default_factory=dict)
    """``common.pt``'s ``args`` as a dict ({} when it has none); a target's are made for its topology."""
    iteration: int | None = None
    """``common.pt``'s ``iteration``."""
    checkpoint_version: Any = CHECKPOINT_VERSION
    """Target: ``common.pt``'s ``checkpoint_version``."""
    extra_states: list[_Verbatim] = field(default_factory=list)
    """Source: the per-layer ``_extra_state`` bytes entries (keyed by global layer), carried as stored (with a
    derived layout: every bytes entry and 0-d tensor)."""
    common: dict[str, Any] | None = None
    """Derived layout: ``common.pt`` without its args (small tensors as ``SmallTensor``), written back whole."""
    chunks: dict[Any, tuple[str, tuple[int, ...], tuple[int, ...], int]] = field(default_factory=dict)
    """Derived source: per item, its stored key, chunk offsets, the key's global size and the rank that wrote it."""
    planner_data: dict[str, Any] = field(default_factory=dict)
    """Derived source: ``.metadata``'s planner data, carried to a derived target."""
    param_groups: list[dict[str, Any]] | None = None
    """Source: the distributed optimizer's param groups (without ``params``, with Adam's ``step``), None if not
    saved; a Megatron target carries them."""
    common_entry: bool = False
    """The common state is megatron-core 0.19's ``common_state`` bytes entry, not ``common.pt`` (``common_state``):
    as read on a source; on a target, the form written."""


def carried_args(source: Source) -> dict[str, Any]:
    """A copy of the Megatron ``args`` a source carries: a ``megatron``, ``mcore-dist`` or ``mcore-fsdp`` one's; else
    {}."""
    state = source.extra.get(KEY) if source.format == "megatron" else \
        source.extra.get(TORCH_DIST_KEY) if source.format in ("mcore-dist", "mcore-fsdp") else None
    return dict(state.args) if isinstance(state, MegatronState | TorchDistState) else {}


def state_of(target: Target) -> MegatronState:
    """A Megatron target's ``MegatronState``; fails when ``target`` was not made by the megatron format."""
    state = target.extra.get(KEY)
    if not isinstance(state, MegatronState) or state.model_order is None:
        raise CheckpointFormatError("target has no megatron state; make it with the megatron format's target()")
    return state
