"""``load_into``: fill a running job's model and optimizer from any checkpoint, each rank reading its bytes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reshard.api.planning import open_checkpoint
from reshard.api.sinks import StagedSink, copies_for, fill_threads, run_windows
from reshard.core.dtypes import itemsize
from reshard.core.chunks import through
from reshard.core.layout import MASTER, PARAM, Layout, common_views
from reshard.core.planner import plan as make_plan
from reshard.errors import PlanError, ReshardError
from reshard.execution.coalescing import RANK_LOAD
from reshard.execution.executor import ByteReader, PlanFill, uint_dtype
from reshard.formats.base import Source
from reshard.formats.module_view import module_layout
from reshard.formats.specs import source_family
from reshard.torch.shards import Shard, local_tensor, rank_layout, shard_of

__all__ = ["LoadReport", "load_into"]

_WINDOW = 64 << 20
"""Bytes read per window of one local shard: what a load holds in memory beyond the job's own tensors."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport:
    """What one rank loaded, and what it read to do it."""

    bytes_read: int
    """Tensor bytes this rank read from the checkpoint (metadata excluded)."""
    share: int
    """Bytes of the boxes this rank holds, in the checkpoint's dtypes: what it needs to read at least."""
    reads: int
    """Read calls made for them."""
    tensors: int
    """Local shards filled (model tensors and optimizer states)."""
    states: tuple[str, ...]
    """The checkpoint states they were filled from (``master`` or ``param`` for the model, then the
    optimizer's)."""
    missing: tuple[str, ...] = ()
    """Model keys the checkpoint does not hold, left as they were (``strict=False`` only)."""


@dataclass(frozen=True, slots=True)
class _Module:
    """The tensors of a family's transformers module that its files do not hold, or hold in other dims
    (``reshard.formats.module_view``): a model key of them is loaded from the logical tensors it holds."""

    whole: Layout
    """The module, unsharded (``module_layout``)."""
    parts: Mapping[str, frozenset[str]]
    """Each such key -> the logical tensors it holds."""
    turned: frozenset[str] = frozenset()
    """The keys of them that are a logical tensor's own name, held in other dims (GPT-2's Conv1D weights)."""

    @classmethod
    def of(cls, source: Source) -> _Module:
        family = source_family(source)
        if family is None or not (family.module_names() or family.module_turned()):
            return cls(whole=Layout(topology=source.topology, tensors={}, items={}, fragments=()), parts={})
        whole = module_layout(family, source.sizes, source.path)
        turned = {it.key for it in whole.items if family.names(it.key, family.module_turned())}
        viewed = ({it.key for it in whole.items} - set(whole.tensors)) | turned
        parts: dict[str, set[str]] = {}
        for f in whole.fragments:
            if f.item.key in viewed:
                parts.setdefault(f.item.key, set()).add(f.tensor)
        return cls(whole=whole, parts={k: frozenset(v) for k, v in parts.items()}, turned=frozenset(turned))

    def viewed(self, name: str, source: Source) -> bool:
        """Whether model key ``name`` is loaded through the module's tensor of that name."""
        return name in self.parts and (name not in source.layout.tensors or name in self.turned)

    def shape(self, name: str, source: Source) -> tuple[int, ...]:
        if self.viewed(name, source):
            return next(info.shape for it, info in self.whole.items.items() if it.key == name)
        return source.layout.tensors[name].shape

    def names(self, name: str, source: Source) -> frozenset[str]:
        """The checkpoint's tensors a model key of checkpoint name ``name`` is loaded from."""
        return self.parts[name] if self.viewed(name, source) else frozenset((name,))


def load_into(model: Any, optimizer: Any, src: str | Path, *,
              names: Mapping[str, str] | Callable[[str], str] | None = None,
              strict: bool = True, threads: int | None = None) -> LoadReport:
    """Fill ``model``'s (and ``optimizer``'s) tensors on this rank from checkpoint ``src``, reading only its bytes.

    Called on every rank of a job, after the model is parallelized (FSDP2 ``fully_shard``,
    ``parallelize_module``, a 2-D mesh) and the optimizer built, at any world size: each rank plans
    the boxes its DTensors hold against the checkpoint's layout and reads just those bytes (and the
    gaps of up to 16 KiB between them, read through as ``reshard.load`` reads: ``RANK_LOAD``). The
    state dicts are ``torch.distributed.checkpoint.state_dict``'s (``get_state_dict``, keyed by
    fully-qualified names, then ``set_state_dict``), so the result is what ``dcp.load`` gives from
    the same checkpoint converted to DCP: the model takes the checkpoint's fp32 master copy where it
    has one (else its weights), cast to the parameter's dtype as ``copy_`` casts; each Adam moment
    its own state; each parameter's ``step`` the checkpoint's (its optimizer's step or iteration
    count where it records no per-parameter step). The optimizer's hyperparameters (``lr``,
    betas, groups) are the job's own and are left as they are. No collective is needed beyond
    those ``set_state_dict`` makes.

    Args:
      model: the parallelized ``torch.nn.Module``.
      optimizer: its ``torch.optim.Optimizer``, or None to load the model only.
      src: a checkpoint of any supported format (Megatron, DeepSpeed, DCP, Hugging Face safetensors).
      names: the checkpoint's tensor name for a model fqn (a mapping or a function), where they differ;
        by default a key is its own name. Checkpoints of a model family name their tensors as Hugging
        Face does, whatever the framework stores, so a Megatron or DeepSpeed checkpoint of a Llama
        loads into ``LlamaForCausalLM`` as it is.
      strict: refuse a model key the checkpoint lacks and a checkpoint tensor the model lacks (False:
        leave the first as it is, ignore the second).
      threads: how many threads fill the tensors (default: 2, at most the usable cores). On a device other
        than the CPU, windows are filled into host staging buffers (pinned for CUDA) and copied to the
        tensors while the next ones fill.

    Returns:
      A ``LoadReport``: the bytes this rank read and its share.

    Raises:
      ReshardError: a tensor missing on either side, shapes that differ (naming the key and both
        shapes), an optimizer with no optimizer state in ``src``, or any error reading ``src``.

    >>> from reshard.torch import load_into                              # doctest: +SKIP
    >>> report = load_into(model, optimizer, "ckpt/iter_0000100")       # doctest: +SKIP
    >>> report.bytes_read, report.share                                 # doctest: +SKIP
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    threads = fill_threads(threads)
    source = open_checkpoint(src)
    held = {(f.tensor, f.state) for f in source.layout.fragments if f.item in source.where}
    opt_states = {s for _, s in held} - {PARAM, MASTER}
    if optimizer is not None and not opt_states:
        raise ReshardError(f"{source.path}: this {source.format} checkpoint holds no optimizer state (only the "
                           "model's weights); pass optimizer=None to load the model alone")
    msd = get_model_state_dict(model)
    rename = _renamer(names)
    module = _Module.of(source)
    shards, locals_, chosen, missing = _model_shards(msd, source, held, rename, module)
    problems = _shape_problems(shards, source, module)
    if strict and missing:
        problems += [f"model key '{k}'{_as(k, rename)} is not in the checkpoint" for k in missing]
    if strict:
        used = {n for s in shards for n in module.names(s.tensor, source)}
        problems += [f"checkpoint tensor '{n}' has no key in the model" for n in sorted(
            {t for t, s in held if s in (PARAM, MASTER) and not source.layout.tensors[t].blob} - used)]
    _refuse(problems, source)  # before the optimizer's state is made (DCP's state dict initializes it)
    osd = None
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer)
        _optimizer_shards(osd, source, held, rename, chosen, shards, locals_, problems, module)  # shapes: its params'
        _refuse(problems, source)
    bytes_read, share, reads = _fill(source, shards, locals_, module, threads)
    if osd is not None:
        _set_steps(osd, source, rename, chosen)
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    else:
        set_model_state_dict(model, msd)
    return LoadReport(bytes_read=bytes_read, share=share, reads=reads, tensors=len(shards),
                      states=tuple(sorted({s.state for s in shards}, key=lambda s: (s not in (MASTER, PARAM), s))),
                      missing=tuple(missing))


def _refuse(problems: list[str], source: Source) -> None:
    """Every problem found, in one error naming the checkpoint (the first 20 of them)."""
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ReshardError(f"{source.path}: cannot load this {source.format} checkpoint into the model:\n  "
                           + "\n  ".join(problems[:20]) + more)


def _renamer(names: Mapping[str, str] | Callable[[str], str] | None) -> Callable[[str], str]:
    if names is None:
        return lambda key: key
    if isinstance(names, Mapping):
        return lambda key: names.get(key, key)
    return names


def _as(key: str, rename: Callable[[str], str]) -> str:
    return "" if rename(key) == key else f" (checkpoint tensor '{rename(key)}')"


def _model_shards(msd: Mapping[str, Any], source: Source, held: set[tuple[str, str]],
                  rename: Callable[[str], str], module: _Module) -> tuple[list[Shard], dict, dict[str, str], list[str]]:
    """The model's shards: per group of keys sharing storage (a tied weight), one shard, filled from the
    first of their names the checkpoint holds, from its fp32 master where it has one (the copy FSDP2
    keeps), else its weights. Returns the shards, their local tensors by item, each key's checkpoint
    name (aliases included) and the keys the checkpoint lacks."""
    import torch

    groups: dict[Any, list[str]] = {}
    for key, value in msd.items():
        if torch.is_tensor(value):
            local = local_tensor(value)
            ident = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)) \
                if local.numel() else key
            groups.setdefault(ident, []).append(key)
    shards: list[Shard] = []
    locals_: dict = {}
    chosen: dict[str, str] = {}
    missing: list[str] = []
    for keys in groups.values():
        key = next((k for k in keys if _holds(source, held, rename(k), PARAM, msd[k], module)), None)
        if key is None:
            missing.append(keys[0])
            continue
        name = rename(key)
        chosen.update(dict.fromkeys(keys, name))
        shape, offsets, lengths = shard_of(key, msd[key])
        master = all((n, MASTER) in held for n in module.names(name, source))
        s = Shard(key=key, tensor=name, state=MASTER if master else PARAM, shape=shape,
                  offsets=offsets, lengths=lengths)
        shards.append(s)
        locals_[s.item] = local_tensor(msd[key])
    return shards, locals_, chosen, missing


def _optimizer_shards(osd: Mapping[str, Any], source: Source, held: set[tuple[str, str]],
                      rename: Callable[[str], str], chosen: Mapping[str, str], shards: list[Shard], locals_: dict,
                      problems: list[str], module: _Module) -> None:
    """Each parameter's optimizer state tensors (``exp_avg``, ...) as shards of the checkpoint's same state;
    the scalar ``step`` is set apart (``_set_steps``)."""
    import torch

    for key, per in osd.get("state", {}).items():
        name = chosen.get(key, rename(key))
        for state, value in per.items():
            if state == "step" or not torch.is_tensor(value):
                continue
            if not _holds(source, held, name, state, value, module):
                problems.append(f"optimizer state '{state}' of '{key}' is not in the checkpoint (it holds "
                                f"{sorted({s for t, s in held if t == name}) or 'nothing of that tensor'})")
                continue
            shape, offsets, lengths = shard_of(f"{key}.{state}", value)
            s = Shard(key=key, tensor=name, state=state, shape=shape, offsets=offsets, lengths=lengths)
            shards.append(s)
            locals_[s.item] = local_tensor(value)


def _holds(source: Source, held: set[tuple[str, str]], name: str, state: str, value: Any, module: _Module) -> bool:
    """Whether the checkpoint holds tensor ``name`` in ``state`` (the model's: in its master copy or its weights),
    or every tensor a fused one of the module holds; a tensor with no elements needs only to be there (it has no
    bytes in any state)."""
    if value.numel() == 0:
        return name in source.layout.tensors
    names = module.names(name, source)
    if state in (PARAM, MASTER):
        return all((n, MASTER) in held for n in names) or all((n, PARAM) in held for n in names)
    return all((n, state) in held for n in names)


def _shape_problems(shards: list[Shard], source: Source, module: _Module) -> list[str]:
    out = []
    for s in shards:
        have = module.shape(s.tensor, source)
        if have != s.shape:
            out.append(f"'{s.key}' [{s.state}]: the model's shape is {list(s.shape)}, the checkpoint's '{s.tensor}' "
                       f"is {list(have)}")
    return out


def _fill(source: Source, shards: list[Shard], locals_: Mapping, module: _Module,
          threads: int) -> tuple[int, int, int]:
    """Plan this rank's boxes against the checkpoint, prove the plan, and read each box into its local tensor
    window by window, on ``threads`` threads. Returns (bytes read, share in bytes, reads)."""
    import torch

    mine = rank_layout(shards)
    fused = {s.tensor for s in shards if module.viewed(s.tensor, source)}
    if fused:  # the module's fused and turned tensors, seen as the logical tensors the checkpoint holds
        mine = through(mine, module.whole, fused)
    src_layout, dst_layout = common_views(source.layout, mine)
    p = make_plan(src_layout, dst_layout)
    try:
        p.validate()
    except PlanError as e:
        raise PlanError(f"{source.path}: {e}") from None
    share = 0
    with ByteReader() as reader, torch.no_grad():
        fill = PlanFill(p, source.where, reader, coalescing=RANK_LOAD)
        windows = {s.item: _windows(s, locals_[s.item], itemsize(fill.dtypes[s.item])) for s in shards if s.numel}
        fill.fit_gaps([w for ws in windows.values() for w in ws])
        tasks = []
        for s in shards:
            if not s.numel:
                continue
            local = locals_[s.item]
            share += s.numel * itemsize(fill.dtypes[s.item])
            if local.is_contiguous():
                flat = local.view(-1)
                tasks += [(s.item, flat, lo, hi) for _, lo, hi in windows[s.item]]
            else:  # a strided view (a transposed module tensor): read whole, then copied into it
                as_torch = getattr(torch, fill.dtypes[s.item])
                local.copy_(torch.frombuffer(bytearray(fill(s.item, 0, s.numel)), dtype=as_torch).reshape(s.lengths))
        # a device's tensors are filled through its staging buffers
        staged = {d: _staged(torch, d, threads) for d in dict.fromkeys(t[1].device for t in tasks if not _on_host(t[1]))}

        def task(job: tuple[Any, Any, int, int]) -> None:
            item, flat, lo, hi = job
            dtype = fill.dtypes[item]
            as_torch = getattr(torch, dtype)
            sink = staged.get(flat.device) if staged else None
            with torch.no_grad():  # grad mode is per thread
                if sink is not None:  # read as stored, cast to the module's dtype by the copy
                    with sink.window(flat, lo, hi, as_torch) as out:
                        fill.fill_into(item, lo, hi, out.view(uint_dtype(dtype)))
                elif flat.dtype == as_torch:  # in place: the stored bits, as they are
                    fill.fill_into(item, lo, hi, flat[lo:hi].view(torch.uint8).numpy().view(uint_dtype(dtype)))
                else:
                    flat[lo:hi].copy_(torch.frombuffer(fill(item, lo, hi), dtype=as_torch))

        try:
            run_windows(task, tasks, threads)
        except BaseException:
            for sink in staged.values():  # no copy left writing into the module's tensors
                sink.finish(quiet=True)
            raise
        for sink in staged.values():
            sink.finish()
        return reader.bytes_read, share, reader.reads


def _on_host(local: Any) -> bool:
    """Whether a module's tensor is filled in host memory, else through staging buffers."""
    return local.device.type == "cpu"


def _staged(torch: Any, device: Any, threads: int) -> StagedSink:
    """The staging buffers of one device's tensors: windows fill while the last ones are copied."""
    sink = StagedSink(torch, device, threads, _WINDOW, copies_for(torch, device))
    sink.ready()
    return sink


def _windows(s: Shard, local: Any, size: int) -> list[tuple[Any, int, int]]:
    """The windows ``(item, lo, hi)`` a local tensor is filled in: ``_WINDOW`` bytes each where it is contiguous,
    else one for the whole."""
    if not local.is_contiguous():
        return [(s.item, 0, s.numel)]
    step = max(1, _WINDOW // size)
    return [(s.item, lo, min(s.numel, lo + step)) for lo in range(0, s.numel, step)]


def _set_steps(osd: Mapping[str, Any], source: Source, rename: Callable[[str], str],
               chosen: Mapping[str, str]) -> None:
    """Each parameter's Adam ``step``, as a DCP checkpoint of ``source`` records it: its param group's step
    where the checkpoint keeps its optimizer's groups (DCP, DeepSpeed), else the checkpoint's step or
    iteration count."""
    import torch

    from reshard.formats.dcp import optimizer_groups as dcp_groups
    from reshard.formats.deepspeed import optimizer_groups as ds_groups

    per_name: dict[str, Any] = {}
    for g in dcp_groups(source) or ds_groups(source):
        if g.step is not None:
            value = g.step.to_torch()
            per_name.update(dict.fromkeys(g.params, value))
    default = torch.tensor(source.progress.step_count, dtype=torch.float32)
    for key, per in osd.get("state", {}).items():
        step = per.get("step")
        if step is None:
            continue
        value = per_name.get(chosen.get(key, rename(key)), default)
        if torch.is_tensor(step):
            step.copy_(value)
        else:
            per["step"] = type(step)(value.item())
