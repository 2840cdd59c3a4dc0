"""Real megatron-core runs with virtual pipeline chunks and the distributed optimizer, torch_dist on CPU with gloo.

Importable (no side effects) and runnable as a script:
``python tests/mcore_vpp_jobs.py ACTION PP VPP DP OPTIONS CKPT DUMP`` (``jobs.run_ranks``). ``pp * dp`` ranks
each build ``vpp`` model chunks of ``mcore_moe_jobs``' dense Llama-style ``GPTModel`` (megatron-core's local
layers, bf16 weights wrapped in ``Float16Module``, fp32 grads), chunk ``c`` with ``vp_stage=c``, as the
trainer's ``get_model`` does: one ``DistributedDataParallel`` per chunk (``disable_bucketing`` on chunks > 0,
so only chunk 0 of pp rank 0 has several buckets), one ``get_megatron_optimizer`` over all chunks (one
``DistributedOptimizer``, a grad buffer per chunk: ``gbuf_idx`` is the chunk).

``save`` takes one Adam step and saves torch_dist as the trainer does (``model0``, ``model1``, ... and the
optimizer's ``dp_reshardable`` state); ``load`` reads CKPT with ``dist_checkpointing.load`` (``mcore_moe_jobs``'
way), then, with ``resave`` set, saves what it loaded to ``DUMP/resaved`` as ``save`` would, and to
``DUMP/resaved-zero`` with the optimizer's state as ``dp_zero_gather_scatter``. Both dump each
rank's parameters and optimizer shards under their global layer names (``DUMP/rank{r}.pt``, as
``mcore_moe_jobs.dump_named`` lays them out), step once more and dump again (``DUMP/next/``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jobs import exit_now, run_ranks

OPTIONS = {"bucket_size": None, "resave": False}


def save(out: Path, dump: Path, pp: int, vpp: int, dp: int, **options) -> None:
    _job(["save", str(pp), str(vpp), str(dp), json.dumps(OPTIONS | options), str(out), str(dump)])


def load(ckpt: Path, dump: Path, pp: int, vpp: int, dp: int, **options) -> None:
    _job(["load", str(pp), str(vpp), str(dp), json.dumps(OPTIONS | options), str(ckpt), str(dump)])


def _job(args: list[str]) -> None:
    run_ranks(__file__, args, "megatron-core vpp")


def _rank(rank: int, world: int, pp: int, vpp: int, opts: dict, port: int, action: str, paths: list[str]) -> None:
    import re

    import torch

    import mcore_moe_jobs as moe

    moe.cpu_only(torch)
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
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    s, dtype, bucket = moe.SIZES, torch.bfloat16, opts["bucket_size"]
    config = TransformerConfig(
        num_layers=s["layers"], hidden_size=s["h"], num_attention_heads=s["heads"], num_query_groups=s["g"],
        kv_channels=s["hd"], ffn_hidden_size=s["f"], gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype, bf16=True,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=dtype)
    chunks, ddps = [], []
    for c in range(vpp):
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=moe.padded_vocab(1), max_sequence_length=64,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=c),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=c),
                         share_embeddings_and_output_weights=False, position_embedding_type="rope", vp_stage=c)
        chunks.append(model)
        ddps.append(DistributedDataParallel(config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=bucket is not None,
            bucket_size=bucket), Float16Module(config, model), disable_bucketing=c > 0))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.0, bf16=True, fp16=False,
                        params_dtype=dtype, use_distributed_optimizer=True), ddps)
    names = {}  # parameter -> its name under the global layer number
    for model in chunks:
        numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
        for n, p in model.named_parameters():
            names[p] = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{numbers[int(m.group(1))]}.", n)
    # The names are global already: the dump says pp 0, so that readers of mcore_moe_jobs' dumps, which add the
    # stage's first layer to a layer number, keep them (the stage is under "stage").
    coords = {"tp": 0, "pp": 0, "ep": 0, "dp": ps.get_data_parallel_rank(), "edp": ps.get_expert_data_parallel_rank(),
              "stage": ps.get_pipeline_model_parallel_rank()}
    args = moe._args(1, pp, 1, world // pp, True, moe.OPTIONS | {"dense": True, "bf16": True, "bucket_size": bucket})
    vars(args).update(virtual_pipeline_model_parallel_size=vpp,
                      num_layers_per_virtual_pipeline_stage=s["layers"] // (pp * vpp))
    metadata = moe._sharding({"fully_reshardable": False})
    if action == "save":
        _step(ddps, optimizer)
        _save(Path(paths[0]), chunks, optimizer, args, metadata)
    else:
        _load(Path(paths[0]), chunks, optimizer, metadata)
        if opts["resave"]:  # as the trainer saves (dp_reshardable), and as with --no-ckpt-fully-parallel-save
            _save(Path(paths[1]) / "resaved", chunks, optimizer, args, metadata)
            _save(Path(paths[1]) / "resaved-zero", chunks, optimizer, args,
                  {**metadata, "distrib_optim_sharding_type": "dp_zero_gather_scatter"})
    moe.dump_named(Path(paths[1]) / f"rank{rank}.pt", names, optimizer, coords, torch)
    _step(ddps, optimizer)
    moe.dump_named(Path(paths[1]) / "next" / f"rank{rank}.pt", names, optimizer, coords, torch)
    dist.barrier()
    exit_now()


def _sharded(chunks, metadata: dict) -> dict:
    """The model's sharded state dict as the trainer's ``generate_state_dict`` keys it: ``model0``, ``model1``, ..."""
    return {f"model{c}": m.sharded_state_dict(metadata=metadata) for c, m in enumerate(chunks)}


def _save(out: Path, chunks, optimizer, args, metadata: dict) -> None:
    from megatron.core import dist_checkpointing

    state = {**_sharded(chunks, metadata), "args": args, "checkpoint_version": 3.0, "iteration": 10}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=metadata)
    it_dir = out / "iter_0000010"
    it_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(it_dir), content_metadata=metadata)
    (out / "latest_checkpointed_iteration.txt").write_text("10")


def _load(ckpt: Path, chunks, optimizer, expected: dict) -> None:
    """``mcore_moe_jobs._load_torch_dist``, per model chunk."""
    import torch
    from megatron.core import dist_checkpointing

    it_dir = ckpt if (ckpt / "metadata.json").is_file() else ckpt / "iter_0000010"
    metadata = dist_checkpointing.load_content_metadata(str(it_dir))
    assert metadata == expected, (metadata, expected)
    for o in optimizer.chained_optimizers:  # the state a fresh torch Adam lacks (mcore_moe_jobs._load_torch_dist)
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                o.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                        "exp_avg_sq": torch.zeros_like(p)}
    model_sd = _sharded(chunks, metadata)
    state = dist_checkpointing.load({**model_sd, "optimizer": optimizer.sharded_state_dict(
        model_sd, is_loading=True, metadata=metadata)}, str(it_dir))
    for c, m in enumerate(chunks):
        m.load_state_dict(state[f"model{c}"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    for o in optimizer.chained_optimizers:
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                o.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


def _step(ddps, optimizer) -> None:
    """One Adam step on gradients that are a function of the weights (``mcore_moe_jobs._step``, every chunk)."""
    for ddp in ddps:
        for p in ddp.parameters():
            p.main_grad.copy_(p.detach() * 0.5 + 0.01)
    ok, _, _ = optimizer.step()
    assert ok


if __name__ == "__main__":
    import torch

    import mcore_moe_jobs
    from jobs import spawn

    action = sys.argv[1]
    pp, vpp, dp = (int(a) for a in sys.argv[2:5])
    options, paths = json.loads(sys.argv[5]), sys.argv[6:]
    os.makedirs(paths[-1], exist_ok=True)
    mcore_moe_jobs.cpu_only(torch)  # before megatron-core is imported, as in a rank of its own
    spawn(_rank, (pp * dp, pp, vpp, options, int(os.environ["RESHARD_MCORE_PORT"]), action, paths), pp * dp)
