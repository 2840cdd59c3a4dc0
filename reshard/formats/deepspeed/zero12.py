"""ZeRO stage 1/2: the flat-partition layout, and the checks of a checkpoint's files against it.

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
dp``, split into ``dp`` equal contiguous partitions. The derived layouts and the families' specs say
so (``flat ... = <group> | pad 2*dp | split dp``), and ``open`` proves it file by file:
``param_shapes``, ``param_slice_mappings``, ``group_paddings`` and ``param_alignment_paddings``
must equal what the resolved layout implies, ``module`` must hold exactly the layout's module
tensors (the groups' params, frozen params, buffers, tied copies) and ``frozen_param_shapes`` and
``frozen_param_fragments`` its frozen params.

Here: the param groups a spec describes (``_spec_info``), each group's flat geometry at a
model-parallel rank, read off a resolved layout (``_groups``), and the checks ``open`` runs
on every model and optimizer file.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.core.layout import MASTER, PARAM, Item, Layout
from reshard.core.spec import Concat, Flat, Pad, Pattern, Product, Section, Spec, Split, Stored, Term
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import MAX_COUNT, Located, expect_int, expect_shape, itemsize, name_of
from reshard.formats.deepspeed.derive import FRAGMENTS
from reshard.formats.deepspeed.files import _Files, _get, _zero_config
from reshard.formats.deepspeed.state import _FRAGMENT, _ZERO_STAGE, DsOptimizer, _is_flat
from reshard.io.bounds import brief
from reshard.io.torchfile import Opaque, TensorRef


@dataclass(frozen=True, slots=True)
class _SpecInfo:
    model_sections: tuple[str, ...]
    """Sections whose tensors are in the model files: ``module_sections`` and ``fragments``."""
    optim_section: str
    groups: tuple[tuple[str, Pattern], ...]
    """Per param group: (the section its flat buffer is built from, the flat buffer's key pattern)."""
    module_sections: tuple[str, ...] = ()
    """Sections whose tensors are in ``module``: the groups' and those outside every group (frozen params,
    buffers, tied copies)."""
    fragments: str | None = None
    """The section of ``frozen_param_fragments`` (the frozen params again, from ZeRO stage 2 on), if any."""

    def flat_key(self, group: int, state: str) -> str:
        return self.groups[group][1].format({"state": state})


def _spec_info(spec: Spec, name: str, zero3: bool = False) -> _SpecInfo:
    """The param groups of a DeepSpeed spec: one flat buffer per group, in group order, in one section. Other
    sections of stored tensors are the module's tensors outside every group, except ``frozen_param_fragments``.
    ``zero3``: the flat buffers are ZeRO-3's, each param split on its own (``perparam``)."""
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
        ops = {op.op for op in fl.ops}
        partition = "perparam" in ops and ops <= {"pad", "split", "perparam"} if zero3 else \
            ops <= {"pad", "split", "align"}
        if not partition or captures != {"state"}:
            expected = "perparam | split dp" if zero3 else "pad 2*dp | split dp"
            raise CheckpointFormatError(f"spec '{name}': flat buffer '{fl.pattern.text}' is not a ZeRO-"
                                        f"{3 if zero3 else '1/2'} partition (expected 'flat <name with {{state}}> = "
                                        f"<section> | {expected}')")
    model = tuple(s.name for s, rules in sections if s is not sec and any(isinstance(r, Stored) for r in rules))
    used = [fl.source for fl in flats]
    if len(set(used)) != len(used) or not set(used) <= set(model) or FRAGMENTS in used:
        raise CheckpointFormatError(f"spec '{name}': each param group's flat buffer must be built from a model "
                                    f"section of its own; model sections: {', '.join(model)}; "
                                    f"flat buffers built from: {', '.join(used)}")
    groups = tuple((fl.source, fl.pattern) for fl in flats)
    return _SpecInfo(model_sections=model, optim_section=sec.name, groups=groups,
                     module_sections=tuple(s for s in model if s != FRAGMENTS),
                     fragments=FRAGMENTS if FRAGMENTS in model else None)


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

    def padding(self, rank: int, optimizer: DsOptimizer) -> int:
        """``group_paddings[g]`` of ``rank``: its partition's padding (BF16_Optimizer: all of it, on the last rank)."""
        if optimizer == DsOptimizer.BF16:
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
            # param -> [first, end, count] of its elements in this partition (a fused param's parts together)
            pieces: dict[str, list[int]] = {}
            for f in frags.get(item, ()):
                end = f.offset + 1 + sum((n - 1) * s for n, s in zip(f.box.lengths, f.strides, strict=True))
                row = pieces.setdefault(key_of[f.tensor], [f.offset, end, 0])
                row[0], row[1], row[2] = min(row[0], f.offset), max(row[1], end), row[2] + math.prod(f.box.lengths)
            for param, (first, end, count) in pieces.items():
                if end - first != count:
                    raise CheckpointFormatError(f"{item}: {param} is not contiguous in the flat buffer "
                                                "(not a ZeRO-1/2 layout)")
                starts[param] = min(starts.get(param, r * share + first), r * share + first)
        params = tuple((it.key, starts[it.key], layout.items[it].numel) for it in order if layout.items[it].numel)
        out.append(_Group(share=share, dp=layout.topology.dp, params=params))
    return out


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
    zero = _zero_config(model_states, where)
    for key in ("round_robin_gradients", "parameter_alignment"):
        if zero.get(key):
            raise CheckpointFormatError(f"{where}: zero_optimization.{key} is on; "
                                        "that flat-buffer layout is not supported")


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
    """A model file against the layout: its param_shapes, frozen params, and its module unless a pipeline keeps
    that in layer files."""
    module = _get(tree, "module", path, (Mapping, type(None)))
    items = {it.key: it for it in layout.items if it.section in info.module_sections and it.unit == _unit(pt)}
    _check_param_shapes(layout, items, tree, path, groups, shapes, spec_name)
    grouped = {key for group in groups for key, _, _ in group.params}
    frozen = tree.get("frozen_param_shapes")
    for key, shape in (frozen.items() if isinstance(frozen, Mapping) else ()):
        it = items.get(key)
        want = layout.items[it].shape if it is not None and key not in grouped else None
        if want != expect_shape(shape, f"frozen_param_shapes['{name_of(key)}']", path):
            placed = "does not store it outside the param groups" if want is None else f"stores {list(want)}"
            raise CheckpointFormatError(f"{path}: frozen_param_shapes['{name_of(key)}'] is {list(shape)}, but spec "
                                        f"'{spec_name}' {placed}")
    fragments = tree.get("frozen_param_fragments")
    if fragments is not None and not isinstance(fragments, Mapping):
        raise CheckpointFormatError(f"{path}: frozen_param_fragments is {brief(fragments, 60)}, not a mapping")
    kept = {it.key: it for it in layout.items if it.section == info.fragments and it.unit == _unit(pt)}
    if fragments or kept:
        _state_dict_tensors(layout, fragments or {}, kept, path, "frozen_param_fragments", spec_name, where)
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


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _show(entry: tuple[str, tuple[int, ...]] | None) -> str:
    return f"'{entry[0]}' {list(entry[1])}" if entry else "nothing"


def _check_optim(layout: Layout, info: _SpecInfo, tree: Any, path: Path, pt: Rank, dp: int, groups: list[_Group],
                 optimizer: DsOptimizer, flat_states: tuple[str, ...], spec_name: str,
                 where: dict[Item, Located]) -> None:
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


def _flat_tensors(osd: Mapping, g: int, optimizer: DsOptimizer, flat_states: tuple[str, ...], share: int, lean: int,
                  path: Path) -> Iterator[tuple[str, Any, int]]:
    """(state, tensor, its expected numel) of param group ``g``'s flat tensors.

    DeepSpeedZeroOptimizer saves the master partition without its padding (``lean``
    elements) and the torch optimizer's states whole, or without padding too in an
    elastic checkpoint; BF16_Optimizer saves everything whole. The padding is never
    mapped, so an item's ``Located`` span may end ``share - lean`` elements early.
    """
    yield MASTER, osd["single_partition_of_fp32_groups"][g], share if optimizer == DsOptimizer.BF16 else lean
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
