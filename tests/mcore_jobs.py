"""Real megatron-core ``torch_dist`` checkpoints, written on CPU with gloo (weights only).

Importable (no side effects) and runnable as a script. ``save`` runs
``python tests/mcore_jobs.py save TP PP OUT``, which spawns ``tp * pp`` ranks that
each build their pipeline stage of a Llama-style ``GPTModel`` (GQA, SwiGLU,
RMSNorm, rotary, untied output layer, vocabulary padded as Megatron pads it)
with megatron-core's local layer spec and CPU initialization, and save
``{"model": sharded_state_dict, "args": ..., "iteration": ...}`` with
``dist_checkpointing.save`` (torch_dist backend), as Megatron's training loop
does; ``load`` builds the model at another tp/pp and loads a checkpoint with
megatron-core's own ``dist_checkpointing.load``. Two CUDA calls megatron-core
makes while saving are stubbed to the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from jobs import exit_now, run_ranks

SIZES = {"h": 64, "heads": 8, "g": 4, "hd": 8, "f": 160, "vocab": 300, "layers": 4}
DIVISIBLE_BY = 128


def padded_vocab(tp: int) -> int:
    multiple = DIVISIBLE_BY * tp
    return -(-SIZES["vocab"] // multiple) * multiple


def save(out: Path, tp: int, pp: int) -> None:
    """A real torch_dist checkpoint at ``out``, written by ``tp * pp`` ranks."""
    _job(["save", str(tp), str(pp), str(out)])


def load(ckpt: Path, tp: int, pp: int, dump: Path) -> None:
    """megatron-core's own ``dist_checkpointing.load`` of ``ckpt`` into a model built at tp/pp;
    each rank then saves its module ``state_dict()`` tensors to ``dump/rank{r}.pt``."""
    _job(["load", str(tp), str(pp), str(ckpt), str(dump)])


def _job(args: list[str]) -> None:
    run_ranks(__file__, args, "megatron-core")


def _args(tp: int, pp: int) -> argparse.Namespace:
    s = SIZES
    return argparse.Namespace(
        num_layers=s["layers"], hidden_size=s["h"], ffn_hidden_size=s["f"], num_attention_heads=s["heads"],
        group_query_attention=True, num_query_groups=s["g"], kv_channels=s["hd"], vocab_size=s["vocab"],
        padded_vocab_size=padded_vocab(tp), make_vocab_size_divisible_by=DIVISIBLE_BY, swiglu=True,
        normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype="float32", seed=1234)


def _rank(rank: int, world: int, tp: int, pp: int, port: int, action: str, paths: list[str]) -> None:
    import torch

    torch.cuda.synchronize = lambda *a, **k: None      # called around the save
    torch.cuda.current_device = lambda: "cpu"            # the failure flag it broadcasts
    import torch.distributed as dist
    import torch.nn.functional as F

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    s = SIZES
    config = TransformerConfig(
        num_layers=s["layers"], hidden_size=s["h"], num_attention_heads=s["heads"], num_query_groups=s["g"],
        kv_channels=s["hd"], ffn_hidden_size=s["f"], gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=padded_vocab(tp), max_sequence_length=64,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    if action == "save":
        state = {"model": model.sharded_state_dict(), "args": _args(tp, pp), "iteration": 10,
                 "checkpoint_version": 3.0}
        dist_checkpointing.save(state, paths[0])
    else:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, paths[0])
        model.load_state_dict(loaded["model"])
        tensors = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        torch.save(tensors, Path(paths[1]) / f"rank{rank}.pt")
    dist.barrier()
    exit_now()  # no destroy_process_group: gloo's teardown sometimes crashes after the work is done


if __name__ == "__main__":
    import torch.multiprocessing as mp

    action, tp, pp, paths = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    os.makedirs(paths[-1], exist_ok=True)
    mp.spawn(_rank, args=(tp * pp, tp, pp, int(os.environ["RESHARD_MCORE_PORT"]), action, paths), nprocs=tp * pp)
