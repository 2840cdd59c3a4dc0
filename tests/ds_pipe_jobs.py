"""Real DeepSpeed pipeline-engine jobs on CPU (gloo) with a custom ``PipelineModule`` no model family describes.

Importable (no side effects) and runnable as a torchrun script; the tests call ``run``, which starts it through
``ds_jobs.run`` (``torchrun --nproc-per-node N tests/ds_pipe_jobs.py MODE CKPT OUT``, ``RESHARD_PP`` stages).

The layer list (``layers``) is no Llama, and has what a custom pipeline has: an embedding in a submodule
(layer 0), a Linear with a bias (1), a parameterless activation module (2: DeepSpeed writes it an empty layer
file), a frozen Linear (3: in its layer file, in no model file), a LayerNorm beside a persistent and a
non-persistent buffer (4), a plain function (5: no layer file at all) and a head (6). Partitioned uniformly
over 2 stages: layers 0-3 and 4-6. AdamW over two param groups on each stage (weight decay on matrices, none on
biases and norms), fp32 or bf16 (``RESHARD_DS_DTYPE``), ZeRO-1, no gradient clipping.

Every rank trains on the same batch (``ds_jobs.batch``), so the gradients averaged over dp 1, 2 or 4 are the
same and a run resumed at another dp continues bit-exactly as the uninterrupted run does.

Modes (as ``ds_jobs``): ``save`` runs two batches, ``save_checkpoint(CKPT)``, then a third; ``load`` runs
``load_checkpoint(CKPT)``, then the third batch. ``OUT`` gets every stage's state before the third batch
(``state:<name>:<kind>``, kind ``param``: training-dtype bits, ``master``, ``exp_avg``, ``exp_avg_sq``; frozen
params and buffers ``param`` only), its loss (``loss``) and the state after it (``after:...``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ds_jobs import F, H, V, save_or_resume


def run(tmp_path: Path, nproc: int, mode: str, ckpt: Path, out: Path, *, pp: int = 2, dtype: str = "fp32") -> None:
    """Run this script under torchrun with ``nproc`` ranks over ``pp`` stages; fails the test with its output."""
    import ds_jobs

    ds_jobs.run(tmp_path, nproc, mode, ckpt, out, stage=1, dtype=dtype, script=__file__,
                options={"RESHARD_PP": str(pp)})


def layers() -> list:
    """The pipeline's layer list (``LayerSpec``s and a function), classes defined here so importing loads no torch."""
    import torch
    from deepspeed.pipe import LayerSpec
    from torch import nn

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, H)

        def forward(self, ids):
            return self.embed(ids)

    class Frozen(nn.Linear):
        def __init__(self):
            super().__init__(F, F)
            self.requires_grad_(False)

    class ScaledNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(F)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, F))
            self.register_buffer("cache", torch.zeros(3), persistent=False)

        def forward(self, x):
            return self.norm(x) * self.scale.to(x.dtype)

    return [LayerSpec(Embed), LayerSpec(nn.Linear, H, F), LayerSpec(nn.Tanh), LayerSpec(Frozen),
            LayerSpec(ScaledNorm), _half, LayerSpec(nn.Linear, F, V, bias=False)]


def _half(x):
    return x * 0.5


def _main() -> None:  # pragma: no cover - runs in the job's processes
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from ds_jobs import batch, loss_of, plain_collectives

    plain_collectives()

    mode, ckpt, out = sys.argv[1:4]
    bf16 = os.environ["RESHARD_DS_DTYPE"] == "bf16"
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = PipelineModule(layers=layers(), num_stages=int(os.environ["RESHARD_PP"]), partition_method="uniform",
                           loss_fn=lambda logits, labels: loss_of(logits))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in trained if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for _, p in trained if p.dim() == 1], "weight_decay": 0.0}]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16},
              "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2), config=config)

    def step(n: int) -> float:
        ids = batch(n)  # the same batch on every rank
        return engine.train_batch(iter([(ids, ids)])).item()

    def bits(t):
        t = t.detach().cpu()
        return t.view(torch.int16).numpy().copy() if t.dtype == torch.bfloat16 else t.numpy().copy()

    def state(prefix: str) -> dict:
        """This stage's state; gathered from every rank, so rank 0 holds every stage's."""
        engine.optimizer._hp_optimizer_states_linked = False  # link every group's states, as ds_jobs does
        engine.optimizer._lazy_init_hp_params_optimizer_state()
        dump = {}
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                dump[f"{prefix}:{name}:master"] = safe_get_full_fp32_param(p).numpy().copy()
                for key in ("exp_avg", "exp_avg_sq"):
                    dump[f"{prefix}:{name}:{key}"] = safe_get_full_optimizer_state(p, key).numpy().copy()
            dump[f"{prefix}:{name}:param"] = bits(p)
        persistent = set(engine.module.state_dict())
        for name, b in engine.module.named_buffers():
            if name in persistent:
                dump[f"{prefix}:{name}:param"] = bits(b)
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, dump)
        return {k: v for d in gathered for k, v in d.items()}

    save_or_resume(engine, mode, ckpt, out, step, state)


if __name__ == "__main__":  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _main()
