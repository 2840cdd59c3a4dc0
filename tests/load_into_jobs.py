"""Real FSDP2 / tensor-parallel jobs on CPU with gloo that load a checkpoint with ``reshard.torch.load_into``.

Importable (no side effects) and runnable as a script; the tests call ``run``, which runs ``python
tests/load_into_jobs.py OUT TASK...`` with one process per rank forked from a parent that has imported
torch and transformers once. The model is a tiny ``LlamaForCausalLM`` of the ``tiny-llama`` fixture's
sizes (or the transformers model of a given ``config.json``), parallelized as ``dcp_jobs`` does (``fsdp``: ``fully_shard`` per layer then the root; ``2d``: the
colwise/rowwise plan on a ``tp`` axis of 2, then ``fully_shard`` on ``dp``), with ``torch.optim.Adam``.

Tasks, run in order at one world size:

- ``save``: the model (seed 0) trained two steps, then ``dcp.save`` of ``get_state_dict``.
- ``load``: the model built with one seed, filled by ``load_into(model, optimizer, SRC)``; the model built
  with another seed, filled by ``dcp.load`` of REF (SRC converted to DCP, or SRC itself) and
  ``set_state_dict``. Each rank compares its local shards and optimizer states of both, bit for bit, takes
  one more training step on each, and compares again; it writes ``OUT/TAG.RANK.json`` with the keys that
  differ, the step's two losses, its ``LoadReport`` and the share it expects (its local elements times
  the checkpoint's element size).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from jobs import exit_now, run_job

SIZES = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 8, "num_hidden_layers": 4, "vocab_size": 1100, "tie_word_embeddings": False}
"""The ``tiny-llama`` fixture model (``reshard.fixtures.MODELS``) as a transformers config."""


def save(ckpt: Path) -> str:
    """The task that trains the model two steps and saves it with ``dcp.save`` at ``ckpt``."""
    return f"save:fsdp:{ckpt}::"


def load(tag: str, mode: str, src: Path, ref: Path, *, optimizer: bool = True, model_bytes: int = 4) -> str:
    """The task that loads ``src`` with ``load_into`` and ``ref`` with ``dcp.load`` and compares them;
    ``model_bytes``: the element size of what the checkpoint fills the model from."""
    return f"load:{mode}:{src}:{ref}:{tag}:{int(optimizer)}:{model_bytes}"


def run(world: int, out: Path, *tasks: str, hf: Path | None = None) -> None:
    """Run ``tasks`` in order in one job of ``world`` ranks; with ``hf``, of the transformers model of the
    ``config.json`` in that directory instead of the Llama."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "RESHARD_DCP_PORT": str(port), "RESHARD_DCP_WORLD": str(world), **({"RESHARD_LOAD_HF": str(hf)} if hf else {})}
    code, err = run_job([sys.executable, __file__, str(out), *tasks], env)
    if code:
        raise RuntimeError(f"load_into job {list(tasks)} at {world} ranks failed ({code}):\n{err[-4000:]}")


def results(out: Path, tag: str, world: int) -> list[dict]:
    return [json.loads((out / f"{tag}.{r}.json").read_text()) for r in range(world)]


# -- inside the ranks ------------------------------------------------------------------------------------


def _model(seed: int, mode: str, world: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import dcp_jobs

    torch.manual_seed(seed)
    if "RESHARD_LOAD_HF" in os.environ:
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.environ["RESHARD_LOAD_HF"])).float()
    else:
        model = LlamaForCausalLM(LlamaConfig(**SIZES)).float()
    model.eval()  # no dropout (GPT-2 has some): the two models' steps draw from one random stream
    model = dcp_jobs._parallelize(model, mode, world, 2)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _step(model, opt, step: int) -> float:
    import torch

    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _locals(model, opt) -> dict:
    """This rank's state under DCP's flat keys: local shards of DTensors, other tensors as they are."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    from torch.distributed.tensor import DTensor

    from dcp_jobs import flatten

    tree = {"model": get_model_state_dict(model)} if opt is None else dict(zip(("model", "optim"),
                                                                               get_state_dict(model, opt)))
    flat = flatten(tree)
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in flat.items()
            if torch.is_tensor(v)}


def _tied_keys(model) -> set[str]:
    """``model.<key>`` of each model key whose local tensor is an earlier key's (a tied weight)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    seen, tied = set(), set()
    for k, v in get_model_state_dict(model).items():
        local = v.to_local() if isinstance(v, DTensor) else v
        ident = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if local.numel() and ident in seen:
            tied.add(f"model.{k}")
        seen.add(ident)
    return tied


def _differ(a: dict, b: dict) -> list[str]:
    import torch

    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def _load(mode: str, world: int, rank: int, src: str, ref: str, tag: str, with_opt: bool, model_bytes: int,
          out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from reshard.torch import load_into

    model, opt = _model(1, mode, world)
    report = load_into(model, opt if with_opt else None, src)
    mine = _locals(model, opt if with_opt else None)
    tied = _tied_keys(model)  # a tied output projection is the embedding: read once
    expected = sum(v.numel() * (model_bytes if k.startswith("model.") else 4) for k, v in mine.items()
                   if not k.endswith(".step") and k not in tied)

    ref_model, ref_opt = _model(2, mode, world)
    if with_opt:
        msd, osd = get_state_dict(ref_model, ref_opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ref)
        set_state_dict(ref_model, ref_opt, model_state_dict=msd, optim_state_dict=osd)
    else:
        msd = get_model_state_dict(ref_model)
        dcp.load({"model": msd}, checkpoint_id=ref)
        set_model_state_dict(ref_model, msd)
    theirs = _locals(ref_model, ref_opt if with_opt else None)
    loaded = _differ(mine, theirs)
    losses = [_step(model, opt, 7), _step(ref_model, ref_opt, 7)]
    stepped = _differ(_locals(model, opt), _locals(ref_model, ref_opt))
    steps = sorted({v.item() for k, v in mine.items() if k.endswith(".step")})
    # Keys whose loaded values are all zero: a fresh optimizer's moments, were nothing loaded into them.
    zeros = [k for k, v in mine.items() if v.numel() and not k.endswith(".step") and not v.any()]
    result = {"loaded": loaded, "steps": steps, "zeros": zeros, "stepped": stepped, "losses": losses, "keys": len(mine), "expected_share": expected,
              "bytes_read": report.bytes_read, "share": report.share, "tensors": report.tensors,
              "states": list(report.states)}
    (out / f"{tag}.{rank}.json").write_text(json.dumps(result))


def _save(world: int, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _model(0, "fsdp", world)
    for step in range(2):
        _step(model, opt, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)


def _rank(rank: int, world: int, port: int, out: str, tasks: list[str]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for task in tasks:
            action, mode, src, ref, rest = task.split(":", 4)
            if action == "save":
                _save(world, src)
            else:
                tag, with_opt, model_bytes = rest.split(":")
                _load(mode, world, rank, src, ref, tag, with_opt == "1", int(model_bytes), Path(out))
            dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_now()  # no destroy_process_group: gloo's teardown is where these jobs crashed, after the work was done


def _main() -> None:
    import importlib

    import torch.multiprocessing as mp

    # Imported once here, before the ranks are forked: a job costs the imports once, not once per rank.
    for name in ("torch.distributed.checkpoint", "torch.distributed.fsdp", "transformers.models.llama.modeling_llama",
                 "reshard.torch"):
        importlib.import_module(name)
    out, tasks = sys.argv[1], sys.argv[2:]
    world, port = int(os.environ["RESHARD_DCP_WORLD"]), int(os.environ["RESHARD_DCP_PORT"])
    mp.start_processes(_rank, args=(world, port, out, tasks), nprocs=world, start_method="fork")


if __name__ == "__main__":
    _main()
