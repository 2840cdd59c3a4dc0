"""Real DeepSpeed jobs on CPU (gloo) with a small custom model that is no model family reshard knows.

Importable (no side effects) and runnable as a torchrun script; the tests call ``run``, which starts
``torchrun --nproc-per-node N tests/ds_jobs.py MODE CKPT OUT`` with the job's options in the environment.

The model (``Custom``) has what real fine-tuning runs have and Llama lacks: an embedding whose weight the
output head shares (a tied weight, ``shared_params``), Linear layers with biases, a LayerNorm, a frozen
Linear (``requires_grad=False``: ``frozen_param_shapes``, ``frozen_param_fragments``), a persistent float
buffer, a persistent int64 buffer and a non-persistent buffer. Options (environment):

- ``RESHARD_DS_STAGE`` (1, 2, 3), ``RESHARD_DS_DTYPE`` (``fp32``, ``bf16``, or ``bf16acc``: bf16 with fp32
  gradient accumulation, which at ZeRO-1 is DeepSpeed's ``BF16_Optimizer``);
- ``RESHARD_DS_GROUPS``: ``1`` (one param group) or ``2`` (as transformers' Trainer makes them: weight
  decay on weights, none on biases and norms);
- ``RESHARD_DS_FROZEN``: ``1`` freezes the ``frozen`` Linear;
- ``RESHARD_DS_BUFFERS``: ``1`` makes ``scale`` and ``seen`` persistent (in the checkpoint), ``0`` not;
- ``RESHARD_DS_CLIP``: ``gradient_clipping`` in the config when set (unset: DeepSpeed's default, 1.0);
- ``RESHARD_DS_UNIVERSAL``: ``1`` (through ``run``'s ``options``) loads a universal folder
  (``"checkpoint": {"load_universal": true}``);
- ``RESHARD_DS_HF``: a Hugging Face model folder (``run``'s ``hf``): the job trains that transformers model
  instead, built from its ``config.json`` with fresh random weights (so what it holds after ``load`` is the
  checkpoint's), its output projection tied as transformers ties it; the state has no Adam moments where the
  checkpoint holds none.

``custom_module`` gives the model's class to other jobs (``fsdp_any_jobs.py`` trains the same module with
FSDP2), and ``batch`` the batch of step ``n``: the same ids at every rank and in every framework.

Every rank trains on the same batch, so the averaged gradient is the same at every dp that is a power of two,
and a run resumed at another dp continues bit-exactly as the uninterrupted run does.

Modes:

- ``save``: two steps, ``save_checkpoint(CKPT)``, then a third step; ``OUT`` gets the state before the third
  step (``state:``), its loss and the parameters after it (``after:``).
- ``load``: ``load_checkpoint(CKPT)`` (not universal), the state it loaded (``state:``), then the third step's
  loss and the parameters after it (``after:``).

State keys are ``state:<name>:<kind>`` with kind ``param`` (training-dtype bits), ``master``, ``exp_avg``,
``exp_avg_sq`` for trained params, and ``param`` alone for frozen params and buffers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

V, H, F = 40, 8, 12


def run(tmp_path: Path, nproc: int, mode: str, ckpt: Path, out: Path, *, stage: int = 2, dtype: str = "fp32",
        groups: int = 1, frozen: bool = True, buffers: bool = True, clip: float | None = None,
        script: str = __file__, options: dict[str, str] | None = None, hf: Path | None = None) -> None:
    """Run this script (or another job ``script`` taking the same arguments, with its ``options`` in the
    environment) under torchrun with ``nproc`` ranks; fails the test with the job's output."""
    from jobs import run_job

    session = next((p for p in tmp_path.parents if p.name.startswith("pytest-") and not p.name.startswith("pytest-of")),
                   tmp_path)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "OMP_NUM_THREADS": "1",
           "RESHARD_DS_STAGE": str(stage), "RESHARD_DS_DTYPE": dtype, "RESHARD_DS_GROUPS": str(groups),
           "RESHARD_DS_FROZEN": "1" if frozen else "0", "RESHARD_DS_BUFFERS": "1" if buffers else "0",
           "TORCH_EXTENSIONS_DIR": str(session / "torch-extensions")}
    if clip is not None:
        env["RESHARD_DS_CLIP"] = str(clip)
    if hf is not None:
        env["RESHARD_DS_HF"] = str(hf)
    env.update(options or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
           mode, str(ckpt), str(out)]
    code, output = run_job(cmd, env)
    if code:
        raise AssertionError(f"deepspeed job {mode} at {nproc} ranks failed ({code}):\n{output[-6000:]}")


def custom_module(persistent: bool = True):
    """The model's class (defined in a function: importing this file loads no torch); ``persistent``: the
    ``scale`` and ``seen`` buffers are in the state dict."""
    import torch
    from torch import nn

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, H)
            self.proj = nn.Linear(H, F)
            self.norm = nn.LayerNorm(F)
            self.frozen = nn.Linear(F, F)
            self.out = nn.Linear(F, H)
            self.head = nn.Linear(H, V, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.register_buffer("scale", torch.linspace(0.5, 1.5, F), persistent=persistent)
            self.register_buffer("seen", torch.arange(3), persistent=persistent)
            self.register_buffer("cache", torch.zeros(5), persistent=False)

        def forward(self, ids):
            x = self.norm(self.proj(self.embed(ids))) * self.scale.to(self.proj.weight.dtype)
            return self.head(self.out(torch.tanh(self.frozen(x))))

    return Custom


def param_groups(model, groups: int) -> list:
    """The trained params as the optimizer gets them: one group, or two as transformers' Trainer makes them
    (weight decay 0.1 on weights, none on biases and norms)."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if groups == 2:
        no_decay = [p for n, p in trained if n.endswith("bias") or n.startswith("norm.")]
        decay = [p for n, p in trained if not (n.endswith("bias") or n.startswith("norm."))]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return [p for _, p in trained]


def batch(n: int):
    """Step ``n``'s batch: the same token ids at every rank."""
    import torch

    gen = torch.Generator().manual_seed(n)
    return torch.randint(0, V, (2, 5), generator=gen)


def loss_of(logits):
    return logits.float().pow(2).mean()


def plain_collectives() -> None:
    """DeepSpeed with gloo's own collectives: at its first collective DeepSpeed probes every op's compiler and then
    JIT-builds its shared-memory CPU collectives (tens of seconds a run), which change no checkpoint byte."""
    import deepspeed

    deepspeed.ops.__compatible_ops__ = {}


def _main() -> None:  # pragma: no cover - runs in the job's processes
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    plain_collectives()
    mode, ckpt, out = sys.argv[1:4]
    stage, bf16 = int(os.environ["RESHARD_DS_STAGE"]), os.environ["RESHARD_DS_DTYPE"].startswith("bf16")
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    if "RESHARD_DS_HF" in os.environ:
        import transformers

        config = transformers.AutoConfig.from_pretrained(os.environ["RESHARD_DS_HF"])
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = custom_module(os.environ["RESHARD_DS_BUFFERS"] == "1")()
    if os.environ["RESHARD_DS_FROZEN"] == "1":
        model.frozen.requires_grad_(False)
    params = param_groups(model, int(os.environ["RESHARD_DS_GROUPS"]))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": bf16},
              "checkpoint": {"load_universal": os.environ.get("RESHARD_DS_UNIVERSAL") == "1"}}
    if os.environ["RESHARD_DS_DTYPE"] == "bf16acc":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if "RESHARD_DS_CLIP" in os.environ:
        config["gradient_clipping"] = float(os.environ["RESHARD_DS_CLIP"])
    adam = torch.optim.AdamW(params, lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adam, config=config)

    def step(n: int) -> float:
        out = engine(batch(n))  # the same batch on every rank
        loss = loss_of(getattr(out, "logits", out))  # a transformers model's output holds its logits
        engine.backward(loss)
        engine.step()
        return loss.item()

    def bits(t):
        t = t.detach().cpu()
        return t.view(torch.int16).numpy().copy() if t.dtype == torch.bfloat16 else t.numpy().copy()

    def state(prefix: str) -> dict:
        if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):  # ZeRO-1/2
            # DeepSpeed links each param to its optimizer states after the first group's first step, before
            # later groups have states: link again, now that every group has them.
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        dump = {}
        # None before a first step, or loaded from a checkpoint without them (a Hugging Face model's).
        moments = any("exp_avg" in s for s in engine.optimizer.optimizer.state.values())
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                dump[f"{prefix}:{name}:master"] = safe_get_full_fp32_param(p).numpy().copy()
                for key in ("exp_avg", "exp_avg_sq") if moments else ():
                    dump[f"{prefix}:{name}:{key}"] = safe_get_full_optimizer_state(p, key).numpy().copy()
            if stage != 3:
                dump[f"{prefix}:{name}:param"] = bits(p)
            elif not p.requires_grad:  # ZeRO-3 keeps no training-dtype weights but the frozen params'
                with deepspeed.zero.GatheredParameters([p]):
                    dump[f"{prefix}:{name}:param"] = bits(p)
        persistent = set(engine.module.state_dict())
        for name, b in engine.module.named_buffers():
            if name in persistent:  # what a checkpoint holds
                dump[f"{prefix}:{name}:param"] = bits(b)
        return dump

    save_or_resume(engine, mode, ckpt, out, step, state)


def save_or_resume(engine, mode: str, ckpt, out, step, state) -> None:  # pragma: no cover - in the job
    """Two steps then save, or load; then the state, one more step's loss and the state after it, from every
    rank into ``out`` (rank 0 writes it); then the job ends."""
    import numpy as np
    import torch

    dump = {}
    if mode == "save":
        step(1)
        step(2)
        engine.save_checkpoint(ckpt)
    else:
        path, _ = engine.load_checkpoint(ckpt)
        assert path is not None
    dump.update(state("state"))
    dump["loss"] = np.array(step(3))
    dump.update(state("after"))
    if torch.distributed.get_rank() == 0:
        np.savez(out, **dump)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    from jobs import exit_now

    exit_now()


if __name__ == "__main__":  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _main()
