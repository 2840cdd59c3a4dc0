"""Real Megatron-FSDP ``fsdp_dtensor`` checkpoints, written on CPU with gloo.

Importable (no side effects) and runnable as a script. ``save`` runs ``python tests/mcore_fsdp_jobs.py save
DP OUT TP EP``: ``tp * dp`` ranks each build ``mcore_jobs``'s Llama-style ``GPTModel`` (local layers, fp32), or at
ep > 1 ``mcore_moe_jobs``'s Mixtral-style one (SequentialMLP experts, each offset by its global number), wrap it in
megatron-core 0.16's ``FullyShardedDataParallel`` (``use_megatron_fsdp``, ``optim_grads_params``: weights,
gradients and optimizer state sharded over dp), take one Adam step with its ``DistributedOptimizer`` and save
what Megatron's trainer saves for ``--ckpt-format fsdp_dtensor``: ``{"model": the wrapper's state_dict(),
"optimizer": sharded_state_dict(metadata={"distrib_optim_sharding_type": "fsdp_dtensor"}), "args", "iteration",
"checkpoint_version"}`` after megatron-core's own preprocessing (``handle_fp8_extra_state_case``,
``handle_swiglu_in_state_dict``, ``handle_experts_in_state_dict``, ``preprocess_state_dict_for_uneven_dtensor``),
with ``torch.distributed.checkpoint.save``. Each rank also gathers every DTensor it saved to the whole tensor over the DTensor's mesh (its chunk and
offsets from megatron-core's own uneven-chunk metadata) and rank 0 dumps them all to ``OUT/../full.pt``, keyed as
stored. Megatron-FSDP has no pipeline parallelism: its device meshes span dp, ep and tp.

CPU stand-ins, in this process only: at tp > 1 Transformer Engine's linear type and the CUDA RNG states synced
over tp (``mcore_fsdp_adapter``); CUDA streams and the device index (``MegatronFSDP.__init__``), the
device meshes' device type (``mcore_fsdp_adapter._init_dist_index`` builds them for "cuda"), ``Tensor.cuda``
(``uneven_dtensor.validate_uneven_dtensor``) and tensors made ``device="cuda"`` (the optimizer's overflow flag).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from jobs import exit_now, run_ranks

ITERATION = 10  # mcore_moe_jobs.ITERATION: its load resumes these runs


def save(out: Path, dp: int, tp: int = 1, ep: int = 1) -> None:
    """A real fsdp_dtensor checkpoint at ``out``, written by ``tp * dp`` ranks: ``mcore_jobs``'s Llama, or at
    ep > 1 ``mcore_moe_jobs``'s Mixtral (its sizes and args); the saved tensors whole in
    ``out.parent / "full.pt"``."""
    run_ranks(__file__, ["save", str(dp), str(out), str(tp), str(ep)], "Megatron-FSDP")


def _cpu_only(torch) -> None:
    """``mcore_moe_jobs.cpu_only``, and Megatron-FSDP's CUDA streams and device meshes on the CPU."""
    import mcore_moe_jobs

    class Stream:
        def __init__(self, *a, **k): ...
        def wait_stream(self, *a, **k): ...
        def synchronize(self): ...

    mcore_moe_jobs.cpu_only(torch)
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter

    # 0.16: a stand-in object without Transformer Engine, which tp > 1 tests with isinstance (0.19 compares names)
    if hasattr(adapter, "TELinear") and not isinstance(adapter.TELinear, type):
        adapter.TELinear = type("NoTransformerEngine", (), {})
    adapter.FullyShardedDataParallel.sync_rng_states_across_tp_group = lambda self: None  # CUDA RNG states only
    torch.cuda.current_device = lambda: 0
    torch.cuda.Stream = Stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: Stream()
    from torch.distributed.device_mesh import DeviceMesh

    from_group = DeviceMesh.from_group

    def cpu_mesh(*a, **k):
        k["device_type"] = "cpu"
        return from_group(*a, **k)
    DeviceMesh.from_group = staticmethod(cpu_mesh)


def _whole(torch, dist, dtensor):
    """The whole tensor of an unevenly sharded DTensor: each rank's chunk at the offsets megatron-core computed,
    gathered over the DTensor's own mesh where it is 1-D (the dp group, or the expert dp group of an expert), else
    over every rank (a dp x tp mesh: every rank saves the same keys)."""
    (chunk,) = dtensor._local_tensor.__create_chunk_list__()
    group = dtensor.device_mesh.get_group() if dtensor.device_mesh.ndim == 1 else None
    held = [None] * dist.get_world_size(group)
    dist.all_gather_object(held, (tuple(chunk.offsets), dtensor.to_local().clone()), group=group)
    whole = torch.zeros(dtensor.shape, dtype=dtensor.dtype)
    for offsets, local in held:
        if local.numel():
            whole[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))] = local
    return whole


def _rank(rank: int, world: int, port: int, out: str, tp: int, ep: int) -> None:
    import torch

    _cpu_only(torch)
    import mcore_moe_jobs
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.fsdp_dtensor_checkpoint import (
        handle_experts_in_state_dict,
        handle_fp8_extra_state_case,
        handle_swiglu_in_state_dict,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Megatron-FSDP's device meshes span dp, ep and tp only (mcore_fsdp_adapter._get_dp_tp_mesh): no pipeline
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                             expert_model_parallel_size=ep)
    experts = mcore_moe_jobs.SIZES["experts"] if ep > 1 else None
    if experts:
        a, padded = mcore_moe_jobs._args(tp, 1, ep, world // tp, True), mcore_moe_jobs.padded_vocab(tp)
    else:
        from mcore_jobs import _args, padded_vocab

        a, padded = _args(tp, 1), padded_vocab(tp)
    moe = {"num_moe_experts": experts, "moe_router_topk": 2, "moe_token_dispatcher_type": "allgather",
           "moe_ffn_hidden_size": a.ffn_hidden_size} if experts else {}
    vars(a).update(transformer_impl="local", use_megatron_fsdp=True, ckpt_format="fsdp_dtensor",
                   use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params",
                   optimizer="adam", lr=1e-3, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
                   adam_eps=1e-8)  # the trainer's args hold its optimizer's (OptimizerConfig's, below)
    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups, kv_channels=a.kv_channels, ffn_hidden_size=a.ffn_hidden_size,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, **moe)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
                         num_experts=experts, normalization="RMSNorm"),
                     vocab_size=padded, max_sequence_length=64, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    if experts:  # CPU initialization gives every ep rank the same experts: offset each by its global number
        local = experts // ep
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".local_experts." in name:
                    j = int(name.split(".local_experts.")[1].split(".")[0])
                    p.add_(float(parallel_state.get_expert_model_parallel_rank() * local + j))
    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                        data_parallel_sharding_strategy="optim_grads_params")
    fsdp = FullyShardedDataParallel(config, ddp, model, device=torch.device("cpu"))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                                                 params_dtype=torch.float32), [fsdp])
    for group in opt.optimizer.param_groups:  # gradients that are a function of the weights, on every shard
        for p in group["params"]:
            p.grad = p.detach() * 0.5 + 0.01
    ok, _, _ = opt.step()
    assert ok
    state = {"model": fsdp.state_dict_for_save_checkpoint(), "args": a, "iteration": ITERATION,
             "checkpoint_version": 3.0}
    state["optimizer"] = opt.sharded_state_dict(state, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    handle_fp8_extra_state_case(state["model"])
    state["model"], _ = handle_swiglu_in_state_dict(fsdp, state["model"], None)
    if experts:  # local expert numbers made global (the trainer's preprocess_fsdp_dtensor_state_dict)
        state["model"] = handle_experts_in_state_dict(state["model"], experts)
    # The optimizer's keys name the parameters one wrapper deeper than the model's (module.module.<name>, from
    # _param_name over the wrapper's named_parameters); handle_swiglu_in_state_dict looks them up one level down.
    _, state["optimizer"] = handle_swiglu_in_state_dict(fsdp.module, {}, state["optimizer"])
    preprocess_state_dict_for_uneven_dtensor(state)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out))
    full = {}
    for key, value in state["model"].items():
        if isinstance(value, DTensor):
            full[f"model.{key}"] = _whole(torch, dist, value)
    for name, states in state["optimizer"]["state"].items():
        for s, value in states.items():
            full[f"optimizer.state.{name}.{s}"] = _whole(torch, dist, value) if isinstance(value, DTensor) \
                else value.clone()
    held = [None] * world
    dist.all_gather_object(held, full)  # each ep rank saved experts of its own
    if rank == 0:
        torch.save({k: v for f in held for k, v in f.items()}, Path(out).parent / "full.pt")
    dist.barrier()
    exit_now()  # no destroy_process_group: gloo's teardown sometimes crashes after the work is done


if __name__ == "__main__":
    import torch

    import mcore_moe_jobs
    from jobs import spawn

    dp, out, tp, ep = int(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:6])
    os.makedirs(out, exist_ok=True)
    mcore_moe_jobs.cpu_only(torch)  # before megatron-core is imported, as in a rank of its own
    spawn(_rank, (tp * dp, int(os.environ["RESHARD_MCORE_PORT"]), out, tp, ep), tp * dp)
