"""Real megatron-core mixture-of-experts checkpoints in Megatron's torch format, written on CPU with gloo.

Importable (no side effects) and runnable as a script. ``save`` runs
``python tests/mcore_moe_jobs.py save TP PP EP DP OUT DUMP``: ``tp * pp * dp`` ranks
each build their part of a Mixtral-style ``GPTModel`` (GQA, SwiGLU experts as
SequentialMLP ``local_experts``, RMSNorm, untied output layer) with megatron-core's
local layers at expert parallelism ``ep``, wrap it in megatron-core's
``DistributedDataParallel`` and take one step of ``get_megatron_optimizer``'s Adam
(a ``ChainedOptimizer`` of a dense and an expert optimizer when ep > 1). The rank that
Megatron-LM's ``save_checkpoint`` picks for each (tp, pp, ep) shard (data-parallel rank
0 or expert-data-parallel rank 0) then writes
``iter_0000010/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` with ``args``,
``checkpoint_version``, ``iteration``, ``model`` (``state_dict_for_save_checkpoint``) and
``optimizer`` (``optimizer.state_dict()``), as ``generate_state_dict`` does, plus the
tracker file. ``load`` builds the model and optimizer at another layout and loads one
such checkpoint with megatron-core's own ``load_state_dict`` calls, strictly, then steps
once more.

Both dump, per rank, what megatron-core holds: its (tp, pp, ep) coordinates from
``parallel_state`` and each parameter's value and Adam state by name, for the test to
compare under global layer and expert numbers. CUDA-only calls megatron-core makes on
the way (device tensors, a synchronize) are redirected to the CPU.

``options`` (``OPTIONS``) vary the run: ``dense`` builds the Llama-style model without
experts, ``bf16`` trains bf16 weights (fp32 grads and main params), ``bucket_size``
overlaps the grad reduce with buckets of that size, ``torch_dist`` saves the checkpoint
with ``dist_checkpointing.save`` as the trainer does (the distributed optimizer's state
``dp_reshardable``, megatron-core 0.16's default) instead of the torch format (and ``load``
reads torch_dist with ``dist_checkpointing.load``, as the trainer's ``load_checkpoint`` does), and
``next`` dumps once more after a further step (``DUMP/next/rank{r}.pt``), ``weights_only`` saves (and loads,
strictly: ``StrictHandling.RAISE_ALL``) a torch_dist checkpoint of the model alone (the trainer's
``--no-save-optim``), and ``qk_norm`` adds per-head q/k RMSNorms (``--qk-layernorm``: Qwen3-MoE style).
``fully_reshardable`` saves (and expects to load) the distributed optimizer's torch_dist state as
``fully_reshardable`` (the trainer's ``--dist-ckpt-optim-fully-reshardable``, gathered over dp as by
default), and ``family`` (with ``dense``) builds another family of ``mcore_jobs.FAMILIES`` instead of
Llama: ``gpt2`` (LayerNorm with biases, biases on every linear, GELU, learned positions, tied) or ``qwen2``
(q/k/v biases, tied). ``grouped`` builds the experts as megatron-core's legacy ``GroupedMLP`` (``--moe-grouped-gemm
--moe-use-legacy-grouped-gemm``: ``weight1`` and ``weight2`` per layer); the ``grouped_gemm`` package it asserts at
construction runs only in its forward, which these jobs never call, so the assertion is skipped.
``etp`` splits the experts over their own tensor-parallel degree (``--expert-tensor-parallel-size``) instead of tp,
``groups`` sets the query groups (``SIZES["g"]`` by default; tp 4 needs 4), and ``vocab`` the vocabulary
(``SIZES["vocab"]`` by default; one that leaves no tp rank's rows all padding at tp 4 needs more than 384).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from jobs import exit_now, run_ranks
from mcore_jobs import FAMILIES

SIZES = {"h": 32, "heads": 4, "g": 2, "hd": 8, "f": 48, "vocab": 300, "layers": 4, "experts": 4}
DIVISIBLE_BY = 128
ITERATION = 10
OPTIONS = {"dense": False, "bf16": False, "bucket_size": None, "torch_dist": False, "next": False,
           "weights_only": False, "qk_norm": False, "fully_reshardable": False, "family": "llama",
           "grouped": False, "etp": None, "groups": None, "vocab": None}


def padded_vocab(tp: int, vocab: int | None = None) -> int:
    multiple = DIVISIBLE_BY * tp
    return -(-(vocab or SIZES["vocab"]) // multiple) * multiple


def save(out: Path, dump: Path, tp: int, pp: int, ep: int, dp: int, distopt: bool = False, **options) -> None:
    """A real MoE checkpoint at ``out`` after one optimizer step, written by ``tp * pp * dp`` ranks
    (with ``distopt``, megatron-core's DistributedOptimizer and its ``distrib_optim.pt``); ``options``: ``OPTIONS``."""
    _job(["save", str(tp), str(pp), str(ep), str(dp), str(int(distopt)), _options(options), str(out), str(dump)])


def load(ckpt: Path, dump: Path, tp: int, pp: int, ep: int, dp: int, distopt: bool = False, **options) -> None:
    """megatron-core loads ``ckpt`` (torch format) into a model and optimizer built at tp/pp/ep/dp and steps once
    more."""
    _job(["load", str(tp), str(pp), str(ep), str(dp), str(int(distopt)), _options(options), str(ckpt), str(dump)])


def _options(given: dict) -> str:
    unknown = set(given) - set(OPTIONS)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)} (known: {sorted(OPTIONS)})")
    return json.dumps(OPTIONS | given)


def _job(args: list[str]) -> None:
    run_ranks(__file__, args, "megatron-core")


def _args(tp: int, pp: int, ep: int, dp: int, distopt: bool, opts: dict = OPTIONS) -> argparse.Namespace:
    s = SIZES
    experts = None if opts["dense"] else s["experts"]
    args = argparse.Namespace(
        num_layers=s["layers"], hidden_size=s["h"], ffn_hidden_size=s["f"], moe_ffn_hidden_size=s["f"],
        num_attention_heads=s["heads"], group_query_attention=True, num_query_groups=opts["groups"] or s["g"],
        kv_channels=s["hd"],
        vocab_size=opts["vocab"] or s["vocab"], padded_vocab_size=padded_vocab(tp, opts["vocab"]),
        make_vocab_size_divisible_by=DIVISIBLE_BY,
        swiglu=True, normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=opts["etp"] or tp, data_parallel_size=dp,
        world_size=tp * pp * dp, num_experts=experts, moe_router_topk=2 if experts else None,
        moe_grouped_gemm=opts["grouped"], moe_use_legacy_grouped_gemm=opts["grouped"], transformer_impl="local", use_distributed_optimizer=distopt,
        params_dtype="bfloat16" if opts["bf16"] else "float32", bf16=opts["bf16"],
        accumulate_allreduce_grads_in_fp32=opts["bf16"], overlap_grad_reduce=opts["bucket_size"] is not None,
        ddp_bucket_size=opts["bucket_size"], seed=1234, use_mcore_models=True, use_legacy_models=False,
        qk_layernorm=opts["qk_norm"], dist_ckpt_optim_fully_reshardable=opts["fully_reshardable"])
    vars(args).update(FAMILIES[opts["family"]])
    return args


def cpu_only(torch) -> None:
    """megatron-core on the CPU: its calls to CUDA devices, tensors and type names answered by the CPU's (once per
    process: a rank forked from a job that did it already keeps it)."""
    if getattr(torch.Tensor.type, "cpu_only", False):
        return
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        make = getattr(torch, name)

        def on_cpu(*a, _make=make, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return _make(*a, **k)
        setattr(torch, name, on_cpu)
    torch.Tensor.cuda = lambda self, *a, **k: self  # fully_reshardable's save gathers "on the GPU"
    type_of = torch.Tensor.type

    def cuda_type(self, *a, **k):  # the optimizers check for torch.cuda.*Tensor
        name = type_of(self, *a, **k)
        return name.replace("torch.", "torch.cuda.", 1) if not a and not k and "cuda" not in name else name
    cuda_type.cpu_only = True
    torch.Tensor.type = cuda_type


def _rank(rank: int, world: int, tp: int, pp: int, ep: int, distopt: bool, opts: dict, port: int, action: str,
          paths: list[str]) -> None:
    import torch

    cpu_only(torch)
    import torch.distributed as dist
    import torch.nn.functional as F

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=opts["etp"] or tp)
    if opts["grouped"]:  # GroupedMLP asserts the grouped_gemm package, which only its forward uses
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    s = SIZES
    experts = None if opts["dense"] else s["experts"]
    dtype = torch.bfloat16 if opts["bf16"] else torch.float32
    # GroupedMLP (moe_use_legacy_grouped_gemm) is gone from megatron-core 0.17 on
    legacy_grouped = {"moe_use_legacy_grouped_gemm": opts["grouped"]} \
        if "moe_use_legacy_grouped_gemm" in {f.name for f in dataclasses.fields(TransformerConfig)} else {}
    assert legacy_grouped or not opts["grouped"], "this megatron-core has no GroupedMLP"
    moe = {"num_moe_experts": experts, "moe_router_topk": 2, "moe_token_dispatcher_type": "allgather",
           "moe_grouped_gemm": opts["grouped"], **legacy_grouped} if experts else {}
    a = _args(tp, pp, ep, world // (tp * pp), distopt, opts)  # the family's structure
    config = TransformerConfig(
        num_layers=s["layers"], hidden_size=s["h"], num_attention_heads=s["heads"], num_query_groups=a.num_query_groups,
        kv_channels=s["hd"], ffn_hidden_size=s["f"], gated_linear_unit=a.swiglu,
        activation_func=F.silu if a.swiglu else F.gelu, normalization=a.normalization,
        add_bias_linear=a.add_bias_linear, add_qkv_bias=getattr(a, "add_qkv_bias", False),
        use_cpu_initialization=True, params_dtype=dtype, bf16=opts["bf16"], tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, pipeline_dtype=dtype,
        expert_tensor_parallel_size=opts["etp"] or tp,
        qk_layernorm=opts["qk_norm"], **moe)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                         num_experts=experts, moe_grouped_gemm=opts["grouped"], normalization=a.normalization,
                         qk_layernorm=opts["qk_norm"], **legacy_grouped),
                     vocab_size=padded_vocab(tp, opts["vocab"]), max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                     position_embedding_type=a.position_embedding_type)
    if opts["bf16"]:  # as the trainer's get_model does: every parameter bf16 (norms included)
        from megatron.core.transformer.module import Float16Module

        wrapped = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=distopt, grad_reduce_in_fp32=opts["bf16"],
        overlap_grad_reduce=opts["bucket_size"] is not None, bucket_size=opts["bucket_size"]),
        wrapped if opts["bf16"] else model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.0, bf16=opts["bf16"], fp16=False,
                        params_dtype=dtype, use_distributed_optimizer=distopt), [ddp])
    ep_rank, local = ps.get_expert_model_parallel_rank(), s["experts"] // ep
    coords = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(), "ep": ep_rank,
              "dp": ps.get_data_parallel_rank(), "edp": ps.get_expert_data_parallel_rank()}
    name = f"mp_rank_{coords['tp']:02d}" + (f"_{coords['pp']:03d}" if pp > 1 else "") + \
        (f"_{ep_rank:03d}" if ep > 1 else "")  # get_checkpoint_name
    it_dir = Path(paths[0]) / f"iter_{ITERATION:07d}" / name
    if action == "save":
        # CPU initialization gives every ep rank the same local experts: offset each by its global
        # number so that a misplaced expert shows. Replicas stay equal, as in training.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".local_experts." in name:
                    j = int(name.split(".local_experts.")[1].split(".")[0])
                    p.add_(float(ep_rank * local + j))
                elif name.endswith(".mlp.experts.weight1"):  # [h, local * 2f/tp], whose memory is [local, h, 2f/tp]
                    p.view(local, p.shape[0], -1).add_(torch.arange(local, dtype=p.dtype)[:, None, None]
                                                       + ep_rank * local)
                elif name.endswith(".mlp.experts.weight2"):  # [local * f/tp, h]: expert-major rows
                    p.view(local, -1, p.shape[1]).add_(torch.arange(local, dtype=p.dtype)[:, None, None]
                                                       + ep_rank * local)
        _step(ddp, optimizer)
        args = _args(tp, pp, ep, world // (tp * pp), distopt, opts)
        if opts["torch_dist"]:
            _save_torch_dist(Path(paths[0]), model, None if opts["weights_only"] else optimizer, args,
                             _sharding(opts))
        else:
            _save_torch(it_dir, rank, coords, model, optimizer, args, distopt)
    elif opts["torch_dist"]:
        _load_torch_dist(Path(paths[0]), model, None if opts["weights_only"] else optimizer, _sharding(opts))
    else:
        state = torch.load(it_dir / "model_optim_rng.pt", weights_only=False)
        model.load_state_dict(state["model"], strict=True)
        optimizer.load_state_dict(state["optimizer"])
        if distopt:
            # Without Apex or TE, load_state_dict gives each torch Adam state a 'step', which
            # load_parameter_state_from_dp_zero then looks for in distrib_optim.pt and fails on
            # (a checkpoint megatron-core itself saved included): set it aside around the call.
            steps = [(st, st.pop("step")) for o in optimizer.chained_optimizers for st in o.optimizer.state.values()
                     if "step" in st]
            with torch.no_grad():  # fp32 main params are views of the weights, which require grad
                optimizer.load_parameter_state(str(it_dir / "distrib_optim.pt"))
            for st, step in steps:  # one tensor shared by every state there: torch Adam would count a step
                st["step"] = step.clone()  # once per parameter
    _dump(Path(paths[1]) / f"rank{rank}.pt", model, optimizer, coords, torch)
    if action == "load" or opts["next"]:
        _step(ddp, optimizer)  # the loaded state trains on
    if opts["next"]:
        _dump(Path(paths[1]) / "next" / f"rank{rank}.pt", model, optimizer, coords, torch)
    dist.barrier()
    exit_now()  # no destroy_process_group: gloo's teardown sometimes crashes after the work is done


def _save_torch(it_dir: Path, rank: int, coords: dict, model, optimizer, args, distopt: bool) -> None:
    """Megatron-LM's torch format: ``model_optim_rng.pt`` per (tp, pp, ep) shard, ``distrib_optim.pt`` beside it."""
    import torch

    it_dir.mkdir(parents=True, exist_ok=True)
    if distopt:  # a collective; written by each optimizer's data-parallel rank 0 (save_parameter_state)
        optimizer.save_parameter_state(str(it_dir / "distrib_optim.pt"))
    if coords["edp"] == 0:  # save_checkpoint's writers of the torch format
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                 "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict()}
        torch.save(state, it_dir / "model_optim_rng.pt")
        if rank == 0:
            (it_dir.parent.parent / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def _sharding(opts: dict) -> dict:
    """The sharded state dict metadata the trainer builds (``_build_sharded_state_dict_metadata``) and saves as
    ``content_metadata``: the distributed optimizer's state ``dp_reshardable``, or ``fully_reshardable``."""
    if opts["fully_reshardable"]:
        return {"distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": False, "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}
    return {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}


def _save_torch_dist(out: Path, model, optimizer, args, metadata: dict) -> None:
    """torch_dist, as the trainer's ``save_checkpoint`` writes it: ``iter_XXXXXXX`` with the model's and the
    optimizer's sharded state dicts (the distributed optimizer's state as ``metadata`` says) and ``args``."""
    from megatron.core import dist_checkpointing

    model_sd = model.sharded_state_dict(metadata=metadata)
    state = {"model": model_sd, "args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    if optimizer is not None:  # None: the model alone (--no-save-optim)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)
    it_dir = out / f"iter_{ITERATION:07d}"
    it_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(it_dir), content_metadata=metadata)
    (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def _load_torch_dist(ckpt: Path, model, optimizer, expected: dict) -> None:
    """torch_dist, as the trainer's ``load_checkpoint`` reads it: the sharding type from the checkpoint's
    ``content_metadata``, the model's and the optimizer's sharded state dicts filled by
    ``dist_checkpointing.load``, then megatron-core's own ``load_state_dict`` calls (``ckpt`` is the
    checkpoint directory itself, or the directory holding ``iter_XXXXXXX``)."""
    import torch
    from megatron.core import dist_checkpointing

    it_dir = ckpt if (ckpt / "metadata.json").is_file() else ckpt / f"iter_{ITERATION:07d}"
    if optimizer is None:  # the model alone, every key on both sides matched (StrictHandling.RAISE_ALL)
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(it_dir), strict="raise_all")
        model.load_state_dict(state["model"], strict=True)
        return
    metadata = dist_checkpointing.load_content_metadata(str(it_dir))
    assert metadata == expected, (metadata, expected)
    # Without Apex or TE, DistributedOptimizer.state_dict (which sharded_state_dict calls) reads each torch
    # Adam state's 'step', which a freshly built optimizer does not have yet: give every parameter the
    # state Adam starts from (the trainer's GPU runs use TE's FusedAdam, which keeps the step in its groups).
    for o in optimizer.chained_optimizers:
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                o.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                        "exp_avg_sq": torch.zeros_like(p)}
    model_sd = model.sharded_state_dict(metadata=metadata)
    state = dist_checkpointing.load({"model": model_sd, "optimizer": optimizer.sharded_state_dict(
        model_sd, is_loading=True, metadata=metadata)}, str(it_dir))
    assert state["iteration"] == ITERATION and state["args"].use_distributed_optimizer
    model.load_state_dict(state["model"], strict=True)
    full = metadata["distrib_optim_sharding_type"] == "fully_reshardable"
    for o in optimizer.chained_optimizers if full else ():
        # Without Apex or TE, fully_reshardable's load copies every state the torch Adam holds, 'step' too,
        # which that format keeps in the param groups only: leave it out of the copy.
        def without_step(p, tensors, _o=o, _set=o._set_main_param_and_optimizer_states):
            group, order = _o.model_param_group_index_map[p]
            held = _o.optimizer.state[_o.optimizer.param_groups[group]["params"][order]]
            step = held.pop("step", None)
            _set(p, tensors)
            if step is not None:
                held["step"] = step
        o._set_main_param_and_optimizer_states = without_step
    with torch.no_grad():  # fp32 runs' main params are views of the weights, which require grad
        optimizer.load_state_dict(state["optimizer"])
    for o in optimizer.chained_optimizers if full else ():
        del o._set_main_param_and_optimizer_states
    # Without Apex or TE, load_state_dict gives every torch Adam state one shared 'step' tensor (which
    # torch Adam would count once per parameter) and not the groups' value: each its own, from its group.
    for o in optimizer.chained_optimizers:
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                o.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


def _step(ddp, optimizer) -> None:
    """One Adam step on gradients that are a function of the weights (equal on every replica)."""
    for p in ddp.parameters():
        p.main_grad.copy_(p.detach() * 0.5 + 0.01)
    ok, _, _ = optimizer.step()
    assert ok


def _dump(path: Path, model, optimizer, coords: dict, torch) -> None:
    """Each parameter's value and, per optimizer state, ``(start, end, values)``: the range of the flattened
    parameter this rank's optimizer holds (all of it, or its distributed optimizer shard)."""
    dump_named(path, {p: n for n, p in model.named_parameters()}, optimizer, coords, torch)


def dump_named(path: Path, names: dict, optimizer, coords: dict, torch) -> None:
    """``_dump`` of the parameters ``names`` names (param -> name: a model's, or several model chunks')."""
    params = {n: p.detach().clone() for p, n in names.items()}
    states: dict[str, dict] = {}
    for o in optimizer.chained_optimizers:
        if not hasattr(o, "model_param_gbuf_map"):  # the plain optimizer: whole parameters
            for p, st in o.optimizer.state.items():
                states[names[p]] = {k: (0, v.numel(), v.detach().flatten().clone()) if v.dim() else (0, 0, v.clone())
                                    for k, v in st.items() if k in ("exp_avg", "exp_avg_sq", "step")}
            continue
        for p in o.model_param_gbuf_map:  # DistributedOptimizer: the shard of each param this dp rank owns
            try:
                r = o._get_model_param_range_map(p)["param"]
            except KeyError:
                continue
            t = o._get_main_param_and_optimizer_states(p)
            states[names[p]] = {k: (r.start, r.end, v.detach().flatten().clone()) if v.dim() else (0, 0, v.clone())
                                for k, v in t.items() if k in ("param", "exp_avg", "exp_avg_sq", "step")}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"coords": coords, "params": params, "states": states}, path)


if __name__ == "__main__":
    import torch

    from jobs import spawn

    action = sys.argv[1]
    tp, pp, ep, dp, distopt = (int(a) for a in sys.argv[2:7])
    options, paths = json.loads(sys.argv[7]), sys.argv[8:]
    os.makedirs(paths[-1], exist_ok=True)
    cpu_only(torch)  # before megatron-core is imported, as in a rank of its own
    spawn(_rank, (tp * pp * dp, tp, pp, ep, bool(distopt), options, int(os.environ["RESHARD_MCORE_PORT"]), action,
                  paths), tp * pp * dp)
