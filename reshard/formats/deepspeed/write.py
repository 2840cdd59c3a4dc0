"""Writing ZeRO-1/2: the tree of each model and optimizer file, recomputed for the target topology.

``param_shapes``, ``param_slice_mappings``, ``group_paddings``, ``param_alignment_paddings``,
``partition_count`` and the world sizes come from the target's layout (``zero12._groups``);
everything else from the carried or synthesized state (``state``). ``DeepSpeedFormat.write``
streams the trees to disk (``files._write_file``); the pipeline's layer files are ``pipe``'s.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from reshard.core.layout import MASTER, Item
from reshard.formats.base import Target
from reshard.formats.deepspeed.state import (
    DeepSpeedExtra,
    DsOptimizer,
    _fragment_address,
    _Sources,
    _with_bf16,
    _with_scalars,
    synthesize_extra,
)
from reshard.formats.deepspeed.zero12 import Rank, _Group, _SpecInfo, _unit
from reshard.io.torchfile import TensorSpec, TorchSize


def _write_extra(target: Target, info: Any) -> tuple[DeepSpeedExtra, str]:
    """The non-tensor state a write uses, and the model dtype: carried, or synthesized for these dtypes."""
    extra: DeepSpeedExtra | None = target.extra.get("deepspeed")
    dtype = next((d for it, d in target.dtypes.items() if it.section in info.model_sections), "float32")
    if extra is None:
        extra = synthesize_extra(groups=len(info.groups), dtype=dtype, dp=target.topology.dp)
    if extra.synthesized:  # the dtypes may have been settled after target() (convert takes the sources')
        extra = _with_bf16(extra, dtype == "bfloat16")
    return extra, dtype


def _model_tree(extra: DeepSpeedExtra, info: _SpecInfo, groups: list[_Group], pt: Rank, target: Target,
                ds_config: Any, pipeline: bool = False) -> tuple[dict[str, Any], _Sources]:
    """A model file: ``module`` (None under a pipeline, whose weights are in layer files) and the engine state,
    with ``frozen_param_shapes`` and ``frozen_param_fragments`` (from stage 2 on) and, for a derived layout,
    ``buffer_names`` and ``shared_params`` as the target's model records them."""
    layout, topo = target.layout, target.topology
    items = {it.key: it for it in layout.items if it.section in info.module_sections and it.unit == _unit(pt)}
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
    ds_model = target.extra.get("ds_model")
    if ds_model is not None:  # a pipeline stage's file names its own stage's buffers
        on = dict(ds_model.stages)
        tree["buffer_names"] = [b for b in ds_model.buffers if on.get(b, pt[0]) == pt[0]]
        if tree.get("shared_params") is not None or ds_model.shared:
            tree["shared_params"] = ds_model.shared
    _frozen_records(tree, target, [it for it in layout.items if it.section == info.fragments and it.unit == _unit(pt)],
                    sources)
    tree["dp_world_size"], tree["mp_world_size"] = topo.dp, topo.pp * topo.tp
    if "checkpoint_parallel_dimensions" in tree:
        tree["checkpoint_parallel_dimensions"] = {"pp_degree": topo.pp, "tp_degree": topo.tp}
    if "ds_config" in tree:
        tree["ds_config"] = ds_config
    return tree, sources


def _frozen_records(tree: dict[str, Any], target: Target, kept: list[Item], sources: _Sources) -> None:
    """A model file's ``frozen_param_shapes`` and ``frozen_param_fragments``, saved from ZeRO stage 2 on (when
    ``tree`` has the first): the frozen params the items ``kept`` hold, set in ``tree``."""
    if tree.get("frozen_param_shapes") is None:
        return
    tree["frozen_param_shapes"] = OrderedDict((it.key, TorchSize(target.layout.items[it].shape)) for it in kept)
    fragments = OrderedDict()
    for it in kept:
        fragments[it.key] = TensorSpec(target.dtypes[it], target.layout.items[it].shape, ("fragment", it.key))
        sources[("fragment", it.key)] = (it, target.layout.items[it].numel)
    tree["frozen_param_fragments"] = fragments


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
            whole = extra.optimizer == DsOptimizer.BF16 or (state != MASTER and not extra.elastic)
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
