"""A torch_dist checkpoint of a model no family describes, laid out from DCP's ``.metadata`` alone.

torch_dist stores global tensors: each key of ``.metadata`` is one whole tensor of
the model (Megatron's own name, layers stacked), with the boxes each rank wrote as
its chunks. Without a family nothing says how those tensors relate to another
framework's, but nothing is needed to keep them: every key becomes a logical
tensor under its own name and global shape (``mcore-dist-derived``, a layout in
the spec language like a family's), each chunk an item, and the distributed
optimizer's ``fully_reshardable`` keys (``optimizer.state.<state>.<key>``) the
same tensors' states. Bytes entries (``_extra_state``, ``rng_state``, ...) and
0-d tensors are carried verbatim, the common state (``common_state``) whole.

Such a source converts to formats that keep every tensor by name (dcp, and
torch_dist itself at the same tp and pp and any dp: the chunks as recorded,
each written by the rank that wrote it, modulo the new world size); formats
that need the family (hf, the torch format) refuse it through
``reshard.formats.specs.require_family``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reshard.core.layout import MASTER, PARAM, Fragment, Item, ItemInfo, Layout
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import Source, Target
from reshard.formats.dcp.layouts import _Chunk
from reshard.formats.dcp.reading import DcpWrite, _Naming
from reshard.formats.derived import Recorded, derived_spec_name, whole_text
from reshard.formats.megatron.common_state import common_bytes
from reshard.formats.megatron.identity import carried_identity
from reshard.formats.megatron.small import _capture
from reshard.formats.megatron.state import TORCH_DIST_KEY, TorchDistState
from reshard.io.dcp_metadata import DcpChunk, DcpMetadata

__all__ = ["DERIVED_SPEC", "MAIN_STATE", "derived_target", "derived_text", "optimizer_state"]

DERIVED_SPEC = derived_spec_name("mcore-dist")
MAIN_STATE = "param"
"""The ``fully_reshardable`` format's state name for the fp32 main params (``optimizer.state.param.<key>``):
reshard's state ``MASTER``."""
_STATE_PREFIX = "optimizer.state."


def optimizer_state(key: str) -> tuple[str | None, str]:
    """``(state, model key)`` of a stored key: ``param`` for a weight, the optimizer state for
    ``optimizer.state.<state>.<model key>`` (the distributed optimizer's ``fully_reshardable``
    format, whose ``param`` state is the fp32 master copy); ``None`` for other optimizer keys."""
    if not key.startswith("optimizer."):
        return PARAM, key
    if not key.startswith(_STATE_PREFIX):
        return None, key
    state, _, model_key = key[len(_STATE_PREFIX):].partition(".")
    if not model_key or state == "fp32_param":  # fp32_param: the old fully_sharded_model_space's flattened ranges
        return None, key
    return (MASTER if state == MAIN_STATE else state), model_key


def stored_key(model_key: str, state: str) -> str:
    """The inverse of ``optimizer_state``: the key a state of a tensor is stored under."""
    if state == PARAM:
        return model_key
    return f"{_STATE_PREFIX}{MAIN_STATE if state == MASTER else state}.{model_key}"


def derived_text(md: DcpMetadata, where: Path | str) -> str:
    """The derived layout of a torch_dist checkpoint: each stored tensor (a weight, or the tensor an optimizer
    state belongs to) whole under its own name, in ``.metadata``'s order; 0-d tensors are carried verbatim."""
    tensors: dict[str, Recorded] = {}
    for key, t in md.tensors.items():
        state, model_key = optimizer_state(key)
        if t.size != () and state is not None:
            tensors.setdefault(model_key, Recorded(model_key, tuple(t.size)))
    return whole_text(list(tensors.values()), where)


def derived_target(source: Source, topology: Topology) -> Target:
    """The torch_dist checkpoint a derived ``source`` is, written again at ``topology``'s dp.

    Raises:
      CheckpointFormatError: ``topology`` changes tp or pp (which dims those split is what the family
        would say), or has cp, ep or vpp.
    """
    state: TorchDistState = source.extra[TORCH_DIST_KEY]
    src = source.topology
    others = [f"{a}({topology.degree(a)})" for a in ("cp", "ep", "vpp") if topology.degree(a) > 1]
    if others or (topology.tp, topology.pp) != (src.tp, src.pp):
        raise CheckpointFormatError(
            f"{source.path}: its layout is derived from the checkpoint alone (no model family), which keeps the "
            f"chunks as stored, those of tp={src.tp}, pp={src.pp}; writing tp={topology.tp}, pp={topology.pp}"
            f"{', ' + ', '.join(others) if others else ''} needs to know how the model splits each tensor: put the "
            "model's config.json of a known family beside the source, or give a spec")
    topology = Topology(tp=src.tp, pp=src.pp, dp=topology.dp)
    world = topology.world_size
    by_item: dict[Item, list[Fragment]] = {}
    for f in source.layout.fragments:
        by_item.setdefault(f.item, []).append(f)
    items: dict[Item, ItemInfo] = {}
    fragments: list[Fragment] = []
    chunks: dict[Item, _Chunk] = {}
    dtypes: dict[Item, str] = {}
    order = sorted((it for it in source.layout.items if it in source.where), key=lambda it: state.chunks[it][3] % world)
    for it in order:
        key, offsets, size, rank = state.chunks[it]
        info = source.layout.items[it]
        item = Item("model", (("rank", rank % world),), 0, it.state, it.key)
        items[item] = ItemInfo(shape=info.shape, mapped=info.mapped, rule=info.rule)
        fragments.extend(replace(f, item=item) for f in by_item.get(it, ()))
        chunks[item] = _Chunk(key, DcpChunk(offsets, info.shape), size, rank % world, item)
        dtypes[item] = source.where[it].dtype
    layout = Layout(topology=topology, tensors=source.layout.tensors, items=MappingProxyType(items),
                    fragments=tuple(fragments))
    args = dict(state.args)
    for name, value in (("data_parallel_size", topology.dp), ("world_size", world)):
        if name in args:
            args[name] = value
    out = TorchDistState(args=args, iteration=state.iteration, checkpoint_version=state.checkpoint_version,
                         common=state.common, common_entry=state.common_entry)
    verbatim = [*state.extra_states, *([common_bytes(out)] if out.common_entry else [])]
    extra = {"dcp": DcpWrite(chunks=chunks, verbatim=verbatim, planner_data=dict(state.planner_data),
                             naming=_Naming("", "", frozenset())), TORCH_DIST_KEY: out}
    return Target(format=source.format, spec_name=source.spec_name, spec=source.spec, topology=topology,
                  sizes=dict(source.sizes), layout=layout, dtypes=dtypes, model=carried_identity(source, None),
                  extra=extra)


def carried_common(common: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """``common.pt`` without its ``args`` (kept as a dict in the state), small tensors read by value."""
    return _capture({k: v for k, v in common.items() if k != "args"}, str(where))
