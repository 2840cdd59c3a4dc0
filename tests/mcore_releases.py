"""The megatron-core releases the interop tests run beside the test environment's own (0.16.1).

Each is installed without its dependencies into a folder of its own in the test venv
(``<venv>/mcore-<name>/<version>``; ``.ci/run`` reads the versions from this file), and a job runs it by
putting that folder first on ``PYTHONPATH``, so its ranks import that megatron-core and everything else
from the test environment:

- ``legacy``, 0.14.0: the last release whose distributed optimizer saves ``fully_sharded_model_space`` by
  default and the last with ``fully_sharded_bucket_space`` (``mcore_legacy_jobs``);
- ``newest``, 0.19.2, the newest release: it keeps the common state inside the DCP checkpoint
  (``common_state``) instead of ``common.pt``, and has no legacy ``GroupedMLP``. Its wheels declare Python
  >= 3.12 while the one it publishes for CPython 3.11 installs and runs here, on the torch the tests use (the
  only torch this machine has is for 3.11), so it is installed with ``--ignore-requires-python``, with the
  ``triton`` it imports at import time (``NEWEST_EXTRA``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LEGACY = "0.14.0"
NEWEST = "0.19.2"
NEWEST_EXTRA = "triton==3.9.0"
_NAMES = {LEGACY: "legacy", NEWEST: "newest"}


def install_dir(version: str) -> Path:
    """Where ``version`` lives: ``$RESHARD_MCORE_<NAME>``, else ``<venv>/mcore-<name>/<version>``."""
    name = _NAMES[version]
    given = os.environ.get(f"RESHARD_MCORE_{name.upper()}")
    return Path(given) if given else Path(sys.prefix) / f"mcore-{name}" / version


def install_step(version: str) -> str:
    extra = f" {NEWEST_EXTRA} --ignore-requires-python" if version == NEWEST else ""
    return (f"bash .ci/run (or: .venv-ci/bin/pip install --no-deps --target .venv-ci/mcore-{_NAMES[version]}/{version}"
            f" megatron-core=={version}{extra})")


def missing(version: str) -> str | None:
    """Why ``version`` cannot run here (not installed where ``install_dir`` says), None if it can."""
    where = install_dir(version)
    if (where / "megatron" / "core" / "__init__.py").is_file():
        return None
    return f"megatron-core {version} is not installed at {where}; run {install_step(version)}"


def python_path(version: str) -> str:
    """``PYTHONPATH`` for a job of ``version``: its folder, then this folder's job modules, then the caller's."""
    return os.pathsep.join([str(install_dir(version)), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])


def common_state(ckpt: Path) -> dict:
    """A torch_dist checkpoint's common state, as megatron-core's ``load_common_state_dict`` reads it: ``common.pt``
    where there is one (up to 0.18), else the ``common_state`` entry of the DCP files (0.19)."""
    import io

    import torch
    import torch.distributed.checkpoint as dcp

    if (ckpt / "common.pt").is_file():
        return torch.load(ckpt / "common.pt", weights_only=False)
    held = {"common_state/shard_0_1": io.BytesIO()}
    dcp.load(held, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    data = held["common_state/shard_0_1"]  # torch's DCP hands back the unpickled object or the stream
    if isinstance(data, io.BytesIO):
        data.seek(0)
        data = torch.load(data, weights_only=False)
    (state,) = data
    return state
