"""The pipeline engine's checkpoints: its layer files, read and written.

The pipeline engine (``PipelineModule``, ZeRO 0/1) keeps the weights in one file per layer,
``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` (``layer_{idx:02d}-model_states.pt`` under a
topology without a model axis), keyed by the names inside the layer; its model files, one per
model-parallel rank ``pp * tp_size + tp``, hold ``module`` None and the stage's
``param_shapes``, and each stage has its own flat buffers. Its parameters are named
``<layer index>.<name>`` with the layer index global over the layer list; the shipped
``deepspeed-pipe-llama`` spec says how a Llama's layers map onto them. ``pp`` changes, and
moves in and out of the pipeline engine, are a change of spec.

Tied pipeline modules (``tied_modules.*``) are not supported.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from reshard.core.layout import Item, Layout
from reshard.core.spec import Spec, Stored
from reshard.errors import CheckpointFormatError
from reshard.formats.base import Located, Target, expect_int
from reshard.formats.deepspeed.files import _Files, _read, layer_file
from reshard.formats.deepspeed.state import DeepSpeedExtra, _Sources
from reshard.formats.deepspeed.zero12 import _few, _SpecInfo, _state_dict_tensors
from reshard.io.torchfile import TensorSpec

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


def _check_layers(layout: Layout, info: _SpecInfo, files: _Files, spec_name: str, where: dict[Item, Located]) -> None:
    """A pipeline's layer files against the layout: each holds exactly its layer's tensors, in their shapes."""
    named = any(t is not None for _, t in files.layers)
    want: dict[tuple[int, int | None], dict[str, Item]] = {}
    for it in layout.items:
        if it.section in info.model_sections:
            index, local = _layer_key(it.key, f"spec '{spec_name}'")
            want.setdefault((index, dict(it.unit)["tp"] if named else None), {})[local] = it
    if extra := sorted(set(files.layers) - set(want)):
        raise CheckpointFormatError(f"{files.layers[extra[0]]}: a layer file spec '{spec_name}' does not describe "
                                    f"(it places layers {sorted({i for i, _ in want})})")
    for key, expected in sorted(want.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        path = files.layers.get(key)
        if path is None:
            raise CheckpointFormatError(f"{files.tag_dir / layer_file(key[0], key[1])}: missing (spec '{spec_name}' "
                                        f"places {_few(sorted(expected))} there)")
        _state_dict_tensors(layout, _read(path), expected, path, "layer", spec_name, where)


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
    """A pipeline's layer files (none without a pipeline): path -> {name in the layer: item}, in layer order."""
    if not _is_pipeline(target.spec):
        return {}
    out: dict[tuple[int, int], dict[str, Item]] = {}
    for it in target.layout.items:
        if it.section in info.model_sections:
            index, local = _layer_key(it.key, f"spec '{target.spec_name}'")
            out.setdefault((index, dict(it.unit)["tp"]), {})[local] = it
    return {Path(extra.tag) / layer_file(index, tp if extra.layer_model_axis else None): items
            for (index, tp), items in sorted(out.items())}


def _layer_tree(target: Target, items: Mapping[str, Item]) -> tuple[OrderedDict, _Sources]:
    """A layer file: the layer's ``state_dict()``, keyed by the names inside the layer."""
    tree, sources = OrderedDict(), {}
    for local, it in items.items():
        tree[local] = TensorSpec(target.dtypes[it], target.layout.items[it].shape, ("layer", local))
        sources[("layer", local)] = (it, target.layout.items[it].numel)
    return tree, sources
