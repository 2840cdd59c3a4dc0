"""DeepSpeed universal checkpoints (UCP, what ``ds_to_universal`` writes), read and written.

A universal folder holds, per parameter, ``zero/<name>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt`` (each ``{"param": full tensor, "cat_dim":
...}``; any other optimizer state likewise) and ``step.pt`` (a 0-d tensor),
plus ``zero/optimizer_state.pt`` (param groups, loss scaler). Tensors are
whole and unsharded, so every file is one item whose bytes are read in place;
``fp32`` is state ``master``. A ZeRO-1/2 folder's model file is read as the
DeepSpeed reader reads one (``recorded_model``): its ``module`` gives every
weight (state ``param``), frozen params, buffers and tied copies included, and
the fp32.pt ds_to_universal writes of a module tensor outside the param groups
(its float32 copy) is left unread. The path may be the universal folder itself
or a save dir whose ``latest_universal`` names it.

Model sizes come from a Hugging Face ``config.json`` in the folder or the two
above it, or from ``sizes``, and the rest from the tensors' shapes (given the
head count, which shapes cannot tell from the head size). Refused with a message: sub-parameter and vocab
padding entries (Megatron-DeepSpeed's tp-fused layouts) and tensors that are not contiguous.

Written as ``ds_to_universal`` writes one for a ZeRO-1/2 run (DeepSpeed 0.19.8,
``checkpoint/ds_to_universal.py``), so that ``"checkpoint": {"load_universal":
true}`` resumes from it at any dp::

    <out>/latest_universal                      the tag
    <out>/<tag>/zero/<name>/fp32.pt             {"cat_dim": 0, "param": whole fp32 master}
    <out>/<tag>/zero/<name>/<state>.pt          each optimizer state (exp_avg, exp_avg_sq), likewise
    <out>/<tag>/zero/<name>/step.pt             the optimizer's step of the param's group (a 0-d tensor)
    <out>/<tag>/zero/optimizer_state.pt         the ZeRO optimizer's state_dict without its partitions,
                                                plus the torch optimizer's param_groups
    <out>/<tag>/zero/<key>/fp32.pt              {"param": float32 copy} of a frozen param, buffer or tied copy
    <out>/<tag>/mp_rank_00_model_states.pt      the engine's model file (weights in the training dtype)

DeepSpeed's loader reads the model file named for its own ZeRO stage, which is
``mp_rank_00_model_states.pt`` for stages 1 and 2. A DeepSpeed ZeRO-1/2 source's
non-tensor state is carried (tag, counters, config, loss scaler, param groups);
other sources get ``synthesize_extra``'s.

For a ZeRO-3 engine (the default for a ZeRO-3 source, or ``zero=3``) the folder is
the one ``ds_to_universal`` writes from a ZeRO-3 checkpoint: each state a bare flat
fp32 tensor, no ``step.pt`` (the step is in ``optimizer_state.pt``, the stage-3
optimizer's state_dict with ``param_groups`` on top, less the partitions
ds_to_universal leaves in it and DeepSpeed never reads), and
``zero_pp_rank_0_mp_rank_00_model_states.pt`` with empty module placeholders. Both
kinds are read; a flat tensor takes its shape from the model file's ``param_shapes``.
Needs the fp32 master weights (or fp32 weights, which are them); tp = pp = 1 (the
universal folder has no topology: the loading job's is used).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from reshard.core.geometry import row_major_strides
from reshard.core.layout import MASTER, PARAM, Fragment, Item, ItemInfo, Layout, LogicalTensor, box_fragments
from reshard.core.spec import parse_spec
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.execution.session import WriteSession
from reshard.formats.base import (
    Fill,
    Located,
    Progress,
    Source,
    Target,
    check_sizes,
    expect_shape,
    expect_step,
    given_sizes,
    name_of,
    read_tag,
)
from reshard.formats.deepspeed.derive import FRAGMENTS, DsModel, model_of_source, recorded_model
from reshard.formats.deepspeed.sizes import _shape_sizes
from reshard.formats.deepspeed.state import DeepSpeedExtra, Scalar, _with_scalars, synthesize_extra
from reshard.formats.deepspeed.write import _frozen_records
from reshard.formats.deepspeed.zero3 import Zero3Extra, extra_from_zero12, model_tree3
from reshard.formats.deepspeed.zero12 import _located
from reshard.formats.derived import Recorded
from reshard.formats.identity import read_identity, write_identity
from reshard.formats.specs import source_config
from reshard.io.location import as_path, read_at
from reshard.io.torch_read import read_torch_file
from reshard.io.torch_types import TensorRef, TensorSpec, TorchSize, scalar_value
from reshard.io.torch_write import TorchFileWriter
from reshard.models.config import config_sizes

__all__ = ["FORMAT", "UcpFormat"]

ZERO = "zero"
MODEL = "model"
MODEL_FILE = "mp_rank_00_model_states.pt"
MODEL_FILE3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_TENSOR_KEY, _CAT_DIM_KEY = "param", "cat_dim"
"""The keys of a ZeRO-1/2 folder's per-state file (``{"param": tensor, "cat_dim": 0}``); on disk, not state names."""
_KNOWN_KEYS = {_TENSOR_KEY, _CAT_DIM_KEY}
_MASTER_STEM = "fp32"
"""The file stem of state ``master`` (``fp32.pt``); every other state's file is named for the state."""
_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
"""What ``ds_to_universal`` leaves out of ``optimizer_state.pt``: the per-rank partitions."""


@dataclass(frozen=True, slots=True, kw_only=True)
class UcpExtra:
    """A universal folder's non-tensor content, as ``write`` lays it down."""

    tag: str
    model_states: dict[str, Any]
    """The model file's tree without ``module`` (``Scalar`` for 0-d tensors)."""
    optimizer_state: dict[str, Any]
    """``zero/optimizer_state.pt``."""
    step: Any
    """``step.pt`` of every param (a ``Scalar``), or None when the optimizer keeps no step."""
    names: tuple[str, ...]
    """The trained params (a folder each), in the model's order."""
    module: tuple[str, ...] = ()
    """The model file's module keys in order (frozen params, buffers, tied copies too); empty: ``names``."""
    copies: tuple[str, ...] = ()
    """The module keys outside the trained params (frozen params, buffers, tied copies), whose
    ``zero/<key>/fp32.pt`` is ``{"param": the module's tensor as float32}``, as ds_to_universal writes it."""
    stage3: bool = False
    """For a ZeRO-3 engine: flat per-param tensors, no ``step.pt``, a stage-3 ``optimizer_state.pt`` and
    ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (module placeholders, ``model_states`` whole) as the model file."""


class UcpFormat:
    """The ``ucp`` format adapter (see ``reshard.formats.base.Format``)."""

    name = "ucp"

    def detect(self, path: Path) -> bool:
        try:
            return _folder(as_path(path)) is not None
        except CheckpointFormatError:  # a broken latest_universal: open names what is wrong
            return True

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        path = as_path(path)
        folder = _folder(path)
        if folder is None:
            raise CheckpointFormatError(f"{path}: not a universal checkpoint (no zero/<param>/fp32.pt)")
        tensors: dict[str, LogicalTensor] = {}
        items: dict[Item, ItemInfo] = {}
        fragments: list[Fragment] = []
        where: dict[Item, Located] = {}
        step = None
        problems: list[str] = []
        shapes = _param_shapes(folder)
        recorded = _recorded_model(folder)
        # ds_to_universal's fp32.pt of a module tensor outside the param groups (a frozen param, a buffer, a tied
        # copy) is the float of what the model file holds, which is read instead.
        copies = {k for k, _ in recorded.module} - {n for g in recorded.groups for n in g} if recorded else set()
        for pdir in sorted(p for p in (folder / ZERO).iterdir() if p.is_dir()):
            name = pdir.name
            if name in copies:
                continue
            for file in sorted(pdir.glob("*.pt")):
                if not file.is_file():
                    problems.append(f"{file}: not a regular file")
                    continue
                obj = read_torch_file(file)
                if file.stem == "step":
                    if isinstance(obj, TensorRef) and obj.shape == () and step is None:
                        step = _scalar(file, obj)
                    continue
                if isinstance(obj, TensorRef) and name in shapes and obj.numel == math.prod(shapes[name]):
                    ref, shape = obj, shapes[name]  # ZeRO-3's: flat, the shape in the model file's param_shapes
                elif isinstance(obj, TensorRef):
                    problems.append(f"{file}: a bare tensor of {obj.numel} elements, and no param_shapes entry of "
                                    f"that size for '{name}' in a model file of {folder}")
                    continue
                elif not isinstance(obj, dict) or not isinstance(obj.get(_TENSOR_KEY), TensorRef):
                    problems.append(f"{file}: expected {{'param': tensor, ...}}, found {type(obj).__name__}")
                    continue
                else:
                    ref = obj[_TENSOR_KEY]
                    shape = ref.shape
                    if name in shapes and shapes[name] != shape:
                        problems.append(f"{file}: '{name}' is {list(shape)}, but the model file's param_shapes "
                                        f"says {list(shapes[name])}")
                        continue
                extra_keys = [name_of(k) for k in obj if k not in _KNOWN_KEYS] if isinstance(obj, dict) else []
                if extra_keys:
                    problems.append(f"{file}: entries {extra_keys} (sub-parameters or vocab padding) are not supported")
                    continue
                if not ref.is_contiguous:
                    problems.append(f"{file}: '{name}' is stored non-contiguous (stride {list(ref.stride)})")
                    continue
                state = MASTER if file.stem == _MASTER_STEM else file.stem
                t = tensors.setdefault(name, LogicalTensor(name=name, shape=shape,
                                                           axes=tuple(f"d{k}" for k in range(len(shape))),
                                                           view=shape, dim_axes=(1,) * len(shape)))
                if t.shape != shape:
                    problems.append(f"{file}: '{name}' is {list(shape)} here but {list(t.shape)} in its fp32.pt")
                    continue
                item = Item(ZERO, (), 0, state, name)
                items[item] = ItemInfo(shape=ref.shape, mapped=ref.numel, rule="ucp")
                where[item] = Located(ref.path, ref.data_offset, ref.dtype)
                zeros = (0,) * len(shape)
                for box, off, st in box_fragments(t, zeros, shape, row_major_strides(shape), 0):
                    fragments.append(Fragment(tensor=name, state=state, box=box, item=item, offset=off, strides=st))
        if not tensors:
            problems.append(f"{folder / ZERO}: no parameter folders")
        if recorded is not None:
            _module_items(recorded, folder / MODEL_FILE, tensors, items, fragments, where, problems)
        if problems:
            raise CheckpointFormatError(f"{folder}: cannot read this universal checkpoint:\n  "
                                        + "\n  ".join(problems[:20]))
        groups = [list(g) for g in recorded.groups] if recorded is not None else _param_groups(folder)
        trained = {n for g in groups for n in g} if recorded is not None else set(tensors)
        missing = sorted(n for n in tensors if n in trained and Item(ZERO, (), 0, MASTER, n) not in items)
        if missing:
            raise CheckpointFormatError(f"{folder / ZERO}: no fp32.pt for {', '.join(missing[:5])}")
        # The model's order (its module's, or its model file's param_shapes), not the folders'.
        order = [t.name for t in recorded.tensors] if recorded is not None else \
            [n for g in groups for n in g if n in tensors]
        tensors = {n: tensors[n] for n in [*order, *(n for n in tensors if n not in set(order))]}
        layout = Layout(topology=Topology(), tensors=MappingProxyType(tensors), items=MappingProxyType(items),
                        fragments=tuple(fragments))
        model = read_identity(folder, folder.parent, folder.parent.parent)
        model_sizes = config_sizes(model.config, folder, tensors=len(tensors))
        model_sizes.update(given_sizes(sizes))
        _shape_sizes(model_sizes, {n: t.shape for n, t in tensors.items()}, folder / ZERO)
        model_sizes = check_sizes(model_sizes, folder / ZERO, counts=dict.fromkeys(("layers", "experts"), len(tensors)))
        step = step if step is not None else _stage3_step(folder)
        progress = Progress(step=expect_step(step, "the optimizer step (step.pt)", folder / ZERO)
                            if step is not None else None, lr=_lr(folder))
        # The param groups DeepSpeed's flat buffers follow, when the model file records them and they hold every
        # param: a DeepSpeed target lays them out again.
        known = [tuple(n for n in g if n in tensors) for g in groups]
        extra = {}
        if recorded is not None:  # the model file's module: frozen params, buffers and tied copies too
            extra["ds_model"] = recorded
        elif groups and sum(map(len, known)) == len(tensors):
            extra["ds_model"] = DsModel(tensors=tuple(Recorded(n, t.shape) for n, t in tensors.items()),
                                        groups=tuple(g for g in known if g), module=tuple((n, n) for n in tensors))
        return Source(format=self.name, path=folder, spec_name="ucp", spec=parse_spec("", "<ucp>"),
                      topology=Topology(), sizes=model_sizes, layout=layout, where=where,
                      model=model, progress=progress, extra=extra)

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        """Whole tensors, one file per param and state; the weights in the model file.

        Raises:
          TopologyError: for a topology other than the trivial one.
          CheckpointFormatError: when the source has no fp32 master weights.
        """
        if topology != Topology(zero=topology.zero):
            raise TopologyError(f"a universal checkpoint holds whole tensors and no topology (DeepSpeed splits them "
                                f"for the job that loads it); got {topology}: leave out --to")
        if spec is not None:
            raise CheckpointFormatError("the ucp format takes no spec: every tensor is stored whole")
        if topology.zero not in (0, 1, 2, 3):
            raise TopologyError(f"zero={topology.zero}: a universal folder is for ZeRO stage 1, 2 or 3")
        stage3 = topology.zero == 3 or (topology.zero == 0 and "zero3" in source.extra)
        held = {(f.tensor, f.state) for f in source.layout.fragments}
        kept = {n for n, t in source.layout.tensors.items()
                if not t.blob and t.shape and any((n, s) in held for s in source.layout.states)}
        # Folders for the trained params (the optimizer's); the module holds frozen params, buffers and tied
        # copies too, as the model's DeepSpeed layout says.
        ds_model = model_of_source(source)
        module = [(k, n) for k, n in ds_model.module if n in kept]
        trained = {n for g in ds_model.groups for n in g}
        names = [n for n in dict.fromkeys(n for _, n in module) if n in trained] or sorted(kept)
        if stage3 and (ds_model.frozen or ds_model.buffers):
            raise CheckpointFormatError(f"{source.path}: a universal folder for ZeRO-3 of a model with frozen "
                                        "parameters or persistent buffers is not supported; use zero=1 or zero=2")
        states = set(source.layout.states)
        fp32 = all(loc.dtype == "float32" for it, loc in source.where.items() if it.state == PARAM)
        if MASTER not in states and not (PARAM in states and fp32):
            raise CheckpointFormatError(f"{source.path}: a universal checkpoint needs the fp32 master weights "
                                        f"(fp32.pt); the source has {', '.join(sorted(states))}, and its weights are "
                                        "not float32")
        opt_states = [s for s in dict.fromkeys(it.state for it in source.layout.items) if s not in (PARAM, MASTER)]
        tensors: dict[str, LogicalTensor] = {}
        items: dict[Item, ItemInfo] = {}
        fragments: list[Fragment] = []
        for name in dict.fromkeys([*(n for _, n in module), *names]):
            shape = source.layout.tensors[name].shape
            tensors[name] = LogicalTensor(name=name, shape=shape, axes=tuple(f"d{k}" for k in range(len(shape))),
                                          view=shape, dim_axes=(1,) * len(shape))
        model_dtype = next((loc.dtype for it, loc in source.where.items() if it.state == PARAM), "float32")
        if stage3:
            extra = _extra3(source, tuple(names), model_dtype)
        else:
            extra = replace(_extra(source, tuple(names), model_dtype, tuple(opt_states)),
                            module=tuple(k for k, _ in module), copies=tuple(k for k, _ in module if k not in names))
        places = [] if stage3 else [(MODEL, PARAM, key, name) for key, name in module]
        if not stage3 and extra.model_states.get("frozen_param_shapes") is not None:  # saved from stage 2 on
            places += [(FRAGMENTS, PARAM, name, name) for name in ds_model.frozen if name in kept]
        for name in names:
            places += [(ZERO, state, name, name) for state in (MASTER, *opt_states)]
        for section, state, key, name in places:
            t, shape = tensors[name], tensors[name].shape
            item = Item(section, (), 0, state, key)
            # ZeRO-3's folders hold each state flat (ds_to_universal's merge_zero3_slices)
            items[item] = ItemInfo(shape=(math.prod(shape),) if stage3 else shape, mapped=math.prod(shape),
                                   rule="ucp")
            for box, off, st in box_fragments(t, (0,) * len(shape), shape, row_major_strides(shape), 0):
                fragments.append(Fragment(tensor=name, state=state, box=box, item=item, offset=off, strides=st))
        layout = Layout(topology=Topology(), tensors=MappingProxyType(tensors), items=MappingProxyType(items),
                        fragments=tuple(fragments))
        dtypes = {it: model_dtype if it.section in (MODEL, FRAGMENTS) else "float32" for it in items}
        model = replace(source.model, config=source_config(source, [model_dtype]))
        return Target(format=self.name, spec_name="ucp", spec=parse_spec("", "<ucp>"), topology=Topology(),
                      sizes=dict(source.sizes), layout=layout, dtypes=dtypes, model=model, extra={"ucp": extra})

    def files_of(self, target: Target) -> dict[Item, Path]:
        """The file, relative to the output directory, that holds each item."""
        tag = target.extra["ucp"].tag
        return {it: Path(tag) / (MODEL_FILE if it.section in (MODEL, FRAGMENTS)
                                 else Path(ZERO, it.key, _file_stem(it.state) + ".pt"))
                for it in target.layout.items}

    def write(self, target: Target, out: Path, fill: Fill, session: WriteSession | None = None, *,
              only: Collection[Path] | None = None) -> list[Path]:
        """Write the universal folder under ``out`` (see the module docstring).

        With ``only``, just those item files; the files holding no items (``step.pt``,
        ``optimizer_state.pt``, ``latest_universal``, ``config.json``) are written by the
        call without ``only`` or with ``only=()``.
        """

        out = Path(out)
        extra: UcpExtra = target.extra["ucp"]
        session = session or WriteSession()
        keep = None if only is None else set(only)
        by_file: dict[Path, list[Item]] = {}
        for it, rel in self.files_of(target).items():
            by_file.setdefault(rel, []).append(it)
        written: list[Path] = []
        for rel, its in by_file.items():
            if keep is not None and rel not in keep:
                continue
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            sources: dict[Any, tuple[Any, int]] = {}
            if rel.name == MODEL_FILE:
                by_key = {it.key: it for it in its if it.section == MODEL}
                module = OrderedDict()
                for name in extra.module or extra.names:
                    module[name] = TensorSpec(target.dtypes[by_key[name]], target.layout.items[by_key[name]].shape,
                                              ("item", name))
                    sources[("item", name)] = (by_key[name], target.layout.items[by_key[name]].numel)
                tree: Any = {"module": module, **_with_scalars(extra.model_states, sources)}
                _frozen_records(tree, target, [it for it in its if it.section == FRAGMENTS], sources)
            else:
                (it,) = its
                spec = TensorSpec("float32", target.layout.items[it].shape, ("item", it.key))
                tree = spec if extra.stage3 else {_CAT_DIM_KEY: 0, _TENSOR_KEY: spec}
                sources[("item", it.key)] = (it, target.layout.items[it].numel)
            with TorchFileWriter(out / rel, tree, open_file=session.open) as writer:
                for key in writer.entries:
                    src, numel = sources[key]
                    if isinstance(src, Item):
                        session.stream_item(fill, src, numel, target.dtypes[src],
                                            lambda data, k=key: writer.write(k, data), at=writer.entries[key][0])
                    else:
                        writer.write(key, src.data)
            written.append(rel)
        if keep:
            return written
        rest: list[tuple[Path, Any]] = [(Path(extra.tag, ZERO, "optimizer_state.pt"), extra.optimizer_state)]
        if extra.stage3:  # its model file holds no items: placeholders only
            rest.append((Path(extra.tag, MODEL_FILE3), extra.model_states))
        if extra.step is not None:
            rest += [(Path(extra.tag, ZERO, name, "step.pt"), extra.step) for name in extra.names]
        for key in extra.copies:
            written.append(_write_copy(target, out, fill, session, Item(MODEL, (), 0, PARAM, key)))
        for rel, obj in rest:
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            scalars: dict[Any, tuple[Any, int]] = {}
            tree = _with_scalars({"x": obj}, scalars)["x"]
            with TorchFileWriter(out / rel, tree, open_file=session.open) as writer:
                for key in writer.entries:
                    writer.write(key, scalars[key][0].data)
            written.append(rel)
        written += write_identity(out, target.model)
        (out / "latest_universal").write_text(extra.tag)
        return [*written, Path("latest_universal")]


def _write_copy(target: Target, out: Path, fill: Fill, session: WriteSession, item: Item) -> Path:
    """``zero/<key>/fp32.pt`` of a module tensor outside the trained params: ``{"param": its float32 copy}``,
    as ds_to_universal writes one for every module tensor it found no optimizer state for."""
    rel = Path(target.extra["ucp"].tag, ZERO, item.key, f"{_MASTER_STEM}.pt")
    (out / rel).parent.mkdir(parents=True, exist_ok=True)
    dtype, numel = target.dtypes[item], target.layout.items[item].numel
    if dtype not in _TO_FLOAT32:
        raise CheckpointFormatError(f"{out / rel}: module tensor '{item.key}' is {dtype}, whose float32 copy "
                                    f"(ds_to_universal's fp32.pt) reshard does not make; supported: "
                                    f"{', '.join(sorted(_TO_FLOAT32))}")
    tree = {_TENSOR_KEY: TensorSpec("float32", target.layout.items[item].shape, ("copy", item.key))}
    step = max(1, session.window_bytes // 4)
    with TorchFileWriter(out / rel, tree, open_file=session.open) as writer:
        for lo in range(0, numel, step):
            writer.write(("copy", item.key), _as_float32(bytes(fill(item, lo, min(numel, lo + step))), dtype))
    return rel


_TO_FLOAT32 = ("bfloat16", "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
"""The dtypes ``_as_float32`` converts as ``tensor.float()`` does (rounded to nearest)."""


def _as_float32(data: bytes, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(data, np.dtype(dtype)).astype(np.float32)


def _extra3(source: Source, names: tuple[str, ...], model_dtype: str) -> UcpExtra:
    """What ds_to_universal writes beside the tensors of a ZeRO-3 checkpoint: the stage-3 optimizer's
    state_dict (less its partitions) with ``param_groups`` on top, and a stage-3 model file."""
    z3: Zero3Extra = source.extra.get("zero3") or extra_from_zero12(source, model_dtype)
    osd = dict(z3.optim_states)
    inner = dict(osd.get("optimizer_state_dict") or {})
    osd["partition_count"] = 1 if not isinstance(osd.get("partition_count"), int) else osd["partition_count"]
    osd["param_groups"] = inner.get("param_groups", [])
    # The flat (registration) order: the source's param_shapes, when it has them.
    carried = [str(k) for g in z3.model_states.get("param_shapes") or () if isinstance(g, Mapping) for k in g]
    names = tuple([n for n in carried if n in names] + [n for n in names if n not in carried])
    dp = source.topology.dp if "zero3" in source.extra else 1  # ds_to_universal copies the source's rank 0 file
    shapes = tuple(Recorded(n, source.layout.tensors[n].shape) for n in names)
    model_file = model_tree3(z3, DsModel(tensors=shapes, groups=(names,), module=tuple((n, n) for n in names)), dp)
    return UcpExtra(tag=z3.tag, model_states=model_file, optimizer_state=osd, step=None, names=names, stage3=True)


def _file_stem(state: str) -> str:
    return _MASTER_STEM if state == MASTER else state


def _extra(source: Source, names: tuple[str, ...], model_dtype: str, opt_states: tuple[str, ...]) -> UcpExtra:
    """The universal folder's non-tensor content: a DeepSpeed ZeRO-1/2 source's own, else synthesized."""
    ds: DeepSpeedExtra | None = source.extra.get("deepspeed") if source.format == "deepspeed" else None
    if ds is None:
        step = _source_step(source)
        if opt_states and step is None:
            raise CheckpointFormatError(f"{source.path}: the source records no optimizer step, which a universal "
                                        f"folder keeps beside {', '.join(opt_states)} (step.pt)")
        value = expect_step(scalar_value(step.data, step.dtype) or 0, "the optimizer step", source.path) \
            if step is not None else 0
        ds = synthesize_extra(dtype=model_dtype if model_dtype in ("bfloat16", "float32") else "float32",
                              states=opt_states, global_steps=value, dp=1,
                              lr=float(source.progress.lr if source.progress.lr is not None else 1e-3))
        ds.model_states["param_shapes"] = [OrderedDict((n, TorchSize(source.layout.tensors[n].shape)) for n in names)]
        for group in ds.optim_states["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            group["step"] = step
    if ds.elastic:
        raise CheckpointFormatError(f"{source.path}: an elastic DeepSpeed checkpoint (base_optimizer_state is a list "
                                    "of groups) has no param_groups to put in optimizer_state.pt")
    osd = ds.optim_states["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    optimizer_state = {k: v for k, v in osd.items() if k not in _SHARDED}
    optimizer_state["param_groups"] = base.get("param_groups", [])
    steps = [s.get("step") for s in base.get("state", {}).values()]
    if len({(s.dtype, s.data) if isinstance(s, Scalar) else repr(s) for s in steps}) > 1:
        raise CheckpointFormatError(f"{source.path}: the optimizer's param groups are at different steps "
                                    f"({len(steps)} groups); a universal folder keeps one step per param")
    step = steps[0] if steps and isinstance(steps[0], Scalar) else None
    order = [n for n in ds.module_order if n in names] + [n for n in names if n not in ds.module_order]
    return UcpExtra(tag=ds.tag, model_states=ds.model_states, optimizer_state=optimizer_state, step=step,
                    names=tuple(order))


def _source_step(source: Source):
    """The optimizer step of a source that is not DeepSpeed ZeRO-1/2, as a ``Scalar`` (Adam keeps a float32)."""
    import struct

    zero3 = source.extra.get("zero3")
    if zero3 is not None:
        inner = zero3.optim_states.get("optimizer_state_dict", {})
        for group in inner.get("state", {}).values():
            if isinstance(group.get("step"), Scalar):
                return group["step"]
    for value in (source.progress.step, source.progress.iteration):
        if value:
            return Scalar("float32", (), struct.pack("<f", float(value)))
    return None


def _folder(path: Path) -> Path | None:
    marker = path / "latest_universal"
    if marker.is_file():
        path = path / read_tag(marker)
    zero = path / ZERO
    if zero.is_dir() and any((p / f"{_MASTER_STEM}.pt").is_file() for p in zero.iterdir() if p.is_dir()):
        return path
    return None


def _recorded_model(folder: Path) -> DsModel | None:
    """The model a ZeRO-1/2 folder's model file records (``recorded_model``: param groups, frozen params,
    buffers, tied copies); None without one, or for a pipeline's or ZeRO-3's, whose module holds no weights."""
    path = folder / MODEL_FILE
    if (folder / MODEL_FILE3).is_file() or not path.is_file():
        return None
    tree = read_torch_file(path)
    if not isinstance(tree, dict) or not isinstance(tree.get("module"), Mapping) or not tree["module"]:
        return None
    groups = tree.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise CheckpointFormatError(f"{path}: param_shapes is not a list of param groups")
    shaped = [[(name_of(k), expect_shape(v, f"param_shapes[{i}]['{name_of(k)}']", path)) for k, v in g.items()]
              for i, g in enumerate(groups)]
    return recorded_model(tree, path, shaped)


def _module_items(model: DsModel, path: Path, tensors: dict[str, LogicalTensor], items: dict[Item, ItemInfo],
                  fragments: list[Fragment], where: dict[Item, Located], problems: list[str]) -> None:
    """The model file's ``module`` as the DeepSpeed reader places it: each key an item of state ``param`` (the
    weights in the training dtype; a tied copy's holds the tensor it shares), frozen params and buffers the
    tensors' only state."""
    module = read_torch_file(path)["module"]
    trained = {n for g in model.groups for n in g}
    if odd := [n for n in tensors if n not in trained]:
        problems.append(f"{path}: param_shapes lists no '{odd[0]}', which has a folder of optimizer state")
    for key, name in model.module:
        ref, shape = module.get(key), model.recorded(name).shape
        if not isinstance(ref, TensorRef) or ref.shape != shape:
            got = f"shape {list(ref.shape)}" if isinstance(ref, TensorRef) else "not a tensor"
            problems.append(f"{path}: module['{key}'] is {got}, but the model file records '{name}' as {list(shape)}")
            continue
        t = tensors.setdefault(name, LogicalTensor(name=name, shape=shape, view=shape, dim_axes=(1,) * len(shape),
                                                   axes=tuple(f"d{k}" for k in range(len(shape)))))
        item = Item(MODEL, (), 0, PARAM, key)
        items[item] = ItemInfo(shape=shape, mapped=ref.numel, rule="ucp module", tensor=name if 0 in shape else None)
        where[item] = _located(ref, path, f"module['{key}']")
        if 0 not in shape:
            for box, off, st in box_fragments(t, (0,) * len(shape), shape, row_major_strides(shape), 0):
                fragments.append(Fragment(tensor=name, state=PARAM, box=box, item=item, offset=off, strides=st))


def _param_groups(folder: Path) -> list[list[str]]:
    """The param groups (names in flat order) of the folder's model file's ``param_shapes``; empty without one."""
    for name in (MODEL_FILE3, MODEL_FILE):
        if (folder / name).is_file():
            tree = read_torch_file(folder / name)
            groups = tree.get("param_shapes") if isinstance(tree, dict) else None
            if isinstance(groups, list):
                return [[name_of(k) for k in g] for g in groups if isinstance(g, Mapping)]
    return []


def _param_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape from the folder's model file (ZeRO-3's first, then ZeRO-1/2's); empty without one."""
    for name in (MODEL_FILE3, MODEL_FILE):
        if (folder / name).is_file():
            tree = read_torch_file(folder / name)
            groups = tree.get("param_shapes") if isinstance(tree, dict) else None
            if isinstance(groups, list):
                return {name_of(k): expect_shape(v, f"param_shapes[{i}]['{name_of(k)}']", folder / name)
                        for i, g in enumerate(groups) if isinstance(g, Mapping) for k, v in g.items()}
    return {}


def _scalar(file: Path, ref: TensorRef) -> float | None:
    return scalar_value(read_at(file, ref.data_offset, ref.itemsize), ref.dtype)


def _lr(folder: Path) -> float | None:
    file = folder / ZERO / "optimizer_state.pt"
    if not file.is_file():
        return None
    state = read_torch_file(file)
    groups = state.get("param_groups") if isinstance(state, dict) else None
    lr = groups[0].get("lr") if isinstance(groups, list) and groups and isinstance(groups[0], dict) else None
    return float(lr) if isinstance(lr, float) and math.isfinite(lr) or type(lr) is int and abs(lr) < 1 << 60 else None


def _stage3_step(folder: Path) -> float | None:
    """A ZeRO-3 folder's step (it has no step.pt): the optimizer's, in optimizer_state.pt."""
    file = folder / ZERO / "optimizer_state.pt"
    state = read_torch_file(file) if file.is_file() else None
    inner = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    groups = inner.get("state") if isinstance(inner, dict) else None
    ref = groups.get(0, {}).get("step") if isinstance(groups, dict) and isinstance(groups.get(0), dict) else None
    return _scalar(file, ref) if isinstance(ref, TensorRef) and ref.shape == () else None


FORMAT = UcpFormat()
