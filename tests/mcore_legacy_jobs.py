"""Real torch_dist checkpoints of an older megatron-core (0.14), whose distributed optimizer saves its state in
model space (``fully_sharded_model_space``), written on CPU with gloo.

Megatron-core 0.8 to 0.14 save the distributed optimizer's state this way by default; 0.16 (the
installed one) can neither save nor load it. The older release is installed beside it, without its
dependencies, into its own folder (``.ci/run``: ``pip install --no-deps --target
.venv-ci/mcore-legacy/0.14.0 megatron-core==0.14.0``, ``mcore_releases``); a job here runs with that folder first
on ``PYTHONPATH``, so its ranks import megatron-core 0.14 and everything else from the test environment.

``save`` runs ``mcore_moe_jobs``'s run (the same model, DDP and ``get_megatron_optimizer`` Adam step,
the same dumps of what each rank holds: weights, fp32 main params and Adam moments by name, and with
``next`` once more after a further step) with one difference: the torch_dist save passes the
optimizer no sharding type, so it writes the release's default, ``fully_sharded_model_space``, and
records that in ``common.pt['content_metadata']`` as the 0.13/0.14 trainer does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mcore_moe_jobs
import mcore_releases
from jobs import run_job

VERSION = mcore_releases.LEGACY
SHARDING = "fully_sharded_model_space"


def install_dir() -> Path:
    """Where the older megatron-core lives (``mcore_releases.install_dir``)."""
    return mcore_releases.install_dir(VERSION)


def missing() -> str | None:
    """Why the older megatron-core cannot run here, None if it can."""
    return mcore_releases.missing(VERSION)


def save(out: Path, dump: Path, tp: int, dp: int, ep: int = 1, **options) -> None:
    """A megatron-core 0.14 torch_dist checkpoint at ``out/iter_0000010`` after one step of the distributed
    optimizer (state ``fully_sharded_model_space``), by ``tp * dp`` ranks (a mixture of experts at ``ep``, unless
    ``dense``); ``options``: ``mcore_moe_jobs.OPTIONS`` (``torch_dist`` implied)."""
    if problem := missing():
        raise RuntimeError(problem)
    opts = mcore_moe_jobs._options({**options, "torch_dist": True})
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESHARD_MCORE_PORT": str(port),
           "PYTHONPATH": mcore_releases.python_path(VERSION)}
    args = ["save", str(tp), str(dp), str(ep), opts, str(out), str(dump)]
    code, output = run_job([sys.executable, __file__, *args], env)
    if code:
        raise RuntimeError(f"megatron-core {VERSION} job {args} failed ({code}):\n{output[-4000:]}")


def _save_model_space(out: Path, model, optimizer, args, metadata: dict | None = None) -> None:
    """torch_dist as the 0.14 trainer saves it: the model's and the optimizer's sharded state dicts, the
    optimizer's state in its default sharding type (no ``distrib_optim_sharding_type`` given to it: the
    ``metadata`` the 0.16 run would pass is not this version's)."""
    import megatron.core
    from megatron.core import dist_checkpointing

    assert megatron.core.__version__ == VERSION, megatron.core.__version__
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    model_sd = model.sharded_state_dict(metadata=metadata)
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=metadata)
    state = {"model": model_sd, "args": args, "checkpoint_version": 3.0, "iteration": mcore_moe_jobs.ITERATION,
             "optimizer": optim_sd}
    it_dir = out / f"iter_{mcore_moe_jobs.ITERATION:07d}"
    it_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(it_dir), content_metadata={"distrib_optim_sharding_type": SHARDING, **metadata})
    (out / "latest_checkpointed_iteration.txt").write_text(str(mcore_moe_jobs.ITERATION))


def _rank(rank: int, world: int, tp: int, ep: int, opts: dict, port: int, paths: list[str]) -> None:
    import numpy

    # 0.14 asks for numpy < 2 and calls np.product (removed in numpy 2), np.prod under its old name.
    numpy.product = getattr(numpy, "product", numpy.prod)
    mcore_moe_jobs._save_torch_dist = _save_model_space  # the run's own save, in this version's default type
    mcore_moe_jobs._rank(rank, world, tp, 1, ep, True, opts, port, "save", paths)


if __name__ == "__main__":
    import numpy
    import torch

    from jobs import spawn

    tp, dp, ep, options, paths = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]), \
        sys.argv[6:]
    os.makedirs(paths[-1], exist_ok=True)
    numpy.product = getattr(numpy, "product", numpy.prod)  # 0.14 calls np.product (removed in numpy 2)
    mcore_moe_jobs.cpu_only(torch)  # before megatron-core is imported, as in a rank of its own
    spawn(_rank, (tp * dp, tp, ep, options, int(os.environ["RESHARD_MCORE_PORT"]), paths), tp * dp)
