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
parameters, and writing ZeRO-3 (convert to ``zero=1`` or ``zero=2``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reshard.catalog import load_spec
from reshard.errors import CheckpointFormatError, SpecError
from reshard.formats.base import Located, Source
from reshard.layout import Item, Layout, resolve
from reshard.topology import Topology
from reshard.torchfile import TensorRef

SPEC = "deepspeed-llama-zero3"
MASTER = "master"
MODEL_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def is_zero3(names: list[str]) -> bool:
    return any(MODEL_FILE.fullmatch(n) for n in names)


def open_zero3(fmt_name: str, root: Path, tag: str, tag_dir: Path, *, spec: str | None,
               sizes: Mapping[str, int] | None) -> Source:
    from reshard.formats.deepspeed import _Files, _get, _hf_config, _llama_sizes, _param_shapes, _read

    names = sorted(p.name for p in tag_dir.iterdir())
    models = {(int(m.group(2)), int(m.group(1))): n for n in names if (m := MODEL_FILE.fullmatch(n))}
    optims = {(int(m.group(3)), int(m.group(2))): n for n in names if (m := OPTIM_FILE.fullmatch(n))}
    tps = {t for t, _ in models}
    if tps != {0}:
        raise CheckpointFormatError(f"{tag_dir}: ZeRO-3 with mp ranks {sorted(tps)}; only tp=1 is supported")
    first_path = tag_dir / models[min(models)]
    first = _read(first_path)
    dp = _get(first, "dp_world_size", first_path)
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
    shapes = _param_shapes(first, first_path)
    if len(shapes) != 1:
        raise CheckpointFormatError(f"{first_path}: {len(shapes)} param groups; the ZeRO-3 reader supports one")
    files = _Files(root=root, tag=tag, tag_dir=tag_dir, model=(first_path,), optim=(), bf16_names=False)
    all_sizes = _llama_sizes(files, shapes, sizes)
    spec_name = spec or SPEC
    parsed = load_spec(spec_name)
    topology = Topology(dp=dp, zero=3)
    osd = [_get(_read(tag_dir / optims[(0, d)]), "optimizer_state_dict", tag_dir / optims[(0, d)]) for d in range(dp)]
    states = _states(osd[0], tag_dir / optims[(0, 0)])
    try:
        full = resolve(parsed, topology, all_sizes, states={"optim": (MASTER, *states)})
    except SpecError as e:
        known = ", ".join(f"{k}={v}" for k, v in sorted(all_sizes.items()))
        raise CheckpointFormatError(f"{tag_dir}: spec '{spec_name}' does not resolve with the sizes known ({known}); "
                                    f"give the others with sizes, or a config.json\n{e}") from None
    _check_order(full, shapes[0], first_path, spec_name)
    items = {it: info for it, info in full.items.items() if it.section == "optim"}
    where: dict[Item, Located] = {}
    for d in range(dp):
        path = tag_dir / optims[(0, d)]
        tree = osd[d]
        if _get(tree, "partition_count", path) != dp:
            raise CheckpointFormatError(f"{path}: partition_count is {tree['partition_count']}, dp_world_size {dp}")
        groups = _get(tree, "fp32_flat_groups", path)
        if not isinstance(groups, list) or len(groups) != 1:
            raise CheckpointFormatError(f"{path}: fp32_flat_groups holds {len(groups) if isinstance(groups, list) else '?'}"
                                        " sub-groups; only one is supported (raise sub_group_size)")
        state = _get(_get(tree, "optimizer_state_dict", path), "state", path)
        per_state = {MASTER: groups[0], **{s: (state.get(0) or {}).get(s) for s in states}}
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
                    fragments=tuple(f for f in full.fragments if f.item.section == "optim"))
    config = _hf_config(files)
    extra: dict[str, Any] = {"step": first.get("global_steps")} if isinstance(first.get("global_steps"), int) else {}
    if config:
        extra["config"] = config
    return Source(format=fmt_name, path=root, spec_name=spec_name, spec=parsed, topology=topology, sizes=all_sizes,
                  layout=layout, where=where, extra=extra)


def _states(tree: Mapping, path: Path) -> tuple[str, ...]:
    state = tree.get("optimizer_state_dict", {}).get("state", {}) if isinstance(tree, Mapping) else {}
    if not isinstance(state, Mapping) or set(state) - {0}:
        raise CheckpointFormatError(f"{path}: optimizer state for {sorted(state) if isinstance(state, Mapping) else '?'}"
                                    " sub-groups; only one is supported")
    per = state.get(0, {})
    return tuple(k for k, v in per.items() if isinstance(v, TensorRef) and v.shape != ())


def _check_order(layout: Layout, shapes: list[tuple[str, tuple[int, ...]]], path: Path, spec_name: str) -> None:
    """``param_shapes`` (the flat order) must be the spec's model section, name by name and shape by shape."""
    want = [(it.key, info.shape) for it, info in layout.items.items() if it.section == "model"]
    have = [(k, tuple(s)) for k, s in shapes]
    if have != want:
        first = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
        got = have[first] if first < len(have) else "nothing"
        exp = want[first] if first < len(want) else "nothing"
        raise CheckpointFormatError(f"{path}: param_shapes entry {first} is {got}; spec '{spec_name}' expects {exp} "
                                    "(the ZeRO-3 flat order must be the spec's model section)")
