"""Real FSDP2 jobs on CPU with gloo for models reshard has no family for: a BERT encoder and a custom module.

Importable (no side effects) and runnable as a script; the tests call ``run``, which runs ``python
tests/fsdp_any_jobs.py TASK...`` with one process per rank forked from a parent that has imported torch
and transformers once (a job costs the imports once, not once per rank). One job runs several tasks,
in order, at one world size:

- ``bert``: a tiny ``BertForMaskedLM`` (transformers; its decoder tied to the word embeddings),
  ``fully_shard`` per encoder layer then the root.
- ``custom``: a plain ``nn.Module`` with a bf16 block (its own ``fully_shard`` group: FSDP2 wants one
  dtype per group) and fp32 parameters, an output layer tied to the embedding, a persistent buffer
  and a non-persistent one, and a BatchNorm (running statistics; ``num_batches_tracked``, a 0-d int64
  buffer).
- ``ds``, ``ds2``: the DeepSpeed jobs' module (``ds_jobs.custom_module``: a tied head, biases, a
  LayerNorm, a frozen Linear, persistent float and int64 buffers), fp32, ``fully_shard`` on the root,
  trained as ``ds_jobs.py`` trains it: the same initial weights, the same batch at every rank,
  ``torch.optim.AdamW`` (lr 1e-2) over the trained params in one param group (``ds``) or two (``ds2``:
  weight decay on weights only), no gradient clipping. Its step ``s`` here is DeepSpeed's step ``s + 1``.

- ``save(model, ckpt, dump)``: the model (seed 0) trained two Adam steps (AdamW for ``ds``), then
  ``dcp.save({"model": msd, "optim": osd})`` of ``get_state_dict``; rank 0 writes every entry in full
  (``full_tensor()``) under DCP's flat keys to ``dump``.
- ``train(model, ckpt, dump)``: as ``save``, then one more step: ``dump`` gets ``{"saved", "stepped",
  "loss"}`` (the uninterrupted run's state at the save, after the next step, and that step's loss).
- ``load(model, dump, ckpts)``: for each checkpoint in turn, the model freshly built with another seed,
  ``dcp.load`` into ``get_state_dict``'s dicts (DCP reshards at load time) and ``set_state_dict``;
  rank 0 dumps the state as loaded (``loaded``), then one more Adam step runs on fixed data and the
  state after it (``stepped``) and its loss are dumped: ``{str(ckpt): {"loaded", "stepped", "loss"}}``.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from dcp_jobs import flatten
from jobs import exit_now, run_job

BERT_CONFIG = {
    "architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": 96, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48, "max_position_embeddings": 40,
    "type_vocab_size": 2, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
}
VOCAB = {"bert": BERT_CONFIG["vocab_size"], "custom": 50}
DS_MODELS = {"ds": 1, "ds2": 2}
"""The DeepSpeed jobs' module, by its number of param groups."""
STEPS = 2


def save(model: str, ckpt: Path, dump: Path) -> str:
    """The task that writes a real FSDP2 checkpoint of ``model`` at ``ckpt``, its full state to ``dump``."""
    return f"save:{model}:{dump}:{ckpt}"


def train(model: str, ckpt: Path, dump: Path) -> str:
    """The task that saves as ``save`` does, then takes one more step (the uninterrupted run)."""
    return f"train:{model}:{dump}:{ckpt}"


def load(model: str, dump: Path, ckpts: list[Path]) -> str:
    """The task that loads each of ``ckpts`` with ``dcp.load`` + ``set_state_dict`` and takes one step."""
    return f"load:{model}:{dump}:{','.join(map(str, ckpts))}"


def run(world: int, *tasks: str) -> None:
    """Run ``tasks`` in order in one job of ``world`` ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "RESHARD_DCP_PORT": str(port), "RESHARD_DCP_WORLD": str(world)}
    code, err = run_job([sys.executable, __file__, *tasks], env)
    if code:
        raise RuntimeError(f"fsdp job {list(tasks)} at {world} ranks failed ({code}):\n{err[-4000:]}")


# -- the models --------------------------------------------------------------------------------------------


def custom_module():
    """The custom model's class (defined in a function: importing this file loads no torch)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16, dtype=torch.bfloat16)
            self.gain = nn.Parameter(torch.ones(16, dtype=torch.bfloat16))

        def forward(self, x):
            return (self.proj(x.to(torch.bfloat16)) * self.gain).float()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB["custom"], 16)
            self.block = Block()
            self.norm = nn.LayerNorm(16)
            self.bn = nn.BatchNorm1d(16)  # running stats, and num_batches_tracked: a 0-d int64 buffer
            self.head = nn.Linear(16, VOCAB["custom"], bias=False)
            self.head.weight = self.emb.weight  # tied
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))  # persistent: in the state dict
            self.register_buffer("cache", torch.zeros(7), persistent=False)  # not in the state dict

        def forward(self, tokens):
            x = self.block(self.emb(tokens)) * self.scale
            return self.head(self.norm(self.bn(x.flatten(0, 1)).view_as(x)))

    return Net


def _model(name: str, seed: int):
    import torch

    torch.manual_seed(seed)
    if name == "bert":
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(**{k: v for k, v in BERT_CONFIG.items() if k not in ("architectures", "model_type")})
        return BertForMaskedLM(config).float()
    if name == "custom":
        return custom_module()()
    if name in DS_MODELS:
        import ds_jobs

        model = ds_jobs.custom_module()()
        model.frozen.requires_grad_(False)
        return model
    raise ValueError(f"unknown model {name}")


def _optimizer(model, name: str):
    import torch

    if name in DS_MODELS:
        import ds_jobs

        return torch.optim.AdamW(ds_jobs.param_groups(model, DS_MODELS[name]), lr=1e-2)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _shard(model, name: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for part in (model.bert.encoder.layer if name == "bert" else [model.block] if name == "custom" else []):
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _step(model, opt, name: str, step: int) -> float:
    import torch

    if name in DS_MODELS:
        import ds_jobs

        loss = ds_jobs.loss_of(model(ds_jobs.batch(step + 1)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB[name], (2, 12), generator=gen)
    if name == "bert":
        loss = model(tokens, labels=tokens).loss
    else:
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full(model, opt) -> dict:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, opt)
    flat = flatten({"model": msd, "optim": osd})
    flat = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items()}
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in flat.items()}


def _save(name: str, world: int, rank: int, ckpt: str, dump: str, *, then_step: bool = False) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _shard(_model(name, 0), name, world)
    opt = _optimizer(model, name)
    for step in range(STEPS):
        _step(model, opt, name, step)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    full = _full(model, opt)
    if then_step:
        loss = _step(model, opt, name, STEPS)
        full = {"saved": full, "stepped": _full(model, opt), "loss": loss}
    if rank == 0:
        torch.save(full, dump)


def _load(name: str, world: int, rank: int, ckpts: list[str], dump: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for ckpt in ckpts:
        model = _shard(_model(name, 1234), name, world)
        opt = _optimizer(model, name)
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        loaded = _full(model, opt)
        loss = _step(model, opt, name, STEPS)
        out[ckpt] = {"loaded": loaded, "stepped": _full(model, opt), "loss": loss}
    if rank == 0:
        torch.save(out, dump)


def _rank(rank: int, world: int, port: int, tasks: list[str]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for task in tasks:
            action, name, dump, where = task.split(":", 3)
            if action in ("save", "train"):
                _save(name, world, rank, where, dump, then_step=action == "train")
            else:
                _load(name, world, rank, where.split(","), dump)
            dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_now()  # no destroy_process_group: gloo's teardown is where these jobs crashed, after the work was done


def _main() -> None:
    import torch.distributed.checkpoint  # noqa: F401 - imported once here, before the ranks are forked
    import torch.distributed.fsdp  # noqa: F401
    import torch.multiprocessing as mp

    tasks = sys.argv[1:]
    if any(t.split(":")[1] == "bert" for t in tasks):
        import transformers.models.bert.modeling_bert  # noqa: F401
    world, port = int(os.environ["RESHARD_DCP_WORLD"]), int(os.environ["RESHARD_DCP_PORT"])
    mp.start_processes(_rank, args=(world, port, tasks), nprocs=world, start_method="fork")


if __name__ == "__main__":
    _main()
