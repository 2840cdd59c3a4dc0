"""Real torch_dist checkpoints whose distributed-optimizer state is in one of megatron-core's older bucket
formats, written on CPU with gloo.

``save`` runs ``mcore_moe_jobs``'s run (the same model, DDP and ``get_megatron_optimizer`` Adam step, the same
dumps of what each rank holds) and saves torch_dist with the optimizer's state in ``sharding``:

- ``dp_zero_gather_scatter`` (megatron-core 0.6-0.16, the installed 0.16): the state gathered on each
  model-parallel group's dp rank 0 and saved as one object, ``distrib_optim.pt``'s dict;
- ``fully_sharded_bucket_space`` (megatron-core 0.6-0.14; run with 0.14, installed beside 0.16 as
  ``mcore_legacy_jobs`` describes): each bucket's padded world buffer, every dp rank its flat pieces.

``common.pt['content_metadata']`` records the type as the trainer does.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import mcore_moe_jobs
from jobs import run_job

ZERO, BUCKET_SPACE = "dp_zero_gather_scatter", "fully_sharded_bucket_space"


def save(out: Path, dump: Path, tp: int, dp: int, sharding: str, *, pp: int = 1, ep: int = 1, **options) -> None:
    """A torch_dist checkpoint at ``out/iter_0000010`` after one step of the distributed optimizer, its state
    saved as ``sharding``, by ``tp * pp * dp`` ranks (experts over ``ep``); ``options``: ``mcore_moe_jobs.OPTIONS``
    (``torch_dist`` implied)."""
    import mcore_legacy_jobs

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    if sharding == BUCKET_SPACE:  # removed in megatron-core 0.15
        if problem := mcore_legacy_jobs.missing():
            raise RuntimeError(problem)
        paths.insert(0, str(mcore_legacy_jobs.install_dir()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["RESHARD_MCORE_PORT"] = str(s.getsockname()[1])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    opts = mcore_moe_jobs._options({**options, "torch_dist": True})
    args = ["save", str(tp), str(pp), str(ep), str(dp), sharding, opts, str(out), str(dump)]
    code, output = run_job([sys.executable, __file__, *args], env)
    if code:
        raise RuntimeError(f"megatron-core job {args} failed ({code}):\n{output[-4000:]}")


def _rank(rank: int, world: int, tp: int, pp: int, ep: int, sharding: str, opts: dict, port: int,
          paths: list[str]) -> None:
    import numpy

    numpy.product = getattr(numpy, "product", numpy.prod)  # 0.14 calls np.product (removed in numpy 2)
    # The trainer's metadata with this sharding type (0.14's optimizer reads the type from it too).
    mcore_moe_jobs._sharding = lambda _opts: {"distrib_optim_sharding_type": sharding,
                                              "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if sharding == BUCKET_SPACE:
        _without_step()
        _several_pieces()
    mcore_moe_jobs._rank(rank, world, tp, pp, ep, True, opts, port, "save", paths)


def _without_step() -> None:
    """Leave torch Adam's per-parameter ``step`` out of the bucket-space state, as with TE's or Apex's FusedAdam
    (the trainer's, which keep the step in the param groups): 0.14 saves every state it finds there as a bucket
    piece and refuses the 0-d ``step``. The step is saved in the param groups either way."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    states, buckets = DistributedOptimizer._get_main_param_and_optimizer_states, \
        DistributedOptimizer.get_parameter_state_fs_bucket_space

    def bucket_space(self):
        self._get_main_param_and_optimizer_states = lambda p: {k: v for k, v in states(self, p).items()
                                                               if k != "step"}
        try:
            return buckets(self)
        finally:
            del self._get_main_param_and_optimizer_states
    DistributedOptimizer.get_parameter_state_fs_bucket_space = bucket_space


def _several_pieces() -> None:
    """Let 0.14's torch_dist strategy save a key of which a rank holds several flat pieces.

    ``sharded_tensor_to_torch_sharded_tensor`` describes a rank's flat pieces of a key by one whole-row
    shard, overwriting the row's offset while looping over the pieces and asserting on it, so any second
    piece fails (megatron-core 0.8-0.14; every bucket-space key has several per dp rank: its parameter
    pieces, the gaps between them, its shard's end). Here each piece is described as the piece it is; the
    pieces, and so the saved chunks, are the strategy's own.
    """
    import inspect
    import textwrap

    from megatron.core.dist_checkpointing.strategies import torch as strategy

    source = textwrap.dedent(inspect.getsource(strategy.sharded_tensor_to_torch_sharded_tensor))
    edits = {"assert offset == sh_ten.local_chunk_offset_in_global()": "",
             "offset = sh_ten.local_chunk_offset_in_global() + (0,)":
                 "piece = sh_ten.local_chunk_offset_in_global() + (sh_ten.flattened_range.start,)",
             "size = (1,) * len(offsets_shape) + global_shape[-1:]\n                else:":
                 "size = (1,) * len(offsets_shape) + (sh_ten.data.numel(),)\n                else:\n"
                 "                    piece = offset",
             "shard_metadata.append(ShardMetadata(offset, size, placement))\n\n        else:":
                 "shard_metadata.append(ShardMetadata(piece, size, placement))\n\n        else:"}
    for old, new in edits.items():
        assert source.count(old) == 1, f"megatron-core's torch_dist strategy changed: {old!r}"
        source = source.replace(old, new)
    exec(compile(source, strategy.__file__, "exec"), strategy.__dict__)


if __name__ == "__main__":
    import numpy
    import torch

    from jobs import spawn

    tp, pp, ep, dp, sharding = (*map(int, sys.argv[2:6]), sys.argv[6])
    options, paths = json.loads(sys.argv[7]), sys.argv[8:]
    os.makedirs(paths[-1], exist_ok=True)
    numpy.product = getattr(numpy, "product", numpy.prod)  # 0.14 calls np.product (removed in numpy 2)
    mcore_moe_jobs.cpu_only(torch)  # before megatron-core is imported, as in a rank of its own
    spawn(_rank, (tp * pp * dp, tp, pp, ep, sharding, options, int(os.environ["RESHARD_MCORE_PORT"]), paths),
          tp * pp * dp)
