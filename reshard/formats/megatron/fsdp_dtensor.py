"""Megatron-FSDP ``fsdp_dtensor`` checkpoints (``--use-megatron-fsdp --ckpt-format fsdp_dtensor``): read as a source.

How megatron-core 0.16 lays one out (``mcore_fsdp_adapter``, ``fsdp_dtensor_checkpoint``, ``uneven_dtensor``,
``DistributedOptimizer.sharded_param_state_fsdp_dtensor``), as its own save shows:

- a plain PyTorch DCP checkpoint, ``torch.distributed.checkpoint.save`` of the nested state dict: ``.metadata``
  and ``__{rank}_0.distcp``; no ``metadata.json``, no ``common.pt``. ``args`` (an ``argparse.Namespace``),
  ``iteration`` and ``checkpoint_version`` are bytes entries of their own;
- the weights as ``model.module.<name>``: the wrapper's ``state_dict()``, one ``module.`` per wrapper, with
  Megatron's names, each layer under its global number (``decoder.layers.{n}.self_attention.linear_qkv.weight``),
  never stacked; each tensor global (tensor parallelism folded into the DTensor), so QKV group-interleaved
  and the vocabulary padded, as torch_dist's are;
- SwiGLU's ``linear_fc1.weight`` split in two (``handle_swiglu_in_state_dict``): ``linear_fc1.weight_w``, the
  gate of the whole ffn, and ``linear_fc1.weight_v``, the up projection; ``_extra_state`` entries dropped;
- a mixture of experts' SequentialMLP experts under their global numbers (``handle_experts_in_state_dict``:
  ``mlp.experts.local_experts.{e}.``, ep rank r holding ``r*E/ep ..``), each sharded over the expert
  data-parallel group; the optimizer's keys name them the same way;
- no pipeline stages: Megatron-FSDP builds its device meshes over dp, ep and tp alone
  (``mcore_fsdp_adapter._get_dp_tp_mesh``), so args with pp > 1 are refused;
- each DTensor ``Shard(0)`` over dp, of a flat buffer cut on row boundaries: one chunk per rank, uneven
  (megatron-core writes the chunk list itself), a rank without rows writing none;
- the optimizer's state as ``optimizer.state.<param name>.<exp_avg|exp_avg_sq|step>``, the parameter named as
  the optimizer's model chunks name it (``module.module.<name>``), each state the weight's shape and chunks,
  ``step`` one 0-d tensor per parameter; its hyperparameters as bytes entries
  ``optimizer.param_to_group_meta.<param name>.<lr|betas|...>``. The weights saved are the optimizer's own
  parameters (``MegatronFSDP`` swaps its DTensor main weights in before ``state_dict``), so with optimizer
  state they are offered as the fp32 master copy too (a torch_dist or megatron target with ``zero=1``).

A model family with a torch_dist layout (from ``args``, or a ``config.json`` beside the checkpoint or its
parent) lays the weights out as torch_dist's global tensors (``mcore-dist-<family>``): a layer's tensor is
row ``n`` of the stacked one (an expert's, row ``(n, e)``), ``weight_w``/``weight_v`` its first and second half;
so every target that converts torch_dist converts this too. The run's args are carried to a Megatron target
(precision, buckets, optimizer), Megatron-FSDP's own switches set back to the trainer's defaults. Without one,
each stored tensor is its own, under its Megatron name (``mcore-fsdp-derived``): it converts to the formats that
keep tensors by name (dcp, deepspeed), and a target that needs a family (hf, megatron, mcore-dist) is refused
by that target, saying so. Writing this format is not supported.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reshard.core.dtypes import SUPPORTED
from reshard.core.layout import (
    MASTER,
    PARAM,
    Fragment,
    Item,
    ItemInfo,
    Layout,
    chunk_fragments,
    with_state_alias,
)
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import MAX_COUNT, Located, Progress, Source, Target, check_sizes, expect_step, given_sizes
from reshard.formats.dcp.reading import _DATA_FILE, _chunk_cover, _chunk_ref, _entry_bytes, _step_value
from reshard.formats.derived import Recorded, derived_spec, derived_spec_name, whole_text
from reshard.formats.megatron.args import _sizes_from_args
from reshard.formats.megatron.dist_moe import is_grouped, is_local
from reshard.formats.megatron.dist_moe import spec_name as _spec_name
from reshard.formats.megatron.identity import agreed_family, read_carried
from reshard.formats.megatron.state import TORCH_DIST_KEY, TorchDistState
from reshard.formats.megatron.torch_dist import METADATA_JSON, _args_of, _parallel, _tied, whole_tensors
from reshard.formats.specs import layout_spec
from reshard.io.dcp_metadata import METADATA_NAME, DcpMetadata, read_metadata
from reshard.io.location import as_path
from reshard.io.torch_read import read_torch_file

__all__ = ["FORMAT", "McoreFsdpFormat", "megatron_name"]

_MODEL = "model."
_STATE = "optimizer.state."
_WRAPPERS = re.compile(r"(?:module\.)*")
_LAYER = re.compile(r"((?:decoder|mtp)\.layers\.)([0-9]+)\.(.*)")
_EXPERT = re.compile(r"(.*\.mlp\.experts\.)local_experts\.([0-9]+)\.(linear_fc[12]\..*)")
_HALVES = {"weight_w": 0, "weight_v": 1}
_LOCAL_NORMS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
"""megatron-core's local layers' ``sharded_state_dict_keys_map``: their norms, by module name in a
``state_dict()``, are keyed in torch_dist as Transformer Engine's fused norms are."""
_EMBEDDING = "embedding.word_embeddings.weight"
_MARKS = ("args", "checkpoint_version", "iteration")
"""The bytes entries Megatron's trainer saves beside the state (``generate_state_dict``)."""


def megatron_name(key: str) -> tuple[str, str] | None:
    """``(Megatron name, state)`` of a stored tensor key, None for a key that is neither a weight nor an
    optimizer state: ``model.module.decoder.layers.0.mlp.linear_fc2.weight`` is ``decoder.layers.0.mlp.
    linear_fc2.weight``'s ``param``; ``optimizer.state.module.module.<name>.exp_avg`` its ``exp_avg``."""
    if key.startswith(_STATE):
        rest, _, state = key[len(_STATE):].rpartition(".")
        name = rest[_WRAPPERS.match(rest).end():]
        return (name, state) if name and state else None
    if key.startswith(_MODEL):
        rest = key[len(_MODEL):]
        name = rest[_WRAPPERS.match(rest).end():]
        return (name, PARAM) if name else None
    return None


class McoreFsdpFormat:
    """The ``mcore-fsdp`` format adapter (see ``reshard.formats.base.Format``): a source only."""

    name = "mcore-fsdp"

    def detect(self, path: Path) -> bool:
        path = as_path(path)
        if not (path / METADATA_NAME).is_file() or (path / METADATA_JSON).exists():
            return False
        try:
            md = read_metadata(path)
        except CheckpointFormatError:
            return False
        return _is_fsdp_dtensor(md)

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read ``.metadata`` and the ``args``/``iteration`` entries; match every stored tensor to its layout.

        Raises:
          CheckpointFormatError: a key that is neither a weight nor an optimizer state, a tensor the family's
            layout has no place for (or a global shape it does not expect), a tensor of the layout stored
            nowhere, chunks that overlap or leave a gap, or a chunk its archive disagrees with; each naming
            the key.
        """
        path = as_path(path)
        md = read_metadata(path)
        args = _args_of({"args": _entry(path, md, "args")})
        if args is not None and (pp := args.get("pipeline_model_parallel_size") or 1) != 1:
            raise CheckpointFormatError(
                f"{path / METADATA_NAME}: args.pipeline_model_parallel_size is {pp}: Megatron-FSDP builds its device "
                "meshes over dp, ep and tp only, so its fsdp_dtensor checkpoints have no pipeline stages; this one "
                "was not saved by a Megatron-FSDP run reshard knows")
        carried, config_path = read_carried(path, path.parent)
        family = agreed_family(args, carried, path / METADATA_NAME, config_path, spec=spec)
        derived = spec is None and (family is None or not family.torch_dist)
        problems: list[str] = []
        named: dict[str, tuple[str, str]] = {}
        for key, t in md.tensors.items():
            role = megatron_name(key)
            if role is None:
                problems.append(f"'{key}' is neither a weight ('model.[module.]<name>') nor an optimizer state "
                                "('optimizer.state.[module.]<name>.<state>')")
            elif t.size != ():
                named[key] = role
        if derived:
            shapes = {name: md.tensors[key].size for key, (name, state) in named.items() if state == PARAM}
            spec_name = derived_spec_name(self.name)
            spec_ast = derived_spec(whole_text([Recorded(n, s) for n, s in shapes.items()], path), self.name, path)
            model_sizes = given_sizes(sizes)
            topology = _parallel(args, path / METADATA_NAME, MAX_COUNT)
        else:
            spec_name = spec or _spec_name(family, _tied(family, args, carried.config), is_local(args), False,
                                           is_grouped(args))
            spec_ast = layout_spec(spec_name)
            model_sizes, topology = _sizes(path, md, named, args, family, carried, config_path, sizes)
        whole, by_key, frags_of = whole_tensors(spec_ast, model_sizes)
        items: dict[Item, ItemInfo] = {}
        fragments: list[Fragment] = []
        where: dict[Item, Located] = {}
        covered: dict[tuple[str, str], int] = {}
        archives: dict[str, Any] = {}
        for key, (name, state) in named.items():
            t = md.tensors[key]
            place = _place(name, t.size, by_key, whole) if not derived else (name, 0, ())
            if isinstance(place, str):
                problems.append(f"'{key}' ({t.dtype} {list(t.size)}): {place} in spec '{spec_name}'")
                continue
            whole_key, shift, lead = place
            if t.dtype not in SUPPORTED:
                problems.append(f"'{key}' has dtype {t.dtype}, which reshard cannot copy")
                continue
            if problem := _chunk_cover(key, t):
                problems.append(problem)
                continue
            whole_item = by_key[whole_key]
            shape = whole.items[whole_item].shape
            covered[whole_key, state] = covered.get((whole_key, state), 0) + math.prod(t.size)
            for c in t.chunks:
                if 0 in c.sizes:
                    continue
                offsets, lengths = list(c.offsets), list(c.sizes)
                offsets[0] += shift
                offsets, lengths = [*lead, *offsets], [*(1 for _ in lead), *lengths]
                item = Item("model", (), 0, state, f"{key}@{','.join(map(str, c.offsets))}")
                mine = [replace(f, state=state) for f in chunk_fragments(frags_of.get(whole_item, []), shape,
                                                                          tuple(offsets), tuple(lengths), item)]
                ref = _chunk_ref(path, md, key, c, t, archives, problems)
                if ref is None:
                    continue
                items[item] = ItemInfo(shape=c.sizes, mapped=sum(math.prod(f.box.lengths) for f in mine),
                                       rule=whole.items[whole_item].rule)
                fragments.extend(mine)
                where[item] = Located(ref.path, ref.data_offset, ref.dtype)
        for key, it in by_key.items():
            held = covered.get((key, PARAM), 0)
            if held != math.prod(whole.items[it].shape):
                problems.append(f"'{key}' is missing (spec '{spec_name}' has it)" if not held else
                                f"'{key}' is stored in part ({held} of {math.prod(whole.items[it].shape)} elements)")
        if problems:
            raise CheckpointFormatError(f"{path}: the fsdp_dtensor checkpoint does not match spec '{spec_name}':\n  "
                                        + "\n  ".join(problems[:20]))
        ranks = {int(m.group(1)) for s in md.storage.values() if (m := _DATA_FILE.fullmatch(s.relative_path))}
        topology = replace(topology, dp=max(1, len(ranks) // (topology.tp * topology.pp)))
        used = {f.tensor for f in fragments}
        tensors = MappingProxyType({n: t for n, t in whole.tensors.items() if n in used})
        layout = Layout(topology=topology, tensors=tensors, items=MappingProxyType(items), fragments=tuple(fragments))
        trained = {f.tensor for f in fragments if f.state not in (PARAM, MASTER)}
        if trained:  # the weights saved are the optimizer's own (fp32 main) parameters
            layout = with_state_alias(layout, PARAM, MASTER, only=trained)
        it = _entry(path, md, "iteration")
        progress = Progress(iteration=expect_step(it, "iteration", path / METADATA_NAME) if it is not None else None,
                            step=_step(path, md))
        model = replace(carried, family=family.name if family else None,
                        hints=family.config_hints(args) if family and args and family.config_hints else {})
        carried_state = TorchDistState(args=_unsharded(args), iteration=progress.iteration)
        return Source(format=self.name, path=path, spec_name=spec_name, spec=spec_ast, topology=topology,
                      sizes=model_sizes, layout=layout, where=where, model=model, progress=progress,
                      extra={TORCH_DIST_KEY: carried_state} if args else {})

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        raise CheckpointFormatError("reshard reads Megatron-FSDP fsdp_dtensor checkpoints but does not write them; "
                                    "convert to mcore-dist (torch_dist), megatron, dcp or hf")

    def files_of(self, target: Target) -> dict:
        raise CheckpointFormatError("the mcore-fsdp format is read only")

    def write(self, *a, **k) -> list[Path]:
        raise CheckpointFormatError("the mcore-fsdp format is read only")


def _unsharded(args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run's args as a Megatron target carries them (its model, precision, optimizer and buckets), with
    Megatron-FSDP's own switches set to the trainer's defaults: the target is torch_dist (or the torch format)
    written for the distributed optimizer, not Megatron-FSDP."""
    if not args:
        return {}
    out = dict(args)
    out.update(use_megatron_fsdp=False, ckpt_format="torch_dist", data_parallel_sharding_strategy="no_shard")
    if "use_custom_fsdp" in out:
        out["use_custom_fsdp"] = False
    return out


def _is_fsdp_dtensor(md: DcpMetadata) -> bool:
    """Megatron's trainer marks (``args``, ``iteration``, ``checkpoint_version`` as bytes entries) and weights
    under ``model.module.``: a DCP checkpoint a Megatron-FSDP run saved."""
    return all(k in md.byte_entries for k in _MARKS) and any(k.startswith(f"{_MODEL}module.") for k in md.tensors)


def _entry(path: Path, md: DcpMetadata, key: str) -> Any:
    """A bytes entry's object (a torch.save archive), None when there is none."""
    s = md.storage.get((key, None))
    if s is None:
        return None
    file = path / s.relative_path
    if not file.is_file():
        raise CheckpointFormatError(f"{file}: missing or not a regular file (the metadata puts '{key}' there)")
    return read_torch_file(file, offset=s.offset, length=s.length)


def _step(path: Path, md: DcpMetadata) -> int | None:
    """Adam's step: the first parameter's ``step`` state (each parameter holds the same count)."""
    key = next((k for k, t in md.tensors.items() if t.size == () and k.startswith(_STATE) and k.endswith(".step")),
               None)
    if key is None:
        return None
    data, ref = _entry_bytes(path, md, key, ())
    value = None if ref is None else _step_value(data, ref, md.storage[(key, ())].offset)
    return None if value is None else expect_step(value, f"'{key}'", path / METADATA_NAME)


def _place(name: str, size: tuple[int, ...], by_key: Mapping[str, Item], whole: Layout) -> tuple | str:
    """Where a stored tensor lies in the family's torch_dist tensors: ``(key, rows shifted, leading indices)`` (the
    layer and expert numbers of a stacked key, outermost first), or why it has no place."""
    base, shift = name, 0
    head, _, last = name.rpartition(".")
    if last in _HALVES:
        base, shift = f"{head}.weight", _HALVES[last] * size[0]
    lead: tuple[int, ...] = ()
    if m := _EXPERT.fullmatch(base):  # SequentialMLP's experts, numbered globally: stacked on an expert dim
        base, lead = f"{m.group(1)}experts.{m.group(3)}", (int(m.group(2)),)
    key = base
    if (m := _LAYER.fullmatch(base)) and base not in by_key:
        rest = next((fused + m.group(3)[len(local):] for local, fused in _LOCAL_NORMS
                     if m.group(3).startswith(local) and f"{m.group(1)}{m.group(3)}" not in by_key), m.group(3))
        key, lead = f"{m.group(1)}{rest}", (int(m.group(2)), *lead)
    if key not in by_key:
        return "no tensor of that name"
    shape = whole.items[by_key[key]].shape
    rows = size[0] * (2 if last in _HALVES else 1)
    expect = (*shape[:len(lead)], rows, *size[1:]) if size else ()
    if expect != shape or any(i >= n for i, n in zip(lead, shape)):
        return f"the stored shape does not fit {key}'s {list(shape)}"
    return key, shift, lead


def _sizes(path: Path, md: DcpMetadata, named: Mapping[str, tuple[str, str]], args: Mapping[str, Any] | None,
           family, carried, config_path, given: Mapping[str, int] | None) -> tuple[dict[str, int], Topology]:
    """The model sizes, from the args (else the carried config, else ``given``), ``vpad`` the stored rows."""
    embedding = next((md.tensors[k] for k, (n, s) in named.items() if n == _EMBEDDING and s == PARAM), None)
    if embedding is None or len(embedding.size) != 2:
        raise CheckpointFormatError(f"{path}: no 2-D '{_MODEL}module.{_EMBEDDING}' in {METADATA_NAME}, so not a "
                                    "GPT checkpoint reshard reads")
    where = f"{path / METADATA_NAME}: args"
    topology = _parallel(args, path / METADATA_NAME, MAX_COUNT)
    if args is not None:
        sizes = _sizes_from_args(args, dict(given or {}), topology, where)
        sizes.pop("vocab_div", None)
    else:
        where = str(config_path or path)
        from_config = family.sizes_from_config(carried.config, config_path) if carried.config else {}
        sizes = {**from_config, **given_sizes(given)}
    sizes["vpad"] = embedding.size[0]
    return check_sizes(sizes, where), topology


FORMAT = McoreFsdpFormat()
