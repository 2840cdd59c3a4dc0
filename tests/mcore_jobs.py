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

``save_families`` and ``load_families`` do the same for models of other families
(``FAMILIES``), several in one job, under ``ROOT/<family>/``: saving writes ``src/``
and dumps each rank's module ``state_dict()`` tensors to ``dump/rank{r}.pt``;
loading reads ``dist/`` strictly (a key missing on either side is an error) and
dumps to ``loaded/rank{r}.pt``.
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


FAMILIES = {
    "llama": {},
    "gpt2": {"swiglu": False, "normalization": "LayerNorm", "add_bias_linear": True,
             "position_embedding_type": "learned_absolute", "untie_embeddings_and_output_weights": False,
             "group_query_attention": False, "num_query_groups": None, "max_position_embeddings": 64},
    "qwen2": {"add_qkv_bias": True, "untie_embeddings_and_output_weights": False},
    "qwen3": {"qk_layernorm": True},
}
"""Family -> how its Megatron args differ from the Llama-style run's: GPT-2 style (LayerNorm with biases, biases
on every linear, GELU, learned positions, one key/value head per query head, tied), Qwen2 (q/k/v biases, tied),
Qwen3 (per-head q/k RMSNorms)."""


def save_families(root: Path, families: list[str], tp: int, pp: int) -> None:
    """Real torch_dist checkpoints of ``families`` at ``root/<family>/src``, and what each rank held."""
    _job(["save-families", str(tp), str(pp), str(root), *families])


def load_families(root: Path, families: list[str], tp: int, pp: int) -> None:
    """megatron-core's strict ``dist_checkpointing.load`` of each ``root/<family>/dist`` at tp/pp."""
    _job(["load-families", str(tp), str(pp), str(root), *families])


def _job(args: list[str]) -> None:
    run_ranks(__file__, args, "megatron-core")


def _args(tp: int, pp: int, family: str = "llama") -> argparse.Namespace:
    s = SIZES
    args = argparse.Namespace(
        num_layers=s["layers"], hidden_size=s["h"], ffn_hidden_size=s["f"], num_attention_heads=s["heads"],
        group_query_attention=True, num_query_groups=s["g"], kv_channels=s["hd"], vocab_size=s["vocab"],
        padded_vocab_size=padded_vocab(tp), make_vocab_size_divisible_by=DIVISIBLE_BY, swiglu=True,
        normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype="float32", seed=1234)
    vars(args).update(FAMILIES[family])
    return args


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

    def build(family: str):
        a = _args(tp, pp, family)
        config = TransformerConfig(
            num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
            num_query_groups=a.num_query_groups, kv_channels=a.kv_channels, ffn_hidden_size=a.ffn_hidden_size,
            gated_linear_unit=a.swiglu, activation_func=F.silu if a.swiglu else F.gelu, normalization=a.normalization,
            add_bias_linear=a.add_bias_linear, add_qkv_bias=getattr(a, "add_qkv_bias", False),
            qk_layernorm=getattr(a, "qk_layernorm", False), use_cpu_initialization=True, params_dtype=torch.float32,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
        spec = get_gpt_layer_local_spec(normalization=a.normalization, qk_layernorm=config.qk_layernorm)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded_vocab(tp),
                        max_sequence_length=64, pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage(),
                        share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
                        position_embedding_type=a.position_embedding_type)

    def held(model) -> dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}

    if action in ("save-families", "load-families"):
        root = Path(paths[0])
        for family in paths[1:]:
            torch.manual_seed(1234)
            model, out = build(family), root / family
            if action == "save-families":
                (out / "src").mkdir(parents=True, exist_ok=True)
                dist_checkpointing.save({"model": model.sharded_state_dict(), "args": _args(tp, pp, family),
                                         "iteration": 10, "checkpoint_version": 3.0}, str(out / "src"))
                dump = out / "dump"
            else:
                loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(out / "dist"),
                                                 strict="raise_all")
                model.load_state_dict(loaded["model"], strict=True)
                dump = out / "loaded"
            dump.mkdir(parents=True, exist_ok=True)
            torch.save(held(model), dump / f"rank{rank}.pt")
            dist.barrier()
        exit_now()
    torch.manual_seed(1234)
    model = build("llama")
    if action == "save":
        state = {"model": model.sharded_state_dict(), "args": _args(tp, pp), "iteration": 10,
                 "checkpoint_version": 3.0}
        dist_checkpointing.save(state, paths[0])
    else:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, paths[0])
        model.load_state_dict(loaded["model"])
        torch.save(held(model), Path(paths[1]) / f"rank{rank}.pt")
    dist.barrier()
    exit_now()  # no destroy_process_group: gloo's teardown sometimes crashes after the work is done


if __name__ == "__main__":
    from jobs import spawn

    action, tp, pp, paths = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    os.makedirs(paths[0] if action.endswith("-families") else paths[-1], exist_ok=True)
    spawn(_rank, (tp * pp, tp, pp, int(os.environ["RESHARD_MCORE_PORT"]), action, paths), tp * pp)
