"""The pipeline engine's checkpoints: its layer files, read and written.

The pipeline engine (``PipelineModule``, ZeRO 0/1) keeps the weights in one file per layer,
``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` (``layer_{idx:02d}-model_states.pt`` under a
topology without a model axis), keyed by the names inside the layer; its model files, one per
model-parallel rank ``pp * tp_size + tp``, hold ``module`` None and the stage's
``param_shapes``, and each stage has its own flat buffers. Its parameters are named
``<layer index>.<name>`` with the layer index global over the layer list; the shipped
``deepspeed-pipe-llama`` spec says how a Llama's layers map onto them. ``pp`` changes, and
moves in and out of the pipeline engine, are a change of spec.

A model no family describes is read from what the checkpoint records (``recorded_pipeline``): each
stage's ``param_shapes`` (its param groups) and ``buffer_names``, and the layer files' tensors
(frozen params and buffers besides the trained params). Each tensor keeps its name and sits
``@stage(s)`` on the stage holding it, so each stage's flat buffers hold its own params. A layer
that no stage's ``param_shapes`` or ``buffer_names`` names (a frozen one) sits with the told layer
before it; no model file names it, so its stage changes nothing written at the same pp. A
parameterless layer module (an activation) has an empty layer file, which is kept. Which layers a
stage holds at another pp is the model's ``PipelineModule`` partitioning, which DeepSpeed does not
record: such a layout is converted at its own pp only.

Tied pipeline modules (``tied_modules.*``) are not supported.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reshard.core.layout import Item, Layout
from reshard.core.spec import Spec, Stored
from reshard.errors import CheckpointFormatError
from reshard.formats.base import Located, Target, expect_int, name_of
from reshard.formats.deepspeed.derive import DsModel, _names, _names_map
from reshard.formats.deepspeed.files import _Files, _read, layer_file
from reshard.formats.deepspeed.state import DeepSpeedExtra, _Sources
from reshard.formats.deepspeed.zero12 import _few, _SpecInfo, _state_dict_tensors
from reshard.formats.derived import Recorded
from reshard.io.bounds import brief
from reshard.io.torchfile import TensorRef, TensorSpec

_LAYER_INDEX = re.compile(r"([0-9]{1,9})\.(.+)", re.DOTALL)


def _layer_index(key: str) -> tuple[int, str] | None:
    """``'3.mlp.up_proj.weight'`` -> (3, 'mlp.up_proj.weight'); None for a name without a layer index."""
    m = _LAYER_INDEX.fullmatch(key)
    return (int(m.group(1)), m.group(2)) if m else None


def _layer_key(key: str, where: str) -> tuple[int, str]:
    """A pipeline param's layer index and its name inside the layer: ``'3.mlp.up_proj.weight'`` -> (3, ...)."""
    if (found := _layer_index(key)) is None:
        raise CheckpointFormatError(f"{where}: '{key}' is not a pipeline parameter name ('<layer index>.<name>')")
    return found


def _check_layers(layout: Layout, info: _SpecInfo, files: _Files, spec_name: str, where: dict[Item, Located],
                  trees: Mapping[Path, Any] | None = None) -> tuple[int, ...]:
    """A pipeline's layer files against the layout: each holds exactly its layer's tensors, in their shapes.
    The layer files outside the layout must be empty (a parameterless layer module's): their layer indexes.
    ``trees``: the layer files already read."""
    def read(path: Path) -> Any:
        return trees[path] if trees is not None and path in trees else _read(path)

    named = any(t is not None for _, t in files.layers)
    want: dict[tuple[int, int | None], dict[str, Item]] = {}
    for it in layout.items:
        if it.section in info.model_sections:
            index, local = _layer_key(it.key, f"spec '{spec_name}'")
            want.setdefault((index, dict(it.unit)["tp"] if named else None), {})[local] = it
    extra = sorted(set(files.layers) - set(want), key=lambda k: (k[0], k[1] or 0))
    if held := next((k for k in extra if read(files.layers[k])), None):
        raise CheckpointFormatError(f"{files.layers[held]}: a layer file spec '{spec_name}' does not describe "
                                    f"(it places layers {sorted({i for i, _ in want})})")
    for key, expected in sorted(want.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        path = files.layers.get(key)
        if path is None:
            raise CheckpointFormatError(f"{files.tag_dir / layer_file(key[0], key[1])}: missing (spec '{spec_name}' "
                                        f"places {_few(sorted(expected))} there)")
        _state_dict_tensors(layout, read(path), expected, path, "layer", spec_name, where)
    return tuple(sorted({i for i, _ in extra}))


def _pipelined(spec: Spec, ds_model: DsModel | None) -> bool:
    """Whether a layout is the pipeline engine's: a derived one's model says so (an ``nn.Sequential``'s params
    are named '<index>.<name>' without a pipeline too), a spec's names do."""
    return ds_model.pipeline if ds_model is not None else _is_pipeline(spec)


def recorded_pipeline(models: list[Mapping[str, Any]], files: _Files,
                      shapes: list[list[list[tuple[str, tuple[int, ...]]]]], trees: Mapping[Path, Any]) -> DsModel:
    """The model a pipeline-engine checkpoint at tp = 1 records, one model file per stage: each stage's param
    groups (``shapes``, its ``param_shapes``) and ``buffer_names``, and every tensor of the layer files
    (``trees``: each read), each on the stage holding its layer.

    Raises CheckpointFormatError naming the file and the entry: tied modules, a name that is not
    '<layer index>.<name>', a param or layer on two stages, stages out of layer order, unequal param groups.
    """
    told: dict[int, int] = {}  # layer index -> the stage whose model file names a tensor of it
    trained: dict[str, tuple[int, ...]] = {}
    buffers: list[str] = []
    for p, (tree, path, groups) in enumerate(zip(models, files.model, shapes, strict=True)):
        if tied := _names_map(tree.get("shared_params"), "shared_params", path):
            raise CheckpointFormatError(f"{path}: tied pipeline modules (shared_params {brief(tied, 80)}) are not "
                                        "supported")
        if len(groups) != len(shapes[0]):
            raise CheckpointFormatError(f"{path}: {len(groups)} param groups in param_shapes, but "
                                        f"{files.model[0].name} has {len(shapes[0])}")
        names = []
        for g, group in enumerate(groups):
            if not group:
                raise CheckpointFormatError(f"{path}: param_shapes[{g}] is empty: stage {p} has no params in param "
                                            f"group {g}, which a pipeline-engine layout cannot place")
            for name, shape in group:
                if name in trained:
                    raise CheckpointFormatError(f"{path}: param_shapes[{g}] lists '{name}', which an earlier param "
                                                "group or stage lists too")
                trained[name] = shape
                names.append((f"param_shapes[{g}]", name))
        mine = _names(tree.get("buffer_names"), "buffer_names", path)
        buffers += mine
        for what, name in [*names, *(("buffer_names", b) for b in mine)]:
            if name.startswith("tied_modules."):
                raise CheckpointFormatError(f"{path}: {what} names '{name}': tied pipeline modules (tied_modules.*) "
                                            "are not supported")
            index, _ = _layer_key(name, f"{path}: {what}")
            if told.setdefault(index, p) != p:
                raise CheckpointFormatError(f"{path}: {what} names '{name}' of layer {index}, which stage "
                                            f"{told[index]}'s model file names too")
    order = sorted(told.items())
    if bad := next((b for a, b in zip(order, order[1:], strict=False) if b[1] < a[1]), None):
        raise CheckpointFormatError(f"{files.model[bad[1]]}: names layer {bad[0]}, but a later stage holds an "
                                    "earlier layer (a pipeline's stages hold consecutive layers)")
    tensors: dict[str, Recorded] = {}
    stages: dict[str, int] = {}
    for (index, _), path in sorted(files.layers.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        stage = told.get(index, max((s for i, s in order if i < index), default=0))
        for key, ref in trees[path].items():
            name = f"{index}.{name_of(key)}"
            if not isinstance(key, str) or not isinstance(ref, TensorRef):
                raise CheckpointFormatError(f"{path}: layer['{name_of(key)}'] is {brief(ref, 60)}, not a tensor")
            tensors[name] = Recorded(name, trained.get(name, ref.shape))
            stages[name] = stage
    for name, shape in trained.items():  # a param its layer file lacks: the check of the layer files names it
        if name not in tensors:
            tensors[name], stages[name] = Recorded(name, shape), told[_layer_key(name, "")[0]]
    if unheld := [b for b in buffers if b not in tensors]:
        raise CheckpointFormatError(f"{files.tag_dir}: buffer_names lists '{unheld[0]}', which no layer file holds")
    groups = tuple(tuple(name for per in shapes for name, _ in per[g]) for g in range(len(shapes[0])))
    kept = set(trained) | set(buffers)
    return DsModel(tensors=tuple(tensors.values()), groups=groups, module=tuple((n, n) for n in tensors),
                   frozen=tuple(n for n in tensors if n not in kept), buffers=tuple(buffers),
                   stages=tuple(stages.items()))


def _is_pipeline(spec: Spec) -> bool:
    """The spec names its model tensors as a PipelineModule does: '<layer index>.<name>'."""
    stored = [st for st in spec.statements if isinstance(st, Stored)]
    lead = re.compile(r"(\{[^}]*\}|\d+)\.")
    return bool(stored) and all(lead.match(st.pattern.text) for st in stored)


def _pipeline_degrees(model_states: Mapping, files: _Files, mp: int) -> tuple[int, int]:
    """(pp, tp) of a pipeline checkpoint: ``checkpoint_parallel_dimensions``, else the layer files' tp ranks."""
    dims = model_states.get("checkpoint_parallel_dimensions")
    if isinstance(dims, Mapping) and "pp_degree" in dims and "tp_degree" in dims:
        pp, tp = (expect_int(dims[k], f"checkpoint_parallel_dimensions['{k}']", files.model[0], lo=1, hi=mp)
                  for k in ("pp_degree", "tp_degree"))
    else:
        tp = max(1, len({t for _, t in files.layers if t is not None}))
        pp = mp // tp
    if pp * tp != mp:
        raise CheckpointFormatError(f"{files.model[0]}: pp_degree({pp}) * tp_degree({tp}) != mp_world_size({mp})")
    return pp, tp


def _pipeline_names(shapes: list[list[tuple[str, tuple[int, ...]]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Hugging Face Llama names for the shipped pipeline spec's layer list (embedding, decoder layers, norm,
    head), to tell the sizes from the shapes."""
    flat = [(found, v) for group in shapes for k, v in group if (found := _layer_index(k))]
    last = max((n for (n, _), _ in flat), default=0)
    out = []
    for (n, local), shape in flat:
        name = ("model.embed_tokens.weight" if n == 0 else "lm_head.weight" if n == last else
                "model.norm.weight" if n == last - 1 else f"model.layers.{n - 1}.{local}")
        out.append((name, shape))
    return [out]


def _pipeline_stages(shapes: list[list[list[tuple[str, tuple[int, ...]]]]], layers: int | None,
                     pp: int) -> tuple[int, ...] | None:
    """Decoder layers per stage, as the model files' param_shapes show them (None: even, or not known)."""
    if layers is None or pp == 1:
        return None
    tps = len(shapes) // pp
    counts = []
    for p in range(pp):
        indexes = {found[0] for g in shapes[p * tps] for k, _ in g if (found := _layer_index(k))}
        counts.append(len({n for n in indexes if 1 <= n <= layers}))
    return None if sum(counts) != layers or len(set(counts)) == 1 else tuple(counts)


def _layer_files(target: Target, info: _SpecInfo, extra: DeepSpeedExtra) -> dict[Path, dict[str, Item]]:
    """A pipeline's layer files (none without a pipeline): path -> {name in the layer: item}, in layer order;
    the empty layers' files hold nothing."""
    if not _pipelined(target.spec, target.extra.get("ds_model")):
        return {}
    out: dict[tuple[int, int], dict[str, Item]] = {}
    for it in target.layout.items:
        if it.section in info.model_sections:
            index, local = _layer_key(it.key, f"spec '{target.spec_name}'")
            out.setdefault((index, dict(it.unit)["tp"]), {})[local] = it
    for index in extra.empty_layers:
        for tp in range(target.topology.tp):
            out.setdefault((index, tp), {})
    return {Path(extra.tag) / layer_file(index, tp if extra.layer_model_axis else None): items
            for (index, tp), items in sorted(out.items())}


def _layer_tree(target: Target, items: Mapping[str, Item]) -> tuple[OrderedDict, _Sources]:
    """A layer file: the layer's ``state_dict()``, keyed by the names inside the layer."""
    tree, sources = OrderedDict(), {}
    for local, it in items.items():
        tree[local] = TensorSpec(target.dtypes[it], target.layout.items[it].shape, ("layer", local))
        sources[("layer", local)] = (it, target.layout.items[it].numel)
    return tree, sources
