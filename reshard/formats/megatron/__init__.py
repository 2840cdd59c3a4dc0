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

Non-tensor state goes to ``Source.extra["megatron"]``, a ``MegatronState`` (see
``MegatronFormat.open``; a torch_dist source's is a ``TorchDistState`` under
``extra["torch_dist"]``, and ``carried_args`` reads either's ``args``). Small non-model
tensors inside it (rng states, per-parameter ``step``, a loss scale, TE ``_extra_state``)
are read into ``SmallTensor``s, at most ``SMALL_TENSOR_LIMIT`` bytes each; model and
optimizer tensors are never read by ``open``.

Identity. Megatron keeps no Hugging Face config; the ``config.json``, ``generation_config.json``
and tokenizer files a source carried are written beside the tracker (``reshard.formats.identity``)
and read back from the save directory or its parent into ``Source.model``. The family is the one
the args describe; a carried config must name it (one that names another model is an error, never
a choice), and where the args describe no family a config of a known family says which it is.
Without either, a torch-format checkpoint cannot be laid out: its tensor-parallel shards do not
record which dimension tp split, and the error names the first such tensor and what to pass.

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
distributed optimizer; ``megatron-mixtral*``, ``megatron-qwen3_moe*`` with q/k norms, ``megatron-gpt_oss*``
with biases and sinks; ``-local`` with
``--transformer-impl local``,
``moe_spec`` picks one; sizes with ``experts``).

Grouped-GEMM experts (``--moe-grouped-gemm``): ``GroupedMLP``'s ``weight1``/``weight2`` (``-grouped``) and
``TEGroupedMLP``'s ``weight{e}`` (``-tegrouped``, without the distributed optimizer), chosen from the args
(``reshard.models.moe_experts``).

Not supported yet (each raises ``CheckpointFormatError`` saying so): experts with their own tp (``--expert-tensor-parallel-size`` other than tp), MoE
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

The package (imports go downward only, ``format`` at the top):

- ``format``: ``MegatronFormat`` (``detect``, ``open``, ``target``, ``write``, ``files_of``) and ``FORMAT``;
- ``reader``: ``_Reader``, rank files' tensors to layout items, and the non-tensor state ``open`` reports;
- ``writer``: ``_Writer``, the rank files and the tracker streamed to disk;
- ``state``: the typed non-tensor state (``MegatronState``, ``MegatronOptimizer``, ``OptimizerKind``,
  ``TorchDistState``) kept in ``Source.extra``/``Target.extra``, and ``carried_args``;
- ``extra``: the non-tensor state of a target (``Target.extra``) and ``write_fixture_extra``;
- ``args``: Megatron's ``args`` read (topology, pipeline, sizes) and made for a target (``megatron_args``);
- ``specs``: spec choice (``SPECS``, ``moe_spec``), ``_resolve``, Megatron's parameter registration order;
- ``param_groups``: the optimizer's weight-decay param groups;
- ``rng``: the rng state of a rank at the start of a run (``torch_cpu_rng_state``);
- ``small``: ``SmallTensor`` and reading small non-model tensors;
- ``files``: the tracker, directories and rank files on disk, and reading a rank file's object tree;
- ``identity``: which model a checkpoint holds (its args' family, which a carried ``config.json`` must agree
  with), the identity a target carries, and the error for a model no family describes;
- ``torch_dist``: the ``mcore-dist`` format, megatron-core's ``torch_dist`` checkpoints (``FORMAT`` of its own);
- ``dist_derived``: a ``torch_dist`` checkpoint of a model no family describes, laid out from ``.metadata`` alone;
- ``dist_optim``: the distributed optimizer's ``dp_reshardable`` bucket space in a ``torch_dist`` checkpoint,
  decoded per parameter through the family's ``-distopt`` specs.
"""

from __future__ import annotations

from reshard.formats.megatron.args import megatron_args
from reshard.formats.megatron.extra import write_fixture_extra
from reshard.formats.megatron.format import FORMAT, MegatronFormat
from reshard.formats.megatron.rng import torch_cpu_rng_state
from reshard.formats.megatron.state import (
    MegatronOptimizer,
    MegatronState,
    OptimizerKind,
    TorchDistState,
    carried_args,
)
from reshard.io.torch_types import SmallTensor

__all__ = ["FORMAT", "MegatronFormat", "MegatronOptimizer", "MegatronState", "OptimizerKind", "SmallTensor",
           "TorchDistState", "carried_args", "megatron_args", "torch_cpu_rng_state", "write_fixture_extra"]
