"""Megatron-core ``torch_dist`` checkpoints (``dist_checkpointing.save``): read as a source.

A directory holds ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``),
the non-sharded state (``args``, ``iteration``, ...: ``common.pt``, or from megatron-core 0.19 the DCP
entry ``common_state``, see ``common_state``) and a
PyTorch DCP checkpoint (``.metadata``, ``__{rank}_{n}.distcp``). Unlike the
torch format, every stored key is the *global* tensor: layers stacked on a
leading dim (``decoder.layers.self_attention.linear_qkv.weight`` is
``[layers, g·(qpg+2)·hd, h]``), QKV group-interleaved, SwiGLU fc1 stored as
``[gate; up]`` of the whole ffn, the vocabulary padded. DCP's chunks say which
box of it each rank wrote. The family's spec ``mcore-dist-<family>[-tied]``
describes the global tensors: the family's Megatron layout with each tensor
whole (``reshard.formats.specs``), for the dense families megatron-core holds
(Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its q/k norms, Phi-3,
and GPT-2 style: LayerNorm weight and bias, every linear's bias, learned
positions, tied) and the mixtures of experts, SequentialMLP, GroupedMLP or TEGroupedMLP
(Mixtral, Qwen3-MoE, GPT-OSS: experts stacked after the layers, ``dist_moe``;
``-local`` for megatron-core's local layers, as ``args.transformer_impl`` says),
and DeepSeek-V3, whose layers are keyed one by one (``dist_layers``; ``-mtp`` with its MTP block);
a tied output layer is no key of its own (it is the embedding's). ``chunk_fragments`` cuts the spec's fragments down to each chunk,
so a conversion reads just the rows each target needs, in place inside the
chunks' ``torch.save`` archives.

Model sizes come from the common state's ``args`` (as Megatron's training loop
saves them) or from ``sizes``; ``vpad`` is the stored embedding's row count.
Per-layer ``_extra_state`` entries are bytes entries, carried as they are to a
torch_dist target (written as megatron-core's local layers write them,
``[None]``, from any other source); they hold nothing the other formats need.
Optimizer state saved by the distributed optimizer is read in both of its
formats: ``fully_reshardable`` (``optimizer.state.<state>.<model key>``, the
same global tensors and chunks as the weights; ``param`` is the fp32 master
copy; the step from ``common.pt``'s param groups) and the default
``dp_reshardable`` bucket space (``[chained_K.]optimizer.distributed.*``, an MoE's dense
and expert buffers, decoded per parameter by ``dist_optim``; the step and param groups from its
``optimizer`` entry, carried to a torch-format target), and megatron-core
0.8-0.14's default ``fully_sharded_model_space`` (``model_space``), and the older bucket
formats ``dp_zero_gather_scatter`` and ``fully_sharded_bucket_space`` (``dist_zero``). Bucket-space
state of derived layouts is refused with a message. Writing lays the same global weights out as
megatron-core's ranks would at the target tp/pp (see
``McoreDistFormat.target``); with ``zero=1`` the distributed optimizer's state
too, as ``dp_reshardable`` (``dist_optim_target``: the buckets of the target's
args, chunk for chunk as megatron-core 0.16 saves them, which its torch_dist
load resumes from; for a mixture of experts at the target's ep, whose experts have buffers
of their own at ep > 1). ``fully_reshardable`` on request (``dist_full``, which also refuses such state saved shifted by
megatron-core's multi-bucket bug). Not written:
Megatron-Bridge's layouts (Gemma, Gemma 2, Gemma 3), which have no
torch_dist layout (refused naming the family and why; such a checkpoint is read
laid out by name, below).

A checkpoint whose args describe no family with a torch_dist layout (and no
``config.json`` beside it names one) is laid out from ``.metadata`` alone,
every key under its own name (``mcore-dist-derived``, ``dist_derived``): it
converts to dcp, and to torch_dist at its own tp and pp and any dp with every
state, bytes entry and ``common.pt`` entry carried. The model's identity
(``config.json`` and the rest) is read from the checkpoint directory or its
parent and written beside a torch_dist target.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reshard.core.dtypes import SUPPORTED
from reshard.core.layout import PARAM, Fragment, Item, ItemInfo, Layout, chunk_fragments
from reshard.core.resolve import resolve
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, SpecError
from reshard.execution.session import WriteSession
from reshard.formats.base import (
    MAX_COUNT,
    Fill,
    Located,
    Progress,
    Source,
    Target,
    check_sizes,
    expect_int,
    expect_step,
    given_sizes,
    read_json,
    require_sizes,
)
from reshard.formats.dcp import FORMAT as DCP
from reshard.formats.dcp.layouts import _Chunk
from reshard.formats.dcp.reading import (
    _DATA_FILE,
    DcpWrite,
    _chunk_cover,
    _chunk_ref,
    _entry_bytes,
    _Naming,
    _Verbatim,
)
from reshard.formats.derived import derived_spec, is_derived
from reshard.formats.identity import write_identity
from reshard.formats.megatron.dist_derived import (
    DERIVED_SPEC,
    carried_common,
    derived_target,
    derived_text,
)
from reshard.formats.megatron.dist_derived import optimizer_state as _optimizer_state
from reshard.formats.megatron.common_state import (
    COMMON,
    COMMON_ENTRY,
    common_bytes,
    common_where,
    metadata_json,
    read_common,
    write_common,
)
from reshard.formats.megatron.dist_full import FULL, check_buckets, full_target, sharding_of
from reshard.formats.megatron.dist_layers import mtp_layers, with_mtp
from reshard.core.chunks import chunk_boxes
from reshard.formats.megatron.dist_moe import bucket_refusal, experts_args, extra_states, is_grouped, is_local
from reshard.formats.megatron.dist_moe import spec_name as _spec_name
from reshard.formats.megatron.dist_optim import bucket_space, is_bucket_key
from reshard.formats.megatron.dist_zero import BUCKET_SPACE, ZERO, flat_chunk, sharding_type, zero_state
from reshard.formats.megatron.identity import agreed_family, carried_identity, read_carried
from reshard.formats.megatron.model_space import common_param_groups, flat_fragments, flat_ranges, is_model_space
from reshard.formats.megatron.specs import spec_name as megatron_spec_name
from reshard.formats.megatron.state import TORCH_DIST_KEY, TorchDistState, carried_args
from reshard.formats.specs import family_of, layout_spec, require_family
from reshard.io.bounds import brief
from reshard.io.dcp_metadata import DcpChunk, read_metadata
from reshard.io.location import as_path
from reshard.models import Family, llama

__all__ = ["FORMAT", "McoreDistFormat"]

METADATA_JSON = "metadata.json"
_EMBEDDING = "embedding.word_embeddings.weight"


class McoreDistFormat:
    """The ``mcore-dist`` format adapter (see ``reshard.formats.base.Format``)."""

    name = "mcore-dist"

    def detect(self, path: Path) -> bool:
        meta = as_path(path) / METADATA_JSON
        if not meta.is_file():
            return False
        try:
            data = read_json(meta)
        except CheckpointFormatError:
            return False
        return isinstance(data, dict) and data.get("sharded_backend") == "torch_dist"

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read ``metadata.json``, ``common.pt`` and DCP's ``.metadata``; match every stored key to the spec.

        The spec is the model family's (``mcore-dist-<family>``, ``-tied`` where the args, or without them the
        config, tie the output layer to the embedding) when ``common.pt``'s args describe a family with a
        torch_dist layout (or, without args, a ``config.json`` beside the checkpoint or its parent names one,
        which the args must agree with); otherwise the layout
        is derived from ``.metadata`` alone (``mcore-dist-derived``, see ``dist_derived``).
        ``Source.model`` carries that ``config.json``, ``generation_config.json`` and tokenizer files.

        Raises:
          CheckpointFormatError: another backend, missing model sizes, a stored
            key the spec does not know (or the reverse), a global shape that
            differs from the spec's, optimizer state in neither the
            ``fully_reshardable``, ``dp_reshardable`` nor ``fully_sharded_model_space``
            format, bucket sizes that differ from the layout's (``dist_optim.bucket_space``),
            or model-space ranges off the weights' chunk grid (``model_space``).
        """
        path = as_path(path)
        backend = _read_json(path / METADATA_JSON).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointFormatError(f"{path / METADATA_JSON}: sharded_backend is {brief(backend)}; reshard reads "
                                        "'torch_dist' (zarr and others are not supported)")
        md = read_metadata(path)
        common, common_entry = read_common(path, md)
        common_at = common_where(path)
        carried, config_path = read_carried(path, path.parent)
        args = _args_of(common)
        family = agreed_family(args, carried, common_at, config_path, spec=spec)
        derived = spec is None and (family is None or not family.torch_dist)
        if derived:  # a model no family describes: every stored tensor under its own name
            spec_name = DERIVED_SPEC
            spec_ast = derived_spec(derived_text(md, path), self.name, path)
            model_sizes, topology = given_sizes(sizes), _parallel(args, common_at, MAX_COUNT)
        else:
            spec_name = spec or _spec_name(family, _tied(family, args, carried.config), is_local(args),
                                           mtp_layers(md.tensors) > 0, is_grouped(args))
            spec_ast = layout_spec(spec_name)
            from_config = family.sizes_from_config(carried.config, config_path) \
                if family and carried.config and args is None else {}  # args, when there are, give the sizes
            from_config = with_mtp(from_config, md.tensors)
            model_sizes, topology = _sizes(path, common, md, {**from_config, **dict(sizes or {})},
                                           (family or family_of(spec_name) or llama.FAMILY).sizes)
        whole, by_key, frags_of = whole_tensors(spec_ast, model_sizes)
        items: dict[Item, ItemInfo] = {}
        fragments: list[Fragment] = []
        where: dict[Item, Located] = {}
        problems: list[str] = []
        bucket = sorted(k for k in [*md.tensors, *md.byte_entries] if is_bucket_key(k))
        buckets, zero, sharding = None, None, sharding_type(common, md)
        if bucket and not derived and family is not None and sharding == ZERO:  # distrib_optim.pt's dicts
            zero = zero_state(path, md, args, family, model_sizes, topology)
            buckets = zero.space
        elif bucket and (derived or family is None or not any(k in md.tensors for k in bucket)):
            problems.append(bucket_refusal(bucket))
        elif bucket:
            buckets = bucket_space(path, md, args, family, model_sizes, topology, padded=sharding == BUCKET_SPACE)
        model_space = not derived and is_model_space(md)  # megatron-core 0.8-0.14's flattened ranges
        flat = flat_ranges(md, {k: whole.items[it].shape for k, it in by_key.items()}, problems) if model_space else {}
        archives: dict[str, Any] = {}
        verbatim: list[_Verbatim] = []
        chunks: dict[Item, tuple] = {}
        for key, t in md.tensors.items():
            if is_bucket_key(key):
                if buckets is None:
                    continue
                state, whole_frags, rule = buckets.states[key], buckets.fragments[key], buckets.spec_name
            elif model_space and key.startswith("optimizer."):
                if key not in flat:
                    continue  # flat_ranges listed why
                whole_item = by_key[flat[key].model_key]
                state, whole_frags, rule = flat[key].state, frags_of.get(whole_item, []), whole.items[whole_item].rule
            elif derived and t.size == ():
                verbatim.append(_Verbatim(key, t, _entry_bytes(path, md, key, ())[0]))
                continue
            else:
                state, model_key = _optimizer_state(key)
                if state is None:
                    problems.append(f"'{key}' is optimizer state reshard does not read (expected "
                                    "optimizer.state.<param|exp_avg|exp_avg_sq|...>.<model key>)")
                    continue
                whole_item = by_key.get(model_key)
                if whole_item is None:
                    problems.append(f"'{key}' ({t.dtype} {list(t.size)}) matches no tensor of spec '{spec_name}'")
                    continue
                if t.size != whole.items[whole_item].shape:
                    problems.append(f"'{key}' is {list(t.size)}, spec '{spec_name}' expects "
                                    f"{list(whole.items[whole_item].shape)} for sizes {model_sizes}")
                    continue
                whole_frags, rule = frags_of.get(whole_item, []), whole.items[whole_item].rule
            if t.dtype not in SUPPORTED:
                problems.append(f"'{key}' has dtype {t.dtype}, which reshard cannot copy")
                continue
            if problem := _chunk_cover(key, t):
                problems.append(problem)
                continue
            for c in t.chunks:
                if 0 in c.sizes:
                    continue
                item = Item("model", (), 0, state, f"{key}@{','.join(map(str, c.offsets))}")
                mine = flat_fragments(flat[key], whole_frags, c, item, f"{path / '.metadata'}: '{key}'") if key in flat \
                    else [replace(f, state=state)
                          for f in chunk_fragments(whole_frags, *flat_chunk(buckets, key, t.size, c), item)]
                if not mine and is_bucket_key(key):  # a gap between parameters: arbitrary bytes, never read
                    continue
                ref = _chunk_ref(path, md, key, c, t, archives, problems)
                if ref is None:
                    continue
                items[item] = ItemInfo(shape=c.sizes, mapped=sum(math.prod(f.box.lengths) for f in mine), rule=rule)
                fragments.extend(mine)
                where[item] = Located(ref.path, ref.data_offset, ref.dtype)
                rank = _DATA_FILE.fullmatch(md.storage[(key, c.offsets)].relative_path)
                chunks[item] = (key, c.offsets, t.size, int(rank.group(1)) if rank else 0)
        if zero is not None:
            items.update(zero.items)
            fragments.extend(zero.fragments)
            where.update(zero.where)
        stored = {_optimizer_state(k)[1] for k in md.tensors}
        for key in by_key:
            if key not in stored:
                problems.append(f"'{key}' is missing (spec '{spec_name}' has it)")
        if problems:
            raise CheckpointFormatError(f"{path}: the torch_dist checkpoint does not match spec '{spec_name}':\n  "
                                        + "\n  ".join(problems[:20]))
        if not derived and family is not None:  # fully_reshardable saved from shifted offsets: refused
            check_buckets(path, args, family, model_sizes, topology, items, fragments, where)
        used = {f.tensor for f in fragments}
        layout = Layout(topology=topology, tensors=MappingProxyType({n: t for n, t in whole.tensors.items() if n in used}),
                        items=MappingProxyType(items), fragments=tuple(fragments))
        it = common.get("iteration")
        step = _group_step(common, common_at) if buckets is None else \
            _step_of((buckets.param_groups or [{}])[0].get("step"), path / ".metadata")
        progress = Progress(iteration=expect_step(it, "iteration", common_at) if it is not None else None,
                            step=step)
        # Per-layer _extra_state (Transformer Engine's FP8 metadata, or [None]): keyed by global layer, so a
        # torch_dist target at any tp/pp takes them as they are. A derived layout carries every bytes entry.
        verbatim += [_Verbatim(k, None, _entry_bytes(path, md, k, None)[0]) for k in md.byte_entries
                     if (derived and k != COMMON_ENTRY) or "._extra_state/shard_" in k]
        state = TorchDistState(args=args or {}, iteration=progress.iteration, extra_states=verbatim,
                               param_groups=buckets.param_groups if buckets else
                               common_param_groups(common, str(common_at)), common_entry=common_entry)
        if derived:
            state.common, state.chunks = carried_common(common, common_at), chunks
            state.planner_data = dict(md.planner_data)
        model = replace(carried, family=family.name if family else None,
                        hints=family.config_hints(args) if family and args and family.config_hints else {})
        return Source(format=self.name, path=path, spec_name=spec_name, spec=spec_ast, topology=topology,
                      sizes=model_sizes, layout=layout, where=where, model=model, progress=progress,
                      extra={TORCH_DIST_KEY: state})

    def target(self, source: Source, topology: Topology, *, spec: str | None = None,
               dist_optim: str | None = None) -> Target:
        """Megatron-core's torch_dist layout of ``source``'s model weights at ``topology`` (tp, pp, vpp, dp).

        The stored tensors are the global ones of the family's ``mcore-dist-<family>[-tied]``
        (vocabulary padded for the target tp; tied when the source stores no output
        projection of its own); the chunks are the boxes megatron-core's ranks
        write: each rank's tensors as the torch-format spec ``megatron-<family>[-tied]``
        places them, one chunk per layer, SwiGLU fc1 as one chunk per half,
        replicated tensors (norms) once, by the lowest rank (dp only changes the
        rank numbers and ``args``). With ``topology.zero`` 1 and optimizer state in
        the source, that state is written ``dp_reshardable`` for the distributed
        optimizer (``dist_optim_target.optimizer_target``: buckets from the target
        args' ``overlap_grad_reduce``/``ddp_bucket_size``, which the resumed run must
        use too); otherwise weights only (optimizer states reported as not carried).

        Raises:
          CheckpointFormatError: cp > 1, ep > 1 without zero=1; a source whose family is recorded nowhere, or has
            no torch_dist layout (mixtures of experts, Megatron-Bridge's Gemmas, OLMo 2: named, with the reason);
            missing sizes; what ``optimizer_target`` refuses.
        """
        from reshard.formats.megatron.args import _padded_vocab, megatron_args

        if spec is None and source.format == self.name and is_derived(source.spec_name):
            return derived_target(source, topology)
        bad = [f"{a}({topology.degree(a)})" for a in ("cp", "ep")
               if topology.degree(a) > 1 and (a, topology.zero) != ("ep", 1)]
        if bad:  # the distributed optimizer's buffers (zero=1) depend on ep; the weights do not
            raise CheckpointFormatError(f"the mcore-dist target writes tp, pp, vpp and dp; {', '.join(bad)} is not "
                                        "supported yet without zero=1 (torch_dist holds every expert whole, numbered "
                                        "globally: write it at ep=1 and megatron-core loads it at any ep)")
        family = require_family(source, "torch_dist stores each family's tensors its own way (layers stacked, "
                                "attention fused)") if spec is None else None
        if family is not None and not family.torch_dist:
            try:
                layout_spec(_spec_name(family, False))
            except SpecError as e:  # names the family and why it has no torch_dist layout
                raise CheckpointFormatError(f"{source.path}: {e}; convert to the megatron format instead") from None
        shaped = family or family_of(spec) or llama.FAMILY  # a given spec of no family: Llama's sizes and ranks
        tied = shaped.tied_in(source.layout.tensors)
        require_sizes(source, shaped.sizes, "mcore-dist")
        sizes = {k: int(source.sizes[k]) for k in shaped.sizes}
        src_args = carried_args(source)
        div = int(src_args.get("make_vocab_size_divisible_by") or source.sizes.get("vocab_div", 128))
        local = is_local(src_args) and shaped.experts if spec is None else "local" in spec.split("-")
        mtp = sizes.get("hf_layers", 0) > sizes.get("layers", 0) if spec is None else "mtp" in spec.split("-")
        grouped = is_grouped(src_args) if spec is None else "grouped" in spec.split("-")  # GroupedMLP experts
        spec_name = spec or _spec_name(shaped, tied, local, mtp, grouped)
        spec_ast = layout_spec(spec_name)
        whole = resolve(spec_ast, Topology(), sizes | {"vpad": _padded_vocab(sizes["vocab"], div, topology.tp)})
        ranks = resolve(layout_spec(megatron_spec_name(shaped, tied=tied, local=local, mtp=mtp)), topology,
                        sizes | {"vocab_div": div})
        boxes = chunk_boxes(whole, ranks, topology)
        frags_of: dict[str, list[Fragment]] = {}
        for f in whole.fragments:
            frags_of.setdefault(f.item.key, []).append(f)
        shapes = {it.key: info.shape for it, info in whole.items.items()}
        items: dict[Item, ItemInfo] = {}
        fragments: list[Fragment] = []
        chunks: dict[Item, Any] = {}
        for (key, offsets), (sizes_, rank) in sorted(boxes.items(), key=lambda kv: (kv[1][1], kv[0])):
            item = Item("model", (("rank", rank),), 0, PARAM, f"{key}@{','.join(map(str, offsets))}")
            mine = chunk_fragments(frags_of[key], shapes[key], offsets, sizes_, item)
            items[item] = ItemInfo(shape=sizes_, mapped=sum(math.prod(f.box.lengths) for f in mine), rule=key)
            fragments.extend(mine)
            chunks[item] = _Chunk(key, DcpChunk(offsets, sizes_), shapes[key], rank, item)
        used = {f.tensor for f in fragments}
        layout = Layout(topology=topology, tensors=MappingProxyType({n: t for n, t in whole.tensors.items() if n in used}),
                        items=MappingProxyType(items), fragments=tuple(fragments))
        args = megatron_args(sizes | {"vocab_div": div}, topology, base=src_args or None, tied=tied,
                             family=shaped.name, iteration=int(source.progress.iteration or 0))
        if family is not None and not src_args:  # rope base and scaling, epsilon: never Megatron's defaults
            try:
                args.update(family.args_from_config(source.model.config))
            except CheckpointFormatError as e:
                raise CheckpointFormatError(f"{source.path}: config.json: {e}") from None
            if family.experts and family.megatron_moe_args:  # the routing: from the config or hints
                args.update(family.megatron_moe_args(sizes, source.model.config or {}, source.model.hints,
                                                     source.path))
        if shaped.experts and is_local(args) != local:
            args["transformer_impl"] = "local" if local else "transformer_engine"
        args.update(experts_args(args, grouped) if shaped.experts else {})
        carried = source.extra.get(TORCH_DIST_KEY) if source.format == self.name else None
        verbatim = list(carried.extra_states if isinstance(carried, TorchDistState) and carried.extra_states
                        else extra_states(whole, sizes))
        state = TorchDistState(args=args, iteration=int(source.progress.iteration or 0),
                               common_entry=isinstance(carried, TorchDistState) and carried.common_entry)
        if dist_optim is not None and topology.zero != 1:
            raise CheckpointFormatError(f"dist_optim '{dist_optim}' is the distributed optimizer's format: give zero=1")
        if topology.zero == 1 and any(s != PARAM for s in source.layout.states):
            from reshard.formats.megatron.dist_optim_target import optimizer_target

            family = family or family_of(spec)  # a generated spec names the family (-grouped picks the experts)
            if family is None:
                raise CheckpointFormatError(f"{source.path}: the distributed optimizer's buckets follow the model "
                                            "family's layout; give no spec (or a generated one) to write its state")
            if sharding_of(args, dist_optim) == FULL:  # model space: the weights' chunks, per state
                (opt_items, opt_frags, opt_chunks, common), entries = full_target(source, family, args, items,
                                                                                  fragments, chunks), []
            else:
                opt_items, opt_frags, opt_chunks, entries, common = optimizer_target(source, family, args, sizes,
                                                                                     topology)
            items.update(opt_items)
            fragments.extend(opt_frags)
            chunks.update(opt_chunks)
            verbatim += entries
            state.common = {"checkpoint_version": state.checkpoint_version, "iteration": state.iteration, **common}
            layout = Layout(topology=topology, tensors=MappingProxyType(
                {n: t for n, t in whole.tensors.items() if n in {f.tensor for f in fragments}}),
                items=MappingProxyType(items), fragments=tuple(fragments))
        if state.common_entry:  # megatron-core 0.19's form, as the source holds it
            verbatim.append(common_bytes(state))
        extra = {"dcp": DcpWrite(chunks=chunks, verbatim=verbatim, planner_data={},
                                 naming=_Naming("", "", frozenset())), TORCH_DIST_KEY: state}
        return Target(format=self.name, spec_name=spec_name, spec=spec_ast, topology=topology, sizes=dict(source.sizes),
                      layout=layout, dtypes=dict.fromkeys(items, "float32"), model=carried_identity(source, family),
                      extra=extra)

    def files_of(self, target: Target) -> dict[Item, Path]:
        return DCP.files_of(target)

    def write(self, target: Target, out: Path, fill: Fill, session: WriteSession | None = None, *,
              only: Collection[Path] | None = None) -> list[Path]:
        """The DCP files as the ``dcp`` format writes them, then ``common.pt`` and ``metadata.json``."""
        out = Path(out)
        session = session or WriteSession()
        written = DCP.write(target, out, fill, session, only=only)
        if only:
            return written
        state = target.extra[TORCH_DIST_KEY]
        if not state.common_entry:  # else it is a DCP entry (common_state), written with the rest
            write_common(out / COMMON, state, session.open)
        (out / METADATA_JSON).write_text(json.dumps(metadata_json(state.common_entry)))
        # Not Megatron's: the model's identity as the source carried it, for later conversions (the dcp writer
        # may have written it already; writing it again is harmless, listing it twice is not).
        identity = [p for p in write_identity(out, target.model) if p not in written]
        return [*written, *([] if state.common_entry else [Path(COMMON)]), Path(METADATA_JSON), *identity]


def whole_tensors(spec_ast, sizes: Mapping[str, int]) -> tuple[Layout, dict[str, Item], dict[Item, list[Fragment]]]:
    """The torch_dist layout's global tensors (the spec at the trivial topology): the layout, each item by its
    key, and each item's fragments."""
    whole = resolve(spec_ast, Topology(), dict(sizes))
    frags_of: dict[Item, list[Fragment]] = {}
    for f in whole.fragments:
        frags_of.setdefault(f.item, []).append(f)
    return whole, {it.key: it for it in whole.items}, frags_of


def _tied(family: Family | None, args: Mapping[str, Any] | None, config: Any) -> bool:
    """Whether the output layer is the embedding: as the args say (Megatron ties unless
    ``untie_embeddings_and_output_weights``), else the carried config (the family's default)."""
    if args is not None:
        return not args.get("untie_embeddings_and_output_weights", False)
    if family is not None:
        return family.config_ties(config)
    return bool(config.get("tie_word_embeddings", False)) if isinstance(config, Mapping) else False


def _group_step(common: Mapping[str, Any], where: Path) -> int | None:
    """Adam's step count, which torch_dist keeps per param group in common.pt (the model-space formats)."""
    groups = common_param_groups(common, str(where))
    return _step_of(groups[0].get("step") if groups else None, where)


def _step_of(step: Any, where: Path) -> int | None:
    return None if step is None else expect_step(step, "optimizer param_groups[0]['step']", where)


def _read_json(path: Path) -> dict[str, Any]:
    data = read_json(path)
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object")
    return data


def _sizes(path: Path, common: Mapping[str, Any], md, given: Mapping[str, int],
           required: tuple[str, ...]) -> tuple[dict[str, int], Topology]:
    from reshard.formats.megatron.args import _sizes_from_args

    embedding = md.tensors.get(_EMBEDDING)
    if embedding is None or len(embedding.size) != 2:
        raise CheckpointFormatError(f"{path}: no 2-D '{_EMBEDDING}' in .metadata, so not a GPT checkpoint reshard "
                                    "reads")
    tp = len({c.offsets[0] for c in embedding.chunks}) or 1
    qkv = md.tensors.get("decoder.layers.self_attention.linear_qkv.weight")
    fc1 = md.tensors.get("decoder.layers.mlp.linear_fc1.weight")
    stacked = {"layers": qkv.size[0] if qkv is not None and len(qkv.size) == 3 else len(md.tensors)}
    args = _args_of(common)
    where = f"{common_where(path)}: args"
    if args is not None:
        topology = _parallel(args, common_where(path), stacked["layers"], tp)  # each stage holds a layer at least
        sizes = _sizes_from_args(args, given, topology, where)
        sizes.pop("vocab_div", None)
    else:
        where = f"{path}: .metadata"
        topology = Topology(tp=tp)
        sizes = given_sizes(given)
        sizes.setdefault("h", embedding.size[1])
        if qkv is not None and len(qkv.size) == 3:
            sizes.setdefault("layers", qkv.size[0])
        if fc1 is not None and len(fc1.size) == 3:
            sizes.setdefault("f", fc1.size[1] // 2)
        missing = [k for k in required if k not in sizes]
        if missing:
            raise CheckpointFormatError(f"{common_where(path)} holds no args, so the model sizes {', '.join(missing)} "
                                        "are unknown; give them as sizes")
    sizes["vpad"] = embedding.size[0]
    return check_sizes(sizes, where, counts=stacked), topology


def _args_of(common: Mapping[str, Any]) -> dict[str, Any] | None:
    """``common.pt``'s ``args`` as a dict, None when it has none."""
    args = common.get("args")
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    return dict(args) if isinstance(args, Mapping) else None


def _parallel(args: Mapping[str, Any] | None, where: Path, pp_hi: int, tp: int = 1) -> Topology:
    """The tp and pp the args record (``tp`` and 1 where they say nothing), each bounded."""
    if args is None:
        return Topology(tp=tp)
    where_ = f"{where}: args"
    tp = expect_int(args.get("tensor_model_parallel_size") or tp, "args.tensor_model_parallel_size", where_,
                    lo=1, hi=MAX_COUNT)
    pp = expect_int(args.get("pipeline_model_parallel_size") or 1, "args.pipeline_model_parallel_size", where_,
                    lo=1, hi=pp_hi)
    return Topology(tp=tp, pp=pp)


FORMAT = McoreDistFormat()
