"""DeepSpeed ZeRO stage 1/2 checkpoints, as ``engine.save_checkpoint`` writes them.

On disk (DeepSpeed ``runtime/engine.py``: ``save_checkpoint``, ``_get_ckpt_name``,
``_get_rank_zero_ckpt_name``)::

    <dir>/latest                                                    the tag, e.g. global_step100
    <dir>/<tag>/mp_rank_{tp:02d}_model_states.pt                    one per tp rank
    <dir>/<tag>/[bf16_]zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt   one per (tp, dp) rank

``bf16_`` prefixes the optimizer files when bf16 is on. DeepSpeed also copies its own
``zero_to_fp32.py`` (and, from 0.19.8, ``zero_to_torch.py``) into ``<dir>``: DeepSpeed's
code, which reshard never writes.

A model file (``_save_checkpoint``, ``_common_checkpoint_state``) holds ``module``, the
state dict in the training dtype, ``param_shapes`` (per param group: name -> shape in
flat-buffer order), ``dp_world_size``, ``mp_world_size``, ``ds_config``, ``ds_version`` and
the engine's counters. An optimizer file (``_save_zero_checkpoint``; ``stage_1_and_2.py``
``state_dict``) holds ``optimizer_state_dict``: ``single_partition_of_fp32_groups`` (this
rank's fp32 master partition per group, its trailing padding cut off),
``base_optimizer_state`` (the torch optimizer's ``state_dict()``, whose ``exp_avg`` and
``exp_avg_sq`` are whole partitions), ``param_slice_mappings`` (per group: name ->
``fragment_address(numel, start)`` of the param's piece of this partition),
``group_paddings``, ``param_alignment_paddings`` (0.19.8), ``partition_count`` and
``zero_stage``. bf16 ZeRO-1 with fp32 gradient accumulation uses ``BF16_Optimizer``
instead (``bf16_optimizer.py``): no loss scaler or stage, the master partition whole,
all padding counted on the last rank. Both are read and written.

Flat layout (``stage_1_and_2.py``: ``flatten_dense_tensors_aligned``,
``align_dense_tensors``, ``get_data_parallel_partitions``;
``mixed_precision_linkage._init_lp_to_hp_mapping``): a group's params, flattened and
concatenated in order, zero-padded to a multiple of ``nccl_start_alignment_factor (2) *
dp``, split into ``dp`` equal contiguous partitions. The shipped specs say so (``flat ... =
model | pad 2*dp | split dp``), and ``open`` proves it file by file: ``param_shapes``,
``param_slice_mappings``, ``group_paddings`` and ``param_alignment_paddings`` must equal
what the resolved layout implies.

States: model weights ``param``; fp32 master ``master``; every tensor the torch optimizer
keeps per flat param (``exp_avg``, ``exp_avg_sq``, ...) under its own name, laid out like
``master``. Scalars (``step``) and all other non-tensor state are carried, never resharded.

ZeRO stage 3 checkpoints are read and written by ``reshard.formats.deepspeed_zero3``; universal
folders by ``reshard.formats.ucp``.
The pipeline engine (``PipelineModule``, ZeRO 0/1) keeps the weights in one file per layer,
``layer_{idx:02d}-model_{tp:02d}-model_states.pt`` (``layer_{idx:02d}-model_states.pt`` under a
topology without a model axis), keyed by the names inside the layer; its model files, one per
model-parallel rank ``pp * tp_size + tp``, hold ``module`` None and the stage's
``param_shapes``, and each stage has its own flat buffers. Its parameters are named
``<layer index>.<name>`` with the layer index global over the layer list; the shipped
``deepspeed-pipe-llama`` spec says how a Llama's layers map onto them. ``pp`` changes, and
moves in and out of the pipeline engine, are a change of spec.

Not supported, each refused with a message: MoE expert files, tied pipeline modules
(``tied_modules.*``), ``round_robin_gradients``, ``parameter_alignment``, frozen parameters,
persistent buffers, tied weights, and tp > 1 with a spec that splits nothing over tp.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.io.bounds import brief
from reshard.core.catalog import load_spec
from reshard.errors import CheckpointFormatError, SpecError, TopologyError
from reshard.formats.base import (LLAMA_SIZES, MAX_COUNT, Fill, Located, Source, Target, check_sizes, expect_int,
                                  expect_shape, given_sizes, itemsize, name_of, read_json, read_tag, require_sizes,
                                  stream_item)
from reshard.formats.deepspeed_zero3 import files_of_zero3, is_zero3, open_zero3, target_zero3, write_zero3
from reshard.formats.hf import llama_config
from reshard.core.layout import Item, Layout
from reshard.core.resolve import resolve
from reshard.core.spec import Concat, Flat, Pad, Pattern, Product, Section, Spec, Split, Stored, Term
from reshard.core.topology import Topology, parse_topology
from reshard.io.torchfile import Opaque, TensorRef, TensorSpec, TorchFileWriter, TorchSize, read_torch_file

__all__ = ["FORMAT", "DeepSpeedExtra", "DeepSpeedFormat", "Scalar", "synthesize_extra"]

DEFAULT_SPEC = "deepspeed-llama"
SPEC_BY_GROUPS = {1: "deepspeed-llama", 2: "deepspeed-llama-hf-trainer"}
"""The shipped spec for a checkpoint with this many param groups."""
PIPE_SPEC_BY_GROUPS = {1: "deepspeed-pipe-llama"}
"""The same for a pipeline-engine checkpoint."""
DS_VERSION = "0.19.8"
"""The DeepSpeed release whose files ``synthesize_extra`` imitates."""
WINDOW_BYTES = 8 << 20
"""Largest ``fill`` window, in bytes."""
PARAM, MASTER = "param", "master"

_MODEL_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_LAYER_FILE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")
_REFUSED_FILES = (
    (re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_\d+_mp_rank_\d+_optim_states\.pt"),
     "DeepSpeed MoE checkpoints (expert files) are not supported"),
)
# Hugging Face config.json keys -> llama.spec size names.
_HF_CONFIG = {"hidden_size": "h", "num_attention_heads": "heads", "num_key_value_heads": "g", "head_dim": "hd",
              "intermediate_size": "f", "vocab_size": "vocab", "num_hidden_layers": "layers"}
_FRAGMENT = ("deepspeed.utils.tensor_fragment", "fragment_address")
_ZERO_STAGE = ("deepspeed.runtime.zero.config", "ZeroStageEnum")
_LOSS_SCALER = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler")


def model_file(mp: int) -> str:
    """The model file of model-parallel rank ``mp`` (``pp * tp_size + tp`` under a pipeline)."""
    return f"mp_rank_{mp:02d}_model_states.pt"


def optim_file(mp: int, dp: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"


def layer_file(layer: int, tp: int | None) -> str:
    """A pipeline layer's weights; ``tp`` None under a topology without a model axis."""
    return f"layer_{layer:02d}{'' if tp is None else f'-model_{tp:02d}'}-model_states.pt"


@dataclass(frozen=True, slots=True)
class Scalar:
    """A 0-d tensor carried by value (Adam's ``step``): its dtype and raw bytes."""

    dtype: str
    data: bytes
    shape: tuple[int, ...] = ()
    """``()``; ``(0,)`` for ZeRO-3's empty module placeholders."""


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
    optimizer: str
    """``zero`` (DeepSpeedZeroOptimizer) or ``bf16`` (BF16_Optimizer)."""
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


# --- files -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Files:
    root: Path
    """The save dir, which holds ``latest``."""
    tag: str
    tag_dir: Path
    model: tuple[Path, ...]
    """Per model-parallel rank (the tp rank, or ``pp * tp_size + tp`` under a pipeline)."""
    optim: tuple[tuple[Path, ...], ...]
    """Per model-parallel rank, the optimizer files found (dp order)."""
    bf16_names: bool
    layers: Mapping[tuple[int, int | None], Path] = dataclasses.field(default_factory=dict)
    """A pipeline's layer files: (layer index, tp rank or None) -> path; empty without a pipeline."""


def _locate(path: Path) -> tuple[Path, str, Path]:
    """(save dir, tag, tag dir) of a save dir with ``latest``, or of a tag dir itself."""
    latest = path / "latest"
    if latest.is_file():
        tag = read_tag(latest)
        if not (path / tag).is_dir():
            raise CheckpointFormatError(f"{latest}: names tag '{tag}' but {path / tag} is not a directory")
        return path, tag, path / tag
    if path.is_dir() and any(_MODEL_FILE.fullmatch(p.name) for p in path.iterdir()):
        return path.parent, path.name, path
    raise CheckpointFormatError(f"{path}: not a DeepSpeed checkpoint (no 'latest' file, no mp_rank_XX_model_states.pt)")


def _find_files(path: Path) -> _Files:
    root, tag, tag_dir = _locate(path)
    names = sorted(p.name for p in tag_dir.iterdir())
    for pattern, reason in _REFUSED_FILES:
        if any(pattern.fullmatch(n) for n in names):
            raise CheckpointFormatError(f"{tag_dir}: {reason}")
    tps = sorted(int(m.group(1)) for n in names if (m := _MODEL_FILE.fullmatch(n)))
    if tps != list(range(len(tps))):
        missing = next(t for t in range(len(tps) + 1) if t not in set(tps))
        raise CheckpointFormatError(f"{tag_dir}: missing {model_file(missing)} (there is a {model_file(tps[-1])})")
    optim: dict[int, dict[int, str]] = {t: {} for t in tps}
    prefixes = set()
    for n in names:
        if m := _OPTIM_FILE.fullmatch(n):
            prefixes.add(bool(m.group(1)))
            if int(m.group(3)) not in optim:
                raise CheckpointFormatError(f"{tag_dir / n}: an optimizer file of mp rank {m.group(3)}, "
                                            "which has no model file")
            optim[int(m.group(3))][int(m.group(2))] = n
    if not prefixes:
        raise CheckpointFormatError(f"{tag_dir}: no *zero_pp_rank_*_optim_states.pt files "
                                    "(saved without a ZeRO optimizer?)")
    if len(prefixes) > 1:
        raise CheckpointFormatError(f"{tag_dir}: both bf16_zero_pp_rank_* and zero_pp_rank_* files; "
                                    "remove the stale set")
    layers: dict[tuple[int, int | None], Path] = {}
    for n in names:
        if m := _LAYER_FILE.fullmatch(n):
            layers[(int(m.group(1)), None if m.group(2) is None else int(m.group(2)))] = tag_dir / n
    if len({tp is None for _, tp in layers}) > 1:
        raise CheckpointFormatError(f"{tag_dir}: both layer_XX-model_YY-model_states.pt and "
                                    "layer_XX-model_states.pt files; remove the stale set")
    return _Files(root=root, tag=tag, tag_dir=tag_dir, model=tuple(tag_dir / model_file(t) for t in tps),
                  optim=tuple(tuple(tag_dir / optim[t][d] for d in sorted(optim[t])) for t in tps),
                  bf16_names=prefixes.pop(), layers=layers)


# --- what the spec says ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _SpecInfo:
    model_sections: tuple[str, ...]
    """Sections whose tensors are in ``module``."""
    optim_section: str
    groups: tuple[tuple[str, Pattern], ...]
    """Per param group: (the section its flat buffer is built from, the flat buffer's key pattern)."""

    def flat_key(self, group: int, state: str) -> str:
        return self.groups[group][1].format({"state": state})


def _spec_info(spec: Spec, name: str) -> _SpecInfo:
    """The param groups of a DeepSpeed spec: one flat buffer per group, in group order, in one section."""
    sections: list[tuple[Section, list]] = []
    for st in spec.statements:
        if isinstance(st, Section):
            sections.append((st, []))
        elif sections:
            sections[-1][1].append(st)
    optim = [(sec, flats) for sec, rules in sections if (flats := [r for r in rules if isinstance(r, Flat)])]
    if len(optim) != 1:
        raise CheckpointFormatError(f"spec '{name}' must have one section of flat buffers (the ZeRO partitions), "
                                    f"found {len(optim)}")
    sec, flats = optim[0]
    for fl in flats:
        captures = {c.name for c in fl.pattern.captures}
        if any(op.op not in ("pad", "split", "align") for op in fl.ops) or captures != {"state"}:
            raise CheckpointFormatError(f"spec '{name}': flat buffer '{fl.pattern.text}' is not a ZeRO-1/2 partition "
                                        "(expected 'flat <name with {state}> = <section> | pad 2*dp | split dp')")
    model = tuple(s.name for s, rules in sections if s is not sec and any(isinstance(r, Stored) for r in rules))
    used = [fl.source for fl in flats]
    if sorted(used) != sorted(model):
        raise CheckpointFormatError(f"spec '{name}': each model section must feed exactly one flat buffer "
                                    f"(a param group); model sections: {', '.join(model)}; "
                                    f"flat buffers built from: {', '.join(used)}")
    groups = tuple((fl.source, fl.pattern) for fl in flats)
    return _SpecInfo(model_sections=model, optim_section=sec.name, groups=groups)


def _splits_over(spec: Spec, axis: str) -> bool:
    def walk(t: Term) -> bool:
        if isinstance(t, Split):
            return t.axis == axis or walk(t.term)
        if isinstance(t, Pad):
            return walk(t.term)
        if isinstance(t, Product):
            return any(walk(x) for x in t.terms)
        return isinstance(t, Concat) and any(walk(x) for p in t.parts for x in p.terms)

    return any(isinstance(st, Stored) and any(walk(t) for t in st.dims or ()) for st in spec.statements)


Rank = tuple[int, int]
"""A model-parallel rank as (pp, tp)."""


def _unit(pt: Rank, dp: int | None = None) -> tuple[tuple[str, int], ...]:
    unit = (("tp", pt[1]), ("pp", pt[0]))
    return unit if dp is None else (*unit, ("dp", dp))


def _ranks(topology: Topology) -> list[Rank]:
    """The model-parallel ranks in file order: ``mp_rank_{pp * tp_size + tp}``."""
    return [(p, t) for p in range(topology.pp) for t in range(topology.tp)]


@dataclass(frozen=True, slots=True)
class _Group:
    """One param group's flat buffer at one tp rank. Every number counts elements."""

    share: int
    """Elements per dp partition: the padded flat length / dp."""
    dp: int
    params: tuple[tuple[str, int, int], ...]
    """(module key, start in the whole flat buffer, numel), in flat order."""

    @property
    def end(self) -> int:
        """Where the last param ends: the group's numel plus any gaps between params."""
        return self.params[-1][1] + self.params[-1][2] if self.params else 0

    def mappings(self, rank: int) -> list[tuple[str, int, int]]:
        """``param_slice_mappings[g]`` of ``rank``: (key, numel, start in the partition) of each piece in it."""
        lo, hi = rank * self.share, (rank + 1) * self.share
        pieces = [(key, max(s, lo), min(s + n, hi)) for key, s, n in self.params]
        return [(key, b - a, a - lo) for key, a, b in pieces if b > a]

    def padding(self, rank: int, optimizer: str) -> int:
        """``group_paddings[g]`` of ``rank``: its partition's padding (BF16_Optimizer: all of it, on the last rank)."""
        if optimizer == "bf16":
            return self.share * self.dp - sum(n for _, _, n in self.params) if rank == self.dp - 1 else 0
        return min(self.share, max(0, (rank + 1) * self.share - self.end))

    def alignment_paddings(self) -> list[int]:
        """``param_alignment_paddings[g]``: the gap after each param (0 after the last)."""
        gaps = [b[1] - (a[1] + a[2]) for a, b in zip(self.params, self.params[1:], strict=False)]
        return gaps + [0] * bool(self.params)


def _groups(layout: Layout, info: _SpecInfo, pt: Rank) -> list[_Group]:
    """The flat geometry of each param group at model-parallel rank ``pt``, read off the layout's fragments."""
    frags: dict[Item, list] = {}
    for f in layout.fragments:
        frags.setdefault(f.item, []).append(f)
    state = next(it.state for it in layout.items if it.section == info.optim_section)
    unit = ",".join(f"{a}={c}" for a, c in _unit(pt))
    out = []
    for g, (section, _) in enumerate(info.groups):
        order = [it for it in layout.order.get(f"{section}/{unit}/0", ()) if it.state == PARAM]
        key_of = {f.tensor: it.key for it in order for f in frags.get(it, ())}
        key = info.flat_key(g, state)
        items = [Item(info.optim_section, _unit(pt, r), 0, state, key) for r in range(layout.topology.dp)]
        share = layout.items[items[0]].shape[0]
        starts: dict[str, int] = {}
        for r, item in enumerate(items):
            pieces: dict[str, list[int]] = {}  # tensor -> [first, end, count] of its elements in this partition
            for f in frags.get(item, ()):
                end = f.offset + 1 + sum((n - 1) * s for n, s in zip(f.box.lengths, f.strides, strict=True))
                row = pieces.setdefault(f.tensor, [f.offset, end, 0])
                row[0], row[1], row[2] = min(row[0], f.offset), max(row[1], end), row[2] + math.prod(f.box.lengths)
            for tensor, (first, end, count) in pieces.items():
                if end - first != count:
                    raise CheckpointFormatError(f"{item}: {tensor} is not contiguous in the flat buffer "
                                                "(not a ZeRO-1/2 layout)")
                starts[key_of[tensor]] = min(starts.get(key_of[tensor], r * share + first), r * share + first)
        params = tuple((it.key, starts[it.key], layout.items[it].numel) for it in order if layout.items[it].numel)
        out.append(_Group(share=share, dp=layout.topology.dp, params=params))
    return out


# --- the format ------------------------------------------------------------------------------------


class DeepSpeedFormat:
    """DeepSpeed ZeRO checkpoints: ``engine.save_checkpoint`` directories (stage 3 read by ``deepspeed_zero3``)."""

    name = "deepspeed"

    def detect(self, path: Path) -> bool:
        try:
            _, _, tag_dir = _locate(Path(path))
            dirs = [tag_dir]
        except CheckpointFormatError:  # a broken 'latest' beside DeepSpeed tag dirs: open names what is wrong
            dirs = [d for d in Path(path).iterdir() if d.is_dir()] if (Path(path) / "latest").is_file() else []
        try:
            return any(_OPTIM_FILE.fullmatch(p.name) or is_zero3([p.name]) for d in dirs for p in d.iterdir())
        except OSError:
            return False

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read a ZeRO-1/2 checkpoint's metadata, resolve its layout and prove the layout against every file.

        ``path`` is the save dir (with ``latest``) or a tag dir. The spec defaults to the
        shipped one for the number of param groups. Sizes come from ``sizes``, else a Hugging
        Face ``config.json`` in the tag dir, the save dir or its parent, else the shapes
        (at tp=1), which cannot tell heads from head dim.

        Raises:
          CheckpointFormatError: naming the file and what disagrees (rank files missing or
            beyond ``dp_world_size``, a param placed elsewhere than the spec says, ...).
        """
        root, tag, tag_dir = _locate(Path(path))
        if is_zero3([p.name for p in tag_dir.iterdir()]):
            return open_zero3(self.name, root, tag, tag_dir, spec=spec, sizes=sizes)
        files = _find_files(Path(path))
        models = [_read(p) for p in files.model]
        first = models[0]
        dp, mp = (expect_int(_get(first, k, files.model[0]), k, files.model[0], lo=1, hi=MAX_COUNT)
                  for k in ("dp_world_size", "mp_world_size"))
        if mp != len(files.model):
            raise CheckpointFormatError(f"{files.model[0]}: mp_world_size is {mp} but {files.tag_dir} "
                                        f"has {len(files.model)} model files")
        pipeline = bool(files.layers) or first.get("module", {}) is None
        pp, tp = _pipeline_degrees(first, files, mp) if pipeline else (1, mp)
        for t, row in enumerate(files.optim):
            if len(row) != dp:
                raise CheckpointFormatError(f"{files.tag_dir}: {len(row)} optimizer files for mp rank {t:02d} but "
                                            f"{files.model[t].name} says dp_world_size={dp}")
            for d in range(dp):
                if (want := files.tag_dir / optim_file(t, d, files.bf16_names)) not in row:
                    raise CheckpointFormatError(f"{want}: missing (dp_world_size={dp})")
        optims = [[_read(p) for p in row] for row in files.optim]
        osd0 = _get(optims[0][0], "optimizer_state_dict", files.optim[0][0], Mapping)
        optimizer = "zero" if "zero_stage" in osd0 else "bf16"
        stage = _stage(osd0["zero_stage"], files.optim[0][0]) if optimizer == "zero" else 1
        _refuse_options(first, files.model[0])
        shapes = [_param_shapes(tree, p) for tree, p in zip(models, files.model, strict=True)]
        spec_name = spec or (PIPE_SPEC_BY_GROUPS if pipeline else SPEC_BY_GROUPS).get(len(shapes[0]))
        if spec_name is None:
            raise CheckpointFormatError(f"{files.model[0]}: {len(shapes[0])} param groups, and no shipped spec "
                                        "has that many; give a spec")
        parsed = load_spec(spec_name)
        info = _spec_info(parsed, spec_name)
        for path, groups in zip(files.model, shapes, strict=True):
            if len(info.groups) != len(groups):
                raise CheckpointFormatError(f"{path}: {len(groups)} param groups in param_shapes, "
                                            f"but spec '{spec_name}' has {len(info.groups)} flat buffers")
        if tp > 1 and not _splits_over(parsed, "tp"):
            raise CheckpointFormatError(f"{files.model[0]}: mp_world_size={tp} but spec '{spec_name}' splits "
                                        "nothing over tp; give a spec that says how tp splits the model")
        if pipeline != _is_pipeline(parsed):
            raise CheckpointFormatError(f"{files.tag_dir}: {'a' if pipeline else 'not a'} pipeline-engine checkpoint, "
                                        f"but spec '{spec_name}' describes {'no' if pipeline else 'a'} pipeline")
        named = _pipeline_names([g for tree in shapes for g in tree]) if pipeline else shapes[0]
        all_sizes = _llama_sizes(files, named if tp == 1 else [], sizes, sum(len(g) for tree in shapes for g in tree))
        stages = _pipeline_stages(shapes, all_sizes.get("layers"), pp) if pipeline else None
        try:
            topology = Topology(tp=tp, pp=pp, dp=dp, zero=stage, stages=stages)
        except TopologyError as e:
            raise CheckpointFormatError(f"{files.model[0]}: {e}") from None
        flat_states = _flat_states(optims, files)
        try:
            layout = resolve(parsed, topology, all_sizes, states={info.optim_section: (MASTER, *flat_states)})
        except TopologyError as e:
            raise CheckpointFormatError(f"{files.tag_dir}: {e}") from None
        except SpecError as e:  # most often a size neither given, nor in a config.json, nor told by the shapes
            known = ", ".join(f"{k}={v}" for k, v in sorted(all_sizes.items()))
            raise CheckpointFormatError(f"{files.tag_dir}: spec '{spec_name}' does not resolve with the sizes known "
                                        f"({known}); give the others with sizes, or a config.json\n{e}") from None
        where: dict[Item, Located] = {}
        for m, pt in enumerate(_ranks(topology)):
            groups = _groups(layout, info, pt)
            _check_model(layout, info, models[m], files.model[m], pt, groups, shapes[m], spec_name, where)
            for d in range(dp):
                _check_optim(layout, info, optims[m][d], files.optim[m][d], pt, d, groups, optimizer, flat_states,
                             spec_name, where)
        if pipeline:
            _check_layers(layout, info, files, spec_name, where)
        elastic = not isinstance(osd0["base_optimizer_state"], Mapping)
        extra = DeepSpeedExtra(tag=files.tag, zero_stage=stage, optimizer=optimizer, bf16_names=files.bf16_names,
                               elastic=elastic, model_states=_template(first, files.model[0], drop=("module",)),
                               optim_states=_optim_template(optims[0][0], files.optim[0][0]),
                               module_order=tuple(name_of(k) for k in first["module"] or ()),
                               layer_model_axis=not any(t is None for _, t in files.layers))
        config = _hf_config(files)
        return Source(format=self.name, path=files.root, spec_name=spec_name, spec=parsed, topology=topology,
                      sizes=all_sizes, layout=layout, where=where,
                      extra={"deepspeed": extra, **({"config": config} if config else {})})

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        """The DeepSpeed layout of ``source``'s model at ``topology``.

        ``topology.zero`` picks the stage (0: the source's, or 2; 1 under a pipeline). A
        DeepSpeed source's non-tensor state is carried; any other source gets
        ``synthesize_extra``'s. ``pp`` > 1 means the pipeline engine: a pipeline spec
        (by default ``deepspeed-pipe-llama``), whose layer files are written too.
        """
        if "transformer.wte.weight" not in source.layout.tensors:
            require_sizes(source, LLAMA_SIZES, "deepspeed")
        if topology.vpp != 1:
            raise TopologyError(f"DeepSpeed's pipeline engine has no virtual stages: vpp({topology.vpp}) must be 1")
        if topology.cp != 1 or topology.ep != 1:
            raise TopologyError(f"DeepSpeed ZeRO checkpoints here have cp=1 and ep=1, got {topology}")
        if "transformer.wte.weight" in source.layout.tensors:
            raise CheckpointFormatError(f"{source.path}: a GPT-2-style model; the deepspeed format supports "
                                        "Llama-style models (specs/deepspeed-llama*.spec) so far")
        carried = source.extra.get("deepspeed") if source.format == self.name else None
        spec_name = spec or (source.spec_name if carried else DEFAULT_SPEC)
        if spec is None and topology.pp > 1 and not _is_pipeline(load_spec(spec_name)):
            spec_name = PIPE_SPEC_BY_GROUPS[1]
        pipeline = _is_pipeline(load_spec(spec_name))
        if topology.pp != 1 and not pipeline:
            raise TopologyError(f"spec '{spec_name}' describes DeepSpeed's engine without a pipeline: pp({topology.pp}) "
                                "must be 1 (give a pipeline spec, such as deepspeed-pipe-llama)")
        default = carried.zero_stage if carried else 3 if "zero3" in source.extra else 2
        stage = topology.zero or (min(default, 1) if pipeline else default)
        if pipeline and stage > 1:
            raise TopologyError(f"DeepSpeed runs ZeRO stage 0 or 1 under a pipeline, not zero={stage}")
        if stage == 3:
            return target_zero3(self.name, source, topology, spec)
        if stage not in (1, 2):
            raise TopologyError(f"DeepSpeed target: writing ZeRO stage {stage} is not supported yet (only 1 and 2); "
                                "give zero=1 or zero=2 in the topology")
        parsed = load_spec(spec_name)
        info = _spec_info(parsed, spec_name)
        if topology.tp > 1 and not _splits_over(parsed, "tp"):
            raise TopologyError(f"spec '{spec_name}' splits nothing over tp; DeepSpeed at tp({topology.tp}) "
                                "needs a spec that does")
        # The source's order of states: a DeepSpeed source's is its optimizer's key order.
        src_states = list(dict.fromkeys(it.state for it in source.layout.items if it.state != PARAM))
        fp32 = all(loc.dtype == "float32" for it, loc in source.where.items() if it.state == PARAM)
        if MASTER not in src_states and fp32 and any(it.state == PARAM for it in source.where):
            src_states.insert(0, MASTER)  # fp32 training: the weights are the master copy (reshard.api aliases them)
        if MASTER not in src_states:
            raise CheckpointFormatError(f"a DeepSpeed checkpoint needs the fp32 master weights (state '{MASTER}'); "
                                        f"the source has: {', '.join(source.layout.states)}")
        states = (MASTER, *[s for s in src_states if s != MASTER])
        layout = resolve(parsed, topology, source.sizes, states={info.optim_section: states})
        model_dtype = next((loc.dtype for it, loc in source.where.items() if it.state == PARAM), "float32")
        if carried is not None:
            extra = _carry(carried, stage, len(info.groups), spec_name)
        else:
            extra = synthesize_extra(groups=len(info.groups), dtype=model_dtype, zero_stage=stage, states=states[1:],
                                     dp=topology.dp)
        dtypes = {it: model_dtype if it.section in info.model_sections else "float32" for it in layout.items}
        carried_config = {"config": source.extra["config"]} if "config" in source.extra else {}
        return Target(format=self.name, spec_name=spec_name, spec=parsed, topology=topology, sizes=dict(source.sizes),
                      layout=layout, dtypes=dtypes, extra={"deepspeed": extra, **carried_config})

    def new_target(self, topology: str | Topology, sizes: Mapping[str, int], *, spec: str = DEFAULT_SPEC,
                   dtype: str = "bfloat16", zero_stage: int = 2, states: tuple[str, ...] = ("exp_avg", "exp_avg_sq"),
                   **options: Any) -> Target:
        """A target from scratch with synthesized non-tensor state (``synthesize_extra(**options)``), for fixtures.

        >>> t = FORMAT.new_target("dp=2", {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "layers": 2})
        >>> t.layout.states
        ('exp_avg', 'exp_avg_sq', 'master', 'param')
        """
        topo = parse_topology(topology) if isinstance(topology, str) else topology
        parsed = load_spec(spec)
        info = _spec_info(parsed, spec)
        layout = resolve(parsed, topo, sizes, states={info.optim_section: (MASTER, *states)})
        options.setdefault("dp", topo.dp)
        extra = synthesize_extra(groups=len(info.groups), dtype=dtype, zero_stage=zero_stage, states=states, **options)
        dtypes = {it: dtype if it.section in info.model_sections else "float32" for it in layout.items}
        return Target(format=self.name, spec_name=spec, spec=parsed, topology=topo, sizes=dict(sizes), layout=layout,
                      dtypes=dtypes, extra={"deepspeed": extra})

    def write(self, target: Target, out: Path, fill: Fill, *, progress: Callable[[int], None] | None = None,
              only: Collection[Path] | None = None, window_bytes: int | None = None) -> list[Path]:
        """Write ``latest``, the model files and the optimizer files of ``target`` under ``out``.

        Recomputed for the target topology: ``param_shapes``, ``param_slice_mappings``,
        ``group_paddings``, ``param_alignment_paddings``, ``partition_count``,
        ``dp_world_size``, ``mp_world_size``, ``checkpoint_parallel_dimensions``, and in
        ``ds_config`` the ZeRO stage and ``train_batch_size`` (= micro batch * accumulation
        steps * dp, when the config gives all three). Everything else comes from
        ``target.extra["deepspeed"]`` (synthesized when absent). Module tensors get a
        storage each (DeepSpeed's share their group's flat buffer; torch loads both alike).
        Item bytes come in windows of at most ``window_bytes`` (default ``WINDOW_BYTES``).
        With ``only``, just those rank files, and not ``config.json`` or ``latest``.
        """
        if "zero3" in target.extra:
            return write_zero3(target, out, fill, progress=progress, only=only, window_bytes=window_bytes)
        info = _spec_info(target.spec, target.spec_name)
        topo = target.topology
        extra, dtype = _write_extra(target, info)
        window = window_bytes or WINDOW_BYTES
        keep = None if only is None else set(only)
        flat_states = tuple(dict.fromkeys(it.state for it in target.layout.items if it.section == info.optim_section))
        ds_config = _ds_config(extra.model_states.get("ds_config"), topo.dp, extra.zero_stage)
        pipeline = _is_pipeline(target.spec)
        (Path(out) / extra.tag).mkdir(parents=True, exist_ok=True)
        written = []
        for m, pt in enumerate(_ranks(topo)):
            groups = _groups(target.layout, info, pt)
            rel = Path(extra.tag) / model_file(m)
            # A pipeline's model files hold no items: the call that writes the item-less files writes them.
            if keep is None or rel in keep or (pipeline and not keep):
                tree = _model_tree(extra, info, groups, pt, target, ds_config, pipeline)
                _write_file(Path(out) / rel, *tree, fill, target, progress, window)
                written.append(rel)
            for d in range(topo.dp):
                rel = Path(extra.tag) / optim_file(m, d, extra.bf16_names)
                if keep is None or rel in keep:
                    tree = _optim_tree(extra, info, groups, pt, d, flat_states, target, ds_config)
                    _write_file(Path(out) / rel, *tree, fill, target, progress, window)
                    written.append(rel)
        if pipeline:
            for rel, items in _layer_files(target, info, extra).items():
                if keep is None or rel in keep:
                    _write_file(Path(out) / rel, *_layer_tree(target, items), fill, target, progress, window)
                    written.append(rel)
        if keep:  # a worker's share: the files holding no items are written by the call with only=()
            return written
        # As the transformers Trainer leaves it: the model's config.json beside the tag
        # directory, so the checkpoint names its own attention layout.
        config = target.extra.get("config") or llama_config(target.sizes, [dtype])
        (Path(out) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (Path(out) / "latest").write_text(extra.tag)
        return [*written, Path("config.json"), Path("latest")]


    def files_of(self, target: Target) -> dict[Item, Path]:
        """The file, relative to the checkpoint directory, that holds each item of ``target``."""
        if "zero3" in target.extra:
            return files_of_zero3(target)
        info = _spec_info(target.spec, target.spec_name)
        extra, _ = _write_extra(target, info)
        out = {it: rel for rel, items in _layer_files(target, info, extra).items() for it in items.values()}
        tps = target.topology.tp
        for item in target.layout.items:
            if item in out:
                continue
            u = dict(item.unit)
            mp = u.get("pp", 0) * tps + u.get("tp", 0)
            name = optim_file(mp, u["dp"], extra.bf16_names) if item.section == info.optim_section else model_file(mp)
            out[item] = Path(extra.tag) / name
        return out


def _write_extra(target: Target, info: Any) -> tuple[DeepSpeedExtra, str]:
    """The non-tensor state a write uses, and the model dtype: carried, or synthesized for these dtypes."""
    extra: DeepSpeedExtra | None = target.extra.get("deepspeed")
    dtype = next((d for it, d in target.dtypes.items() if it.section in info.model_sections), "float32")
    if extra is None:
        extra = synthesize_extra(groups=len(info.groups), dtype=dtype, dp=target.topology.dp)
    if extra.synthesized:  # the dtypes may have been settled after target() (convert takes the sources')
        extra = _with_bf16(extra, dtype == "bfloat16")
    return extra, dtype


FORMAT = DeepSpeedFormat()


# --- reading and checking --------------------------------------------------------------------------


def _read(path: Path) -> dict[str, Any]:
    tree = read_torch_file(path)
    if not isinstance(tree, dict):
        raise CheckpointFormatError(f"{path}: holds a {type(tree).__name__}, not a DeepSpeed checkpoint dict")
    if (key := next((k for k in tree if not isinstance(k, str)), None)) is not None:
        raise CheckpointFormatError(f"{path}: top-level key {brief(key, 60)} is not a string")
    return tree


def _get(tree: Any, key: str, where: Path, kind: type | tuple[type, ...] | None = None) -> Any:
    """``tree[key]``, which must exist (and be a ``kind``, when given)."""
    if not isinstance(tree, Mapping) or key not in tree:
        raise CheckpointFormatError(f"{where}: no '{key}' (not a DeepSpeed ZeRO checkpoint file?)")
    if kind is not None and not isinstance(tree[key], kind):
        raise CheckpointFormatError(f"{where}: '{key}' is a {type(tree[key]).__name__} "
                                    f"({brief(tree[key], 60)}), not what a DeepSpeed checkpoint holds there")
    return tree[key]


def _stage(value: Any, where: Path) -> int:
    enum = isinstance(value, Opaque) and (value.module, value.name) == _ZERO_STAGE
    if enum and value.args in ((1,), (2,)):
        return value.args[0]
    if enum and value.args == (3,):
        raise CheckpointFormatError(f"{where}: ZeRO stage 3 checkpoints are not supported yet; only stages 1 and 2")
    raise CheckpointFormatError(f"{where}: zero_stage is {brief(value, 80)}, expected ZeroStageEnum(1) or (2)")


def _refuse_options(model_states: Mapping, where: Path) -> None:
    for key in ("frozen_param_shapes", "buffer_names"):
        value = model_states.get(key)
        if value is not None and not isinstance(value, Mapping | list | tuple):
            raise CheckpointFormatError(f"{where}: {key} is {brief(value, 80)}, expected a mapping or a list "
                                        "of names")
        if value:
            raise CheckpointFormatError(f"{where}: {key} is not empty ({_few([name_of(k) for k in value])}); "
                                        "frozen parameters and persistent buffers are not supported")
    zero = _zero_config(model_states, where)
    for key in ("round_robin_gradients", "parameter_alignment"):
        if zero.get(key):
            raise CheckpointFormatError(f"{where}: zero_optimization.{key} is on; "
                                        "that flat-buffer layout is not supported")


def _zero_config(model_states: Mapping, where: Path) -> Mapping:
    """``ds_config.zero_optimization`` (empty when absent), which a target rewrites: each a mapping if there."""
    config = model_states.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    if not isinstance(config, Mapping | None) or not isinstance(zero, Mapping | None):
        raise CheckpointFormatError(f"{where}: ds_config is {brief(config, 80)}; expected a mapping whose "
                                    "zero_optimization, if any, is a mapping")
    return zero or {}


def _param_shapes(tree: Any, path: Path) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``param_shapes``: per param group, (name, shape) in flat-buffer order."""
    groups = _get(tree, "param_shapes", path)
    if not isinstance(groups, list) or not groups or not all(isinstance(g, Mapping) for g in groups):
        raise CheckpointFormatError(f"{path}: param_shapes is {brief(groups, 80)}; was the checkpoint saved with "
                                    "ZeRO?")
    return [[(name_of(k), expect_shape(v, f"param_shapes[{g}]['{name_of(k)}']", path)) for k, v in group.items()]
            for g, group in enumerate(groups)]


def _base_groups(base: Any, path: Path) -> list[Mapping[str, Any]]:
    """Per-group optimizer state: ``state[g]`` of a torch optimizer state_dict, or an elastic checkpoint's list."""
    if isinstance(base, Mapping) and isinstance(base.get("state"), Mapping):
        state = base["state"]
        if not all(type(k) is int for k in state) or not all(isinstance(g, Mapping) for g in state.values()):
            raise CheckpointFormatError(f"{path}: base_optimizer_state.state is keyed {brief(list(state), 60)}; "
                                        "expected param group numbers, each with a mapping of states")
        if not isinstance(base.get("param_groups", []), list):
            raise CheckpointFormatError(f"{path}: base_optimizer_state.param_groups is not a list")
        return [state[k] for k in sorted(state)]
    if isinstance(base, list) and all(isinstance(g, Mapping) for g in base):
        return list(base)
    raise CheckpointFormatError(f"{path}: base_optimizer_state is neither a torch optimizer state_dict "
                                "nor a list of groups")


def _is_flat(value: Any) -> bool:
    return isinstance(value, TensorRef) and len(value.shape) >= 1


def _flat_states(optims: list[list[Any]], files: _Files) -> tuple[str, ...]:
    """The optimizer's per-param tensor states (``exp_avg``, ...): the same in every group and file."""
    seen: tuple[str, ...] | None = None
    for t, row in enumerate(optims):
        for d, tree in enumerate(row):
            path = files.optim[t][d]
            per = _base_groups(_get(_get(tree, "optimizer_state_dict", path), "base_optimizer_state", path), path)
            names = {tuple(name_of(k) for k, v in grp.items() if _is_flat(v)) for grp in per}
            if len(names) > 1:
                raise CheckpointFormatError(f"{path}: param groups hold different optimizer states: {sorted(names)}")
            if bad := [k for grp in per for k, v in grp.items() if _is_flat(v) and not isinstance(k, str)]:
                raise CheckpointFormatError(f"{path}: an optimizer state is named {brief(bad[0], 40)}, not a string")
            mine = names.pop() if names else ()
            if clash := [s for s in mine if s in (MASTER, PARAM)]:
                raise CheckpointFormatError(f"{path}: an optimizer state named '{clash[0]}' clashes with "
                                            "reshard's state names")
            if seen is not None and mine != seen:
                raise CheckpointFormatError(f"{path}: optimizer states {list(mine)} differ from the first file's "
                                            f"{list(seen)}")
            seen = mine
    return seen or ()


def _check_model(layout: Layout, info: _SpecInfo, tree: Any, path: Path, pt: Rank, groups: list[_Group],
                 shapes: list[list[tuple[str, tuple[int, ...]]]], spec_name: str, where: dict[Item, Located]) -> None:
    """A model file against the layout: its param_shapes, and its module unless a pipeline keeps that in layer files."""
    module = _get(tree, "module", path, (Mapping, type(None)))
    items = {it.key: it for it in layout.items if it.section in info.model_sections and it.unit == _unit(pt)}
    _check_param_shapes(layout, items, tree, path, groups, shapes, spec_name)
    if module is None:  # a pipeline's: the weights are in its layer files
        return
    _state_dict_tensors(layout, module, items, path, "module", spec_name, where)


def _state_dict_tensors(layout: Layout, state_dict: Mapping, items: Mapping[str, Item], path: Path, what: str,
                        spec_name: str, where: dict[Item, Located]) -> None:
    """A state dict (``module``, or a pipeline layer's) holds exactly ``items``, in their shapes: locate each."""
    if extra := [name_of(k) for k in state_dict if k not in items]:
        raise CheckpointFormatError(f"{path}: {what} tensors not described by spec '{spec_name}': {_few(extra)}")
    if missing := [k for k in items if k not in state_dict]:
        raise CheckpointFormatError(f"{path}: {what} lacks {_few(missing)}, which spec '{spec_name}' stores")
    for key, it in items.items():
        ref, shape = state_dict[key], layout.items[it].shape
        if not isinstance(ref, TensorRef) or ref.shape != shape:
            got = f"shape {list(ref.shape)}" if isinstance(ref, TensorRef) else "not a tensor"
            raise CheckpointFormatError(f"{path}: {what}['{key}'] is {got}; spec '{spec_name}' stores {list(shape)}")
        where[it] = _located(ref, path, f"{what}['{key}']")


def _check_param_shapes(layout: Layout, items: Mapping[str, Item], tree: Any, path: Path, groups: list[_Group],
                        shapes: list[list[tuple[str, tuple[int, ...]]]], spec_name: str) -> None:
    for g, (group, have) in enumerate(zip(groups, shapes, strict=True)):
        want = [(k, layout.items[items[k]].shape) for k, _, _ in group.params]
        for pos in range(max(len(have), len(want))):
            h, w = (have[pos] if pos < len(have) else None), (want[pos] if pos < len(want) else None)
            if h != w:
                hint = (f"; tied weights (shared_params {brief(tree['shared_params'], 80)}) are not "
                        "supported"
                        if tree.get("shared_params") else "")
                raise CheckpointFormatError(f"{path}: param_shapes[{g}] position {pos} is {_show(h)} "
                                            f"but spec '{spec_name}' has {_show(w)}{hint}")


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


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _show(entry: tuple[str, tuple[int, ...]] | None) -> str:
    return f"'{entry[0]}' {list(entry[1])}" if entry else "nothing"


def _check_optim(layout: Layout, info: _SpecInfo, tree: Any, path: Path, pt: Rank, dp: int, groups: list[_Group],
                 optimizer: str, flat_states: tuple[str, ...], spec_name: str, where: dict[Item, Located]) -> None:
    osd = _get(tree, "optimizer_state_dict", path, Mapping)
    for key in ("single_partition_of_fp32_groups", "group_paddings", "partition_count", "param_slice_mappings"):
        if not isinstance(value := _get(osd, key, path), list) or len(value) != len(groups):
            raise CheckpointFormatError(f"{path}: {key} should list {len(groups)} param groups, "
                                        f"got {brief(value, 80)}")
    aligned = osd.get("param_alignment_paddings")
    if aligned is not None and (not isinstance(aligned, list) or len(aligned) != len(groups)
                                or not all(isinstance(a, list) for a in aligned)):
        raise CheckpointFormatError(f"{path}: param_alignment_paddings should list {len(groups)} param groups' "
                                    f"paddings, got {brief(aligned, 80)}")
    for g, group in enumerate(groups):
        pad = group.padding(dp, optimizer)
        expect_int(osd["partition_count"][g], f"partition_count[{g}]", path, lo=1, hi=MAX_COUNT)
        expect_int(osd["group_paddings"][g], f"group_paddings[{g}]", path, hi=max(group.share, 1) * group.dp)
        if not isinstance(osd["param_slice_mappings"][g], Mapping):
            raise CheckpointFormatError(f"{path}: param_slice_mappings[{g}] is "
                                        f"{brief(osd['param_slice_mappings'][g], 60)}, expected a mapping of names "
                                        "to fragment addresses")
        if osd["partition_count"][g] != group.dp:
            raise CheckpointFormatError(f"{path}: partition_count[{g}] is {osd['partition_count'][g]}, "
                                        f"but dp_world_size is {group.dp}")
        if osd["group_paddings"][g] != pad:
            raise CheckpointFormatError(f"{path}: group_paddings[{g}] is {osd['group_paddings'][g]} but spec "
                                        f"'{spec_name}' gives {pad} (partitions of {group.share} elements, "
                                        f"params end at {group.end})")
        have = [(name_of(k), *_fragment(v, f"{path}: param_slice_mappings[{g}]['{name_of(k)}']"))
                for k, v in osd["param_slice_mappings"][g].items()]
        if have != (want := group.mappings(dp)):
            raise CheckpointFormatError(f"{path}: {_mapping_diff(have, want, g, spec_name)}")
        if aligned is not None and list(aligned[g]) != group.alignment_paddings():
            raise CheckpointFormatError(f"{path}: param_alignment_paddings[{g}] is {brief(aligned[g])} "
                                        f"but spec '{spec_name}' gives {group.alignment_paddings()}")
        for state, ref, numel in _flat_tensors(osd, g, optimizer, flat_states, group.share, group.share - pad, path):
            if not isinstance(ref, TensorRef) or ref.shape != (numel,):
                got = f"shape {list(ref.shape)}" if isinstance(ref, TensorRef) else "not a tensor"
                raise CheckpointFormatError(f"{path}: {state} of param group {g} is {got}, expected [{numel}] "
                                            f"(partitions of {group.share} elements, {pad} of them padding here)")
            item = Item(info.optim_section, _unit(pt, dp), 0, state, info.flat_key(g, state))
            where[item] = _located(ref, path, f"{state} of param group {g}")


def _flat_tensors(osd: Mapping, g: int, optimizer: str, flat_states: tuple[str, ...], share: int, lean: int,
                  path: Path) -> Iterator[tuple[str, Any, int]]:
    """(state, tensor, its expected numel) of param group ``g``'s flat tensors.

    DeepSpeedZeroOptimizer saves the master partition without its padding (``lean``
    elements) and the torch optimizer's states whole, or without padding too in an
    elastic checkpoint; BF16_Optimizer saves everything whole. The padding is never
    mapped, so an item's ``Located`` span may end ``share - lean`` elements early.
    """
    yield MASTER, osd["single_partition_of_fp32_groups"][g], share if optimizer == "bf16" else lean
    base = osd["base_optimizer_state"]
    rigid = isinstance(base, Mapping)  # the torch optimizer's state_dict: its state is keyed by param id = group
    if not rigid and g >= len(base):
        raise CheckpointFormatError(f"{path}: base_optimizer_state lists {len(base)} param groups, expected "
                                    f"at least {g + 1}")
    group = base.get("state", {}).get(g, {}) if rigid else base[g]
    for state in flat_states:
        if state not in group:
            raise CheckpointFormatError(f"{path}: base_optimizer_state has no '{state}' for param group {g}")
        yield state, group[state], share if rigid else lean


def _fragment(value: Any, where: str) -> tuple[int, int]:
    """(numel, start) of a ``fragment_address``."""
    if isinstance(value, Opaque) and (value.module, value.name) == _FRAGMENT and isinstance(value.state, Mapping):
        numel, start = value.state.get("numel"), value.state.get("start")
        if isinstance(numel, int) and isinstance(start, int):
            return expect_int(numel, "numel", where), expect_int(start, "start", where)
    raise CheckpointFormatError(f"{where}: not a fragment_address: {brief(value, 80)}")


def _mapping_diff(have: list[tuple[str, int, int]], want: list[tuple[str, int, int]], g: int, spec_name: str) -> str:
    h, w = {k: (n, s) for k, n, s in have}, {k: (n, s) for k, n, s in want}
    for k, (n, s) in w.items():
        if k not in h:
            return (f"param_slice_mappings[{g}] lacks '{k}', which spec '{spec_name}' places in this partition "
                    f"at (numel={n}, start={s})")
        if h[k] != (n, s):
            return (f"param_slice_mappings[{g}]['{k}'] is fragment_address(numel={h[k][0]}, start={h[k][1]}) "
                    f"but spec '{spec_name}' places it at (numel={n}, start={s})")
    if extra := [k for k in h if k not in w]:
        return (f"param_slice_mappings[{g}] names '{extra[0]}', which spec '{spec_name}' does not place "
                "in this partition")
    return f"param_slice_mappings[{g}] lists its params in another order than spec '{spec_name}': {list(h)}"


def _located(ref: TensorRef, path: Path, what: str) -> Located:
    itemsize(ref.dtype)  # a dtype the executor can copy
    if not ref.is_contiguous:
        raise CheckpointFormatError(f"{path}: {what} is not contiguous "
                                    f"(stride {list(ref.stride)}, shape {list(ref.shape)})")
    return Located(path=path, offset=ref.data_offset, dtype=ref.dtype)


# --- carried state ---------------------------------------------------------------------------------


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
            with path.open("rb") as f:
                f.seek(x.data_offset)
                data = f.read(x.nbytes)
            if len(data) != x.nbytes:
                raise CheckpointFormatError(f"{path}: ends inside a scalar tensor")
            return Scalar(x.dtype, data)
        return _map_tree(x, walk)

    return {k: walk(v) for k, v in tree.items() if k not in drop}


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
    if extra.optimizer == "bf16":
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


# --- writing ---------------------------------------------------------------------------------------

_Sources = dict[Any, tuple["Item | Scalar", int]]
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


def _model_tree(extra: DeepSpeedExtra, info: _SpecInfo, groups: list[_Group], pt: Rank, target: Target,
                ds_config: Any, pipeline: bool = False) -> tuple[dict[str, Any], _Sources]:
    """A model file: ``module`` (None under a pipeline, whose weights are in layer files) and the engine state."""
    layout, topo = target.layout, target.topology
    items = {it.key: it for it in layout.items if it.section in info.model_sections and it.unit == _unit(pt)}
    order = [k for k in extra.module_order if k in items] + [k for k in items if k not in extra.module_order]
    sources: _Sources = {}
    module: OrderedDict | None = None
    if not pipeline:
        module = OrderedDict()
        for k in order:
            module[k] = TensorSpec(target.dtypes[items[k]], layout.items[items[k]].shape, ("module", k))
            sources[("module", k)] = (items[k], layout.items[items[k]].numel)
    tree = {"module": module, **_with_scalars(extra.model_states, sources)}
    tree["param_shapes"] = [OrderedDict((k, TorchSize(layout.items[items[k]].shape)) for k, _, _ in g.params)
                            for g in groups]
    tree["dp_world_size"], tree["mp_world_size"] = topo.dp, topo.pp * topo.tp
    if "checkpoint_parallel_dimensions" in tree:
        tree["checkpoint_parallel_dimensions"] = {"pp_degree": topo.pp, "tp_degree": topo.tp}
    if "ds_config" in tree:
        tree["ds_config"] = ds_config
    return tree, sources


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


def _optim_tree(extra: DeepSpeedExtra, info: _SpecInfo, groups: list[_Group], pt: Rank, dp: int,
                flat_states: tuple[str, ...], target: Target, ds_config: Any) -> tuple[dict[str, Any], _Sources]:
    sources: _Sources = {}
    tree = _with_scalars(extra.optim_states, sources)
    osd = tree["optimizer_state_dict"]
    pads = [g.padding(dp, extra.optimizer) for g in groups]
    masters, per_group = [], []
    for g, group in enumerate(groups):
        specs = {}
        for state in flat_states:  # as _flat_tensors reads them: the master without padding unless BF16_Optimizer
            whole = extra.optimizer == "bf16" or (state != MASTER and not extra.elastic)
            n = group.share if whole else group.share - pads[g]
            item = Item(info.optim_section, _unit(pt, dp), 0, state, info.flat_key(g, state))
            specs[state] = TensorSpec(target.dtypes[item], (n,), ("flat", state, g))
            sources[("flat", state, g)] = (item, n)
        masters.append(specs.pop(MASTER))
        per_group.append(specs)
    osd["single_partition_of_fp32_groups"] = masters
    base = osd["base_optimizer_state"]
    if extra.elastic:
        osd["base_optimizer_state"] = [{**(base[g] if g < len(base) else {}), **per_group[g]}
                                       for g in range(len(groups))]
    elif any(per_group):
        base["state"] = {g: {**base.get("state", {}).get(g, {}), **per_group[g]} for g in range(len(groups))}
    osd["group_paddings"] = pads
    osd["partition_count"] = [target.topology.dp] * len(groups)
    if "param_alignment_paddings" in osd:
        osd["param_alignment_paddings"] = [g.alignment_paddings() for g in groups]
    osd["param_slice_mappings"] = [OrderedDict((k, _fragment_address(n, s)) for k, n, s in g.mappings(dp))
                                   for g in groups]
    if "ds_config" in tree:
        tree["ds_config"] = ds_config
    return tree, sources


def _write_file(path: Path, tree: Any, sources: _Sources, fill: Fill, target: Target,
                progress: Callable[[int], None] | None, window: int = WINDOW_BYTES) -> None:
    """One torch file, each item's bytes streamed from ``fill`` in windows of at most ``window`` bytes."""
    with TorchFileWriter(path, tree) as writer:
        for key in writer.entries:
            src, numel = sources[key]
            if isinstance(src, Scalar):
                writer.write(key, src.data)
                continue
            stream_item(fill, src, numel, target.dtypes[src], lambda data, key=key: writer.write(key, data),
                        progress, window)


# --- sizes and synthesized state -------------------------------------------------------------------


def _llama_sizes(files: _Files, shapes: list[list[tuple[str, tuple[int, ...]]]],
                 override: Mapping[str, int] | None, params: int) -> dict[str, int]:
    """Model sizes: ``override``, else a Hugging Face config.json, else what Llama tensor shapes tell; each
    checked, and the layer count at most ``params`` (the params in the model files' param_shapes)."""
    by_name = {k: s for group in shapes for k, s in group}
    sizes: dict[str, int] = {}
    if len(embed := by_name.get("model.embed_tokens.weight", ())) == 2:
        sizes["vocab"], sizes["h"] = embed
    if layers := {int(m.group(1)) for k in by_name if (m := re.match(r"model\.layers\.([0-9]{1,9})\.", k))}:
        sizes["layers"] = max(layers) + 1
    if gate := by_name.get("model.layers.0.mlp.gate_proj.weight"):
        sizes["f"] = gate[0]
    counts = {"layers": params}  # each layer holds a param at least
    config = _hf_config(files)
    found = {name: config[key] for key, name in _HF_CONFIG.items() if config.get(key) is not None}
    sizes.update(check_sizes(found, _config_file(files), counts=counts) if found else {})
    sizes.update(given_sizes(override))
    q, k = by_name.get("model.layers.0.self_attn.q_proj.weight"), by_name.get("model.layers.0.self_attn.k_proj.weight")
    if q and k and len(q) == 2 and len(k) == 2:
        if "hd" not in sizes and "heads" not in sizes:
            places = ", ".join(str(p) for p in (files.tag_dir, files.root, files.root.parent))
            raise CheckpointFormatError(
                f"{files.tag_dir}: the attention head layout cannot be told from tensor shapes alone "
                f"(q_proj has {q[0]} rows, k_proj {k[0]}): give sizes heads=N (and hd, g if not hidden/heads), "
                f"or put the model's config.json in one of: {places}")
        if "hd" not in sizes:
            sizes["hd"] = q[0] // sizes["heads"]
        if sizes["hd"] < 1:
            raise CheckpointFormatError(f"{files.model[0]}: q_proj has {q[0]} rows for {sizes['heads']} heads")
        sizes.setdefault("heads", q[0] // sizes["hd"])
        sizes.setdefault("g", k[0] // sizes["hd"])
    elif "hd" not in sizes and "h" in sizes and "heads" in sizes:
        sizes["hd"] = sizes["h"] // sizes["heads"]  # Hugging Face's default head_dim
    return check_sizes(sizes, f"{files.model[0]}: param_shapes", counts=counts)


def _config_file(files: _Files) -> Path | None:
    return next((p for d in (files.tag_dir, files.root, files.root.parent) if (p := d / "config.json").is_file()), None)


def _hf_config(files: _Files) -> dict[str, Any]:
    config = read_json(path) if (path := _config_file(files)) else {}
    return config if isinstance(config, dict) else {}


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
    step = Scalar("float32", struct.pack("<f", global_steps))
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
    return DeepSpeedExtra(tag=tag or f"global_step{global_steps}", zero_stage=zero_stage, optimizer="zero",
                          bf16_names=bf16, elastic=False, model_states=model_states, synthesized=True,
                          optim_states={"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": ds_version})


def _with_bf16(extra: DeepSpeedExtra, bf16: bool) -> DeepSpeedExtra:
    """Synthesized state for bf16 training (``bf16_`` file names, ``"bf16": {"enabled": true}``) or not."""
    model_states, optim_states = copy.deepcopy(extra.model_states), copy.deepcopy(extra.optim_states)
    for tree in (model_states, optim_states):
        tree["ds_config"]["bf16"] = {"enabled": bf16}
    return dataclasses.replace(extra, bf16_names=bf16, model_states=model_states, optim_states=optim_states)
