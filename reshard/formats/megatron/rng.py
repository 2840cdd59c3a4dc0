"""The rng state of a Megatron rank at the start of a run, computed without torch.

What ``_set_random_seed`` and ``model_parallel_cuda_manual_seed`` leave behind: python
``random``, numpy and torch CPU generator states, the CUDA default state and the rng
trackers, per (tp, pp, ep, dp) rank.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from reshard.errors import CheckpointFormatError
from reshard.formats.base import expect_int
from reshard.formats.megatron.args import DEFAULT_SEED
from reshard.io.torch_types import SmallTensor

# The rng trackers model_parallel_cuda_manual_seed adds, in its order (megatron/core/tensor_parallel/random.py).
_TRACKERS = ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")
# get_rng_state's entries, in its order.
_RNG_KEYS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")


def _fresh_rng(args: Mapping[str, Any], tp_rank: int, pp_rank: int, like: Any, ep_rank: int = 0) -> list[dict[str, Any]]:
    """``rng_state`` of a rank at the start of a run (``_set_random_seed``, ``model_parallel_cuda_manual_seed``).

    ``like`` (a source rank's rng_state) decides which entries and tracker names appear.
    """
    seed0 = expect_int(args.get("seed") or DEFAULT_SEED, "args.seed", "the source's args", hi=(1 << 32) - 1)
    per_dp = bool(args.get("data_parallel_random_init"))
    sample = like[0] if isinstance(like, list) and like and isinstance(like[0], Mapping) else None
    trackers = sample.get("rng_tracker_states") if sample else None
    names = tuple(trackers) if isinstance(trackers, Mapping) else _TRACKERS
    keys = tuple(sample) if sample else _RNG_KEYS
    out = []
    for dp_rank in range(int(args.get("data_parallel_size") or 1) if per_dp else 1):
        seed = seed0 + 100 * pp_rank + (10 * dp_rank if per_dp else 0)
        if seed >= 1 << 32:  # numpy's legacy seeding takes 32 bits: Megatron itself could not have run with it
            raise CheckpointFormatError(f"args.seed {seed0} + 100 * pp rank {pp_rank} is {seed}, above 2**32 - 1")
        cpu = torch_cpu_rng_state(seed)
        tracker_seeds = {"data-parallel-rng": seed, "model-parallel-rng": seed + 2718 + tp_rank,
                         "expert-parallel-rng": seed + 1024 + 100 * ep_rank + tp_rank}
        state = {
            "random_rng_state": random.Random(seed).getstate(),
            "np_rng_state": np.random.RandomState(seed).get_state(),
            "torch_rng_state": SmallTensor("uint8", (len(cpu),), cpu),
            "cuda_rng_state": _cuda_state(seed),
            "rng_tracker_states": {n: _cuda_state(tracker_seeds.get(n, seed)) for n in names},
        }
        out.append({k: state[k] for k in keys if k in state})
    return out


def torch_cpu_rng_state(seed: int) -> bytes:
    """``torch.Generator().manual_seed(seed).get_state()`` as bytes, without importing torch.

    ATen's ``CPUGeneratorImplState``: the seed, mt19937's ``left`` (1), ``seeded`` (1) and
    ``next`` (0), its 624 state words (init_genrand of the seed's low 32 bits, the key numpy's
    legacy seeding makes too) widened to 64 bits, the cached normal samples (none), padded
    as the C struct is: 5056 bytes.
    """
    key = np.random.RandomState(seed & 0xFFFFFFFF).get_state()[1].astype("<u8")
    return (struct.pack("<qiiQ", seed, 1, 1, 0) + key.tobytes()
            + struct.pack("<dddi4xf?3x", 0.0, 0.0, 0.0, 0, 0.0, False))


def _cuda_state(seed: int) -> SmallTensor:
    """torch.cuda.get_rng_state() right after manual_seed: the Philox seed and offset 0, little-endian."""
    return SmallTensor("uint8", (16,), struct.pack("<Qq", seed & (2**64 - 1), 0))
