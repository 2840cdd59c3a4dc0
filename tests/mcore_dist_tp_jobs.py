"""megatron-core saves torch_dist of a model built from a Megatron checkpoint's args at tensor parallelism tp, on
CPU.

Importable (no side effects) and runnable as a script: ``python tests/mcore_dist_tp_jobs.py CASE TP`` (with a free
port in ``RESHARD_MCORE_PORT``, ``jobs.run_ranks``), where CASE holds ``meg/`` (a torch-format checkpoint at tp=TP,
pp=1 in megatron-core's local layers, as reshard writes it). TP processes (gloo) each build a ``GPTModel`` from
the rank file's args (``mcore_family_jobs``), load their rank file's state dict strictly and save together, with
``dist_checkpointing.save``, the trainer's torch_dist (``args``, ``iteration``) to ``real/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from jobs import exit_now


def _rank(rank: int, tp: int, port: int, case: str) -> None:
    import torch
    import torch.distributed as dist

    import mcore_family_jobs as family_jobs

    family_jobs._patch_cpu(torch)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    (rank_file,) = (Path(case) / "meg").glob(f"iter_*/mp_rank_{rank:02d}/model_optim_rng.pt")
    saved = torch.load(rank_file, weights_only=False)  # the framework's own loader, as Megatron loads it
    torch.manual_seed(0)
    model = family_jobs._model(vars(saved["args"]), torch)
    model.load_state_dict(saved["model"], strict=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": saved["args"], "checkpoint_version": 3.0,
                             "iteration": saved["iteration"]}, str(Path(case) / "real"))
    dist.barrier()
    exit_now()


if __name__ == "__main__":
    from jobs import spawn

    tp = int(sys.argv[2])
    (Path(sys.argv[1]) / "real").mkdir()
    spawn(_rank, (tp, int(os.environ["RESHARD_MCORE_PORT"]), sys.argv[1]), tp)
