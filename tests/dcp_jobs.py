"""Real PyTorch DCP jobs on CPU with gloo: FSDP2, DTensor tensor parallelism and 2-D meshes.

Importable (no side effects) and runnable as a script; the test suite calls
``save`` and ``load``, which run ``python tests/dcp_jobs.py ...`` with
``torch.multiprocessing.spawn`` inside, one process per rank.

- ``save``: a tiny ``LlamaForCausalLM`` (transformers) parallelized by
  ``mode`` (``fsdp``: ``fully_shard`` per layer then the root; ``tp``:
  ``parallelize_module`` with ColwiseParallel q/k/v/gate/up and
  RowwiseParallel o/down; ``2d``: that plan on the ``tp`` submesh, then
  ``fully_shard`` on ``dp``), trained ``steps`` Adam steps, then
  ``dcp.save({"model": msd, "optim": osd})`` of ``get_state_dict``.
- ``load``: the same model freshly built with another seed and parallelized at
  the given mesh, ``dcp.load`` into ``get_state_dict``'s dicts, then
  ``set_state_dict``; rank 0 writes every tensor in full (``full_tensor()``)
  under DCP's flat keys to a torch file, then one more training step runs
  and its loss is added (``loss_after_step``).
- ``load_model``: as ``load`` with the model alone, of the transformers model whose ``config.json`` is in the
  directory ``RESHARD_DCP_HF`` names (``fully_shard`` per decoder layer then the root), with no step after it.
- ``save`` and ``load`` with ``hf`` given: of that model (FSDP2 only), freshly built from its config.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from jobs import exit_now, run_job

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
    "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 300,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
}
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], world: int, **extra: str) -> None:
    env = {**os.environ, **extra, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "RESHARD_DCP_PORT": str(_free_port()), "RESHARD_DCP_WORLD": str(world)}
    code, err = run_job([sys.executable, __file__, *args], env)
    if code:
        raise RuntimeError(f"dcp job {args} failed ({code}):\n{err[-4000:]}")


def save(out: Path, mode: str, world: int, *, dp: int | None = None, steps: int = 2, hf: Path | None = None) -> None:
    """A real checkpoint at ``out`` written by ``world`` ranks (``2d``: ``dp`` x ``world // dp``), of the model
    whose config.json is in ``hf`` where given."""
    _run(["save", str(out), mode, str(dp or 0), str(steps)], world, **_hf(hf))


def load(ckpt: Path, mode: str, world: int, dump: Path, *, dp: int | None = None, hf: Path | None = None) -> None:
    """Real ``dcp.load`` of ``ckpt`` at this mesh; full tensors (and one step's loss) to ``dump``."""
    _run(["load", str(ckpt), mode, str(dp or 0), str(dump)], world, **_hf(hf))


def _hf(hf: Path | None) -> dict[str, str]:
    return {"RESHARD_DCP_HF": str(hf)} if hf is not None else {}


def flatten(tree: object, prefix: str = "") -> dict:
    """A nested state dict as DCP's flat keys (``optim.state.<fqn>.exp_avg``, ``optim.param_groups.0.lr``)."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, list) and not (tree and isinstance(tree[0], str)):
        out = {}
        for i, v in enumerate(tree):
            out.update(flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: tree}


# -- inside the ranks ------------------------------------------------------------------------------------


def load_model(ckpt: Path, hf: Path, world: int, dump: Path) -> None:
    """Real ``dcp.load`` of just the model of ``ckpt`` into the transformers model of ``hf``'s config.json, sharded
    by FSDP2 over ``world`` ranks; its full tensors to ``dump``."""
    _run(["load_model", str(ckpt), "fsdp", "0", str(dump)], world, RESHARD_DCP_HF=str(hf))


def _model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if "RESHARD_DCP_HF" in os.environ:
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.environ["RESHARD_DCP_HF"])).float()
    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    return LlamaForCausalLM(config).float()


def _parallelize(model, mode: str, world: int, dp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mode == "fsdp":
        mesh, fsdp_mesh, tp_mesh = init_device_mesh("cpu", (world,)), None, None
        fsdp_mesh = mesh
    elif mode == "tp":
        tp_mesh, fsdp_mesh = init_device_mesh("cpu", (world,)), None
    elif mode == "2d":
        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
        fsdp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    else:
        raise ValueError(f"unknown mode {mode}")
    if tp_mesh is not None:
        plan = {**{n: ColwiseParallel() for n in _COLWISE}, **{n: RowwiseParallel() for n in _ROWWISE}}
        for layer in model.model.layers:
            parallelize_module(layer, tp_mesh, plan)
    if fsdp_mesh is not None:
        for layer in _layers(model):
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return model


def _layers(model):
    """A transformers causal LM's decoder layers: ``model.layers`` (Llama and most), ``transformer.h`` (GPT-2)."""
    base = model.model if hasattr(model, "model") else model.transformer
    return base.layers if hasattr(base, "layers") else base.h


def _step(model, opt, step: int) -> float:
    import torch

    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _rank(rank: int, world: int, port: int, args: list[str]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        action, path, mode, dp = args[0], Path(args[1]), args[2], int(args[3])
        model = _parallelize(_model(0 if action == "save" else 1234), mode, world, dp)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if action == "save":
            for step in range(int(args[4])):
                _step(model, opt, step)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        elif action == "load_model":
            msd = model.state_dict()
            dcp.load({"model": msd}, checkpoint_id=path)
            model.load_state_dict(msd)
            full = {f"model.{k}": (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                    for k, v in model.state_dict().items()}
            if rank == 0:
                torch.save(full, args[4])
        else:
            msd, osd = get_state_dict(model, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            msd, osd = get_state_dict(model, opt)
            full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in
                    flatten({"model": msd, "optim": osd}).items()}
            full = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in full.items()}
            full["loss_after_step"] = _step(model, opt, 99)
            if rank == 0:
                torch.save(full, args[4])
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_now()  # no destroy_process_group: gloo's teardown is where these jobs crashed, after the work was done


def _main() -> None:
    import torch.multiprocessing as mp

    world, port = int(os.environ["RESHARD_DCP_WORLD"]), int(os.environ["RESHARD_DCP_PORT"])
    mp.spawn(_rank, args=(world, port, sys.argv[1:]), nprocs=world)


if __name__ == "__main__":
    _main()
