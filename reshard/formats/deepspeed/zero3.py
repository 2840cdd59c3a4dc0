"""DeepSpeed ZeRO stage 3 checkpoints, read as a source (``DeepSpeedFormat.open`` dispatches here).

On disk (DeepSpeed ``engine.save_checkpoint`` with ``zero_optimization.stage = 3``)::

    <dir>/latest
    <dir>/<tag>/zero_pp_rank_{dp}_mp_rank_00_model_states.pt   per dp rank: param_shapes, empty module tensors
    <dir>/<tag>/[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt

An optimizer file's ``optimizer_state_dict`` holds ``fp32_flat_groups`` (this
rank's fp32 master partition, a tensor tagged with ``ds_id``),
``optimizer_state_dict.state[0]`` (the torch optimizer's per-partition states,
``exp_avg`` and ``exp_avg_sq`` for Adam, and ``step``) and ``partition_count``.
Every param is padded to a multiple of dp and split on its own; rank r holds
``ceil(numel / dp)`` elements of each, concatenated in ``param_shapes`` order
(spec ``deepspeed-llama-zero3``). The training-dtype weights are not stored:
the fp32 master partitions are the weights, as DeepSpeed's own
``zero_to_fp32`` reads them; a target that needs weights gets them.

Checked before any tensor byte is read: the files for every dp rank,
``partition_count``, ``param_shapes`` against the spec (names, order, shapes),
and every flat tensor's size. Not supported, each refused: tp > 1, several
param groups or sub-groups (``sub_group_size`` smaller than the model), frozen
parameters. ``target_zero3``/``write_zero3`` write the same layout at any dp.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reshard.core.layout import MASTER, PARAM, Item, Layout
from reshard.core.resolve import resolve
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, SpecError
from reshard.execution.session import WriteSession
from reshard.formats.base import (
    MAX_COUNT,
    Fill,
    Located,
    ModelMeta,
    Progress,
    Source,
    Target,
    expect_int,
    expect_step,
    require_sizes,
)
from reshard.formats.deepspeed.files import (
    _Files,
    _get,
    _hf_config,
    _param_shapes,
    _read,
    _write_file,
    _zero_config,
)
from reshard.formats.deepspeed.sizes import _llama_sizes
from reshard.formats.deepspeed.state import Scalar, _ds_config, _template, _with_scalars, _zero_stage, synthesize_extra
from reshard.formats.specs import layout_spec, source_family, target_config
from reshard.io.bounds import brief
from reshard.io.torchfile import TensorRef, TensorSpec, TorchSize
from reshard.models import llama

SPEC = "deepspeed-llama-zero3"
MODEL, OPTIM = "model", "optim"
"""The spec's sections: the params in flat order (``param_shapes``), and the flat partitions the files hold."""
MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def is_zero3(names: list[str]) -> bool:
    return any(MODEL_FILE.fullmatch(n) for n in names)


def open_zero3(fmt_name: str, root: Path, tag: str, tag_dir: Path, *, spec: str | None,
               sizes: Mapping[str, int] | None) -> Source:
    names = sorted(p.name for p in tag_dir.iterdir())
    models = {(int(m.group(2)), int(m.group(1))): n for n in names if (m := MODEL_FILE.fullmatch(n))}
    optims = {(int(m.group(3)), int(m.group(2))): n for n in names if (m := OPTIM_FILE.fullmatch(n))}
    tps = {t for t, _ in models}
    if tps != {0}:
        raise CheckpointFormatError(f"{tag_dir}: ZeRO-3 with mp ranks {sorted(tps)}; only tp=1 is supported")
    first_path = tag_dir / models[min(models)]
    first = _read(first_path)
    dp = expect_int(_get(first, "dp_world_size", first_path), "dp_world_size", first_path, lo=1, hi=MAX_COUNT)
    for d in range(dp):
        for kind, table in (("model", models), ("optimizer", optims)):
            if (0, d) not in table:
                raise CheckpointFormatError(f"{tag_dir}: no ZeRO-3 {kind} file for dp rank {d} "
                                            f"({first_path.name} says dp_world_size={dp})")
    extra_ranks = sorted(d for _, d in [*models, *optims] if d >= dp)
    if extra_ranks:
        raise CheckpointFormatError(f"{tag_dir}: files for dp rank {extra_ranks[0]}, but dp_world_size is {dp}")
    if first.get("frozen_param_shapes"):
        raise CheckpointFormatError(f"{first_path}: frozen parameters are not supported")
    _zero_config(first, first_path)
    shapes = _param_shapes(first, first_path)
    if len(shapes) != 1:
        raise CheckpointFormatError(f"{first_path}: {len(shapes)} param groups; the ZeRO-3 reader supports one")
    files = _Files(root=root, tag=tag, tag_dir=tag_dir, model=(first_path,), optim=(), bf16_names=False)
    all_sizes = _llama_sizes(files, shapes, sizes, len(shapes[0]))
    spec_name = spec or SPEC
    parsed = layout_spec(spec_name)
    topology = Topology(dp=dp, zero=3)
    optim_trees = [_read(tag_dir / optims[(0, d)]) for d in range(dp)]
    osd = [_get(tree, "optimizer_state_dict", tag_dir / optims[(0, d)], Mapping) for d, tree in enumerate(optim_trees)]
    states = _states(osd[0], tag_dir / optims[(0, 0)])
    try:
        full = resolve(parsed, topology, all_sizes, states={OPTIM: (MASTER, *states)})
    except SpecError as e:
        known = ", ".join(f"{k}={v}" for k, v in sorted(all_sizes.items()))
        raise CheckpointFormatError(f"{tag_dir}: spec '{spec_name}' does not resolve with the sizes known ({known}); "
                                    f"give the others with sizes, or a config.json\n{e}") from None
    _check_order(full, shapes[0], first_path, spec_name)
    items = {it: info for it, info in full.items.items() if it.section == OPTIM}
    where: dict[Item, Located] = {}
    for d in range(dp):
        path = tag_dir / optims[(0, d)]
        tree = osd[d]
        if _get(tree, "partition_count", path) != dp:
            raise CheckpointFormatError(f"{path}: partition_count is {brief(tree['partition_count'])}, "
                                        f"dp_world_size {dp}")
        groups = _get(tree, "fp32_flat_groups", path)
        if not isinstance(groups, list) or len(groups) != 1:
            raise CheckpointFormatError(f"{path}: fp32_flat_groups holds {len(groups) if isinstance(groups, list) else '?'}"
                                        " sub-groups; only one is supported (raise sub_group_size)")
        mine = _states_of(tree, path)
        per_state = {MASTER: groups[0], **{s: mine.get(s) for s in states}}
        for it in items:
            if dict(it.unit).get("dp") != d:
                continue
            ref = per_state.get(it.state)
            if not isinstance(ref, TensorRef) or not ref.is_contiguous:
                raise CheckpointFormatError(f"{path}: no contiguous flat tensor for state '{it.state}'")
            if ref.shape != items[it].shape:
                raise CheckpointFormatError(f"{path}: '{it.state}' partition has {list(ref.shape)} elements; spec "
                                            f"'{spec_name}' gives this rank {list(items[it].shape)}")
            where[it] = Located(ref.path, ref.data_offset, ref.dtype)
    layout = Layout(topology=topology, tensors=full.tensors, items=MappingProxyType(items),
                    fragments=tuple(f for f in full.fragments if f.item.section == OPTIM))
    config = _hf_config(files)
    steps = first.get("global_steps")
    progress = Progress(step=expect_step(steps, "global_steps", first_path) if steps is not None else None)
    bf16 = optims[(0, 0)].startswith("bf16_")
    extra = {"zero3": extra_from_files(first, optim_trees[0], first_path, tag_dir / optims[(0, 0)], tag, bf16)}
    return Source(format=fmt_name, path=root, spec_name=spec_name, spec=parsed, topology=topology, sizes=all_sizes,
                  layout=layout, where=where, model=ModelMeta(config=config or None), progress=progress, extra=extra)


def _states_of(tree: Mapping, path: Path) -> dict[str, Any]:
    """``optimizer_state_dict.optimizer_state_dict.state[0]`` of an optimizer file: the one sub-group's states."""
    inner = tree.get("optimizer_state_dict")
    state = inner.get("state", {}) if isinstance(inner, Mapping) else None
    if not isinstance(state, Mapping) or set(state) - {0} or not isinstance(state.get(0, {}), Mapping):
        raise CheckpointFormatError(f"{path}: optimizer state is {brief(state, 60)}; expected one sub-group's states "
                                    "(only one is supported)")
    return dict(state.get(0, {}))


def _states(tree: Mapping, path: Path) -> tuple[str, ...]:
    return tuple(k for k, v in _states_of(tree, path).items() if isinstance(v, TensorRef) and v.shape != ())


def _check_order(layout: Layout, shapes: list[tuple[str, tuple[int, ...]]], path: Path, spec_name: str) -> None:
    """``param_shapes`` (the flat order) must be the spec's model section, name by name and shape by shape."""
    want = [(it.key, info.shape) for it, info in layout.items.items() if it.section == MODEL]
    have = [(k, tuple(s)) for k, s in shapes]
    if have != want:
        first = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
        got = have[first] if first < len(have) else "nothing"
        exp = want[first] if first < len(want) else "nothing"
        raise CheckpointFormatError(f"{path}: param_shapes entry {first} is {got}; spec '{spec_name}' expects {exp} "
                                    "(the ZeRO-3 flat order must be the spec's model section)")


# --- writing --------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Zero3Extra:
    """What a ZeRO-3 writer needs besides item bytes: the files' trees without their tensors."""

    tag: str
    bf16: bool
    """The engine ran with bf16: ``bf16_`` optimizer file names, bf16 module placeholders."""
    model_states: dict[str, Any]
    """A model file's tree without ``module``, ``param_shapes`` and the world sizes."""
    optim_states: dict[str, Any]
    """An optimizer file's ``optimizer_state_dict`` without the flat tensors; ``step`` as a ``Scalar``."""
    optim_file: dict[str, Any]
    """The optimizer file's other keys (``ds_config``, ``ds_version``)."""
    ds_id: str


def extra_from_files(model: Mapping, optim: Mapping, model_path: Path, optim_path: Path, tag: str,
                     bf16: bool) -> Zero3Extra:
    """A ZeRO-3 source's own non-tensor state, carried to a ZeRO-3 target."""
    osd = dict(optim["optimizer_state_dict"])
    flat = osd.pop("fp32_flat_groups")
    inner = dict(osd["optimizer_state_dict"])
    inner["state"] = {g: {k: v for k, v in s.items() if isinstance(v, TensorRef) and v.shape == ()}
                      for g, s in inner.get("state", {}).items()}
    osd["optimizer_state_dict"] = inner
    ds_id = dict(flat[0].attrs).get("ds_id", "") if flat and isinstance(flat[0], TensorRef) else ""
    rest = {k: v for k, v in optim.items() if k != "optimizer_state_dict"}
    return Zero3Extra(tag=tag, bf16=bf16, model_states=_template(model, model_path, drop=("module",)),
                      optim_states=_template(osd, optim_path), optim_file=_template(rest, optim_path),
                      ds_id=str(ds_id))


def extra_from_zero12(source: Source, dtype: str) -> Zero3Extra:
    """ZeRO-3 state for a source that is not ZeRO-3: a DeepSpeed ZeRO-1/2 run's counters and Adam
    hyperparameters when the source has them, DeepSpeed 0.19.8's defaults otherwise."""
    carried = source.extra.get("deepspeed") if source.format == "deepspeed" else None
    base = carried or synthesize_extra(dtype=dtype, global_steps=int(source.progress.step or source.progress.iteration or 0))
    model_states = {k: v for k, v in base.model_states.items()}
    zero = base.optim_states["optimizer_state_dict"]
    bos = zero.get("base_optimizer_state", {})
    groups = bos.get("param_groups", []) if isinstance(bos, Mapping) else []
    state0 = (bos.get("state", {}) or {}).get(0, {}) if isinstance(bos, Mapping) else {}
    step = state0.get("step") if isinstance(state0.get("step"), Scalar) else None
    inner = {"state": {0: {"step": step}} if step is not None else {}, "param_groups": [dict(g) for g in groups[:1]]}
    if inner["param_groups"]:
        inner["param_groups"][0]["params"] = [0]
    optim_states = {"zero_stage": _zero_stage(3), "loss_scaler": zero.get("loss_scaler"),
                    "dynamic_loss_scale": zero.get("dynamic_loss_scale", False), "overflow": zero.get("overflow", False),
                    "partition_count": 0, "optimizer_state_dict": inner}
    rest = {k: v for k, v in base.optim_states.items() if k != "optimizer_state_dict"}
    return Zero3Extra(tag=base.tag, bf16=dtype == "bfloat16", model_states=model_states, optim_states=optim_states,
                      optim_file=rest, ds_id="")


def target_zero3(fmt_name: str, source: Source, topology: Topology, spec: str | None) -> Target:
    """The ZeRO-3 layout of ``source``'s model at ``topology.dp`` (tp=1)."""

    if topology.tp != 1 or topology.pp != 1 or topology.vpp != 1:
        raise CheckpointFormatError(f"{topology}: the ZeRO-3 target supports dp only (tp=1, pp=1)")
    require_sizes(source, llama.SIZES, "deepspeed ZeRO-3")
    spec_name = spec or SPEC
    parsed = layout_spec(spec_name)
    src_states = [s for s in dict.fromkeys(it.state for it in source.layout.items) if s not in (PARAM, MASTER)]
    has_master = MASTER in source.layout.states
    fp32 = all(loc.dtype == "float32" for it, loc in source.where.items() if it.state == PARAM)
    if not has_master and not (fp32 and PARAM in source.layout.states):
        raise CheckpointFormatError(f"a ZeRO-3 checkpoint needs fp32 master weights; {source.path} has "
                                    f"{', '.join(source.layout.states)} (bf16 weights alone cannot be cast bit-exactly)")
    topo = Topology(dp=topology.dp, zero=3)
    full = resolve(parsed, topo, source.sizes, states={OPTIM: (MASTER, *src_states)})
    items = {it: info for it, info in full.items.items() if it.section == OPTIM}
    order = [(it.key, info.shape) for it, info in full.items.items() if it.section == MODEL]
    layout = Layout(topology=topo, tensors=full.tensors, items=MappingProxyType(items),
                    fragments=tuple(f for f in full.fragments if f.item.section == OPTIM))
    param_dtype = next((loc.dtype for it, loc in source.where.items() if it.state == PARAM), None)
    carried = source.extra.get("zero3") if source.format == fmt_name else None
    # The training dtype: the source's weights', else float32 (a source with only fp32 masters, such as a
    # universal checkpoint, does not say).
    extra = carried or extra_from_zero12(source, param_dtype or "float32")
    return Target(format=fmt_name, spec_name=spec_name, spec=parsed, topology=topo, sizes=dict(source.sizes),
                  layout=layout, dtypes=dict.fromkeys(items, "float32"),
                  model=ModelMeta(family=family.name if (family := source_family(source)) else None,
                                  config=source.model.config, hints=dict(source.model.hints)),
                  extra={"zero3": extra, "param_order": order})


def model_tree3(extra: Zero3Extra, order: list[tuple[str, tuple[int, ...]]], dp: int) -> dict[str, Any]:
    """A ZeRO-3 model file: empty module placeholders (``Scalar`` leaves of shape ``(0,)``), ``param_shapes``
    in flat order, the world sizes and the ZeRO-3 ds_config; the rest from ``extra``."""
    dtype = "bfloat16" if extra.bf16 else "float32"
    tree: dict[str, Any] = {"module": OrderedDict((k, Scalar(dtype, (0,), b"")) for k, _ in order),
                            **extra.model_states}
    tree["param_shapes"] = [OrderedDict((k, TorchSize(s)) for k, s in order)]
    tree["dp_world_size"], tree["mp_world_size"] = dp, 1
    if "checkpoint_parallel_dimensions" in tree:
        tree["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 1}
    if "ds_config" in tree:
        tree["ds_config"] = _ds_config3(tree["ds_config"], dp)
    return tree


def _ds_config3(config: Any, dp: int) -> Any:
    """``config`` for ZeRO stage 3 at ``dp`` ranks (a stage added when it names none)."""
    config = _ds_config(config, dp, 3)
    if isinstance(config, dict):
        config["zero_optimization"] = {**(config.get("zero_optimization") or {}), "stage": 3}
    return config


def model_file3(dp: int) -> str:
    return f"zero_pp_rank_{dp}_mp_rank_00_model_states.pt"


def optim_file3(dp: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp}_mp_rank_00_optim_states.pt"


def files_of_zero3(target: Target) -> dict[Item, Path]:
    extra: Zero3Extra = target.extra["zero3"]
    return {it: Path(extra.tag) / optim_file3(dict(it.unit)["dp"], extra.bf16) for it in target.layout.items}


def write_zero3(target: Target, out: Path, fill: Fill, session: WriteSession, *, only=None) -> list[Path]:
    """Per dp rank a model file (``param_shapes``, empty module placeholders) and an optimizer file
    (``fp32_flat_groups`` and the optimizer's flat states), as DeepSpeed's stage 3 saves them."""
    extra: Zero3Extra = target.extra["zero3"]
    dp = target.topology.dp
    keep = None if only is None else set(only)
    ds_config = _ds_config3(extra.model_states.get("ds_config"), dp)
    out = Path(out)
    (out / extra.tag).mkdir(parents=True, exist_ok=True)
    order = target.extra["param_order"]
    states = tuple(dict.fromkeys(it.state for it in target.layout.items))
    written: list[Path] = []
    for d in range(dp):
        rel = Path(extra.tag) / model_file3(d)
        if not keep:  # model files hold no items: written by the call that writes the files without any
            sources: dict = {}
            tree = _with_scalars(model_tree3(extra, order, dp), sources)
            _write_file(out / rel, tree, sources, fill, target, session)
            written.append(rel)
        rel = Path(extra.tag) / optim_file3(d, extra.bf16)
        if keep is None or rel in keep:
            sources = {}
            osd = _with_scalars(extra.optim_states, sources)
            items = {it.state: it for it in target.layout.items if dict(it.unit)["dp"] == d}
            flats = {}
            for state in states:
                it = items[state]
                n = target.layout.items[it].numel
                attrs = (("ds_id", extra.ds_id or f"0_{len(order) - 1}"),) if state == MASTER else ()
                flats[state] = TensorSpec("float32", (n,), ("flat", state), attrs=attrs,
                                          requires_grad=state == MASTER)
                sources[("flat", state)] = (it, n)
            inner = osd["optimizer_state_dict"]
            state0 = dict((inner.get("state") or {}).get(0, {}))
            state0.update({s: flats[s] for s in states if s != MASTER})
            inner["state"] = {0: state0}
            osd["partition_count"] = dp
            osd["fp32_flat_groups"] = [flats[MASTER]]
            tree = {"optimizer_state_dict": osd, **_with_scalars(extra.optim_file, sources)}
            if "ds_config" in tree:
                tree["ds_config"] = ds_config
            _write_file(out / rel, tree, sources, fill, target, session)
            written.append(rel)
    if keep:
        return written
    config = target_config(target, ["bfloat16" if extra.bf16 else "float32"])
    if config is not None:
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "latest").write_text(extra.tag)
    return [*written, *([Path("config.json")] if config is not None else []), Path("latest")]
