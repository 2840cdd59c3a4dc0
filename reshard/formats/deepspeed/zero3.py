"""DeepSpeed ZeRO stage 3 checkpoints, read (``DeepSpeedFormat.open`` dispatches here) and written.

On disk (DeepSpeed ``engine.save_checkpoint`` with ``zero_optimization.stage = 3``)::

    <dir>/latest
    <dir>/<tag>/zero_pp_rank_{dp}_mp_rank_00_model_states.pt   per dp rank: param_shapes, module, frozen fragments
    <dir>/<tag>/[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt

A model file's ``module`` holds an empty placeholder for every parameter (tied copies and frozen params
too) and each persistent buffer whole; ``param_shapes`` lists, per sub-group, its params in flat order;
``frozen_param_shapes`` the frozen ones, and ``frozen_param_fragments`` this rank's piece of each (its
``ds_tensor``: the param padded to a multiple of dp and split); ``shared_params`` (on rank 0 only) the
tied weights. An optimizer file's ``optimizer_state_dict`` holds ``fp32_flat_groups`` (this rank's fp32
master partition of each sub-group, tagged with ``ds_id``), ``optimizer_state_dict.state[g]`` (the torch
optimizer's states of sub-group ``g``: ``exp_avg``, ``exp_avg_sq`` and ``step`` for Adam) and
``partition_count``. Every param is padded to a multiple of dp and split on its own; rank r holds
``ceil(numel / dp)`` elements of each, concatenated in ``param_shapes`` order. The training-dtype weights
of trained params are not stored: the fp32 master partitions are the weights, as DeepSpeed's own
``zero_to_fp32`` reads them; a target that needs weights gets them.

Without a spec the layout is derived from the files (``derive.zero3_text``): any model, any number of
groups, frozen params, buffers and tied weights. With a spec (``deepspeed-<family>-zero3``) the family's
layout, one group, and a tied head (``specs.tied_head``) as a placeholder named in ``shared_params``. Checked before any tensor byte is read: the files for every dp rank, ``partition_count``,
every rank's ``param_shapes`` against the layout (names, order, shapes), every flat tensor's, buffer's and
fragment's size, and that ``module`` holds nothing but placeholders besides the buffers. Not supported:
tp > 1. Written at any dp: from a ZeRO-3 source its own state, from another source a ZeRO-1/2 run's
counters and hyperparameters (or DeepSpeed's defaults), one sub-group per param group (DeepSpeed's default
``sub_group_size``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
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
    given_sizes,
)
from reshard.formats.deepspeed.derive import (
    DsModel,
    derived,
    foreign_groups,
    model_of_layout,
    model_of_source,
    recorded_model,
    zero3_text,
)
from reshard.formats.deepspeed.files import (
    _Files,
    _get,
    _param_shapes,
    _read,
    _write_file,
    _zero_config,
    config_path,
)
from reshard.formats.deepspeed.sizes import _llama_sizes
from reshard.formats.deepspeed.sources import derivable, family_spec, fp32_weights, target_model, weights_dtype
from reshard.formats.deepspeed.state import (
    DeepSpeedExtra,
    Scalar,
    _ds_config,
    _template,
    _with_scalars,
    _without_fragments,
    _zero_stage,
    synthesize_extra,
)
from reshard.formats.deepspeed.zero12 import _spec_info, _SpecInfo
from reshard.formats.derived import derived_spec_name, is_derived
from reshard.formats.identity import write_identity
from reshard.formats.specs import BUFFERS, family_of, layout_spec, target_config, tied_head
from reshard.io.bounds import brief
from reshard.io.torchfile import TensorRef, TensorSpec, TorchSize
from reshard.models.config import config_sizes

MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def is_zero3(names: list[str]) -> bool:
    return any(MODEL_FILE.fullmatch(n) for n in names)


def open_zero3(fmt_name: str, root: Path, tag: str, tag_dir: Path, *, spec: str | None,
               sizes: Mapping[str, int] | None, identity: ModelMeta) -> Source:
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
    _zero_config(first, first_path)
    shapes = _param_shapes(first, first_path)
    model_paths = [tag_dir / models[(0, d)] for d in range(dp)]
    model_trees = [first, *(_read(p) for p in model_paths[1:])]
    for path, tree in zip(model_paths[1:], model_trees[1:], strict=True):
        if _param_shapes(tree, path) != shapes:
            raise CheckpointFormatError(f"{path}: param_shapes differs from {first_path.name}'s")
    files = _Files(root=root, tag=tag, tag_dir=tag_dir, model=(first_path,), optim=(), bf16_names=False)
    ds_model = None
    if spec is None:  # derived from the files: any model
        ds_model = recorded_model(first, first_path, shapes)
        spec_name, parsed = derived_spec_name(fmt_name), derived(zero3_text(ds_model, tag_dir), tag_dir)
        all_sizes = config_sizes(identity.config, config_path(tag_dir, root), tensors=len(ds_model.tensors))
        all_sizes.update(given_sizes(sizes))
    else:
        spec_name, parsed = spec, layout_spec(spec)
        all_sizes = _llama_sizes(files, shapes, sizes, sum(len(g) for g in shapes))
    info = _spec_info(parsed, spec_name, zero3=True)
    if len(info.groups) != len(shapes):
        raise CheckpointFormatError(f"{first_path}: {len(shapes)} param groups in param_shapes, but spec "
                                    f"'{spec_name}' has {len(info.groups)} flat buffers")
    optim_paths = [tag_dir / optims[(0, d)] for d in range(dp)]
    optim_trees = [_read(p) for p in optim_paths]
    osd = [_get(tree, "optimizer_state_dict", p, Mapping) for p, tree in zip(optim_paths, optim_trees, strict=True)]
    states = _states(osd[0], optim_paths[0], len(shapes))
    topology = Topology(dp=dp, zero=3)
    try:
        full = resolve(parsed, topology, all_sizes, states={info.optim_section: (MASTER, *states)})
    except SpecError as e:
        known = ", ".join(f"{k}={v}" for k, v in sorted(all_sizes.items()))
        raise CheckpointFormatError(f"{tag_dir}: spec '{spec_name}' does not resolve with the sizes known ({known}); "
                                    f"give the others with sizes, or a config.json\n{e}") from None
    _check_order(full, info, shapes, first_path, spec_name)
    items = {it: i for it, i in full.items.items() if it.section in _stored_sections(info)}
    where: dict[Item, Located] = {}
    for d in range(dp):
        mine = [it for it in items if dict(it.unit)["dp"] == d]
        _locate_optim(osd[d], optim_paths[d], info, mine, items, dp, len(shapes), where)
        _locate_model(model_trees[d], model_paths[d], info, mine, items, spec_name, where)
    layout = Layout(topology=topology, tensors=full.tensors, items=MappingProxyType(items),
                    fragments=tuple(f for f in full.fragments if f.item in items))
    steps = first.get("global_steps")
    progress = Progress(step=expect_step(steps, "global_steps", first_path) if steps is not None else None)
    bf16 = optims[(0, 0)].startswith("bf16_")
    extra: dict[str, Any] = {"zero3": extra_from_files(first, optim_trees[0], first_path, optim_paths[0], tag, bf16)}
    if ds_model is not None:
        extra["ds_model"] = ds_model
    return Source(format=fmt_name, path=root, spec_name=spec_name, spec=parsed, topology=topology, sizes=all_sizes,
                  layout=layout, where=where, model=identity, progress=progress, extra=extra)


def _stored_sections(info: _SpecInfo) -> set[str]:
    """The sections ZeRO-3's files hold: the flat buffers, the buffers, the frozen fragments (not the groups'
    weights, which only give the flat order)."""
    return {info.optim_section, *info.model_sections} - {section for section, _ in info.groups}


def _located(ref: Any, path: Path, what: str, shape: tuple[int, ...]) -> Located:
    if not isinstance(ref, TensorRef) or not ref.is_contiguous:
        raise CheckpointFormatError(f"{path}: no contiguous tensor for {what}")
    if ref.shape != shape:
        raise CheckpointFormatError(f"{path}: {what} is {list(ref.shape)}; the layout gives this rank {list(shape)}")
    return Located(ref.path, ref.data_offset, ref.dtype)


def _locate_optim(osd: Mapping, path: Path, info: _SpecInfo, mine: list[Item], items: Mapping, dp: int, groups: int,
                  where: dict[Item, Located]) -> None:
    if _get(osd, "partition_count", path) != dp:
        raise CheckpointFormatError(f"{path}: partition_count is {brief(osd['partition_count'])}, dp_world_size {dp}")
    flats = _get(osd, "fp32_flat_groups", path)
    if not isinstance(flats, list) or len(flats) != groups:
        raise CheckpointFormatError(f"{path}: fp32_flat_groups holds {len(flats) if isinstance(flats, list) else '?'} "
                                    f"sub-groups, param_shapes {groups}")
    per_group = _states_of(osd, path, groups)
    group_of = {info.flat_key(g, it.state): g for it in mine for g in range(groups)}
    for it in mine:
        if it.section == info.optim_section:
            g = group_of[it.key]
            ref = flats[g] if it.state == MASTER else per_group[g].get(it.state)
            where[it] = _located(ref, path, f"'{it.state}' of sub-group {g}", items[it].shape)


def _locate_model(tree: Mapping, path: Path, info: _SpecInfo, mine: list[Item], items: Mapping, spec_name: str,
                  where: dict[Item, Located]) -> None:
    """A model file's buffers and frozen fragments; everything else in ``module`` must be a placeholder."""
    module = _get(tree, "module", path, Mapping)
    fragments = tree.get("frozen_param_fragments") or {}
    if not isinstance(fragments, Mapping):
        raise CheckpointFormatError(f"{path}: frozen_param_fragments is {brief(fragments, 60)}, not a mapping")
    kept = {it.key: it for it in mine if it.section in info.module_sections}
    frozen = {it.key: it for it in mine if it.section == info.fragments}
    for key, ref in module.items():
        if key in kept:
            where[kept[key]] = _located(ref, path, f"module['{key}']", items[kept[key]].shape)
        elif not isinstance(ref, TensorRef) or ref.numel:
            raise CheckpointFormatError(f"{path}: module['{key}'] holds {brief(ref, 60)}; spec '{spec_name}' stores "
                                        "no buffer of that name (ZeRO-3's parameters are empty placeholders)")
    if missing := [k for k in kept if k not in module]:
        raise CheckpointFormatError(f"{path}: module lacks '{missing[0]}', which spec '{spec_name}' stores")
    if odd := [k for k in fragments if k not in frozen]:
        raise CheckpointFormatError(f"{path}: frozen_param_fragments holds '{odd[0]}', which spec '{spec_name}' "
                                    "does not describe")
    for key, it in frozen.items():
        where[it] = _located(fragments.get(key), path, f"frozen_param_fragments['{key}']", items[it].shape)


def _states_of(tree: Mapping, path: Path, groups: int) -> list[dict[str, Any]]:
    """``optimizer_state_dict.optimizer_state_dict.state[g]`` of an optimizer file, per sub-group (empty
    before the optimizer's first step)."""
    inner = tree.get("optimizer_state_dict")
    state = inner.get("state", {}) if isinstance(inner, Mapping) else None
    if not isinstance(state, Mapping) or set(state) - set(range(groups)) or \
            not all(isinstance(s, Mapping) for s in state.values()):
        raise CheckpointFormatError(f"{path}: optimizer state is {brief(state, 60)}; expected the states of "
                                    f"{groups} sub-group(s), keyed 0 to {groups - 1}")
    return [dict(state.get(g, {})) for g in range(groups)]


def _states(tree: Mapping, path: Path, groups: int) -> tuple[str, ...]:
    """The optimizer's flat states (``exp_avg``, ...): the same in every sub-group."""
    per = [tuple(k for k, v in s.items() if isinstance(v, TensorRef) and v.shape != ())
           for s in _states_of(tree, path, groups)]
    if len(set(per)) > 1:
        raise CheckpointFormatError(f"{path}: sub-groups hold different optimizer states: {sorted(set(per))}")
    return per[0] if per else ()


def _check_order(layout: Layout, info: _SpecInfo, shapes: list[list[tuple[str, tuple[int, ...]]]], path: Path,
                 spec_name: str) -> None:
    """``param_shapes`` (the flat order) must be the spec's group sections, name by name and shape by shape."""
    for g, ((section, _), group) in enumerate(zip(info.groups, shapes, strict=True)):
        want = [(it.key, i.shape) for it, i in layout.items.items() if it.section == section and it.state == PARAM]
        have = [(k, tuple(s)) for k, s in group]
        if have != want:
            pairs = enumerate(zip(have, want, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), min(len(have), len(want)))
            got = have[first] if first < len(have) else "nothing"
            exp = want[first] if first < len(want) else "nothing"
            raise CheckpointFormatError(f"{path}: param_shapes[{g}] entry {first} is {got}; spec '{spec_name}' "
                                        f"expects {exp} (the ZeRO-3 flat order must be the spec's)")


# --- the non-tensor state -------------------------------------------------------------------------------


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
    ds_ids: tuple[str, ...] = ()
    """Each flat buffer's ``ds_id`` (its first and last param's ids), as the source's files have them."""
    placeholder: str = ""
    """The dtype of the module's placeholders (the training dtype); empty: bf16 or fp32 as ``bf16`` says."""
    dp: int = 0
    """The source's dp (0: not a ZeRO-3 source): sub-groups are kept only at the same dp."""


def extra_from_files(model: Mapping, optim: Mapping, model_path: Path, optim_path: Path, tag: str,
                     bf16: bool) -> Zero3Extra:
    """A ZeRO-3 source's own non-tensor state, carried to a ZeRO-3 target."""
    osd = dict(optim["optimizer_state_dict"])
    flat = osd.pop("fp32_flat_groups")
    inner = dict(osd["optimizer_state_dict"])
    inner["state"] = {g: {k: v for k, v in s.items() if isinstance(v, TensorRef) and v.shape == ()}
                      for g, s in inner.get("state", {}).items()}
    osd["optimizer_state_dict"] = inner
    ds_ids = tuple(str(dict(t.attrs).get("ds_id", "")) for t in flat if isinstance(t, TensorRef))
    module = model.get("module")
    placeholder = next((t.dtype for t in module.values() if isinstance(t, TensorRef) and not t.numel), "") \
        if isinstance(module, Mapping) else ""
    rest = {k: v for k, v in optim.items() if k != "optimizer_state_dict"}
    return Zero3Extra(tag=tag, bf16=bf16, model_states=_template(_without_fragments(model), model_path,
                                                                 drop=("module",)),
                      optim_states=_template(osd, optim_path), optim_file=_template(rest, optim_path),
                      ds_ids=ds_ids, placeholder=placeholder, dp=expect_int(model.get("dp_world_size", 0),
                                                                              "dp_world_size", model_path))


def extra_from_zero12(source: Source, dtype: str, groups: int = 1) -> Zero3Extra:
    """ZeRO-3 state for a source that is not ZeRO-3: a DeepSpeed ZeRO-1/2 run's counters and optimizer
    hyperparameters (per param group) when the source has them, DeepSpeed 0.19.8's defaults otherwise."""
    carried = source.extra.get("deepspeed") if source.format == "deepspeed" else None
    steps = int(source.progress.step or source.progress.iteration or 0)
    moments = tuple(s for s in source.layout.states if s not in (PARAM, MASTER))  # none: no Adam step either
    base = carried or _foreign_state(synthesize_extra(groups=groups, dtype=dtype if dtype in ("bfloat16", "float32")
                                                      else "float32", states=moments, global_steps=steps),
                                     foreign_groups(source))
    model_states = copy.deepcopy(base.model_states)
    zero = base.optim_states["optimizer_state_dict"]
    bos = zero.get("base_optimizer_state", {})
    param_groups = bos.get("param_groups", []) if isinstance(bos, Mapping) else []
    state = (bos.get("state", {}) or {}) if isinstance(bos, Mapping) else {}
    inner: dict[str, Any] = {"state": {}, "param_groups": []}
    for g in range(groups):
        step = state.get(g, {}).get("step")
        if isinstance(step, Scalar):
            inner["state"][g] = {"step": step}
        if g < len(param_groups):
            inner["param_groups"].append({**param_groups[g], "params": [g]})
    optim_states = {"zero_stage": _zero_stage(3), "loss_scaler": zero.get("loss_scaler"),
                    "dynamic_loss_scale": zero.get("dynamic_loss_scale", False),
                    "overflow": zero.get("overflow", False),
                    "partition_count": 0, "optimizer_state_dict": inner}
    rest = {k: v for k, v in base.optim_states.items() if k != "optimizer_state_dict"}
    return Zero3Extra(tag=base.tag, bf16=dtype == "bfloat16", model_states=model_states, optim_states=optim_states,
                      optim_file=rest, placeholder=dtype)


def _foreign_state(extra: DeepSpeedExtra, told: tuple[Any, ...]) -> DeepSpeedExtra:
    """Synthesized state for a source that is not DeepSpeed ZeRO-1/2, whose run recorded no ``clip_grad``: none
    is written, so the resuming engine clips as its own config says (DeepSpeed's loader lets a file's value
    override the config). With the source optimizer's param groups (``foreign_groups``: as many as the target
    has), each group's hyperparameters and Adam ``step`` replace the defaults."""
    optim_states = copy.deepcopy(extra.optim_states)
    osd = optim_states["optimizer_state_dict"]
    osd.pop("clip_grad", None)
    bos = osd["base_optimizer_state"]
    if told and len(told) == len(bos["param_groups"]):
        bos["param_groups"] = [{**copy.deepcopy(g.hyper), "params": [k]} for k, g in enumerate(told)]
        for k, g in enumerate(told):
            if g.step is not None and k in bos["state"]:
                bos["state"][k] = {**bos["state"][k], "step": g.step}
    return dataclasses.replace(extra, optim_states=optim_states)


def extra_for_zero12(source: Source, stage: int, groups: int, dtype: str, states: tuple[str, ...],
                     dp: int) -> DeepSpeedExtra:
    """ZeRO-1/2 state for a source that is not DeepSpeed ZeRO-1/2: a ZeRO-3 run's counters, loss scaler,
    config and optimizer hyperparameters and step per param group when the source is one, else
    ``synthesize_extra``'s for the source's optimizer step (or 1) and learning rate, or its optimizer's
    param groups when it records them; no ``clip_grad`` either way (``_foreign_state``)."""
    z3: Zero3Extra | None = source.extra.get("zero3") if source.format == "deepspeed" else None
    step = int(source.progress.step or source.progress.iteration or 1)
    lr = source.progress.lr if source.progress.lr is not None else 1e-3
    base = _foreign_state(synthesize_extra(groups=groups, dtype=dtype if dtype in ("bfloat16", "float32") else
                                           "float32", zero_stage=stage, states=states, dp=dp, global_steps=step,
                                           lr=lr), foreign_groups(source))
    if z3 is None:
        return base
    inner = z3.optim_states.get("optimizer_state_dict") or {}
    param_groups = inner.get("param_groups") or []
    if len(param_groups) != groups:
        raise CheckpointFormatError(f"{source.path}: {len(param_groups)} param groups in the optimizer's state but "
                                    f"{groups} flat buffers; their hyperparameters cannot be carried")
    model_states = {**copy.deepcopy(z3.model_states), "frozen_param_shapes": OrderedDict() if stage >= 2 else None,
                    "frozen_param_fragments": OrderedDict() if stage >= 2 else None}
    optim_states = copy.deepcopy(base.optim_states)
    osd = optim_states["optimizer_state_dict"]
    for key in ("loss_scaler", "dynamic_loss_scale", "overflow"):
        if key in z3.optim_states:
            osd[key] = copy.deepcopy(z3.optim_states[key])
    bos = osd["base_optimizer_state"]
    bos["param_groups"] = [{**copy.deepcopy(g), "params": [k]} for k, g in enumerate(param_groups)]
    bos["state"] = {k: dict(s) for k, s in (inner.get("state") or {}).items()}
    for key in ("ds_config", "ds_version"):
        if key in z3.optim_file:
            optim_states[key] = copy.deepcopy(z3.optim_file[key])
    return dataclasses.replace(base, tag=z3.tag, bf16_names=z3.bf16, model_states=model_states,
                               optim_states=optim_states, synthesized=False)


def target_zero3(fmt_name: str, source: Source, topology: Topology, spec: str | None) -> Target:
    """The ZeRO-3 layout of ``source``'s model at ``topology.dp`` (tp=1): derived, or a family's."""
    if topology.tp != 1 or topology.pp != 1 or topology.vpp != 1:
        raise CheckpointFormatError(f"{topology}: the ZeRO-3 target supports dp only (tp=1, pp=1)")
    carried: Zero3Extra | None = source.extra.get("zero3") if source.format == fmt_name else None
    ds_model = None
    if spec is not None:
        spec_name = spec
    elif carried is not None and not is_derived(source.spec_name):
        spec_name = source.spec_name
    elif derivable(source):
        ds_model = model_of_source(source)
        spec_name = derived_spec_name(fmt_name)
        if "ds_model" not in source.extra and ds_model.frozen:
            # Not a DeepSpeed source: a tensor without optimizer state may be a frozen param (partitioned under
            # ZeRO-3) or a buffer (stored whole); the source does not say which, and DeepSpeed loads neither guess.
            raise CheckpointFormatError(
                f"{source.path}: '{ds_model.frozen[0]}' has no optimizer state, and the {source.format} checkpoint "
                "does not record whether it is a frozen parameter or a buffer, which ZeRO-3 stores differently; "
                "convert to ZeRO-1/2 (zero=2), whose files hold both alike")
    else:
        spec_name = family_spec(source, "a family's flat buffers follow its registration order", "-zero3")
    parsed = derived(zero3_text(ds_model, source.path), source.path) if ds_model else layout_spec(spec_name)
    info = _spec_info(parsed, spec_name, zero3=True)
    src_states = [s for s in dict.fromkeys(it.state for it in source.layout.items) if s not in (PARAM, MASTER)]
    fp32 = fp32_weights(source)
    if MASTER not in source.layout.states and not (fp32 and PARAM in source.layout.states):
        raise CheckpointFormatError(f"a ZeRO-3 checkpoint needs fp32 master weights; {source.path} has "
                                    f"{', '.join(source.layout.states)} (bf16 weights alone cannot be cast "
                                    "bit-exactly)")
    topo = Topology(dp=topology.dp, zero=3)
    full = resolve(parsed, topo, source.sizes, states={info.optim_section: (MASTER, *src_states)})
    items = {it: i for it, i in full.items.items() if it.section in _stored_sections(info)}
    if ds_model is None:  # a family's: its groups' params, its buffers whole, and a placeholder of its tied head
        family = family_of(spec_name)
        tie = tied_head(family, "tied" in spec_name.split("-")[2:] or None) if family is not None else None
        ds_model = model_of_layout(full, [section for section, _ in info.groups],
                                   ties=[(tie[0], tie[1].name)] if tie else [],
                                   buffers=[BUFFERS] if BUFFERS in info.module_sections else [])
    layout = Layout(topology=topo, tensors=full.tensors, items=MappingProxyType(items),
                    fragments=tuple(f for f in full.fragments if f.item in items))
    param_dtype = weights_dtype(source)
    # The training dtype: the source's weights', else float32 (a source with only fp32 masters, such as a
    # universal checkpoint, does not say).
    extra = carried or extra_from_zero12(source, param_dtype or "float32", len(info.groups))
    had = len(extra.optim_states.get("optimizer_state_dict", {}).get("param_groups", []))
    if carried is not None and had != len(info.groups) and carried.dp != topology.dp:
        raise CheckpointFormatError(f"{source.path}: {len(info.groups)} sub-groups in {had} param groups "
                                    "(sub_group_size smaller than a group): DeepSpeed forms them anew at another dp, "
                                    "so this checkpoint can only be written at its own dp")
    dtypes = {it: "float32" if it.section == info.optim_section else param_dtype or "float32" for it in items}
    return Target(format=fmt_name, spec_name=spec_name, spec=parsed, topology=topo, sizes=dict(source.sizes),
                  layout=layout, dtypes=dtypes, model=target_model(source),
                  extra={"zero3": extra, "ds_model": ds_model})


# --- writing --------------------------------------------------------------------------------------------


def model_tree3(extra: Zero3Extra, model: DsModel, dp: int, rank: int = 0,
                leaves: Mapping[tuple[str, str], Any] | None = None) -> dict[str, Any]:
    """A ZeRO-3 model file: module placeholders (``Scalar`` leaves of shape ``(0,)``) and the buffers,
    ``param_shapes`` per group, the frozen params' shapes and fragments, the world sizes and the ZeRO-3
    ds_config; the rest from ``extra``. ``leaves`` holds the buffers' and fragments' tensor leaves, by
    ``("module", key)`` and ``("fragment", name)``."""
    leaves = leaves or {}
    dtype = extra.placeholder or ("bfloat16" if extra.bf16 else "float32")
    module = OrderedDict((k, leaves[("module", k)] if ("module", k) in leaves else Scalar(dtype, (0,), b""))
                         for k, _ in model.module)
    tree: dict[str, Any] = {"module": module, **extra.model_states}
    tree["param_shapes"] = [OrderedDict((n, TorchSize(model.recorded(n).shape)) for n in g) for g in model.groups]
    if "buffer_names" in tree or model.buffers:
        tree["buffer_names"] = list(model.buffers)
    tree["frozen_param_shapes"] = OrderedDict((n, TorchSize(model.recorded(n).shape)) for n in model.frozen)
    tree["frozen_param_fragments"] = OrderedDict((n, leaves[("fragment", n)]) for n in model.frozen
                                                 if ("fragment", n) in leaves)
    if "shared_params" in tree or model.shared:
        tree["shared_params"] = model.shared if rank == 0 else {}  # as DeepSpeed saves it: rank 0's
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
    info = _spec_info(target.spec, target.spec_name, zero3=True)
    return {it: Path(extra.tag) / (optim_file3(dict(it.unit)["dp"], extra.bf16) if it.section == info.optim_section
                                   else model_file3(dict(it.unit)["dp"])) for it in target.layout.items}


def _ds_ids(extra: Zero3Extra, model: DsModel) -> list[str]:
    """Each flat buffer's ``ds_id``: the source's, else its first and last param's place among the params."""
    if len(extra.ds_ids) == len(model.groups):
        return list(extra.ds_ids)
    params = [n for k, n in model.module if k == n and n not in model.buffers]
    index = {n: params.index(n) if n in params else 0 for g in model.groups for n in g}
    return [f"{index[g[0]]}_{index[g[-1]]}" if g else "0_0" for g in model.groups]


@dataclass(slots=True)
class _Rank:
    """One dp rank's items of a ZeRO-3 target, by where they go."""

    optim: dict[tuple[str, str], Item] = field(default_factory=dict)
    """(flat key, state) -> item."""
    model: dict[tuple[str, str], Item] = field(default_factory=dict)
    """("module", key) or ("fragment", name) -> item."""


def _ranks3(target: Target, info: _SpecInfo) -> list[_Rank]:
    ranks = [_Rank() for _ in range(target.topology.dp)]
    for it in target.layout.items:
        rank = ranks[dict(it.unit)["dp"]]
        if it.section == info.optim_section:
            rank.optim[(it.key, it.state)] = it
        else:
            rank.model[("fragment" if it.section == info.fragments else "module", it.key)] = it
    return ranks


def write_zero3(target: Target, out: Path, fill: Fill, session: WriteSession, *, only=None) -> list[Path]:
    """Per dp rank a model file (``param_shapes``, module placeholders and buffers, frozen fragments) and an
    optimizer file (``fp32_flat_groups`` and the optimizer's flat states), as DeepSpeed's stage 3 saves them."""
    extra: Zero3Extra = target.extra["zero3"]
    model: DsModel = target.extra["ds_model"]
    info = _spec_info(target.spec, target.spec_name, zero3=True)
    dp = target.topology.dp
    keep = None if only is None else set(only)
    ds_config = _ds_config3(extra.model_states.get("ds_config"), dp)
    out = Path(out)
    (out / extra.tag).mkdir(parents=True, exist_ok=True)
    states = tuple(dict.fromkeys(it.state for it in target.layout.items if it.section == info.optim_section))
    ds_ids = _ds_ids(extra, model)
    written: list[Path] = []
    for d, rank in enumerate(_ranks3(target, info)):
        rel = Path(extra.tag) / model_file3(d)
        # A model file without buffers or frozen params holds no items: the call that writes those writes it.
        if keep is None or rel in keep or (not keep and not rank.model):
            sources: dict = {}
            leaves = {}
            for key, it in rank.model.items():
                leaves[key] = TensorSpec(target.dtypes[it], target.layout.items[it].shape, key)
                sources[key] = (it, target.layout.items[it].numel)
            tree = _with_scalars(model_tree3(extra, model, dp, d, leaves), sources)
            _write_file(out / rel, tree, sources, fill, target, session)
            written.append(rel)
        rel = Path(extra.tag) / optim_file3(d, extra.bf16)
        if keep is None or rel in keep:
            sources = {}
            osd = _with_scalars(extra.optim_states, sources)
            flats: list[dict[str, TensorSpec]] = []
            for g in range(len(info.groups)):
                specs = {}
                for state in states:
                    it = rank.optim[(info.flat_key(g, state), state)]
                    n = target.layout.items[it].numel
                    attrs = (("ds_id", ds_ids[g]),) if state == MASTER else ()
                    specs[state] = TensorSpec("float32", (n,), ("flat", state, g), attrs=attrs,
                                              requires_grad=state == MASTER)
                    sources[("flat", state, g)] = (it, n)
                flats.append(specs)
            inner = osd["optimizer_state_dict"]
            old = inner.get("state") or {}
            inner["state"] = {g: {**dict(old.get(g, {})), **{s: f[s] for s in states if s != MASTER}}
                              for g, f in enumerate(flats)}
            osd["partition_count"] = dp
            osd["fp32_flat_groups"] = [f[MASTER] for f in flats]
            tree = {"optimizer_state_dict": osd, **_with_scalars(extra.optim_file, sources)}
            if "ds_config" in tree:
                tree["ds_config"] = ds_config
            _write_file(out / rel, tree, sources, fill, target, session)
            written.append(rel)
    if keep:
        return written
    identity = write_identity(out, target.model, target_config(target, ["bfloat16" if extra.bf16 else "float32"]))
    (out / "latest").write_text(extra.tag)
    return [*written, *identity, Path("latest")]
