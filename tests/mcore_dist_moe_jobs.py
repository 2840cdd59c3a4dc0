"""megatron-core saves and strictly loads torch_dist of a model built from a Megatron checkpoint's args, on CPU.

Importable (no side effects) and runnable as a script: ``python tests/mcore_dist_moe_jobs.py CASE``, where CASE
holds ``meg/`` (a tp=1, pp=1 torch-format checkpoint in megatron-core's local layers) and ``dist/`` (a torch_dist
checkpoint of the same model). One process (world size 1, gloo) builds a ``GPTModel`` from the rank file's args
(``mcore_family_jobs``), loads the rank file's state dict strictly, saves its own torch_dist to ``real/`` with
``dist_checkpointing.save`` (with the rank file's ``args`` and ``iteration``, as the trainer saves them), then builds the model again, loads ``dist/`` with ``dist_checkpointing.load``
(``strict="raise_all"``: a key missing on either side is an error) and writes ``result.json``: the weights that
differ from the first model's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jobs import exit_now


def run(case: Path) -> dict:
    """This script on ``case`` in a process of its own; its ``result.json``."""
    import os

    from jobs import run_job

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    code, output = run_job([sys.executable, __file__, str(case)], env)
    assert code == 0, output[-4000:]
    return json.loads((case / "result.json").read_text())


def same_chunks(real_dir: Path, ours_dir: Path):
    """Assert that two torch_dist checkpoints hold the same keys, bytes entries, global shapes and chunks; their
    metadata (megatron-core's, reshard's)."""
    from reshard.io.dcp_metadata import read_metadata

    real, ours = read_metadata(real_dir), read_metadata(ours_dir)
    assert ours.tensors.keys() == real.tensors.keys() and sorted(ours.byte_entries) == sorted(real.byte_entries)
    for key, t in real.tensors.items():
        assert t.size == ours.tensors[key].size and sorted((c.offsets, c.sizes) for c in ours.tensors[key].chunks) \
            == sorted((c.offsets, c.sizes) for c in t.chunks), key
    return real, ours


def main(case: Path) -> None:
    import torch
    import torch.distributed as dist

    import mcore_family_jobs as family_jobs

    family_jobs._patch_cpu(torch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    (rank_file,) = (case / "meg").glob("iter_*/mp_rank_*/model_optim_rng.pt")
    saved = torch.load(rank_file, weights_only=False)  # the framework's own loader, as Megatron loads it
    args = vars(saved["args"])
    model = family_jobs._model(args, torch)
    model.load_state_dict(saved["model"], strict=True)
    (case / "real").mkdir()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": saved["args"], "checkpoint_version": 3.0,
                             "iteration": saved["iteration"]}, str(case / "real"))
    again = family_jobs._model(args, torch)
    loaded = dist_checkpointing.load({"model": again.sharded_state_dict()}, str(case / "dist"), strict="raise_all")
    again.load_state_dict(loaded["model"], strict=True)
    want, got = model.state_dict(), again.state_dict()
    differ = [k for k, v in want.items() if torch.is_tensor(v) and not torch.equal(v, got[k])]
    (case / "result.json").write_text(json.dumps({"differ": differ, "compared": len(want)}))
    exit_now()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
