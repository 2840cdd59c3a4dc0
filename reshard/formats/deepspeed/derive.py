"""Layouts derived from what a DeepSpeed checkpoint records of its model, for a model of any family or none.

DeepSpeed records everything a ZeRO layout needs: ``param_shapes`` (per param group, name -> shape in
flat-buffer order), ``frozen_param_shapes`` (the params outside every group, from ZeRO stage 2 on),
``buffer_names`` (persistent buffers), ``shared_params`` (tied weights: the module key DeepSpeed does not
flatten -> the param it shares) and the module's state dict (its keys in order, a buffer's shape). A
``DsModel`` holds that; ``zero12_text`` and ``zero3_text`` write its layout in the spec language with the
``deepspeed`` rules of ``reshard.formats.specs``, generalised:

- one model section per param group (``group0``, ``group1``, ...), the group's params in flat order;
- a section ``module`` of what ``module`` holds outside the groups: frozen params, persistent buffers and
  the tied copies (``head.weight -> embed.weight``), each whole;
- under ZeRO-2 (whose engine saves frozen params twice) a section ``frozen_param_fragments``: the frozen
  params whole (ZeRO-3: each rank's piece, padded to a multiple of dp and split, as ``ds_tensor`` is);
- one flat buffer per group: ``flat optimizer.<g>.{state} = group<g> | pad 2*dp | split dp`` (ZeRO-3:
  ``flat fp32_flat_groups.<g>.{state} = group<g> | perparam | split dp``).

Tensor parallelism is not derived: DeepSpeed does not record how tp splits a tensor. ``model_of_source``
gives the ``DsModel`` of a checkpoint of another format: its tensors in the order it records them, the ones
with optimizer state (or all of them, when it holds none) in one param group (or in the param groups its
optimizer had, when it records them: ``foreign_groups``), the rest frozen. ``model_of_layout`` gives the
``DsModel`` of a family's layout (``reshard.formats.specs``), so that its files record a tied head and persistent
buffers as a derived layout's do (``shared_params``, ``buffer_names``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.core.layout import PARAM, Layout
from reshard.core.spec import Spec
from reshard.errors import CheckpointFormatError
from reshard.formats.base import Source, expect_shape, name_of
from reshard.formats.derived import Recorded, check_names, derived_spec, logical_lines, recorded_of, stored_line
from reshard.io.bounds import brief
from reshard.io.torchfile import TensorRef

__all__ = ["FRAGMENTS", "MODULE", "OPTIM", "DsModel", "foreign_groups", "model_of_layout", "model_of_source",
           "recorded_model",
           "zero12_text", "zero3_text"]

MODULE = "module"
"""The section of the module's tensors outside every param group: frozen params, buffers, tied copies."""
FRAGMENTS = "frozen_param_fragments"
"""The section of the frozen params a ZeRO-2/3 model file keeps again under that key."""
OPTIM = "optim"
"""The section of the flat buffers."""
_STATES = "states master exp_avg exp_avg_sq"


@dataclass(frozen=True, slots=True)
class DsModel:
    """A model as a DeepSpeed checkpoint records it: every tensor's name and shape, the param groups, the
    frozen params, the buffers and the tied weights. Needs no model family."""

    tensors: tuple[Recorded, ...]
    """Every logical tensor (params, frozen params, persistent buffers), each once, in module order."""
    groups: tuple[tuple[str, ...], ...]
    """Per param group, its params in flat-buffer order (``param_shapes``)."""
    module: tuple[tuple[str, str], ...]
    """(module key, the tensor it holds) in the module's order; a tied copy holds another key's tensor."""
    frozen: tuple[str, ...] = ()
    """Params outside every group (frozen, or without elements), in ``frozen_param_shapes`` order."""
    buffers: tuple[str, ...] = ()
    """Persistent buffers (``buffer_names``)."""
    stages: tuple[tuple[str, int], ...] = ()
    """A pipeline-engine model's: (tensor, the pipeline stage holding it) for every tensor; empty for a model
    of the engine without a pipeline."""

    @property
    def pipeline(self) -> bool:
        """Whether the model is a ``PipelineModule``'s: its tensors in layer files, each on its stage."""
        return bool(self.stages)

    @property
    def shared(self) -> dict[str, str]:
        """``shared_params``: each tied copy's key -> the tensor it holds."""
        return {key: name for key, name in self.module if key != name}

    def recorded(self, name: str) -> Recorded:
        return next(t for t in self.tensors if t.name == name)


def zero12_text(model: DsModel, stage: int, where: Path | str) -> str:
    """The ZeRO-1/2 layout of ``model`` in the spec language (``frozen_param_fragments`` from stage 2 on); a
    pipeline's tensors each ``@stage(s)`` of the stage holding it, so each stage's flat buffers hold its own."""
    by_name = {t.name: t for t in model.tensors}
    grouped = {n for group in model.groups for n in group}
    check_names([Recorded(key, ()) for key, _ in model.module], where)  # tied copies' keys too
    on = dict(model.stages)

    def line(name: str, key: str | None = None) -> str:
        text = stored_line(by_name[name], key)
        return text if name not in on else text.replace(" = ", f" @stage({on[name]}) = ", 1)  # names hold no space

    lines = logical_lines(list(model.tensors), where)
    for g, names in enumerate(model.groups):
        lines += ["", f"section group{g} per tp pp", *(line(n) for n in names)]
    rest = [(key, name) for key, name in model.module if key not in grouped]
    if rest:
        lines += ["", f"section {MODULE} per tp pp", *(line(n, key) for key, n in rest)]
    if stage >= 2 and model.frozen:
        lines += ["", f"section {FRAGMENTS} per tp pp", *(line(n) for n in model.frozen)]
    lines += ["", f"section {OPTIM} per tp pp dp {_STATES}"]
    lines += [f"flat optimizer.{g}.{{state}} = group{g} | pad 2*dp | split dp" for g in range(len(model.groups))]
    return "\n".join(lines) + "\n"


def zero3_text(model: DsModel, where: Path | str) -> str:
    """The ZeRO-3 layout of ``model``: each param padded to a multiple of dp and split on its own, in the
    flat buffers (trained params) or in ``frozen_param_fragments`` (frozen ones); buffers whole in every
    rank's model file. The groups' sections give the flat order; the files hold no training-dtype weights."""
    by_name = {t.name: t for t in model.tensors}
    lines = logical_lines(list(model.tensors), where)
    for g, names in enumerate(model.groups):
        lines += ["", f"section group{g} per tp pp", *(stored_line(by_name[n]) for n in names)]
    if model.buffers:
        lines += ["", f"section {MODULE} per tp pp dp", *(stored_line(by_name[n]) for n in model.buffers)]
    if model.frozen:
        lines += ["", f"section {FRAGMENTS} per tp pp dp"]
        for name in model.frozen:
            t = by_name[name]
            if not t.shape:
                raise CheckpointFormatError(f"{where}: frozen parameter '{name}' is 0-d, which a ZeRO-3 layout "
                                            "cannot split")
            lines.append(f"{name} = ({t.dims})~dp/dp")
    lines += ["", f"section {OPTIM} per tp pp dp {_STATES}"]
    lines += [f"flat fp32_flat_groups.{g}.{{state}} = group{g} | perparam | split dp"
              for g in range(len(model.groups))]
    return "\n".join(lines) + "\n"


def derived(text: str, where: Path | str) -> Spec:
    return derived_spec(text, "deepspeed", where)


# --- from a DeepSpeed model file ---------------------------------------------------------------------


def recorded_model(tree: Mapping[str, Any], path: Path, groups: list[list[tuple[str, tuple[int, ...]]]],
                   module: Mapping[Any, Any] | None = None) -> DsModel:
    """The model a DeepSpeed model file records: ``groups`` (its ``param_shapes``), and ``module`` (its
    state dict, by default the file's own), ``frozen_param_shapes``, ``buffer_names`` and ``shared_params``.

    Raises CheckpointFormatError naming the entry that disagrees with the rest.
    """
    module = tree.get("module") if module is None else module
    if not isinstance(module, Mapping):
        raise CheckpointFormatError(f"{path}: module is {brief(module, 60)}, not a state dict")
    keys = [name_of(k) for k in module]
    if bad := next((k for k in module if not isinstance(k, str)), None):
        raise CheckpointFormatError(f"{path}: module key {brief(bad, 60)} is not a string")
    shared = _names_map(tree.get("shared_params"), "shared_params", path)
    buffers = _names(tree.get("buffer_names"), "buffer_names", path)
    recorded_frozen = tree.get("frozen_param_shapes")
    frozen_shapes: dict[str, tuple[int, ...]] | None = None
    if recorded_frozen is not None:
        if not isinstance(recorded_frozen, Mapping):
            raise CheckpointFormatError(f"{path}: frozen_param_shapes is {brief(recorded_frozen, 60)}, not a mapping")
        frozen_shapes = {name_of(k): expect_shape(v, f"frozen_param_shapes['{name_of(k)}']", path)
                         for k, v in recorded_frozen.items()}
    shapes: dict[str, tuple[int, ...]] = {}
    for g, group in enumerate(groups):
        for name, shape in group:
            if name in shapes:
                raise CheckpointFormatError(f"{path}: param_shapes[{g}] lists '{name}', which an earlier param "
                                            "group lists too")
            shapes[name] = shape
    grouped = set(shapes)
    for name, shape in (frozen_shapes or {}).items():
        if name in grouped:
            raise CheckpointFormatError(f"{path}: frozen_param_shapes lists '{name}', which param_shapes lists "
                                        "as trained")
        shapes[name] = shape
    for key, name in shared.items():
        if key not in module or name not in module:
            missing = key if key not in module else name
            raise CheckpointFormatError(f"{path}: shared_params ties '{key}' to '{name}', but module has no "
                                        f"'{missing}'")
        if key in shapes:
            raise CheckpointFormatError(f"{path}: shared_params names '{key}' a tied copy, but it is a parameter "
                                        "of its own in param_shapes or frozen_param_shapes")
    tensors: dict[str, Recorded] = {}
    for key in keys:
        name = shared.get(key, key)
        if name in tensors:
            continue
        if name not in shapes:
            ref = module[name]
            if not isinstance(ref, TensorRef):
                raise CheckpointFormatError(f"{path}: module['{name}'] is {brief(ref, 60)}, not a tensor")
            shapes[name] = ref.shape
        tensors[name] = Recorded(name, shapes[name])
    for name in grouped:  # a trained param the module lacks: the check of the module names it
        tensors.setdefault(name, Recorded(name, shapes[name]))
    frozen = [k for k in keys if k not in grouped and k not in shared and k not in buffers]
    if frozen_shapes is not None:
        if set(frozen_shapes) != set(frozen):
            odd = sorted(set(frozen_shapes) ^ set(frozen))[0]
            where = "module keeps it as a parameter" if odd in frozen else "it is not a parameter module keeps"
            raise CheckpointFormatError(f"{path}: frozen_param_shapes {'lacks' if odd in frozen else 'lists'} "
                                        f"'{odd}', but {where} outside param_shapes, buffer_names and "
                                        "shared_params")
        frozen = list(frozen_shapes)
    if unknown := [b for b in buffers if b not in module]:
        raise CheckpointFormatError(f"{path}: buffer_names lists '{unknown[0]}', which module does not hold")
    return DsModel(tensors=tuple(tensors.values()), groups=tuple(tuple(n for n, _ in g) for g in groups),
                   module=tuple((k, shared.get(k, k)) for k in keys), frozen=tuple(frozen), buffers=tuple(buffers))


def _names(value: Any, field: str, path: Path) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise CheckpointFormatError(f"{path}: {field} is {brief(value, 60)}, not a list of names")
    return list(value)


def _names_map(value: Any, field: str, path: Path) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CheckpointFormatError(f"{path}: {field} is {brief(value, 60)}, not a mapping of names to names")
    return dict(value)


# --- from a checkpoint of another format ----------------------------------------------------------------


def foreign_groups(source: Source) -> tuple[Any, ...]:
    """The param groups (``reshard.formats.dcp.ParamGroup``: hyperparameters, params by name, Adam step) of a
    torch optimizer that a source of another format records: a DCP checkpoint's ``param_groups``; empty for
    any other."""
    if source.format == "dcp":
        from reshard.formats.dcp import optimizer_groups

        return optimizer_groups(source)
    return ()


def model_of_source(source: Source) -> DsModel:
    """The ``DsModel`` of ``source``'s tensors: a DeepSpeed source's own, else its tensors in the order it
    records them, those it holds optimizer state for (all, when it holds none) in one param group, or in the
    source optimizer's param groups when it records them (``foreign_groups``: each group's params in its
    order), and the rest, and tensors without elements, frozen."""
    carried = source.extra.get("ds_model")
    if isinstance(carried, DsModel):
        return carried
    tensors = recorded_of(source.layout)
    trained_states = {f.tensor for f in source.layout.fragments if f.state != PARAM and f.item in source.where}
    trained = [t.name for t in tensors if (not trained_states or t.name in trained_states) and math.prod(t.shape)]
    kept = set(trained)
    groups: tuple[tuple[str, ...], ...] = (tuple(trained),)
    told = foreign_groups(source)
    if told and sorted(p for g in told for p in g.params) == sorted(trained):
        groups = tuple(tuple(g.params) for g in told)
    return DsModel(tensors=tuple(tensors), groups=groups, module=tuple((t.name, t.name) for t in tensors),
                   frozen=tuple(t.name for t in tensors if t.name not in kept))


# --- from a family's layout -----------------------------------------------------------------------------


def model_of_layout(layout: Layout, groups: Sequence[str], module: Sequence[str] = (),
                    ties: Sequence[tuple[str, str]] = (), buffers: Sequence[str] = ()) -> DsModel:
    """The ``DsModel`` of a resolved layout of a family's spec, which has no frozen params: each ``groups``
    section's params (``param_shapes``: keys and stored shapes, in flat order), then the persistent buffers of
    the ``buffers`` sections (``buffer_names``), then the tied copies (``shared_params``): each key of the
    ``module`` sections, holding a param group's tensor, and ``ties`` (key, tensor) besides (a ZeRO-3 layout's,
    which stores no tied copy).

    Raises CheckpointFormatError naming a module key whose tensor no param group holds.
    """
    def keys(section: str) -> list[str]:  # a key is an item per tp rank (and per dp rank: a ZeRO-3 buffer)
        return list(dict.fromkeys(it.key for it in layout.items if it.section == section and it.state == PARAM))

    shapes = {it.key: info.shape for it, info in layout.items.items() if it.state == PARAM}
    tensor_of = {f.item.key: f.tensor for f in layout.fragments if f.item.section in module}
    grouped = [keys(s) for s in groups]
    held = {k for g in grouped for k in g}
    kept = [k for s in buffers for k in keys(s)]
    tied = [*((k, tensor_of[k]) for s in module for k in keys(s)), *ties]
    for key, name in tied:
        if name not in held:
            raise CheckpointFormatError(f"module key '{key}' holds '{name}', which no param group holds: not a "
                                        "tied weight DeepSpeed records in shared_params")
    return DsModel(tensors=tuple(Recorded(k, shapes[k]) for k in [*(k for g in grouped for k in g), *kept]),
                   groups=tuple(tuple(g) for g in grouped),
                   module=(*((k, k) for g in grouped for k in g), *((k, k) for k in kept), *tied),
                   buffers=tuple(kept))
