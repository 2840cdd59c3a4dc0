"""Megatron-LM checkpoints in the torch format (``--ckpt-format torch``).

On disk (``megatron/training/checkpointing.py :: get_checkpoint_name``,
``get_checkpoint_tracker_filename``, ``get_distributed_optimizer_checkpoint_name``)::

    <dir>/latest_checkpointed_iteration.txt           the iteration, or 'release'
    <dir>/iter_{it:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt
    <dir>/iter_{it:07d}/mp_rank_{tp:02d}[_{pp:03d}]/distrib_optim.pt   with --use-distributed-optimizer

(``release/`` instead of ``iter_…`` for release checkpoints; the pp suffix only when
pp > 1, the ep suffix only when ep > 1.) Each ``model_optim_rng.pt`` is the dict
``generate_state_dict`` builds on data-parallel rank 0 of one (tp, pp) rank, or, with
expert parallelism, on expert-data-parallel rank 0 of one (tp, pp, ep) rank: its local
experts (``local_experts.0`` … ``E/ep - 1``, global expert ``ep_rank * E/ep + j``) and a
replica of every dense weight. In this key order: ``args`` (an ``argparse.Namespace``),
``checkpoint_version`` (3.0), ``iteration``, ``model`` (or ``model0``, ``model1``, … with
a virtual pipeline; each an ``OrderedDict`` state dict with stage-local layer numbers and
TE ``_extra_state`` entries), ``optimizer``, ``opt_param_scheduler``, ``rng_state``
(a list of one ``get_rng_state`` dict, or one per dp rank with
``--data-parallel-random-init``), ``num_floating_point_operations_so_far``.

Megatron-LM's legacy GPTModel (``--use-legacy-models``) nests its state dict
(``language_model`` -> ``embedding`` -> ``word_embeddings`` -> ``weight``; the
encoder's layers flat inside ``encoder``); it is read flattened with '/' between the
levels, which is how the ``megatron-legacy-llama`` spec names its tensors, and
written nested again.

``optimizer`` is ``optimizer.state_dict()``:

- mixed precision (``Float16OptimizerWithFloat16Params.state_dict``):
  ``{'optimizer': torch_state_dict, ['grad_scaler': …,] 'fp32_from_fp16_params': [[fp32 main
  param, …] per param group]}``; ``torch_state_dict`` is ``{'state': {index: {'step',
  'exp_avg', 'exp_avg_sq', …}}, 'param_groups': [{…, 'params': [index, …]}]}``. Indices
  count params group after group; a group holds, in ``named_parameters`` order over the
  model chunks, the params with weight decay (``wd_mult`` 1) or without (1-D params and
  biases, ``wd_mult`` 0) (``megatron/core/optimizer/__init__.py :: _get_param_groups``).
- fp32 (``FP32Optimizer.state_dict``): the torch state dict itself.
- MoE at ep > 1: ``[dense, expert]``, one of the above each (``ChainedOptimizer``): expert
  params are not ``allreduce`` params there, so ``get_megatron_optimizer`` gives them an
  optimizer of their own, with its own indices and param groups (``is_expert_parallel``).
  At ep = 1 they are ordinary params of the one optimizer.
- distributed (``DistributedOptimizer.state_dict``): ``{'optimizer': {'param_groups': […]
  without 'params', with 'step'}, ['grad_scaler': …]}``; the tensors are in
  ``distrib_optim.pt`` (``save_parameter_state`` / ``get_parameter_state_dp_zero``):
  ``{'buckets_coalesced': True, gbuf_idx: {(param_dtype, grad_dtype): {'param', 'exp_avg',
  'exp_avg_sq', 'numel_unpadded'}}}``, one buffer per model chunk, laid out as
  MEGATRON-DISTOPT.md §2/§4 and ``specs/megatron-llama-distopt-torch.spec`` say. MoE at
  ep > 1 chains a dense and an expert DistributedOptimizer: ``optimizer`` is a list of two
  such dicts and ``distrib_optim.pt`` the list ``[dense, expert]`` (``save_parameter_state``),
  the dense entry ``None`` except in the ep rank 0 file; expert buffers hold only expert
  params (``megatron-mixtral-ep-distopt-torch``).

Mapping. Every tensor of a model chunk is a layout item of section ``model`` (state
``param``); fp32 main params are state ``master`` and per-parameter optimizer tensors keep
their names (``exp_avg``, …), read from the file, not assumed. With the distributed
optimizer they are the items of section ``optim``, keys ``distrib_optim.<state>``. A
tensor no rule maps is an error naming the file and the key (fail closed), and so is an
item no file holds.

Non-tensor state goes to ``Source.extra`` (see ``MegatronFormat.open``). Small non-model
tensors inside it (rng states, per-parameter ``step``, a loss scale, TE ``_extra_state``)
are read into ``SmallTensor``s, at most ``SMALL_TENSOR_LIMIT`` bytes each; model and
optimizer tensors are never read by ``open``.

Use::

    source = FORMAT.open("ckpt/")                        # pickles only, no tensor data
    target = FORMAT.target(source, parse_topology("tp=4,pp=2,dp=8,zero=1"))
    FORMAT.write(target, out_dir, fill)                  # fill(item, lo, hi) -> the item's bytes

``zero=1`` in the target topology selects the distributed optimizer (and a ``-distopt``
spec); without it the optimizer is written per parameter. ``write_fixture_extra`` makes
the non-tensor state of a fresh run, for fixtures written from scratch.

Models: Llama style (SwiGLU, RMSNorm, no biases, rotary; ``megatron-llama*`` specs) and
GPT-2 style (``args.swiglu`` false, ``normalization`` LayerNorm, ``add_bias_linear``,
``position_embedding_type`` learned_absolute: per-head QKV with biases, LayerNorm biases,
``embedding.position_embeddings`` on the first stage, output layer tied;
``megatron-gpt2*`` specs, sizes with ``positions`` from ``max_position_embeddings``), and
Mixtral-style MoE (``--num-experts`` with SequentialMLP experts over any ep, untied, plain or
distributed optimizer; ``megatron-mixtral*``, ``-local`` with ``--transformer-impl local``,
``moe_spec`` picks one; sizes with ``experts``).

Not supported yet (each raises ``CheckpointFormatError`` saying so): ``--moe-grouped-gemm``
experts, experts with their own tp (``--expert-tensor-parallel-size`` other than tp), MoE
with tied embeddings, context parallelism > 1, torch_dist/DCP
checkpoints, other ``ChainedOptimizer``s than the dense + expert pair,
distrib_optim.pt files before ``buckets_coalesced`` (megatron-core < 0.7),
``--ddp-num-buckets``, param groups other than the standard weight-decay split (e.g.
``--decoupled-lr``), GPT-2 style with an untied output layer or grouped-query
attention, tied embeddings with pp > 1 and the distributed optimizer when the
output layer's shard is not a multiple of 64 elements (its own-bucket rule then moves
the next parameter), ``--account-for-embedding/loss-in-pipeline-split``. Not reproduced:
the state dicts' ``_metadata`` (module versions; ``load_state_dict`` does not need them),
and ``_extra_state`` when the source is not Megatron (Megatron's loader tolerates its
absence). Layout rules are those of megatron-core >= 0.13 (MEGATRON-DISTOPT.md §7).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from reshard.io.bounds import brief
from reshard.core.catalog import load_spec
from reshard.errors import CheckpointFormatError, ReshardError, TopologyError
from reshard.core.dtypes import SUPPORTED
from reshard.formats.base import (LLAMA_SIZES, MAX_COUNT, MAX_SIZE, Fill, Located, Source, Target,
                                  check_sizes, expect_int, given_sizes, itemsize, read_tag, require_sizes, scalar_value,
                                  stream_item)
from reshard.core.layout import Item, Layout
from reshard.core.resolve import resolve
from reshard.core.spec import Flat, Section, Spec
from reshard.core.topology import Topology, parse_topology
from reshard.io.torchfile import Opaque, TensorRef, TensorSpec, TorchDtype, TorchFileWriter, map_tensors, read_torch_file

__all__ = ["FORMAT", "MegatronFormat", "SmallTensor", "megatron_args", "write_fixture_extra"]

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DISTOPT_FILE = "distrib_optim.pt"
CHECKPOINT_VERSION = 3.0
WINDOW_BYTES = 8 << 20
"""Largest window asked of ``fill`` at once, in bytes."""
SMALL_TENSOR_LIMIT = 1 << 20
"""Largest non-model tensor (rng state, step, TE extra state) ``open`` reads, in bytes."""
DEFAULT_SEED = 1234  # Megatron's --seed default

GPT2_SPEC = "megatron-gpt2"
"""Shipped spec of GPT-2-style models (LayerNorm, biases, learned positions, tied output layer)."""
GPT2_DISTOPT_SPEC = "megatron-gpt2-distopt-torch"
"""The same with the distributed optimizer's coalesced ``distrib_optim.pt``."""
SPECS = {
    (False, False): "megatron-llama",
    (True, False): "megatron-llama-tied",
    (False, True): "megatron-llama-distopt-torch",
    (True, True): "megatron-llama-tied-distopt-torch",
}
"""Shipped spec per (tied embeddings, distributed optimizer)."""
MOE_SPEC = "megatron-mixtral"
"""Megatron-core GPT with SequentialMLP experts over ep, untied, plain optimizer (Transformer Engine layers)."""
MOE_LOCAL_SPEC = "megatron-mixtral-local"
"""The same with megatron-core's local layers (``--transformer-impl local``)."""


def moe_spec(local: bool, distopt: bool, ep: int) -> str:
    """The shipped MoE spec: TE or local layers; with the distributed optimizer, one buffer over every param at
    ep = 1, a dense and an expert buffer at ep > 1."""
    base = MOE_LOCAL_SPEC if local else MOE_SPEC
    return base if not distopt else f"{base}-distopt-torch" if ep == 1 else f"{base}-ep-distopt-torch"


_MOE_LOCAL_SPECS = {moe_spec(True, d, ep) for d in (False, True) for ep in (1, 2)}
# The distrib_optim.pt buffers each flat section holds: the dense optimizer's, or the expert optimizer's.
_FLAT_NAMES = {"optim": "distrib_optim", "expert_optim": "expert_distrib_optim"}
LEGACY_SPEC = "megatron-legacy-llama"
"""Megatron-LM's legacy GPTModel (nested ``language_model`` state dict), untied, plain optimizer."""

# Megatron's file key for the fp32 main params in distrib_optim.pt, and our state name for them.
_MAIN = ("param", "master")
# The rng trackers model_parallel_cuda_manual_seed adds, in its order (megatron/core/tensor_parallel/random.py).
_TRACKERS = ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")
# get_rng_state's entries, in its order.
_RNG_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")


@dataclass(frozen=True, slots=True)
class SmallTensor:
    """A small non-model tensor carried as bytes (rng state, step, loss scale, TE extra state)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes = b""

    @staticmethod
    def scalar(value: float, dtype: str = "float32") -> SmallTensor:
        return SmallTensor(dtype, (), np.array(value, dtype=dtype).tobytes())

    def value(self) -> float:
        value = scalar_value(self.data, self.dtype) if self.shape in ((), (1,)) else None
        if value is None:
            raise CheckpointFormatError(f"a {self.dtype} {list(self.shape)} tensor where a number (step) was expected")
        return value


# --- reading ---------------------------------------------------------------------------


def _is_tensor(obj: Any) -> bool:
    return type(obj) is TensorRef


def _dtype_name(dtype: Any) -> str:
    """'bfloat16' from a TensorRef's dtype or a pickled ``torch.bfloat16`` (a TorchDtype)."""
    return dtype.name if isinstance(dtype, TorchDtype) else dtype if isinstance(dtype, str) else brief(dtype, 40)


def _namespace(obj: Any, where: str) -> dict[str, Any]:
    """The attributes of a pickled ``argparse.Namespace`` as a dict."""
    if isinstance(obj, argparse.Namespace):
        return dict(vars(obj))
    raise CheckpointFormatError(f"{where}: 'args' is {type(obj).__name__}, expected an argparse.Namespace")


@dataclass(slots=True)
class _Rank:
    tp: int
    pp: int
    ep: int
    path: Path  # model_optim_rng.pt
    obj: dict
    distopt: Any = None  # the distrib_optim.pt tree
    distopt_path: Path | None = None


class MegatronFormat:
    """Megatron-LM torch-format checkpoints; see the module docstring."""

    name = "megatron"

    def detect(self, path: Path) -> bool:
        path = Path(path)
        try:
            it_dir = _iteration_dir(path)[0]
        except CheckpointFormatError:  # a broken tracker beside iteration directories: open names what is wrong
            return (path / TRACKER).is_file() and any(re.fullmatch(r"iter_[0-9]{7,}|release", p.name)
                                                       for p in path.iterdir())
        return any(p.name.startswith("mp_rank_") and (p / MODEL_FILE).is_file() for p in it_dir.iterdir())

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read every rank file's pickle (no tensor data) and map each tensor to a layout item.

        ``Source.extra`` holds:

        - ``args``: the ``argparse.Namespace`` attributes of rank (tp 0, pp 0), as a dict;
        - ``iteration``, ``release``, ``checkpoint_version``;
        - ``top_keys``: the file's top-level keys in order;
        - ``other``: other top-level entries (``num_floating_point_operations_so_far``,
          ``rerun_state_machine``, …) of rank (0, 0), tensors as ``SmallTensor``;
        - ``opt_param_scheduler``;
        - ``optimizer``: ``kind`` (``fp16``, ``fp32``, ``distributed`` or None),
          ``param_groups`` (without ``params``), ``grad_scaler``, ``step`` (the per-parameter
          ``step`` all parameters share, or None), ``state_keys`` (per-parameter state key
          order), ``buffer_dtypes`` (distributed: ``(param_dtype, grad_dtype)`` names);
        - ``rng_state``: per ``(tp, pp, ep)``, the file's ``rng_state`` tree;
        - ``extra_state``: per ``_extra_state`` key with global layer and expert numbers, per tp rank,
          its value.

        Args:
          path: the save directory (with ``latest_checkpointed_iteration.txt``) or an
            ``iter_XXXXXXX``/``release`` directory.
          spec: a spec name or path instead of the one chosen from ``args``.
          sizes: model sizes overriding or completing ``args`` (``vocab`` when ``args`` lacks
            ``vocab_size``).

        Raises:
          CheckpointFormatError: a missing, extra or inconsistent rank file, an unsupported
            feature, or a tensor no rule maps, naming the file and the key.
        """
        path = Path(path)
        it_dir, iteration, release = _iteration_dir(path)
        if (it_dir / "metadata.json").exists() or (it_dir / ".metadata").exists():
            raise CheckpointFormatError(
                f"{it_dir}: a torch_dist/DCP checkpoint (metadata.json/.metadata); the megatron format reads "
                "--ckpt-format torch checkpoints (mp_rank_* directories) only")
        first_path = _rank0_file(it_dir)
        first = _read(first_path)
        if "args" not in first:
            raise CheckpointFormatError(f"{first_path}: no 'args', so the topology and model sizes are unknown")
        args = _namespace(first["args"], str(first_path))
        topo = _topology_from_args(args, str(first_path), sum(p.name.startswith("mp_rank_") for p in it_dir.iterdir()))
        ranks = self._read_ranks(it_dir, topo, first_path, first, iteration)
        distopt = bool(args.get("use_distributed_optimizer"))
        if distopt:
            topo = replace(topo, zero=1)
        model_sizes = _sizes_from_args(args, sizes or {}, topo, str(first_path))
        tied = not args.get("untie_embeddings_and_output_weights", False)
        if spec is None and _is_gpt2(args):
            if not tied:
                raise CheckpointFormatError(
                    f"{first_path}: GPT-2-style models are supported with the output layer tied to the embedding "
                    "(args.untie_embeddings_and_output_weights is True); give a spec for this one")
            spec = GPT2_DISTOPT_SPEC if distopt else GPT2_SPEC
        if spec is None and not args.get("swiglu", False):
            raise CheckpointFormatError(
                f"{first_path}: args.swiglu is False; the shipped megatron specs are Llama-style (SwiGLU, RMSNorm, "
                "no biases) or GPT-2-style (LayerNorm, biases, learned positions). Give a spec for this model")
        if spec is None and args.get("num_experts"):
            if tied:
                raise CheckpointFormatError(
                    f"{first_path}: a mixture-of-experts model with tied embeddings; the shipped {MOE_SPEC} specs are "
                    "untied: give a spec for this one")
            spec = moe_spec(args.get("transformer_impl") == "local", distopt, topo.ep)
        if spec is None and _is_legacy(first):
            if tied or distopt:
                raise CheckpointFormatError(
                    f"{first_path}: a legacy (non-mcore) model with {'tied embeddings' if tied else ''}"
                    f"{' and ' if tied and distopt else ''}{'the distributed optimizer' if distopt else ''}; the "
                    f"shipped {LEGACY_SPEC} spec is untied with Megatron's plain optimizer: give a spec for this one")
            spec = LEGACY_SPEC
        spec_name = spec or SPECS[(tied, distopt)]
        spec_ast = load_spec(spec_name)
        per_ep = _per_ep(spec_ast)
        if topo.ep > 1 and not per_ep:
            raise CheckpointFormatError(
                f"{first_path}: expert_model_parallel_size={topo.ep}, but spec {spec_name} has no section per ep")
        reader = _Reader(ranks, topo, spec_name, per_ep, model_sizes.get("experts", 0))
        stored = sum(len(ps) for ps in reader.params.values())  # each layer and expert holds a tensor at least
        model_sizes = check_sizes(model_sizes, f"{first_path}: args", counts={"layers": stored, "experts": stored})
        model_sizes["bucket_size"] = _bucket_size(args, topo) if distopt else 0
        # Weights first, so an unknown tensor is named before the optimizer's structure is judged.
        layout = _resolve(spec_ast, topo, model_sizes, {"model": ("param",), "optim": (), "expert_optim": ()})
        where = reader.map(layout)
        opt_states = reader.optimizer_states()
        if opt_states:
            states = {"model": ("param", *opt_states)} if not distopt else \
                {"model": ("param",), "optim": opt_states, "expert_optim": opt_states}
            layout = _resolve(spec_ast, topo, model_sizes, states)
            where = reader.map(layout)
        extra = reader.extra(args, layout)
        extra.update(iteration=iteration, release=release,
                     checkpoint_version=first.get("checkpoint_version", CHECKPOINT_VERSION),
                     config_hints=config_hints(args))
        return Source(format=self.name, path=path, spec_name=spec_name, spec=spec_ast, topology=topo,
                      sizes=model_sizes, layout=layout, where=where, extra=extra)

    def _read_ranks(self, it_dir: Path, topo: Topology, first_path: Path, first: dict,
                    iteration: int | None) -> dict[tuple[int, int, int], _Rank]:
        expected = {_rank_dir_name(t, p, topo.pp, e, topo.ep): (t, p, e)
                    for t in range(topo.tp) for p in range(topo.pp) for e in range(topo.ep)}
        found = {p.name for p in it_dir.iterdir() if p.name.startswith("mp_rank_") and p.is_dir()}
        missing = sorted(n for n in expected if not (it_dir / n / MODEL_FILE).is_file())
        if missing:
            raise CheckpointFormatError(
                f"{it_dir}: missing rank file {missing[0]}/{MODEL_FILE}"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; args say "
                f"tensor_model_parallel_size={topo.tp}, pipeline_model_parallel_size={topo.pp}"
                f"{f', expert_model_parallel_size={topo.ep}' if topo.ep > 1 else ''}")
        extra = sorted(found - set(expected))
        if extra:
            raise CheckpointFormatError(
                f"{it_dir}: unexpected rank directory {extra[0]}; args say tensor_model_parallel_size={topo.tp}, "
                f"pipeline_model_parallel_size={topo.pp}, expert_model_parallel_size={topo.ep} "
                f"({', '.join(sorted(expected))})")
        ranks: dict[tuple[int, int, int], _Rank] = {}
        first_it = first.get("iteration")
        if iteration is not None and first_it is not None and first_it != iteration:
            raise CheckpointFormatError(
                f"{first_path}: iteration {brief(first_it)}, but {TRACKER} says {iteration}; the checkpoint mixes "
                "iterations")
        for name, (t, p, e) in sorted(expected.items(), key=lambda kv: (kv[1][1], kv[1][2], kv[1][0])):
            fpath = it_dir / name / MODEL_FILE
            obj = first if fpath == first_path else _read(fpath)
            if obj.get("iteration") != first_it:
                raise CheckpointFormatError(
                    f"{fpath}: iteration {brief(obj.get('iteration'))}, but {first_path} has iteration "
                    f"{brief(first_it)}; "
                    "the checkpoint mixes iterations")
            if "args" in obj and fpath != first_path:
                a = _namespace(obj["args"], str(fpath))
                got = (a.get("tensor_model_parallel_size"), a.get("pipeline_model_parallel_size"),
                       a.get("expert_model_parallel_size") or 1)
                if got != (topo.tp, topo.pp, topo.ep):
                    raise CheckpointFormatError(
                        f"{fpath}: args say (tp, pp, ep) = {brief(got)}, but {first_path} says "
                        f"tp={topo.tp}, pp={topo.pp}, ep={topo.ep}")
            rank = _Rank(t, p, e, fpath, obj)
            dpath = it_dir / name / DISTOPT_FILE
            if dpath.is_file():
                rank.distopt, rank.distopt_path = _read(dpath, model=False), dpath
            ranks[(t, p, e)] = rank
        with_opt = [r for r in ranks.values() if r.distopt is not None]
        if with_opt and len(with_opt) != len(ranks):
            lacking = next(r for r in ranks.values() if r.distopt is None)
            raise CheckpointFormatError(f"{lacking.path.parent}: missing {DISTOPT_FILE} (other ranks have one)")
        args = _namespace(first["args"], str(first_path))
        if with_opt and not args.get("use_distributed_optimizer", False):
            raise CheckpointFormatError(
                f"{with_opt[0].distopt_path}: found, but args.use_distributed_optimizer is False")
        if (args.get("use_distributed_optimizer") and not args.get("no_save_optim") and "optimizer" in first
                and not with_opt):
            raise CheckpointFormatError(
                f"{it_dir}: args.use_distributed_optimizer is True and the optimizer was saved, but no rank has "
                f"{DISTOPT_FILE}")
        return ranks

    # -- target

    def target(self, source: Source, topology: Topology, *, spec: str | None = None,
               vocab_pad: str | None = None) -> Target:
        """The layout and non-tensor state of ``source``'s model written as Megatron at ``topology``.

        ``vocab_pad`` fills the rows that pad the vocabulary to a multiple of
        ``make_vocab_size_divisible_by * tp``: ``zero``, or ``last`` (copies of the last
        real row, as Megatron's ``tools/checkpoint`` pads when it grows a vocabulary);
        None keeps the spec's own pad policy (the shipped specs pad with zeros).

        The distributed optimizer is used when ``topology.zero`` is 1 (``zero=1`` in a
        topology string) or ``spec`` names a ``-distopt`` spec. ``Target.extra`` holds what
        ``write`` needs besides item bytes: ``args`` (updated for the topology),
        ``iteration``, ``checkpoint_version``, ``opt_param_scheduler``, ``optimizer``,
        per-(tp, pp, ep) ``rng_state``, per-(tp, pp, ep, chunk) ``model_order`` (keys, with
        ``_extra_state`` values), ``other`` and ``top_keys``. A mixture-of-experts target at
        ep > 1 gets the dense + expert optimizer pair (``expert_param_groups``).

        RNG state is carried from the source rank with the same (tp, pp, ep) when tp, pp and
        ep are unchanged (and dp too with ``--data-parallel-random-init``); otherwise it is the
        state ``_set_random_seed(args.seed)`` gives that rank at the start of a run
        (``megatron/training/initialize.py``): python ``random``, numpy and torch CPU
        generators seeded ``seed + 100 * pp_rank`` (``+ 10 * dp_rank`` with
        data_parallel_random_init), the CUDA default state and the rng trackers
        ``data-parallel-rng`` (seed), ``model-parallel-rng`` (seed + 2718 + tp_rank),
        ``expert-parallel-rng`` (seed + 1024 + 100 * ep_rank + tp_rank) with offset 0
        (``model_parallel_cuda_manual_seed``).
        """
        if "transformer.wte.weight" not in source.layout.tensors:
            require_sizes(source, LLAMA_SIZES, "megatron")
        if topology.zero > 1:
            raise CheckpointFormatError(f"zero={topology.zero}: Megatron's distributed optimizer is ZeRO-1 (zero=1)")
        if topology.cp > 1:
            raise CheckpointFormatError(f"{topology}: the megatron format does not support cp > 1 yet")
        meg = source.format == self.name and "args" in source.extra  # else: synthesize Megatron's state
        src_args = dict(source.extra.get("args", {})) if meg else {}
        sizes = {k: v for k, v in source.sizes.items() if k != "bucket_size"}
        sizes.setdefault("vocab_div", src_args.get("make_vocab_size_divisible_by") or 128)
        tied = (not src_args.get("untie_embeddings_and_output_weights", False)) if meg else \
            "lm_head.weight" not in source.layout.tensors
        gpt2 = "transformer.wte.weight" in source.layout.tensors
        gpt2_spec = GPT2_DISTOPT_SPEC if topology.zero == 1 else GPT2_SPEC
        legacy = meg and source.spec_name == LEGACY_SPEC and spec is None
        moe = "experts" in source.sizes
        if moe and spec is None and tied:
            raise CheckpointFormatError(f"the shipped {MOE_SPEC} specs are untied; tied embeddings need a spec of "
                                        "their own")
        local = meg and source.spec_name in _MOE_LOCAL_SPECS
        spec_name = spec or (LEGACY_SPEC if legacy else moe_spec(local, topology.zero == 1, topology.ep) if moe else
                             gpt2_spec if gpt2 else SPECS[(tied, topology.zero == 1)])
        spec_ast = load_spec(spec_name)
        distopt = _has_flat(spec_ast)
        per_ep = _per_ep(spec_ast)
        if topology.ep > 1 and not per_ep:
            raise CheckpointFormatError(
                f"{topology}: ep > 1 needs a mixture-of-experts spec with sections per ep; {spec_name} has none")
        flats = _flat_sections(spec_ast)
        if distopt and "expert_optim" in flats and topology.ep == 1:
            raise CheckpointFormatError(
                f"spec {spec_name} gives experts a buffer of their own, but at ep=1 Megatron keeps them in the dense "
                f"buffer (they are allreduce params); use {moe_spec(spec_name in _MOE_LOCAL_SPECS, True, 1)}")
        if distopt and moe and topology.ep > 1 and "expert_optim" not in flats:
            raise CheckpointFormatError(
                f"spec {spec_name} keeps experts in the dense buffer, but at ep={topology.ep} Megatron gives them an "
                f"optimizer of their own; use {moe_spec(spec_name in _MOE_LOCAL_SPECS, True, topology.ep)}")
        if legacy and topology.zero == 1:
            raise CheckpointFormatError(f"zero=1: the shipped {LEGACY_SPEC} spec has no distributed optimizer; "
                                        "give a spec for the legacy model's buckets")
        topology = replace(topology, zero=1 if distopt else 0)
        src_states = [s for s in source.layout.states if s != "param"]
        opt_states = (("master",) if "master" in src_states else ()) + tuple(sorted(set(src_states) - {"master"}))
        if distopt and opt_states and "master" not in opt_states:
            raise CheckpointFormatError(
                f"the distributed optimizer stores fp32 main params (state 'master'), which {source.path} lacks "
                f"(it has {', '.join(opt_states)})")
        states = {"model": ("param",), "optim": opt_states, "expert_optim": opt_states} if distopt else \
            {"model": ("param", *opt_states)}
        args = megatron_args(sizes, topology, base=src_args, tied=tied)
        if not meg and not gpt2:
            args.update(_args_from_config(source.extra.get("config")))
        if moe and not meg:
            args.update(_moe_args(source, sizes))
        if (spec_name == LEGACY_SPEC) != (meg and source.spec_name == LEGACY_SPEC):  # the model class changes
            args.update(use_legacy_models=spec_name == LEGACY_SPEC, use_mcore_models=spec_name != LEGACY_SPEC)
        if moe and (spec_name in _MOE_LOCAL_SPECS) != local:
            args["transformer_impl"] = "local" if spec_name in _MOE_LOCAL_SPECS else "transformer_engine"
        sizes["bucket_size"] = _bucket_size(args, topology) if distopt else 0
        if vocab_pad is not None:
            if vocab_pad not in ("zero", "last"):
                raise CheckpointFormatError(f"vocab_pad '{vocab_pad}': expected zero or last")
            spec_ast = _with_vocab_pad(spec_ast, vocab_pad)
        layout = _resolve(spec_ast, topology, sizes, states)
        unit_axes = ("tp", "pp", "ep") if per_ep else ("tp", "pp")
        bad = next((it for it in layout.items if it.section not in ("model", *_FLAT_NAMES)
                    or tuple(a for a, _ in it.unit) != unit_axes), None)
        if bad is not None:
            raise CheckpointFormatError(
                f"spec {spec_name} stores {bad} per {', '.join(a for a, _ in bad.unit) or 'nothing'}; the torch format "
                "holds sections 'model' and 'optim' per (tp, pp) rank, or per (tp, pp, ep) rank for experts "
                "(distrib_optim.pt is gathered on dp rank 0)")
        _check_registration_order(layout, spec_name, strict=distopt)
        if distopt and tied and topology.pp > 1:
            _check_shared_embedding_bucket(layout)
        extra = _target_extra(source, topology, layout, args, meg)
        dtypes = _default_dtypes(source, layout)
        return Target(format=self.name, spec_name=spec_name, spec=spec_ast, topology=topology, sizes=sizes,
                      layout=layout, dtypes=dtypes, extra=extra)

    # -- write

    def write(self, target: Target, out: Path, fill: Fill, *, progress: Callable[[int], None] | None = None,
              only: Collection[Path] | None = None, window_bytes: int | None = None) -> list[Path]:
        """Write every rank's ``model_optim_rng.pt`` (and ``distrib_optim.pt``) and the tracker file.

        Item bytes come from ``fill`` in windows of at most ``window_bytes`` (default
        ``WINDOW_BYTES``); the files are streamed, never built in memory. With ``only``, just
        those rank files and not the tracker. Returns the files written, relative to ``out``.
        """
        return _Writer(target, Path(out), fill, progress, only, window_bytes or WINDOW_BYTES).run()

    def files_of(self, target: Target) -> dict[Item, Path]:
        """The file, relative to the checkpoint directory, that holds each item of ``target``."""
        it_dir = "release" if target.extra.get("release") else f"iter_{int(target.extra['iteration']):07d}"
        out = {}
        for item in target.layout.items:
            u = dict(item.unit)
            name = DISTOPT_FILE if item.section in _FLAT_NAMES else MODEL_FILE
            out[item] = Path(it_dir) / _rank_dir_name(u.get("tp", 0), u.get("pp", 0), target.topology.pp,
                                                      u.get("ep", 0), target.topology.ep) / name
        return out


# --- reading helpers -------------------------------------------------------------------


def _read(path: Path, *, model: bool = True) -> Any:
    """A rank file's object tree (read_torch_file: no tensor data, no pickled code run)."""
    try:
        obj = read_torch_file(path)
    except ReshardError:
        raise
    except Exception as e:  # a malformed file must not surface as a bare traceback
        raise CheckpointFormatError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if model and not isinstance(obj, dict):
        raise CheckpointFormatError(f"{path}: holds a {type(obj).__name__}, expected a dict")
    if model and (key := next((k for k in obj if not isinstance(k, str)), None)) is not None:
        raise CheckpointFormatError(f"{path}: top-level key {brief(key, 60)} is not a string")
    return obj


def _iteration_dir(path: Path) -> tuple[Path, int | None, bool]:
    """The iteration directory to read, its iteration (None for release) and whether it is a release."""
    tracker = path / TRACKER
    if tracker.is_file():
        text = read_tag(tracker, "iteration number or 'release'")
        if text == "release":
            it_dir, iteration, release = path / "release", None, True
        elif re.fullmatch(r"[0-9]{1,15}", text):
            iteration, release = int(text), False
            it_dir = path / f"iter_{iteration:07d}"
        else:
            raise CheckpointFormatError(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}")
        if not it_dir.is_dir():
            raise CheckpointFormatError(f"{tracker} names {text}, but {it_dir} does not exist")
        return it_dir, iteration, release
    m = re.fullmatch(r"iter_([0-9]{7,})", path.name)
    if m and path.is_dir():
        return path, int(m.group(1)), False
    if path.name == "release" and path.is_dir():
        return path, None, True
    raise CheckpointFormatError(f"{path}: no {TRACKER} and not an iter_XXXXXXX directory")


def _rank_dir_name(tp: int, pp: int, pp_size: int, ep: int = 0, ep_size: int = 1) -> str:
    """``mp_rank_TT``, ``_PPP`` when pp > 1, then ``_EEE`` when ep > 1 (``get_checkpoint_name``)."""
    name = f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return name + (f"_{ep:03d}" if ep_size > 1 else "")


def _rank0_file(it_dir: Path) -> Path:
    """The file of rank (tp 0, pp 0, ep 0), whatever the pp and ep suffixes (args tell which apply)."""
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        if (it_dir / name / MODEL_FILE).is_file():
            return it_dir / name / MODEL_FILE
    raise CheckpointFormatError(f"{it_dir}: missing rank file mp_rank_00/{MODEL_FILE} (nor mp_rank_00_000/)")


def _arg(args: Mapping[str, Any], name: str, where: str) -> Any:
    value = args.get(name)
    if value is None:
        raise CheckpointFormatError(f"{where}: args.{name} is missing")
    return value


def _int_arg(args: Mapping[str, Any], name: str, where: str, default: int | None = None, *, lo: int = 1,
             hi: int = MAX_COUNT) -> int:
    """``args.<name>``, an integer in ``[lo, hi]`` (``default`` when missing or None; required without one)."""
    value = args.get(name)
    if value is None and default is not None:
        return default
    return expect_int(_arg(args, name, where), f"args.{name}", where, lo=lo, hi=hi)


def _topology_from_args(args: Mapping[str, Any], where: str, ranks: int) -> Topology:
    """The parallel layout ``args`` record, whose model-parallel ranks (tp * pp * ep) must fit in the ``ranks``
    rank directories found."""
    tp = _int_arg(args, "tensor_model_parallel_size", where, hi=max(1, ranks))
    pp = _int_arg(args, "pipeline_model_parallel_size", where, hi=max(1, ranks))
    cp = _int_arg(args, "context_parallel_size", where, 1)
    ep = _int_arg(args, "expert_model_parallel_size", where, 1, hi=max(1, ranks))
    if tp * pp * ep > max(1, ranks):
        raise CheckpointFormatError(f"{where}: args say tp({tp}) * pp({pp}) * ep({ep}) = {tp * pp * ep} rank "
                                    f"directories, the checkpoint has {ranks}")
    if ep > 1 and not args.get("num_experts"):
        raise CheckpointFormatError(f"{where}: expert_model_parallel_size={ep} without num_experts")
    etp = None if args.get("expert_tensor_parallel_size") is None else \
        _int_arg(args, "expert_tensor_parallel_size", where)
    if args.get("num_experts") and etp is not None and etp != tp:
        raise CheckpointFormatError(
            f"{where}: expert_tensor_parallel_size={etp} differs from tensor_model_parallel_size={tp}; "
            "experts split over their own tp are not supported yet")
    if args.get("num_experts") and args.get("moe_grouped_gemm"):
        raise CheckpointFormatError(f"{where}: --moe-grouped-gemm experts (GroupedMLP weight1/weight2) are not "
                                    "supported yet; the SequentialMLP experts (local_experts.N) are")
    if cp > 1:
        raise CheckpointFormatError(f"{where}: context_parallel_size={cp} is not supported yet")
    world = _int_arg(args, "world_size", where, 0, lo=0, hi=MAX_COUNT * ranks)
    dp = _int_arg(args, "data_parallel_size", where, world // (tp * pp * cp) or 1)
    if world and world != tp * pp * cp * dp:
        raise CheckpointFormatError(f"{where}: tp({tp}) * pp({pp}) * dp({dp}) = {tp * pp * dp} != world_size({world})")
    layers = _int_arg(args, "num_layers", where)
    if (dp * cp) % ep:
        raise CheckpointFormatError(f"{where}: expert_model_parallel_size={ep} does not divide data_parallel_size={dp}")
    try:
        vpp, stages = _pipeline_from_args(args, pp, layers, where)
        return Topology(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, vpp=vpp, stages=stages)
    except TopologyError as e:
        raise CheckpointFormatError(f"{where}: args give no valid pipeline: {e}") from None


def _pipeline_from_args(args: Mapping[str, Any], pp: int, layers: int,
                        where: str) -> tuple[int, tuple[int, ...] | None]:
    """vpp and layers per virtual stage (None: even), as Megatron's get_num_layers_to_build places them."""
    if args.get("account_for_embedding_in_pipeline_split") or args.get("account_for_loss_in_pipeline_split"):
        raise CheckpointFormatError(f"{where}: --account-for-embedding/loss-in-pipeline-split is not supported yet")
    vpp = _int_arg(args, "virtual_pipeline_model_parallel_size", where, 1, hi=layers)
    layout = args.get("pipeline_model_parallel_layout")
    if layout is not None:
        if not isinstance(layout, str):
            raise CheckpointFormatError(
                f"{where}: args.pipeline_model_parallel_layout is a {type(layout).__name__}, expected a string")
        topo = parse_topology(f"pp={pp},layout={layout}")
        return topo.vpp, topo.stages
    first, last = (None if args.get(k) is None else _int_arg(args, k, where, lo=0, hi=layers)
                   for k in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"))
    if first is None and last is None:
        return vpp, None
    rest, left = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
    if left > 0 and rest % left:
        raise CheckpointFormatError(f"{where}: {rest} layers left over for {left} middle stages do not divide evenly")
    per_stage = [rest // left if left > 0 else 0] * pp
    if first is not None:
        per_stage[0] = first
    if last is not None:
        per_stage[-1] = last
    if any(n % vpp for n in per_stage):
        raise CheckpointFormatError(f"{where}: stage layer counts {per_stage} are not divisible by vpp({vpp})")
    return vpp, tuple(per_stage[v % pp] // vpp for v in range(pp * vpp))


def _sizes_from_args(args: Mapping[str, Any], given: Mapping[str, int], topo: Topology, where: str) -> dict[str, int]:
    def arg(name: str, default: int | None = None) -> int:
        return _int_arg(args, name, where, default, hi=MAX_SIZE)

    h, heads = arg("hidden_size"), arg("num_attention_heads")
    g = arg("num_query_groups", heads) if args.get("group_query_attention") else heads
    sizes = {
        "h": h, "heads": heads, "g": g, "hd": arg("kv_channels", h // heads),
        "f": arg("moe_ffn_hidden_size") if args.get("moe_ffn_hidden_size") else arg("ffn_hidden_size"),
        "layers": _int_arg(args, "num_layers", where), "vocab_div": arg("make_vocab_size_divisible_by", 128),
    }
    if args.get("num_experts"):
        sizes["experts"] = _int_arg(args, "num_experts", where)
    if _is_gpt2(args):
        if sizes["g"] != heads:
            raise CheckpointFormatError(f"{where}: num_query_groups={sizes['g']} with num_attention_heads={heads}; "
                                        "GPT-2-style specs have one key/value head per query head")
        sizes["positions"] = arg("max_position_embeddings")
        del sizes["g"]
    padded = None if args.get("padded_vocab_size") is None else arg("padded_vocab_size")
    given = given_sizes(given)
    vocab = given.get("vocab", None if args.get("vocab_size") is None else arg("vocab_size"))
    if vocab is None:
        hint = f" (a number in [{padded - sizes['vocab_div'] * topo.tp + 1}, {padded}])" if padded else ""
        raise CheckpointFormatError(
            f"{where}: args has padded_vocab_size={padded} but not the tokenizer's vocab size; "
            f"give it as sizes={{'vocab': N}}{hint}")
    sizes["vocab"] = vocab
    sizes.update(given)
    if padded is not None:
        want = _padded_vocab(sizes["vocab"], sizes["vocab_div"], topo.tp)
        if want != padded:
            raise CheckpointFormatError(
                f"{where}: vocab {sizes['vocab']} pads to {want} at tp={topo.tp} "
                f"(make_vocab_size_divisible_by={sizes['vocab_div']}), but args.padded_vocab_size is {padded}")
    return sizes


def _padded_vocab(vocab: int, div: int, tp: int) -> int:
    multiple = div * tp
    return -(-vocab // multiple) * multiple


def _bucket_size(args: Mapping[str, Any], topo: Topology) -> int:
    """The DDP bucket size of (pp rank 0, chunk 0), 0 for one bucket (training.py :: resolve_ddp_bucket_size)."""
    if not args.get("overlap_grad_reduce"):
        return 0
    if args.get("ddp_num_buckets"):
        raise CheckpointFormatError(
            "--ddp-num-buckets is not supported yet (its bucket size depends on the model's parameter count)")
    if args.get("ddp_bucket_size"):
        return _int_arg(args, "ddp_bucket_size", "args", hi=MAX_SIZE)
    return max(40_000_000, 1_000_000 * topo.dp * topo.cp)


def _per_ep(spec: Spec) -> bool:
    """Whether the spec's sections are per expert-parallel rank (the ``_EEE`` files)."""
    return any(isinstance(st, Section) and "ep" in st.axes for st in spec.statements)


def _is_expert(key: str) -> bool:
    """An expert parameter (``allreduce`` False at ep > 1: the expert optimizer's, not the dense one's)."""
    return ".mlp.experts." in key


_EXPERT_NUM = re.compile(r"(\.mlp\.experts\.local_experts\.)([0-9]+)(\.)")


def _renumber_expert(key: str, fn: Callable[[int], int]) -> str:
    return _EXPERT_NUM.sub(lambda m: f"{m.group(1)}{fn(int(m.group(2)))}{m.group(3)}", key, count=1)


def _has_flat(spec: Spec) -> bool:
    return any(isinstance(st, Flat) for st in spec.statements)


def _flat_sections(spec: Spec) -> set[str]:
    out, current = set(), None
    for st in spec.statements:
        if isinstance(st, Section):
            current = st.name
        elif isinstance(st, Flat) and current:
            out.add(current)
    return out


def _resolve(spec: Spec, topo: Topology, sizes: Mapping[str, int], states: Mapping[str, tuple[str, ...]]) -> Layout:
    """``resolve``, with Megatron's bucketing only on (pp rank 0, chunk 0).

    DistributedDataParallel drops bucketing on stages with pp rank > 0, and the trainer
    on model chunks > 0 (``disable_bucketing``); a spec has one ``bucket_size``, so the
    flat sections of the other units come from a resolution with ``bucket_size = 0``.
    """
    bucket = int(sizes.get("bucket_size", 0))
    if not bucket or (topo.pp == 1 and topo.vpp == 1):
        return resolve(spec, topo, sizes, states=states)
    one = resolve(spec, topo, {**sizes, "bucket_size": 0}, states=states)
    bucketed = resolve(spec, topo, sizes, states=states)
    flat = _flat_sections(spec)

    def first(it: Item) -> bool:
        return it.section in flat and dict(it.unit).get("pp", 0) == 0 and it.chunk == 0

    items = {it: info for it, info in one.items.items() if not first(it)}
    items.update({it: info for it, info in bucketed.items.items() if first(it)})
    frags = tuple(f for f in one.fragments if not first(f.item)) + tuple(f for f in bucketed.fragments if first(f.item))
    return Layout(topology=topo, tensors=one.tensors, items=MappingProxyType(items), fragments=frags, order=one.order)


# Megatron-core GPT registration order (named_parameters, and so state_dict order):
# GPTModel registers embedding, decoder (layers, then final_layernorm), output_layer;
# TransformerLayer its norms and sublayers; Attention registers core_attention and
# linear_proj before SelfAttention adds linear_qkv (megatron/core/transformer/attention.py).
_TOP = ("embedding.", "decoder.layers.", "decoder.final_layernorm.", "output_layer.")
_LAYER = ("input_layernorm.", "self_attention.", "pre_cross_attn_layernorm.", "cross_attention.",
          "pre_mlp_layernorm.", "mlp.")
_SUB = {
    "self_attention.": ("core_attention.", "linear_proj.", "linear_qkv.", "q_layernorm.", "k_layernorm."),
    "mlp.": ("router.", "linear_fc1.", "linear_fc2.", "experts.", "shared_experts."),
}
_LAYER_KEY = re.compile(r"decoder\.layers\.([0-9]+)\.(.*)")


_LOCAL_EXPERT = re.compile(r"experts\.local_experts\.([0-9]{1,9})\.linear_fc([12])\.")


def _mcore_rank(key: str) -> tuple[int, ...] | None:
    """Sort key of a state-dict key in Megatron-core's registration order; None if unknown."""
    extra = int(key.endswith("._extra_state"))
    m = _LAYER_KEY.fullmatch(key)
    if m is None:
        top = next((k for k, p in enumerate(_TOP) if key.startswith(p)), None)
        return None if top is None else (top, 0, 0, 0, 0, 0, extra)
    rest = m.group(2)
    part = next((k for k, p in enumerate(_LAYER) if rest.startswith(p)), None)
    if part is None:
        return None
    sub_names = _SUB.get(_LAYER[part], ())
    tail = rest[len(_LAYER[part]):]
    sub = next((k for k, p in enumerate(sub_names) if tail.startswith(p)), 0 if not sub_names else None)
    if sub is None:
        return None
    # SequentialMLP registers each local expert whole: expert 0's fc1 and fc2, then expert 1's, ...
    e = _LOCAL_EXPERT.match(tail) if sub_names and sub_names[sub] == "experts." else None
    expert = (int(e.group(1)), int(e.group(2))) if e else (0, 0)
    return (1, int(m.group(1)), part, sub, *expert, extra)


def _mcore_order(keys: list[str]) -> list[str]:
    ranks = {}
    for k in keys:
        r = _mcore_rank(k)
        if r is None:
            raise CheckpointFormatError(f"cannot place '{k}' in Megatron-core's parameter registration order")
        ranks[k] = r
    return sorted(keys, key=lambda k: ranks[k])  # stable: a module's own params keep spec order


def _check_registration_order(layout: Layout, spec_name: str, *, strict: bool) -> None:
    """The spec's registration order must be Megatron's where a flat buffer depends on it."""
    if not strict:
        return
    for name, items in layout.order.items():
        keys = [it.key for it in items]
        want = _mcore_order(keys)
        if keys != want:
            k = next(i for i, (a, b) in enumerate(zip(keys, want, strict=True)) if a != b)
            raise CheckpointFormatError(
                f"spec {spec_name} registers '{keys[k]}' where Megatron registers '{want[k]}' ({name}); the "
                "distributed optimizer's buffers follow Megatron's order, so this spec would misplace them")


def _check_shared_embedding_bucket(layout: Layout) -> None:
    for it, info in layout.items.items():
        if it.key == "output_layer.weight" and it.state == "param" and info.numel % 64:
            raise CheckpointFormatError(
                f"{it}: with tied embeddings and pp > 1 Megatron gives the output layer a bucket of its own, which "
                f"moves the next parameter when its {info.numel} elements are not a multiple of 64; not supported yet")


def _small(ref: Any, where: str) -> SmallTensor:
    """Read a small non-model tensor's bytes."""
    dtype = _dtype_name(ref.dtype)
    shape = tuple(int(n) for n in ref.shape)
    n = math.prod(shape)
    nbytes = n * itemsize(dtype)
    if nbytes > SMALL_TENSOR_LIMIT:
        raise CheckpointFormatError(f"{where}: a {nbytes}-byte tensor where small state was expected")
    offset = _contiguous_offset(ref, where)
    with Path(ref.path).open("rb") as f:
        f.seek(offset)
        data = f.read(nbytes)
    if len(data) != nbytes:
        raise CheckpointFormatError(f"{where}: file ends before the tensor's {nbytes} bytes")
    return SmallTensor(dtype, shape, data)


def _contiguous_offset(ref: Any, where: str) -> int:
    """Byte offset in the file of a row-major contiguous tensor's first element."""
    if not ref.is_contiguous:
        raise CheckpointFormatError(
            f"{where}: tensor is not contiguous (shape {tuple(ref.shape)}, stride {tuple(ref.stride)})")
    return int(ref.data_offset)


def _capture(obj: Any, where: str) -> Any:
    """A copy of a small object tree with every tensor read into a SmallTensor."""
    return map_tensors(obj, lambda ref: _small(ref, where))


def _map_small(obj: Any, fn: Callable[[SmallTensor], Any]) -> Any:
    """A copy of ``obj`` with every SmallTensor leaf replaced by ``fn(leaf)`` (containers keep their types)."""
    if isinstance(obj, SmallTensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict/defaultdict and instance attributes
        for k, v in obj.items():
            out[k] = _map_small(v, fn)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_map_small(v, fn) for v in obj)
    if type(obj) is argparse.Namespace:
        return argparse.Namespace(**{k: _map_small(v, fn) for k, v in vars(obj).items()})
    if type(obj) is Opaque:
        return replace(obj, args=_map_small(obj.args, fn), state=_map_small(obj.state, fn),
                       listitems=_map_small(obj.listitems, fn), dictitems=_map_small(obj.dictitems, fn))
    return obj


def _chunks(obj: dict, vpp: int, where: str) -> dict[int, Mapping[str, Any]]:
    if vpp == 1:
        if "model" not in obj:
            raise CheckpointFormatError(f"{where}: no 'model' state dict")
        return {0: obj["model"]}
    out = {c: obj[f"model{c}"] for c in range(vpp) if f"model{c}" in obj}
    if not out:
        raise CheckpointFormatError(f"{where}: no 'model0' … 'model{vpp - 1}' state dicts (vpp={vpp})")
    return out


def _flat_items(sd: Mapping[str, Any], where: Path, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """A state dict's entries, nested dicts (the legacy model's ``language_model`` tree) joined with '/'."""
    for key, value in sd.items():
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{where}: state dict key {brief(key, 60)} (in '{prefix}') is not a string")
        if isinstance(value, Mapping):
            yield from _flat_items(value, where, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def _nested(sd: Mapping[str, Any]) -> OrderedDict:
    """The inverse of ``_flat_items``: 'a/b/c' keys as nested dicts, in first-seen order."""
    out: OrderedDict = OrderedDict()
    for key, value in sd.items():
        *path, last = key.split("/")
        node = out
        for part in path:
            node = node.setdefault(part, OrderedDict())
        node[last] = value
    return out


def _is_legacy(obj: Mapping[str, Any]) -> bool:
    """A legacy (non-mcore) model: its state dict is the nested ``language_model`` tree."""
    sd = obj.get("model", obj.get("model0"))
    return isinstance(sd, Mapping) and isinstance(sd.get("language_model"), Mapping)


class _Reader:
    """Maps the tensors of a checkpoint's rank files to layout items."""

    def __init__(self, ranks: dict[tuple[int, int, int], _Rank], topo: Topology, spec_name: str, per_ep: bool,
                 experts: int) -> None:
        self.ranks = ranks
        self.topo = topo
        self.spec_name = spec_name
        self.per_ep = per_ep  # items carry an ep coordinate (the spec's sections are per ep)
        self.experts = experts
        # per rank: [(chunk, key, TensorRef)] params in named_parameters order, and extra states
        self.params: dict[tuple[int, int, int], list[tuple[int, str, Any]]] = {}
        self.extras: dict[tuple[int, int, int], list[tuple[int, str, Any]]] = {}
        for rk, r in ranks.items():
            ps, xs = [], []
            for c, sd in _chunks(r.obj, topo.vpp, str(r.path)).items():
                if not isinstance(sd, Mapping):
                    raise CheckpointFormatError(f"{r.path}: model chunk {c} is a {type(sd).__name__}, not a state dict")
                for key, value in _flat_items(sd, r.path):
                    if key.endswith("._extra_state") or key == "_extra_state":
                        xs.append((c, key, value))
                    elif _is_tensor(value):
                        ps.append((c, key, value))
                    else:
                        raise CheckpointFormatError(f"{r.path}: '{key}' is a {type(value).__name__}, not a tensor")
            self.params[rk], self.extras[rk] = ps, xs
        self.kind: str | None = None
        self.chained = False  # a ChainedOptimizer of a dense and an expert optimizer (MoE at ep > 1)
        self.state_keys: list[str] = []
        self.step: SmallTensor | None = None
        # per rank: {(chunk, key): {state: TensorRef}}
        self.per_param: dict[tuple[int, int, int], dict[tuple[int, str], dict[str, Any]]] = {}
        self.buffer_dtypes: tuple[str, str] | None = None

    def unit(self, t: int, p: int, e: int) -> tuple[tuple[str, int], ...]:
        return (("tp", t), ("pp", p)) + ((("ep", e),) if self.per_ep else ())

    # -- optimizer

    def optimizer_states(self) -> tuple[str, ...]:
        """Read the optimizer structure of every rank; return the per-parameter state names."""
        states: tuple[str, ...] | None = None
        for _, r in sorted(self.ranks.items()):
            opt = r.obj.get("optimizer")
            if opt is None:
                found: tuple[str, ...] = ()
                kind = None
            elif isinstance(opt, list):
                kind, found = self._chained(r, opt)
            elif r.distopt is not None:
                kind, found = "distributed", self._distributed(r)
            else:
                kind, found = self._one(r, opt, None, "'optimizer'")
            if states is None:
                states, self.kind = found, kind
            elif (found, kind) != (states, self.kind):
                raise CheckpointFormatError(
                    f"{r.path}: optimizer {kind} with states {brief(list(found))}, "
                    f"but other ranks have {self.kind} with {brief(list(states))}")
        return states or ()

    def _one(self, r: _Rank, opt: Any, which: Callable[[str], bool] | None, shown: str) -> tuple[str, tuple[str, ...]]:
        """One fp16 or fp32 optimizer's kind and state names, over the params ``which`` selects."""
        if not isinstance(opt, Mapping):
            raise CheckpointFormatError(f"{r.path}: {shown} is a {type(opt).__name__}, expected a Megatron optimizer "
                                        "state dict")
        if "fp32_from_fp16_params" in opt:
            return "fp16", self._per_param(r, opt.get("optimizer"), opt["fp32_from_fp16_params"], which)
        if "state" in opt and "param_groups" in opt:
            return "fp32", self._per_param(r, opt, None, which)
        raise CheckpointFormatError(
            f"{r.path}: {shown} has keys {brief(list(opt))}; expected a Megatron optimizer state dict")

    def _chained(self, r: _Rank, opts: list) -> tuple[str, tuple[str, ...]]:
        """``ChainedOptimizer.state_dict()``: the dense optimizer's, then the expert optimizer's (MoE at ep > 1)."""
        experts = any(_is_expert(key) for _, key, _ in self.params[(r.tp, r.pp, r.ep)])
        if len(opts) != 2 or not experts:
            raise CheckpointFormatError(
                f"{r.path}: 'optimizer' is a list of {len(opts)} optimizers (a ChainedOptimizer); only the dense + "
                "expert pair of a mixture-of-experts model is supported")
        self.chained = True
        if r.distopt is not None:
            if not all(isinstance(o, Mapping) and isinstance(o.get("optimizer"), Mapping) for o in opts):
                raise CheckpointFormatError(f"{r.path}: 'optimizer' is not two DistributedOptimizer state dicts")
            return "distributed", self._distributed(r)
        dense = self._one(r, opts[0], lambda k: not _is_expert(k), "'optimizer'[0] (dense)")
        expert = self._one(r, opts[1], _is_expert, "'optimizer'[1] (experts)")
        if dense != expert:
            raise CheckpointFormatError(
                f"{r.path}: the dense optimizer is {dense[0]} with states {list(dense[1])}, the expert optimizer "
                f"{expert[0]} with {list(expert[1])}")
        return dense

    def _groups(self, r: _Rank, inner: Any) -> list[dict]:
        groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise CheckpointFormatError(f"{r.path}: optimizer has no list of param_groups")
        return groups

    def _per_param(self, r: _Rank, inner: Mapping, masters: Any, which: Callable[[str], bool] | None) -> tuple[str, ...]:
        """fp16/fp32 optimizer: map optimizer index -> param through the param groups."""
        groups = self._groups(r, inner)
        params = [x for x in self.params[(r.tp, r.pp, r.ep)] if which is None or which(x[1])]
        assign = _assign_groups(groups, [(key, tuple(ref.shape)) for _, key, ref in params], str(r.path))
        state = inner.get("state", {})
        if not isinstance(state, Mapping) or not all(isinstance(v, Mapping) for v in state.values()):
            raise CheckpointFormatError(f"{r.path}: optimizer 'state' is not a mapping of parameter index to states")
        if masters is not None and (not isinstance(masters, list) or len(masters) != len(groups)):
            raise CheckpointFormatError(f"{r.path}: fp32_from_fp16_params does not have one list per param group")
        out: dict[tuple[int, str], dict[str, Any]] = {}
        names: tuple[str, ...] | None = None
        for g, members in enumerate(assign):
            indices = groups[g].get("params")
            if not isinstance(indices, list) or not all(type(i) is int for i in indices):
                raise CheckpointFormatError(f"{r.path}: param group {g}'s 'params' is {brief(indices, 60)}, not a "
                                            "list of parameter indices")
            low = [k for k in members if params[k][2].dtype in ("bfloat16", "float16")]
            if masters is not None and (not isinstance(masters[g], list) or len(masters[g]) != len(low)):
                raise CheckpointFormatError(
                    f"{r.path}: fp32_from_fp16_params[{g}] does not hold one main param per 16-bit parameter "
                    f"of param group {g} ({len(low)})")
            for i, k in enumerate(members):
                chunk, key, ref = params[k]
                where = f"{r.path}: optimizer state of '{key}'"
                found: dict[str, Any] = {}
                if masters is not None and k in low:
                    # Float16OptimizerWithFloat16Params keeps main params of its 16-bit params only, in group order.
                    j = low.index(k)
                    m = masters[g][j]
                    if not _is_tensor(m) or tuple(m.shape) != tuple(ref.shape):
                        raise CheckpointFormatError(
                            f"{where}: fp32_from_fp16_params[{g}][{j}] does not have its shape {tuple(ref.shape)}")
                    found["master"] = m
                per = state.get(indices[i], {})
                for name, value in per.items():
                    if not isinstance(name, str):
                        raise CheckpointFormatError(f"{where}: state name {brief(name, 40)} is not a string")
                    if name == "step" and _is_tensor(value) and tuple(value.shape) == ():
                        step = _small(value, where + ".step")
                        if self.step is not None and step != self.step:
                            raise CheckpointFormatError(f"{where}: step {step.data.hex()} ({step.dtype}) differs from "
                                                        f"another parameter's {self.step.data.hex()}")
                        self.step = step
                    elif _is_tensor(value) and tuple(value.shape) == tuple(ref.shape) and name not in _MAIN:
                        found[name] = value
                    else:
                        shape = tuple(value.shape) if _is_tensor(value) else type(value).__name__
                        raise CheckpointFormatError(
                            f"{where}: state '{name}' ({shape}) does not map to the parameter {tuple(ref.shape)}")
                if not self.state_keys and per:
                    self.state_keys = list(per)
                got = tuple(found)
                if names is None:
                    names = got
                elif got != names:
                    raise CheckpointFormatError(f"{where}: states {list(got)}, other parameters have "
                                                f"{list(names)}")
                out[(chunk, key)] = found
        extra = set(state) - {groups[g]["params"][i] for g, m in enumerate(assign) for i in range(len(m))}
        if extra:
            raise CheckpointFormatError(
                f"{r.path}: optimizer state for index {brief(next(iter(extra)), 40)} belongs to no parameter")
        self.per_param.setdefault((r.tp, r.pp, r.ep), {}).update(out)
        return names or ()

    def _distributed(self, r: _Rank) -> tuple[str, ...]:
        """distrib_optim.pt: one optimizer's buffers, or ``[dense, expert]`` (MoE at ep > 1; ``None`` for the
        dense one except in the ep rank 0 file, whose writer is dense data-parallel rank 0)."""
        d, path = r.distopt, r.distopt_path
        if not isinstance(d, list):
            return self._buffers(r, d, "optim")
        if len(d) != 2 or not any(_is_expert(key) for _, key, _ in self.params[(r.tp, r.pp, r.ep)]):
            raise CheckpointFormatError(
                f"{path}: a list of {len(d)} optimizer states (a ChainedOptimizer); only the dense + expert pair of "
                "a mixture-of-experts model is supported")
        if d[1] is None or (d[0] is None) != (r.ep > 0):
            raise CheckpointFormatError(
                f"{path}: holds {['dense' if d[0] is not None else None, 'expert' if d[1] is not None else None]}; "
                f"expert-parallel rank {r.ep}'s file holds {'the expert' if r.ep else 'the dense and the expert'} "
                "optimizer's buffers")
        self.chained = True
        names = self._buffers(r, d[1], "expert_optim")
        if d[0] is not None and self._buffers(r, d[0], "optim") != names:
            raise CheckpointFormatError(f"{path}: the dense and the expert buffers hold different states")
        return names

    def _buffers(self, r: _Rank, d: Any, section: str) -> tuple[str, ...]:
        path = r.distopt_path
        if not isinstance(d, Mapping) or not d.get("buckets_coalesced"):
            raise CheckpointFormatError(
                f"{path}: not the coalesced format of megatron-core >= 0.7 (no 'buckets_coalesced'); "
                "older per-bucket files are not supported yet")
        chunks = sorted(self._chunk_keys(r))
        bufs = {k: v for k, v in d.items() if k != "buckets_coalesced"}
        if set(bufs) != set(range(len(chunks))) or not all(type(k) is int for k in bufs):
            raise CheckpointFormatError(
                f"{path}: buffers {brief(list(bufs))}, expected one per model chunk {list(range(len(chunks)))}")
        out: dict[tuple[int, str], dict[str, Any]] = {}
        names: tuple[str, ...] | None = None
        for gbuf, dtypes in bufs.items():
            if not isinstance(dtypes, Mapping) or len(dtypes) != 1:
                raise CheckpointFormatError(f"{path}: buffer {gbuf} is not one (param_dtype, grad_dtype) group")
            (key, tensors), = dtypes.items()
            pair = (_dtype_name(key[0]), _dtype_name(key[1])) if isinstance(key, tuple) and len(key) == 2 else None
            if pair is None or not set(pair) <= set(SUPPORTED) or not isinstance(tensors, Mapping):
                raise CheckpointFormatError(
                    f"{path}: buffer {gbuf} is {{{brief(key, 60)}: {type(tensors).__name__}}}, expected "
                    "{(param_dtype, grad_dtype): {state: tensor}}")
            if self.buffer_dtypes not in (None, pair):
                raise CheckpointFormatError(
                    f"{path}: buffer {gbuf} has dtypes {pair}, another has {self.buffer_dtypes}")
            self.buffer_dtypes = pair
            found = {}
            for name, value in tensors.items():
                if name == "numel_unpadded":
                    continue
                if not isinstance(name, str) or not _is_tensor(value) or len(value.shape) != 1:
                    raise CheckpointFormatError(f"{path}: buffer {gbuf} entry {brief(name, 40)} is not a 1-D tensor "
                                                "under a state name")
                found[_MAIN[1] if name == _MAIN[0] else name] = value
            n = tensors.get("numel_unpadded")
            n = None if n is None else expect_int(n, f"buffer {gbuf} numel_unpadded", path)
            for name, value in found.items():
                if n is not None and int(value.shape[0]) != n:
                    raise CheckpointFormatError(
                        f"{path}: buffer {gbuf} '{name}' has {value.shape[0]} elements, numel_unpadded is {n}")
            got = tuple(found)
            if names is None:
                names = got
            elif got != names:
                raise CheckpointFormatError(f"{path}: buffer {gbuf} holds {list(got)}, others {list(names)}")
            out[(chunks[gbuf], section)] = found
        self.per_param.setdefault((r.tp, r.pp, r.ep), {}).update(out)
        if names and "master" not in names:
            raise CheckpointFormatError(f"{path}: no 'param' (fp32 main params) in the buffers")
        return (("master",) + tuple(n for n in names if n != "master")) if names else ()

    def _chunk_keys(self, r: _Rank) -> set[int]:
        return set(_chunks(r.obj, self.topo.vpp, str(r.path)))

    # -- items

    def map(self, layout: Layout) -> dict[Item, Located]:
        """Every tensor of every file to its item; fail closed both ways."""
        index = {(it.section, it.unit, it.chunk, it.state, it.key): it for it in layout.items}
        where: dict[Item, Located] = {}

        def place(section: str, rk: tuple[int, int, int], chunk: int, state: str, key: str, ref: Any, path: Path,
                  shown: str) -> None:
            it = index.get((section, self.unit(*rk), chunk, state, key))
            if it is None:
                raise CheckpointFormatError(
                    f"{path}: tensor '{shown}' is not in spec {self.spec_name} at {self.topo}"
                    f"{f' (model chunk {chunk})' if self.topo.vpp > 1 else ''}")
            want = layout.items[it].shape
            if tuple(ref.shape) != want:
                raise CheckpointFormatError(
                    f"{path}: '{shown}' has shape {tuple(ref.shape)}, the layout expects {want}")
            if it in where:
                raise CheckpointFormatError(f"{path}: '{shown}' is stored twice")
            where[it] = Located(path, _contiguous_offset(ref, f"{path}: '{shown}'"), _dtype_name(ref.dtype))

        for rk, r in self.ranks.items():
            for chunk, key, ref in self.params[rk]:
                place("model", rk, chunk, "param", key, ref, r.path, key)
            for (chunk, key), states in self.per_param.get(rk, {}).items():
                if r.distopt is not None:
                    for state, ref in states.items():
                        name = _MAIN[0] if state == _MAIN[1] else state
                        shown = f"[{chunk}][{_dtype_pair_text(self.buffer_dtypes)}]['{name}']"
                        if self.chained:
                            shown = f"[{0 if key == 'optim' else 1}]{shown}"
                        place(key, rk, chunk, state, f"{_FLAT_NAMES[key]}.{state}", ref, Path(r.distopt_path or ""),
                              shown)
                else:
                    for state, ref in states.items():
                        place("model", rk, chunk, state, key, ref, r.path, f"optimizer state '{state}' of {key}")
            if r.distopt is not None:
                self._check_order(layout, rk, r)
        for it in layout.items:  # the dense buffers of ep ranks > 0: replicas of ep rank 0's, stored there only
            u = dict(it.unit)
            if it.section == "optim" and u.get("ep", 0) > 0 and self.chained and it not in where:
                twin = replace(it, unit=tuple((a, 0 if a == "ep" else c) for a, c in it.unit))
                if twin in where:
                    where[it] = where[twin]
        missing = [it for it, info in layout.items.items() if info.mapped and it not in where]
        if missing:
            it = missing[0]
            u = dict(it.unit)
            r = self.ranks[(u["tp"], u["pp"], u.get("ep", 0))]
            raise CheckpointFormatError(
                f"{r.path.parent}: no tensor for {it} (spec {self.spec_name} expects it)"
                f"{f'; {len(missing) - 1} more missing' if len(missing) > 1 else ''}")
        return where

    def _check_order(self, layout: Layout, rk: tuple[int, int, int], r: _Rank) -> None:
        for chunk in range(self.topo.vpp):
            have = [key for c, key, _ in self.params[rk] if c == chunk]
            want = [it.key for it in layout.order.get(_order_name(self.unit(*rk), chunk), ())]
            if have != want:
                k = next((i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b),
                         min(len(have), len(want)))
                raise CheckpointFormatError(
                    f"{r.path}: model chunk {chunk} registers parameters in another order than spec {self.spec_name} "
                    f"(position {k}: '{(have + [None])[k]}' vs '{(want + [None])[k]}'); "
                    f"{DISTOPT_FILE} cannot be decoded")

    # -- non-tensor state

    def extra(self, args: dict, layout: Layout) -> dict[str, Any]:
        r0 = self.ranks[(0, 0, 0)]
        obj = r0.obj
        known = {"args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "rng_state"}
        known |= {k for k in obj if re.fullmatch(r"model[0-9]*", str(k))}
        opt = obj.get("optimizer")
        groups: list[dict] = []
        expert_groups: list[dict] | None = None
        scaler = None

        def groups_of(one: Any) -> list[dict]:
            inner = one if self.kind == "fp32" else one.get("optimizer", {})
            return [{k: v for k, v in g.items() if k != "params"} for g in self._groups(r0, inner)]

        if isinstance(opt, list) and self.chained:
            groups, expert_groups = groups_of(opt[0]), groups_of(opt[1])
            opt = opt[0]
        elif isinstance(opt, Mapping):
            groups = groups_of(opt)
        if isinstance(opt, Mapping) and "grad_scaler" in opt:
            scaler = _capture(opt.get("grad_scaler"), f"{r0.path}: grad_scaler")
        extra_state: dict[str, dict[int, Any]] = {}
        places = self.topo.layer_placement(int(args["num_layers"]))
        local_to_global = {(pl.stage, pl.chunk, pl.local): g for g, pl in enumerate(places)}
        local_experts = self.experts // self.topo.ep if self.experts else 0
        for (t, p, e), xs in self.extras.items():
            for chunk, key, value in xs:
                m = _LAYER_KEY.fullmatch(key)
                name = key
                where = f"{self.ranks[(t, p, e)].path}: {key}"
                if m is not None:
                    layer = local_to_global.get((p, chunk, int(m.group(1)))) if len(m.group(1)) < 10 else None
                    expert = _EXPERT_NUM.search(key)
                    if layer is None or (local_experts and expert and not (len(expert.group(2)) < 10 and
                                                                            int(expert.group(2)) < local_experts)):
                        raise CheckpointFormatError(f"{where}: names a layer or expert this rank does not hold")
                    name = f"decoder.layers.{layer}.{m.group(2)}"
                    if local_experts:  # local expert numbers are global ones on ep rank e
                        name = _renumber_expert(name, lambda j: e * local_experts + j)
                per_tp = extra_state.setdefault(name, {})
                value = _capture(value, where)
                if t in per_tp and per_tp[t] != value:  # a replica over ep (dense) that is not one
                    raise CheckpointFormatError(
                        f"{where}: differs from the same entry of another expert-parallel rank; cannot tell "
                        "which to carry")
                per_tp[t] = value
        return {
            "args": args,
            "top_keys": [str(k) for k in obj],
            "other": {k: _capture(v, f"{r0.path}: {k}") for k, v in obj.items() if k not in known},
            "opt_param_scheduler": _capture(obj.get("opt_param_scheduler"), f"{r0.path}: opt_param_scheduler"),
            "optimizer": {"kind": self.kind, "param_groups": _capture(groups, f"{r0.path}: param_groups"),
                          "expert_param_groups": None if expert_groups is None else
                          _capture(expert_groups, f"{r0.path}: param_groups of the expert optimizer"),
                          "grad_scaler": scaler, "has_grad_scaler": isinstance(opt, Mapping) and "grad_scaler" in opt,
                          "step": self.step, "state_keys": list(self.state_keys), "buffer_dtypes": self.buffer_dtypes},
            "rng_state": {rk: _capture(r.obj["rng_state"], f"{r.path}: rng_state")
                          for rk, r in self.ranks.items() if "rng_state" in r.obj},
            "extra_state": extra_state,
        }


def _order_name(unit: tuple[tuple[str, int], ...], chunk: int, section: str = "model") -> str:
    """The key of ``Layout.order`` for a unit's model chunk (as ``resolve`` names it)."""
    return f"{section}/{','.join(f'{a}={c}' for a, c in unit)}/{chunk}"


def _dtype_pair_text(pair: tuple[str, str] | None) -> str:
    return "(?)" if pair is None else f"(torch.{pair[0]}, torch.{pair[1]})"


def _no_wd(key: str, shape: tuple[int, ...]) -> bool:
    """Megatron's default no-weight-decay rule: biases and 1-D params (get_standard_config_overrides)."""
    return len(shape) == 1 or key.endswith(".bias")


def _group_is_no_wd(group: Mapping[str, Any], where: str, g: int) -> bool:
    if isinstance(group.get("wd_mult"), int | float) and not isinstance(group["wd_mult"], bool):
        return float(group["wd_mult"]) == 0.0
    if "wd_mult" in group:
        raise CheckpointFormatError(f"{where}: param group {g} has wd_mult {brief(group['wd_mult'], 40)}, "
                                    "not a number")
    raise CheckpointFormatError(f"{where}: param group {g} has no 'wd_mult'; cannot tell which parameters it holds")


def _assign_groups(groups: Sequence[Mapping[str, Any]], params: list[tuple[str, tuple[int, ...]]],
                   where: str) -> list[list[int]]:
    """Per param group, the indices into ``params`` (named_parameters order) it holds, in order."""
    kinds = [_group_is_no_wd(g, where, k) for k, g in enumerate(groups)]
    if kinds.count(True) > 1 or kinds.count(False) > 1:
        raise CheckpointFormatError(
            f"{where}: {len(groups)} optimizer param groups; only Megatron's default weight-decay split "
            "(one group with wd_mult 1, one with wd_mult 0) is supported yet")
    out: list[list[int]] = [[] for _ in groups]
    for k, (key, shape) in enumerate(params):
        nowd = _no_wd(key, shape)
        if nowd not in kinds:
            raise CheckpointFormatError(f"{where}: no param group for '{key}' (wd_mult {'0' if nowd else '1'})")
        out[kinds.index(nowd)].append(k)
    for g, members in enumerate(out):
        listed = groups[g].get("params")
        if listed is not None and not isinstance(listed, list):
            raise CheckpointFormatError(f"{where}: param group {g}'s 'params' is {brief(listed, 60)}, not a list")
        if listed is not None and len(listed) != len(members):
            raise CheckpointFormatError(
                f"{where}: param group {g} lists {len(listed)} parameters, the model has {len(members)} "
                f"{'without' if kinds[g] else 'with'} weight decay")
    return out


# --- target: args, rng, optimizer structure ---------------------------------------------


def megatron_args(sizes: Mapping[str, int], topology: Topology, *, base: Mapping[str, Any] | None = None,
                  tied: bool = False, iteration: int = 0) -> dict[str, Any]:
    """Megatron's ``args`` (as a dict) for a checkpoint of the model ``sizes`` at ``topology``.

    ``base`` (a source checkpoint's args) is kept and only its parallel layout is
    updated: tensor/pipeline/expert sizes, the virtual pipeline and uneven stages,
    ``data_parallel_size``, ``world_size``, ``padded_vocab_size`` (recomputed for the
    new tp, as ``vocab_size_with_padding`` does) and ``use_distributed_optimizer``.
    Without ``base``, a minimal Llama-style set is synthesized (GPT-2 style when
    ``sizes`` has ``positions``, learned position embeddings): what
    ``load_args_from_checkpoint`` and ``check_checkpoint_args`` read, and what ``open``
    needs (``vocab_size`` included, so the real vocab is never lost).
    """
    a = dict(base) if base else _default_args(sizes, tied, iteration)
    old_tp = a.get("tensor_model_parallel_size")
    tp, pp, dp, cp = topology.tp, topology.pp, topology.dp, topology.cp
    div = int(a.get("make_vocab_size_divisible_by") or sizes.get("vocab_div", 128))
    a.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        data_parallel_size=dp,
        world_size=tp * pp * dp * cp,
        padded_vocab_size=_padded_vocab(int(sizes["vocab"]), div, tp),
        use_distributed_optimizer=topology.zero == 1,
    )
    a.setdefault("vocab_size", int(sizes["vocab"]))
    if "transformer_pipeline_model_parallel_size" in a:
        a["transformer_pipeline_model_parallel_size"] = pp
    if a.get("expert_tensor_parallel_size") is not None and a["expert_tensor_parallel_size"] == old_tp:
        a["expert_tensor_parallel_size"] = tp
    if "expert_model_parallel_size" in a or topology.ep > 1:
        a["expert_model_parallel_size"] = topology.ep
    a.update(_pipeline_args(topology, int(sizes["layers"])))
    return a


def _is_gpt2(args: Mapping[str, Any]) -> bool:
    """GPT-2 style: LayerNorm, biases, learned absolute positions, no SwiGLU."""
    return (not args.get("swiglu", False) and args.get("normalization", "LayerNorm") == "LayerNorm"
            and bool(args.get("add_bias_linear", True)) and args.get("position_embedding_type") == "learned_absolute")


# Hugging Face LlamaConfig keys <-> Megatron args, for what changes the model's outputs.
_HF_ARGS = (("rms_norm_eps", "norm_epsilon"), ("rope_theta", "rotary_base"),
            ("max_position_embeddings", "max_position_embeddings"))


def _moe_args(source: Source, sizes: Mapping[str, int]) -> dict[str, Any]:
    """Megatron's MoE args for a Mixtral-style source: experts, their ffn size, and top-k routing from its config."""
    config = source.extra.get("config") if isinstance(source.extra.get("config"), Mapping) else {}
    hints = source.extra.get("config_hints") if isinstance(source.extra.get("config_hints"), Mapping) else {}
    topk = config.get("num_experts_per_tok", hints.get("num_experts_per_tok"))
    if not isinstance(topk, int):
        raise CheckpointFormatError(f"{source.path}: a mixture-of-experts model without num_experts_per_tok in its "
                                    "config.json; Megatron's args need moe_router_topk")
    return {"num_experts": int(sizes["experts"]), "moe_router_topk": topk, "moe_ffn_hidden_size": int(sizes["f"]),
            "ffn_hidden_size": int(sizes["f"]), "moe_grouped_gemm": False,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0) or 0.0)}


def config_hints(args: Mapping[str, Any]) -> dict[str, Any]:
    """What a Llama ``config.json`` takes from a Megatron run's args: epsilon, rope base, positions, tying."""
    if _is_gpt2(args):
        return {}
    hints: dict[str, Any] = {"tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False)}
    if args.get("num_experts"):
        hints.update(model_type="mixtral", architectures=["MixtralForCausalLM"],
                     num_local_experts=int(args["num_experts"]), num_experts_per_tok=args.get("moe_router_topk"))
    for hf, meg in _HF_ARGS:
        value = args.get(meg)
        if isinstance(value, int | float) and not isinstance(value, bool):
            hints[hf] = value
    return hints


def _args_from_config(config: Any) -> dict[str, Any]:
    """Megatron args for a Llama ``config.json`` (the source's, carried): the inverse of ``config_hints``."""
    if not isinstance(config, Mapping):
        return {}
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), Mapping) else {}
    if (rope.get("rope_type") or "default") != "default" or config.get("rope_scaling"):
        raise CheckpointFormatError(f"rope scaling ({rope.get('rope_type') or config.get('rope_scaling')}) has no "
                                    "Megatron args reshard can write yet; the weights would convert, the model would not")
    values = {"rms_norm_eps": config.get("rms_norm_eps"), "rope_theta": rope.get("rope_theta", config.get("rope_theta")),
              "max_position_embeddings": config.get("max_position_embeddings")}
    return {meg: values[hf] for hf, meg in _HF_ARGS if isinstance(values[hf], int | float)}


def _with_vocab_pad(spec_ast: Spec, policy: str) -> Spec:
    """``spec_ast`` with every padding of the ``vocab`` axis filled by ``policy`` (zero or last)."""
    from reshard.core.spec import Axis, Concat, Pad, Product, Split, Stored

    def term(t: Any) -> Any:
        if isinstance(t, Pad):
            inner = term(t.term)
            vocab = isinstance(inner, Axis) and inner.name == "vocab"
            return replace(t, term=inner, policy=policy if vocab else t.policy)
        if isinstance(t, Split):
            return replace(t, term=term(t.term))
        if isinstance(t, Product):
            return replace(t, terms=tuple(term(x) for x in t.terms))
        if isinstance(t, Concat):
            return replace(t, parts=tuple(replace(p, terms=tuple(term(x) for x in p.terms)) for p in t.parts))
        return t

    statements = tuple(replace(st, dims=tuple(term(d) for d in st.dims)) if isinstance(st, Stored) and st.dims else st
                       for st in spec_ast.statements)
    return replace(spec_ast, statements=statements)


def _default_args(sizes: Mapping[str, int], tied: bool, iteration: int) -> dict[str, Any]:
    h, heads = int(sizes["h"]), int(sizes["heads"])
    g = int(sizes.get("g", heads))
    if "positions" in sizes:  # GPT-2 style
        return {**_llama_args(sizes, h, heads, g, tied, iteration),
                "max_position_embeddings": int(sizes["positions"]), "position_embedding_type": "learned_absolute",
                "add_position_embedding": True, "use_rotary_position_embeddings": False,
                "normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True, "add_qkv_bias": True,
                "group_query_attention": False, "num_query_groups": None, "layernorm_epsilon": 1e-5}
    return _llama_args(sizes, h, heads, g, tied, iteration)


def _llama_args(sizes: Mapping[str, int], h: int, heads: int, g: int, tied: bool, iteration: int) -> dict[str, Any]:
    return {
        "num_layers": int(sizes["layers"]), "hidden_size": h, "ffn_hidden_size": int(sizes["f"]),
        "num_attention_heads": heads, "group_query_attention": g != heads, "num_query_groups": g,
        "kv_channels": int(sizes.get("hd", h // heads)),
        "max_position_embeddings": sizes.get("max_position_embeddings"),
        "position_embedding_type": "rope", "add_position_embedding": False, "use_rotary_position_embeddings": True,
        "rotary_base": 10000, "norm_epsilon": 1e-5,
        "rotary_interleaved": False, "normalization": "RMSNorm", "swiglu": True, "squared_relu": False,
        "add_bias_linear": False, "add_qkv_bias": False, "apply_layernorm_1p": False,
        "untie_embeddings_and_output_weights": not tied, "vocab_size": int(sizes["vocab"]),
        "make_vocab_size_divisible_by": int(sizes.get("vocab_div", 128)), "tokenizer_type": None,
        "num_experts": None, "expert_model_parallel_size": 1,
        "bf16": True, "fp16": False, "params_dtype": TorchDtype("bfloat16"), "accumulate_allreduce_grads_in_fp32": True,
        "overlap_grad_reduce": False, "ddp_bucket_size": None, "ddp_num_buckets": None,
        "seed": DEFAULT_SEED, "data_parallel_random_init": False,
        "optimizer": "adam", "lr": 3.0e-4, "min_lr": 3.0e-5, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95,
        "adam_eps": 1e-8, "clip_grad": 1.0, "lr_decay_style": "cosine", "lr_warmup_iters": 0,
        "train_iters": max(iteration, 1), "global_batch_size": 1, "micro_batch_size": 1,
        "ckpt_format": "torch", "use_dist_ckpt": False, "no_save_optim": None, "no_save_rng": None,
        "iteration": iteration, "consumed_train_samples": iteration, "consumed_valid_samples": 0,
        "skipped_train_samples": 0,
    }


def _pipeline_args(topology: Topology, layers: int) -> dict[str, Any]:
    """The virtual-pipeline and uneven-stage args that make Megatron place layers as ``topology`` does."""
    pp, vpp = topology.pp, topology.vpp
    topology.layer_placement(layers)  # validates stages against the layer count
    out: dict[str, Any] = {
        "virtual_pipeline_model_parallel_size": vpp if vpp > 1 else None,
        "num_layers_per_virtual_pipeline_stage": None, "num_virtual_stages_per_pipeline_rank": None,
        "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
        "pipeline_model_parallel_layout": None,
    }
    stages = topology.stages
    if stages is None or len(set(stages)) == 1:
        if vpp > 1:
            out["num_layers_per_virtual_pipeline_stage"] = layers // (pp * vpp)
        return out
    per_stage = [sum(stages[v] for v in range(s, pp * vpp, pp)) for s in range(pp)]
    chunk_even = all(stages[v] * vpp == per_stage[v % pp] for v in range(pp * vpp))
    if chunk_even and pp >= 2 and len(set(per_stage[1:-1])) <= 1:
        out["decoder_first_pipeline_num_layers"] = per_stage[0]
        out["decoder_last_pipeline_num_layers"] = per_stage[-1]
        if vpp > 1:
            out["num_virtual_stages_per_pipeline_rank"] = vpp
        return out
    # Anything else: an explicit --pipeline-model-parallel-layout, one '|' per virtual stage.
    parts = ["t" * n for n in stages]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    out["pipeline_model_parallel_layout"] = "|".join(parts)
    return out


def write_fixture_extra(sizes: Mapping[str, int], topology: Topology, *, iteration: int = 0, tied: bool = False,
                        seed: int = DEFAULT_SEED, optimizer: bool = True) -> dict[str, Any]:
    """The non-tensor state of a freshly made Megatron checkpoint, as ``MegatronFormat.open`` reports it.

    Lets a fixture writer (or ``target`` for a source of another format) produce a
    realistic checkpoint from scratch: put the result in ``Source.extra`` of a
    ``Source(format="megatron", ...)`` at ``topology`` and call ``target``/``write``.
    It holds ``args`` (``megatron_args``), ``iteration``, ``checkpoint_version`` 3.0,
    ``opt_param_scheduler`` (cosine decay, as ``OptimizerParamScheduler.state_dict``),
    the optimizer's two standard param groups (weight decay and none; torch AdamW keys
    plus Megatron's ``wd_mult``/``lr_mult``/...), a per-parameter ``step`` of
    ``iteration``, and per (tp, pp, ep) rank the rng state a run seeded ``seed`` starts with.

    Example:
        >>> extra = write_fixture_extra({"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100,
        ...                              "layers": 4, "vocab_div": 8}, Topology(tp=2, pp=2), iteration=10)
        >>> extra["args"]["padded_vocab_size"], len(extra["rng_state"])
        (112, 4)
    """
    args = megatron_args(sizes, topology, tied=tied, iteration=iteration)
    args["seed"] = seed
    groups = _default_param_groups(args) if optimizer else []
    return {
        "args": args, "iteration": iteration, "release": False, "checkpoint_version": CHECKPOINT_VERSION,
        "top_keys": [], "other": {"num_floating_point_operations_so_far": 0},
        "opt_param_scheduler": {
            "max_lr": args["lr"], "lr_warmup_steps": 0, "num_steps": iteration * args["global_batch_size"],
            "lr_decay_style": args["lr_decay_style"], "lr_decay_steps": args["train_iters"] * args["global_batch_size"],
            "min_lr": args["min_lr"], "start_wd": args["weight_decay"], "end_wd": args["weight_decay"],
            "wd_incr_style": "constant", "wd_incr_steps": args["train_iters"] * args["global_batch_size"],
        },
        "optimizer": {"kind": None, "param_groups": groups, "grad_scaler": None, "has_grad_scaler": False,
                      "step": SmallTensor.scalar(float(iteration)) if optimizer else None,
                      "state_keys": [], "buffer_dtypes": None},
        "rng_state": {(t, p, e): _fresh_rng(args, t, p, None, e) for t in range(topology.tp)
                      for p in range(topology.pp) for e in range(topology.ep)},
        "extra_state": {},
    }


def _default_param_groups(args: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The optimizer's param groups as Megatron builds them: weight-decayed params, then the rest (wd_mult 0).

    Keys in the order a real state dict has them: Megatron's (``_get_param_groups``), then
    torch AdamW's defaults; ``weight_decay`` as the scheduler sets it (``wd * wd_mult``).
    """
    def group(wd_mult: float) -> dict[str, Any]:
        return {
            "is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": args["lr"], "min_lr": args["min_lr"],
            "lr": args["lr"], "betas": (args["adam_beta1"], args["adam_beta2"]), "eps": args["adam_eps"],
            "weight_decay": args["weight_decay"] * wd_mult, "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
        }
    return [group(1.0), group(0.0)]


def _fresh_rng(args: Mapping[str, Any], tp_rank: int, pp_rank: int, like: Any, ep_rank: int = 0) -> list[dict[str, Any]]:
    """``rng_state`` of a rank at the start of a run (``_set_random_seed``, ``model_parallel_cuda_manual_seed``).

    ``like`` (a source rank's rng_state) decides which entries and tracker names appear.
    """
    seed0 = expect_int(args.get("seed") or DEFAULT_SEED, "args.seed", "the source's args", hi=(1 << 32) - 1)
    per_dp = bool(args.get("data_parallel_random_init"))
    sample = like[0] if isinstance(like, list) and like and isinstance(like[0], Mapping) else None
    trackers = sample.get("rng_tracker_states") if sample else None
    names = tuple(trackers) if isinstance(trackers, Mapping) else _TRACKERS
    keys = tuple(sample) if sample else _RNG_KEYS
    out = []
    for dp_rank in range(int(args.get("data_parallel_size") or 1) if per_dp else 1):
        seed = seed0 + 100 * pp_rank + (10 * dp_rank if per_dp else 0)
        if seed >= 1 << 32:  # numpy's legacy seeding takes 32 bits: Megatron itself could not have run with it
            raise CheckpointFormatError(f"args.seed {seed0} + 100 * pp rank {pp_rank} is {seed}, above 2**32 - 1")
        cpu = torch_cpu_rng_state(seed)
        tracker_seeds = {"data-parallel-rng": seed, "model-parallel-rng": seed + 2718 + tp_rank,
                         "expert-parallel-rng": seed + 1024 + 100 * ep_rank + tp_rank}
        state = {
            "random_rng_state": random.Random(seed).getstate(),
            "np_rng_state": np.random.RandomState(seed).get_state(),
            "torch_rng_state": SmallTensor("uint8", (len(cpu),), cpu),
            "cuda_rng_state": _cuda_state(seed),
            "rng_tracker_states": {n: _cuda_state(tracker_seeds.get(n, seed)) for n in names},
        }
        out.append({k: state[k] for k in keys if k in state})
    return out


def torch_cpu_rng_state(seed: int) -> bytes:
    """``torch.Generator().manual_seed(seed).get_state()`` as bytes, without importing torch.

    ATen's ``CPUGeneratorImplState``: the seed, mt19937's ``left`` (1), ``seeded`` (1) and
    ``next`` (0), its 624 state words (init_genrand of the seed's low 32 bits, the key numpy's
    legacy seeding makes too) widened to 64 bits, the cached normal samples (none), padded
    as the C struct is: 5056 bytes.
    """
    key = np.random.RandomState(seed & 0xFFFFFFFF).get_state()[1].astype("<u8")
    return (struct.pack("<qiiQ", seed, 1, 1, 0) + key.tobytes()
            + struct.pack("<dddi4xf?3x", 0.0, 0.0, 0.0, 0, 0.0, False))


def _cuda_state(seed: int) -> SmallTensor:
    """torch.cuda.get_rng_state() right after manual_seed: the Philox seed and offset 0, little-endian."""
    return SmallTensor("uint8", (16,), struct.pack("<Qq", seed & (2**64 - 1), 0))


def _target_extra(source: Source, topology: Topology, layout: Layout, args: dict[str, Any],
                  meg: bool) -> dict[str, Any]:
    src = dict(source.extra) if meg else write_fixture_extra(
        source.sizes | {"vocab_div": args["make_vocab_size_divisible_by"]}, source.topology,
        tied=not args["untie_embeddings_and_output_weights"])
    src_topo = source.topology
    opt = dict(src.get("optimizer") or {})
    flat = "optim" in {it.section for it in layout.items}
    found = {it.state for it in layout.items if it.section == ("optim" if flat else "model")} - {"param"}
    opt_states = (["master"] if "master" in found else []) + sorted(found - {"master"})
    kind = None
    if opt_states:
        kind = "distributed" if flat else "fp16" if "master" in opt_states else "fp32"
    groups = [dict(g) for g in (opt.get("param_groups") or [])] or (_default_param_groups(args) if kind else [])
    # Megatron splits expert params into an optimizer of their own only at ep > 1 (they are allreduce
    # params otherwise): optimizer.state_dict() is then [dense, expert] (ChainedOptimizer), and so is
    # distrib_optim.pt.
    expert_keys = [(it.key, info.shape) for it, info in layout.items.items()
                   if it.section == "model" and it.state == "param" and _is_expert(it.key)]
    chained = kind is not None and topology.ep > 1 and bool(expert_keys)
    expert_groups = None
    if chained:
        expert_groups = [dict(g) for g in (opt.get("expert_param_groups") or [])]
        if not expert_groups:  # the dense groups as the expert optimizer has them: only those with members
            classes = {_no_wd(k, shape) for k, shape in expert_keys}
            expert_groups = [{**g, "is_expert_parallel": True} for k, g in enumerate(groups)
                             if _group_is_no_wd(g, f"{source.path}: optimizer", k) in classes]
    elif opt.get("expert_param_groups"):  # back to one optimizer: every param in the dense groups
        groups = [{**g, "is_expert_parallel": False} for g in groups]
    every_group = groups + (expert_groups or [])
    step, state_keys = opt.get("step"), list(opt.get("state_keys") or [])
    group_step = next((g["step"] for g in every_group if "step" in g), None)
    if kind == "distributed":
        # DistributedOptimizer.state_dict puts the step into every group (a float from torch Adam's tensors).
        value = group_step if group_step is not None else \
            step.value() if step is not None else float(src.get("iteration") or 0)
        for g in every_group:
            g["step"] = value
    elif kind is not None and step is None and isinstance(group_step, float):
        # From the distributed optimizer with torch Adam: the step goes back into each parameter's state.
        step = SmallTensor.scalar(group_step)
        for g in every_group:
            g.pop("step", None)
    opt_names = [s for s in opt_states if s != "master"]
    if kind in ("fp16", "fp32"):
        keys = [k for k in state_keys if k in opt_names or (k == "step" and step is not None)]
        state_keys = (["step"] if step is not None and "step" not in keys else []) + keys
        state_keys += [s for s in opt_names if s not in state_keys]
    same_ranks = (src_topo.tp, src_topo.pp, src_topo.ep) == (topology.tp, topology.pp, topology.ep) and (
        not args.get("data_parallel_random_init") or src_topo.dp == topology.dp)
    rng: dict[tuple[int, int, int], Any] = {}
    src_rng = src.get("rng_state") or {}
    if src_rng or not meg:
        for t in range(topology.tp):
            for p in range(topology.pp):
                for e in range(topology.ep):
                    rng[(t, p, e)] = src_rng[(t, p, e)] if same_ranks and (t, p, e) in src_rng else \
                        _fresh_rng(args, t, p, next(iter(src_rng.values()), None), e)
    return {
        "args": args,
        "iteration": src.get("iteration") or 0,
        "release": bool(src.get("release")),
        "checkpoint_version": src.get("checkpoint_version", CHECKPOINT_VERSION),
        "top_keys": list(src.get("top_keys") or []),
        "other": dict(src.get("other") or {}),
        "opt_param_scheduler": src.get("opt_param_scheduler"),
        "optimizer": {"kind": kind, "param_groups": groups, "expert_param_groups": expert_groups,
                      "grad_scaler": opt.get("grad_scaler"),
                      "has_grad_scaler": bool(opt.get("has_grad_scaler")),
                      "step": step if kind in ("fp16", "fp32") else None,
                      "state_keys": state_keys, "opt_states": opt_states,
                      "grad_dtype": (opt.get("buffer_dtypes") or (None, None))[1]},
        "rng_state": rng,
        "model_order": _model_order(layout, topology, src.get("extra_state") or {}, src_topo.tp,
                                    int(args["num_layers"]), int(source.sizes.get("experts", 0))),
    }


def _model_order(layout: Layout, topology: Topology, extra_state: Mapping[str, Mapping[int, Any]], src_tp: int,
                 layers: int, experts: int = 0) -> dict[tuple[int, int, int, int], list[tuple[str, Any]]]:
    """Per (tp, pp, ep, chunk): the model state dict's entries in Megatron's order: (key, Item or extra-state value).

    ``extra_state`` names carry global layer and expert numbers; here they become the
    stage-local layer and the ep-local expert of the rank that holds them.
    """
    out: dict[tuple[int, int, int, int], list[tuple[str, Any]]] = {}
    for it in layout.items:
        if it.section == "model" and it.state == "param":
            u = dict(it.unit)
            out.setdefault((u["tp"], u["pp"], u.get("ep", 0), it.chunk), []).append((it.key, it))
    local_experts = experts // topology.ep if experts else 0
    places = topology.layer_placement(layers)
    last = (topology.pp - 1, topology.vpp - 1)
    for name, per_tp in extra_state.items():
        m = _LAYER_KEY.fullmatch(name)
        ep_ranks = range(topology.ep)
        if m:
            pl = places[int(m.group(1))]
            stage, chunk, key = pl.stage, pl.chunk, f"decoder.layers.{pl.local}.{m.group(2)}"
            g = _EXPERT_NUM.search(key)
            if g is not None and local_experts:
                ep_ranks = [int(g.group(2)) // local_experts]
                key = _renumber_expert(key, lambda j: j % local_experts)
        else:
            rank = _mcore_rank(name)
            stage, chunk = (0, 0) if rank is not None and rank[0] == 0 else last
            key = name
        values = list(per_tp.values())
        for t in range(topology.tp):
            if topology.tp == src_tp and t in per_tp:
                value = per_tp[t]
            elif all(v == values[0] for v in values):
                value = values[0]
            else:
                raise CheckpointFormatError(
                    f"{name}: the tp ranks hold different values (fp8 scaling state?); "
                    f"cannot carry it to tp={topology.tp}")
            for e in ep_ranks:
                out.setdefault((t, stage, e, chunk), []).append((key, _Extra(value)))
    per_ep = _layout_per_ep(layout)
    for (t, p, e, c), entries in out.items():
        if any("/" in k for k, _ in entries):  # the legacy model's nested names: the spec's order is Megatron's
            unit = (("tp", t), ("pp", p)) + ((("ep", e),) if per_ep else ())
            spec_order = [it.key for it in layout.order.get(_order_name(unit, c), ())]
        else:
            spec_order = _mcore_order([k for k, _ in entries])
        pos = {k: i for i, k in enumerate(spec_order)}
        entries.sort(key=lambda e: pos.get(e[0], len(pos)))
    return out


def _layout_per_ep(layout: Layout) -> bool:
    return any(a == "ep" for it in layout.items for a, _ in it.unit)


@dataclass(frozen=True, slots=True)
class _Extra:
    """A model state dict entry that is not a layout item (an ``_extra_state`` value)."""

    value: Any


def _default_dtypes(source: Source, layout: Layout) -> dict[Item, str]:
    """Each target item's dtype: the source's for the same state where known, else bf16 weights and fp32 states."""
    by_state: dict[str, str] = {}
    for it, loc in source.where.items():
        by_state.setdefault(it.state, loc.dtype)
    return {it: by_state.get(it.state, "bfloat16" if it.state == "param" else "float32") for it in layout.items}


# --- writing --------------------------------------------------------------------------------


class _Writer:
    """Builds each rank's object trees with TensorSpec leaves and streams the item bytes into them."""

    def __init__(self, target: Target, out: Path, fill: Fill, progress: Callable[[int], None] | None,
                 only: Collection[Path] | None = None, window_bytes: int = WINDOW_BYTES) -> None:
        self.only = None if only is None else set(only)
        self.window_bytes = window_bytes
        self.t = target
        self.x = target.extra
        self.out = out
        self.fill = fill
        self.progress = progress
        self.topo = target.topology
        if "model_order" not in self.x:
            raise CheckpointFormatError("target has no megatron state; make it with the megatron format's target()")
        self._optim_items: dict[tuple[str, int, int, int, int], dict[str, Item]] = {}
        for it in target.layout.items:
            if it.section in _FLAT_NAMES:
                u = dict(it.unit)
                self._optim_items.setdefault((it.section, u["tp"], u["pp"], u.get("ep", 0), it.chunk), {})[it.state] = it

    def run(self) -> list[Path]:
        x = self.x
        release = x.get("release")
        it_dir = "release" if release else f"iter_{int(x['iteration']):07d}"
        written: list[Path] = []
        for p in range(self.topo.pp):
            for e in range(self.topo.ep):
                for t in range(self.topo.tp):
                    rel = Path(it_dir) / _rank_dir_name(t, p, self.topo.pp, e, self.topo.ep)
                    (self.out / rel).mkdir(parents=True, exist_ok=True)
                    if self.only is None or rel / MODEL_FILE in self.only:
                        self._file(self.out / rel / MODEL_FILE, self._model_tree(t, p, e))
                        written.append(rel / MODEL_FILE)
                    if x["optimizer"]["kind"] == "distributed" and (self.only is None or rel / DISTOPT_FILE in self.only):
                        self._file(self.out / rel / DISTOPT_FILE, self._distopt_tree(t, p, e))
                        written.append(rel / DISTOPT_FILE)
        if not self.only:  # the tracker: by a full write, or the call with only=() after parallel workers
            (self.out / TRACKER).write_text("release" if release else str(int(x["iteration"])))
            written.append(Path(TRACKER))
        return written

    # -- trees

    def _leaf(self, sources: dict, item: Item) -> TensorSpec:
        key = len(sources)
        sources[key] = item
        return TensorSpec(self._dtype(item), self.t.layout.items[item].shape, key=key)

    def _small_leaf(self, sources: dict, obj: Any) -> Any:
        """A copy of ``obj`` with SmallTensors as TensorSpec leaves, their bytes noted in ``sources``."""
        def leaf(st: SmallTensor) -> TensorSpec:
            key = len(sources)
            sources[key] = st
            return TensorSpec(st.dtype, st.shape, key=key)
        return _map_small(obj, leaf)

    def _dtype(self, item: Item) -> str:
        dtype = self.t.dtypes.get(item)
        if dtype is None:
            dtype = "float32" if item.state != "param" else "bfloat16"
        return dtype

    def _model_tree(self, t: int, p: int, e: int) -> tuple[dict, dict]:
        x = self.x
        sources: dict[int, Any] = {}  # TensorSpec key -> the Item or SmallTensor its bytes come from
        entries: dict[str, Any] = {
            "args": argparse.Namespace(**x["args"]),
            "checkpoint_version": x["checkpoint_version"],
            "iteration": int(x["iteration"]),
        }
        chunks = {}
        order = x["model_order"]
        for c in range(self.topo.vpp):
            sd = OrderedDict()
            for key, value in order.get((t, p, e, c), []):
                is_item = isinstance(value, Item)
                sd[key] = self._leaf(sources, value) if is_item else self._small_leaf(sources, value.value)
            chunks["model" if self.topo.vpp == 1 else f"model{c}"] = _nested(sd)
        entries.update(chunks)
        optimizer = self._optimizer(t, p, e, sources)
        if optimizer is not None:
            entries["optimizer"] = optimizer
        if x.get("opt_param_scheduler") is not None:
            entries["opt_param_scheduler"] = self._small_leaf(sources, x["opt_param_scheduler"])
        for k, v in x.get("other", {}).items():
            entries[k] = self._small_leaf(sources, v)
        if (t, p, e) in x.get("rng_state", {}):
            entries["rng_state"] = self._small_leaf(sources, x["rng_state"][(t, p, e)])
        return _ordered_top(entries, x.get("top_keys") or [], list(chunks)), sources

    def _params(self, t: int, p: int, e: int = 0) -> list[tuple[int, str, Item]]:
        """This rank's parameters in named_parameters order over its model chunks."""
        order = self.x["model_order"]
        return [(c, key, v) for c in range(self.topo.vpp) for key, v in order.get((t, p, e, c), [])
                if isinstance(v, Item)]

    def _optimizer(self, t: int, p: int, e: int, sources: dict) -> Any:
        o = self.x["optimizer"]
        kind = o["kind"]
        if kind is None:
            return None
        if kind == "distributed":
            def one(groups: list[dict]) -> dict[str, Any]:
                out: dict[str, Any] = {"optimizer": {"param_groups": self._small_leaf(sources, groups)}}
                if o["has_grad_scaler"]:
                    out["grad_scaler"] = self._small_leaf(sources, o["grad_scaler"])
                return out
            if o.get("expert_param_groups") is None:
                return one(o["param_groups"])
            return [one(o["param_groups"]), one(o["expert_param_groups"])]
        params = self._params(t, p, e)
        where = f"{self.t.spec_name} at {self.topo}, rank tp={t}, pp={p}{f', ep={e}' if self.topo.ep > 1 else ''}"
        if o.get("expert_param_groups") is None:
            return self._one_optimizer(params, o["param_groups"], sources, where)
        return [self._one_optimizer([x for x in params if not _is_expert(x[1])], o["param_groups"], sources, where),
                self._one_optimizer([x for x in params if _is_expert(x[1])], o["expert_param_groups"], sources,
                                    where + ", expert optimizer")]

    def _one_optimizer(self, params: list[tuple[int, str, Item]], param_groups: list[dict], sources: dict,
                       where: str) -> Any:
        """One fp16 or fp32 optimizer's state dict over ``params``."""
        o = self.x["optimizer"]
        kind = o["kind"]
        groups = [dict(g) for g in param_groups]
        out: dict[str, Any] = {}
        assign = _assign_groups(groups, [(key, self.t.layout.items[it].shape) for _, key, it in params], where)
        state: dict[int, dict] = {}
        masters: list[list[TensorSpec]] = []
        n = 0
        for g, members in enumerate(assign):
            ids, group_masters = [], []
            for k in members:
                _, _, item = params[k]
                ids.append(n)
                per = {}
                for name in o["state_keys"]:
                    per[name] = self._small_leaf(sources, o["step"]) if name == "step" else \
                        self._leaf(sources, replace(item, state=name))
                state[n] = per
                if kind == "fp16":
                    if self._dtype(item) not in ("bfloat16", "float16"):
                        raise CheckpointFormatError(
                            f"{item}: a {self._dtype(item)} weight with an fp32 main param; Megatron keeps main "
                            "params for 16-bit weights only")
                    group_masters.append(self._leaf(sources, replace(item, state="master")))
                n += 1
            groups[g] = self._small_leaf(sources, {**groups[g], "params": ids})
            masters.append(group_masters)
        inner = {"state": {i: state[i] for i in sorted(state) if state[i]}, "param_groups": groups}
        if kind == "fp32":
            return inner
        out["optimizer"] = inner
        if o["has_grad_scaler"]:
            out["grad_scaler"] = self._small_leaf(sources, o["grad_scaler"])
        out["fp32_from_fp16_params"] = masters
        return out

    def _distopt_tree(self, t: int, p: int, e: int) -> tuple[Any, dict]:
        """distrib_optim.pt of rank (t, p, e): one optimizer's buffers, or [dense, expert] with the dense ones
        only in the ep rank 0 file (its writer is dense data-parallel rank 0; save_parameter_state)."""
        sources: dict[int, Any] = {}
        if self.x["optimizer"].get("expert_param_groups") is None:
            return self._buffers_tree("optim", t, p, e, sources), sources
        dense = self._buffers_tree("optim", t, p, e, sources) if e == 0 else None
        return [dense, self._buffers_tree("expert_optim", t, p, e, sources)], sources

    def _buffers_tree(self, section: str, t: int, p: int, e: int, sources: dict[int, Any]) -> dict:
        o = self.x["optimizer"]
        tree: dict[Any, Any] = {"buckets_coalesced": True}
        gbuf = 0
        for c in range(self.topo.vpp):
            items = self._optim_items.get((section, t, p, e, c))
            if not items:
                continue
            params = [v for k, v in self.x["model_order"].get((t, p, e, c), []) if isinstance(v, Item)]
            param_dtype = self._dtype(params[0]) if params else "bfloat16"
            grad_dtype = o.get("grad_dtype") or ("float32" if self.x["args"].get("accumulate_allreduce_grads_in_fp32")
                                                   else param_dtype)
            n = self.t.layout.items[next(iter(items.values()))].shape[0]
            buf: dict[str, Any] = {(_MAIN[0] if s == _MAIN[1] else s): self._leaf(sources, items[s])
                                   for s in o["opt_states"]}
            buf["numel_unpadded"] = n
            tree[gbuf] = {(TorchDtype(param_dtype), TorchDtype(grad_dtype)): buf}
            gbuf += 1
        return tree

    # -- bytes

    def _file(self, path: Path, tree_and_sources: tuple[Any, dict]) -> None:
        tree, sources = tree_and_sources
        with TorchFileWriter(path, tree) as w:
            for key in w.entries:
                src = sources[key]
                if isinstance(src, SmallTensor):
                    w.write(key, src.data)
                    continue
                stream_item(self.fill, src, self.t.layout.items[src].numel, self._dtype(src),
                            lambda data, key=key: w.write(key, data), self.progress, self.window_bytes)


_TOP_ORDER = ("args", "checkpoint_version", "iteration", "<models>", "optimizer", "opt_param_scheduler",
              "rerun_state_machine", "rng_state", "num_floating_point_operations_so_far")


def _ordered_top(entries: dict[str, Any], source_keys: list[str], models: list[str]) -> dict[str, Any]:
    """The top-level dict in the source file's key order, else generate_state_dict's."""
    base = [k for k in source_keys if not re.fullmatch(r"model[0-9]*", k)]
    if source_keys:
        first_model = next((i for i, k in enumerate(source_keys) if re.fullmatch(r"model[0-9]*", k)), None)
        if first_model is not None:
            base.insert(sum(1 for k in source_keys[:first_model] if not re.fullmatch(r"model[0-9]*", k)), "<models>")
    order = base or list(_TOP_ORDER)
    for k in _TOP_ORDER:  # entries the source lacked (an optimizer it did not have, ...), in canonical position
        if k not in order:
            after = [o for o in _TOP_ORDER[: _TOP_ORDER.index(k)] if o in order]
            order.insert(order.index(after[-1]) + 1 if after else 0, k)
    out: dict[str, Any] = {}
    for k in order:
        if k == "<models>":
            out.update({m: entries[m] for m in models})
        elif k in entries:
            out[k] = entries[k]
    out.update({k: v for k, v in entries.items() if k not in out})
    return out


FORMAT = MegatronFormat()
