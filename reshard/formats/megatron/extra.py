"""The non-tensor state a Megatron target writes (``Target.extra["megatron"]``, a ``MegatronState``).

Carried from a Megatron source, or synthesized for a fresh run (``write_fixture_extra``):
args, the optimizer's kind, param groups and step, each rank's rng state, each rank's
model state dict order with its ``_extra_state`` entries; and the items' dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard.core.layout import MASTER, PARAM, Item, Layout
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import Source
from reshard.formats.megatron.args import DEFAULT_SEED, megatron_args
from reshard.formats.megatron.files import CHECKPOINT_VERSION
from reshard.formats.megatron.param_groups import _default_param_groups, _expert_groups
from reshard.formats.megatron.rng import _fresh_rng
from reshard.formats.megatron.specs import (
    _EXPERT_NUM,
    _LAYER_KEY,
    _is_expert,
    _mcore_order,
    _mcore_rank,
    _order_name,
    _renumber_expert,
)
from reshard.formats.megatron.state import (
    KEY,
    TORCH_DIST_KEY,
    MegatronOptimizer,
    MegatronState,
    OptimizerKind,
    TorchDistState,
)
from reshard.io.torch_types import SmallTensor


def write_fixture_extra(sizes: Mapping[str, int], topology: Topology, *, iteration: int = 0, tied: bool = False,
                        seed: int = DEFAULT_SEED, optimizer: bool = True, family: str = "llama") -> MegatronState:
    """The non-tensor state of a freshly made Megatron checkpoint, as ``MegatronFormat.open`` reports it.

    Lets a fixture writer (or ``target`` for a source of another format) produce a
    realistic checkpoint from scratch: put the result in ``Source.extra["megatron"]`` of a
    ``Source(format="megatron", ...)`` at ``topology`` and call ``target``/``write``.
    It holds ``args`` (``megatron_args``), ``iteration``, ``checkpoint_version`` 3.0,
    ``opt_param_scheduler`` (cosine decay, as ``OptimizerParamScheduler.state_dict``),
    the optimizer's two standard param groups (weight decay and none; torch AdamW keys
    plus Megatron's ``wd_mult``/``lr_mult``/...), a per-parameter ``step`` of
    ``iteration``, and per (tp, pp, ep) rank the rng state a run seeded ``seed`` starts with.
    The optimizer's ``kind`` is left None: ``target`` chooses it from the layout's states.

    Example:
        >>> state = write_fixture_extra({"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100,
        ...                              "layers": 4, "vocab_div": 8}, Topology(tp=2, pp=2), iteration=10)
        >>> state.args["padded_vocab_size"], len(state.rng_state)
        (112, 4)
    """
    args = megatron_args(sizes, topology, tied=tied, iteration=iteration, family=family)
    args["seed"] = seed
    groups = _default_param_groups(args) if optimizer else []
    return MegatronState(
        args=args, iteration=iteration, release=False, checkpoint_version=CHECKPOINT_VERSION,
        top_keys=[], other={"num_floating_point_operations_so_far": 0},
        opt_param_scheduler={
            "max_lr": args["lr"], "lr_warmup_steps": 0, "num_steps": iteration * args["global_batch_size"],
            "lr_decay_style": args["lr_decay_style"], "lr_decay_steps": args["train_iters"] * args["global_batch_size"],
            "min_lr": args["min_lr"], "start_wd": args["weight_decay"], "end_wd": args["weight_decay"],
            "wd_incr_style": "constant", "wd_incr_steps": args["train_iters"] * args["global_batch_size"],
        },
        optimizer=MegatronOptimizer(kind=None, param_groups=groups, grad_scaler=None, has_grad_scaler=False,
                                    step=SmallTensor.scalar(float(iteration)) if optimizer else None,
                                    state_keys=[], buffer_dtypes=None),
        rng_state={(t, p, e): _fresh_rng(args, t, p, None, e) for t in range(topology.tp)
                   for p in range(topology.pp) for e in range(topology.ep)},
        extra_state={},
    )


def _target_state(source: Source, topology: Topology, layout: Layout, args: dict[str, Any],
                  meg: bool, family: str = "llama") -> MegatronState:
    """The ``MegatronState`` a target writes: carried from a Megatron source (``meg``), else a fresh run's."""
    src: MegatronState = source.extra[KEY] if meg else write_fixture_extra(
        source.sizes | {"vocab_div": args["make_vocab_size_divisible_by"]}, source.topology,
        tied=not args["untie_embeddings_and_output_weights"], family=family)
    dist = source.extra.get(TORCH_DIST_KEY) if not meg else None
    if isinstance(dist, TorchDistState) and dist.param_groups:  # a torch_dist run's optimizer: its groups and step
        src.optimizer.param_groups, src.optimizer.step = [dict(g) for g in dist.param_groups], None
        src.iteration = dist.iteration
    src_topo = source.topology
    opt = src.optimizer
    flat = "optim" in {it.section for it in layout.items}
    found = {it.state for it in layout.items if it.section == ("optim" if flat else "model")} - {PARAM}
    opt_states = ([MASTER] if MASTER in found else []) + sorted(found - {MASTER})
    kind = None
    if opt_states:
        kind = OptimizerKind.DISTRIBUTED if flat else OptimizerKind.FP16 if MASTER in opt_states else \
            OptimizerKind.FP32
    groups = [dict(g) for g in opt.param_groups] or (_default_param_groups(args) if kind else [])
    # Megatron splits expert params into an optimizer of their own only at ep > 1 (they are allreduce
    # params otherwise): optimizer.state_dict() is then [dense, expert] (ChainedOptimizer), and so is
    # distrib_optim.pt.
    expert_keys = [(it.key, info.shape) for it, info in layout.items.items()
                   if it.section == "model" and it.state == PARAM and _is_expert(it.key)]
    chained = kind is not None and topology.ep > 1 and bool(expert_keys)
    expert_groups = None
    if chained:
        expert_groups = [dict(g) for g in (opt.expert_param_groups or [])]
        if not expert_groups:  # the dense groups as the expert optimizer has them: only those with members
            expert_groups = _expert_groups(groups, expert_keys, f"{source.path}: optimizer")
    elif opt.expert_param_groups:  # back to one optimizer: every param in the dense groups
        groups = [{**g, "is_expert_parallel": False} for g in groups]
    every_group = groups + (expert_groups or [])
    step, state_keys = opt.step, list(opt.state_keys)
    group_step = next((g["step"] for g in every_group if "step" in g), None)
    per_param = kind in (OptimizerKind.FP16, OptimizerKind.FP32)
    if kind is OptimizerKind.DISTRIBUTED:
        # DistributedOptimizer.state_dict puts the step into every group (a float from torch Adam's tensors).
        value = group_step if group_step is not None else \
            step.value() if step is not None else float(src.iteration or 0)
        for g in every_group:
            g["step"] = value
    elif kind is not None and step is None and isinstance(group_step, float):
        # From the distributed optimizer with torch Adam: the step goes back into each parameter's state.
        step = SmallTensor.scalar(group_step)
        for g in every_group:
            g.pop("step", None)
    opt_names = [s for s in opt_states if s != MASTER]
    if per_param:
        keys = [k for k in state_keys if k in opt_names or (k == "step" and step is not None)]
        state_keys = (["step"] if step is not None and "step" not in keys else []) + keys
        state_keys += [s for s in opt_names if s not in state_keys]
    same_ranks = (src_topo.tp, src_topo.pp, src_topo.ep) == (topology.tp, topology.pp, topology.ep) and (
        not args.get("data_parallel_random_init") or src_topo.dp == topology.dp)
    rng: dict[tuple[int, int, int], Any] = {}
    src_rng = src.rng_state
    if src_rng or not meg:
        for t in range(topology.tp):
            for p in range(topology.pp):
                for e in range(topology.ep):
                    rng[(t, p, e)] = src_rng[(t, p, e)] if same_ranks and (t, p, e) in src_rng else \
                        _fresh_rng(args, t, p, next(iter(src_rng.values()), None), e)
    return MegatronState(
        args=args,
        iteration=src.iteration or 0,
        release=bool(src.release),
        checkpoint_version=src.checkpoint_version,
        top_keys=list(src.top_keys),
        other=dict(src.other),
        opt_param_scheduler=src.opt_param_scheduler,
        optimizer=MegatronOptimizer(kind=kind, param_groups=groups, expert_param_groups=expert_groups,
                                    grad_scaler=opt.grad_scaler, has_grad_scaler=bool(opt.has_grad_scaler),
                                    step=step if per_param else None, state_keys=state_keys,
                                    buffer_dtypes=opt.buffer_dtypes, opt_states=opt_states),
        rng_state=rng,
        model_order=_model_order(layout, topology, src.extra_state, src_topo.tp,
                                 int(args["num_layers"]), int(source.sizes.get("experts", 0))),
    )


def _model_order(layout: Layout, topology: Topology, extra_state: Mapping[str, Mapping[int, Any]], src_tp: int,
                 layers: int, experts: int = 0) -> dict[tuple[int, int, int, int], list[tuple[str, Any]]]:
    """Per (tp, pp, ep, chunk): the model state dict's entries in Megatron's order: (key, Item or extra-state value).

    ``extra_state`` names carry global layer and expert numbers; here they become the
    stage-local layer and the ep-local expert of the rank that holds them.
    """
    out: dict[tuple[int, int, int, int], list[tuple[str, Any]]] = {}
    for it in layout.items:
        if it.section == "model" and it.state == PARAM:
            u = dict(it.unit)
            out.setdefault((u["tp"], u["pp"], u.get("ep", 0), it.chunk), []).append((it.key, it))
    local_experts = experts // topology.ep if experts else 0
    modules = {it.key.rpartition(".")[0] for it in layout.items if it.section == "model"}
    places = topology.layer_placement(layers)
    last = (topology.pp - 1, topology.vpp - 1)
    for name, per_tp in extra_state.items():
        m = _LAYER_KEY.fullmatch(name)
        ep_ranks = range(topology.ep)
        if m:
            pl = places[int(m.group(1))]
            stage, chunk, key = pl.stage, pl.chunk, f"decoder.layers.{pl.local}.{m.group(2)}"
            g = _EXPERT_NUM.search(key)
            if g is not None and local_experts:
                ep_ranks = [int(g.group(2)) // local_experts]
                key = _renumber_expert(key, lambda j: j % local_experts)
        else:
            rank = _mcore_rank(name)
            stage, chunk = (0, 0) if rank is not None and rank[0] == 0 else last
            key = name
        if ".mlp.experts." in key and key.endswith("._extra_state") and key[:-len("._extra_state")] not in modules:
            continue  # experts the target stores otherwise (SequentialMLP's as grouped GEMM): that module is gone
        values = list(per_tp.values())
        for t in range(topology.tp):
            if topology.tp == src_tp and t in per_tp:
                value = per_tp[t]
            elif all(v == values[0] for v in values):
                value = values[0]
            else:
                raise CheckpointFormatError(
                    f"{name}: the tp ranks hold different values (fp8 scaling state?); "
                    f"cannot carry it to tp={topology.tp}")
            for e in ep_ranks:
                out.setdefault((t, stage, e, chunk), []).append((key, _Extra(value)))
    per_ep = _layout_per_ep(layout)
    for (t, p, e, c), entries in out.items():
        if any("/" in k for k, _ in entries):  # the legacy model's nested names: the spec's order is Megatron's
            unit = (("tp", t), ("pp", p)) + ((("ep", e),) if per_ep else ())
            spec_order = [it.key for it in layout.order.get(_order_name(unit, c), ())]
        else:
            spec_order = _mcore_order([k for k, _ in entries])
        pos = {k: i for i, k in enumerate(spec_order)}
        entries.sort(key=lambda e: pos.get(e[0], len(pos)))
    return out


def _layout_per_ep(layout: Layout) -> bool:
    return any(a == "ep" for it in layout.items for a, _ in it.unit)


@dataclass(frozen=True, slots=True)
class _Extra:
    """A model state dict entry that is not a layout item (an ``_extra_state`` value)."""

    value: Any


def _default_dtypes(source: Source, layout: Layout) -> dict[Item, str]:
    """Each target item's dtype: the source's for the same state where known, else bf16 weights and fp32 states."""
    by_state: dict[str, str] = {}
    for it, loc in source.where.items():
        by_state.setdefault(it.state, loc.dtype)
    return {it: by_state.get(it.state, "bfloat16" if it.state == PARAM else "float32") for it in layout.items}
