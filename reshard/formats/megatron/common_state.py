"""A torch_dist checkpoint's common (non-sharded) state: ``args``, ``iteration``, ``checkpoint_version``, the
optimizer's param groups, ``content_metadata``.

Megatron-core up to 0.18 saves it as ``common.pt`` beside the DCP files and names its backend in
``metadata.json`` (``"common_backend": "torch"``). From 0.19 ``dist_checkpointing.save`` stores it inside the
DCP checkpoint instead, as the bytes entry ``common_state/shard_0_1`` (a ``ShardedObject`` keyed
``common_state``, a torch.save archive of ``[state]``), with no ``common.pt`` and no ``common_backend`` in
``metadata.json``; its loader reads ``common.pt`` where there is one and that entry otherwise. Either form is
read here, from what the checkpoint holds, and a torch_dist target writes the form its source was in
(``common.pt`` for a source of another format, which every release from 0.8 on loads).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.formats.dcp.reading import _storage, _Verbatim
from reshard.formats.megatron.small import _map_small
from reshard.formats.megatron.state import TorchDistState
from reshard.io.bounds import brief
from reshard.io.dcp_metadata import DcpMetadata
from reshard.io.storage import OutputFile
from reshard.io.torch_read import read_torch_file
from reshard.io.torch_types import SmallTensor
from reshard.io.torch_write import write_torch_file
from reshard.io.torchfile import TensorSpec

__all__ = ["COMMON", "COMMON_ENTRY", "common_bytes", "common_where", "metadata_json", "read_common", "write_common"]

COMMON = "common.pt"
COMMON_ENTRY = "common_state/shard_0_1"
"""megatron-core 0.19's bytes entry of the common state (``ShardedObject('common_state', ...).unique_key``)."""


def common_where(path: Path) -> Path:
    """Where ``path``'s common state is, for messages: ``common.pt``, or ``<path>/common_state`` (the entry)."""
    return path / COMMON if (path / COMMON).is_file() else path / "common_state"


def read_common(path: Path, md: DcpMetadata) -> tuple[dict[str, Any], bool]:
    """The common state as a dict ({} when the checkpoint has none) and whether it is megatron-core 0.19's
    ``common_state`` entry (rather than ``common.pt``, which megatron-core reads first where both are)."""
    file = path / COMMON
    if file.is_file():
        obj = read_torch_file(file)
        return (obj if isinstance(obj, dict) else {}), False
    if COMMON_ENTRY not in md.byte_entries:
        return {}, False
    s = _storage(path, md, COMMON_ENTRY, None)
    file = path / s.relative_path
    if not file.is_file():  # never open a FIFO or a device
        raise CheckpointFormatError(f"{file}: missing or not a regular file (the metadata puts '{COMMON_ENTRY}' there)")
    obj = read_torch_file(file, offset=s.offset, length=s.length)
    if not (isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], dict)):
        raise CheckpointFormatError(f"{file}: '{COMMON_ENTRY}' should hold a list of one dict (the common state, as "
                                    f"megatron-core 0.19 saves it), it holds {brief(obj)}")
    return obj[0], True


def _tree(state: TorchDistState) -> tuple[dict[str, Any], dict[int, bytes]]:
    """The common state's tree (the carried tree with the state's ``args``, or the args, version and iteration
    alone), its small tensors as ``TensorSpec`` leaves keyed into the returned bytes."""
    tree: dict[str, Any] = {"args": argparse.Namespace(**state.args)}
    if state.common is None:
        tree |= {"checkpoint_version": state.checkpoint_version, "iteration": state.iteration}
    else:
        tree |= state.common
        if not state.args:
            tree.pop("args")
    tensors: dict[int, bytes] = {}

    def leaf(st: SmallTensor) -> TensorSpec:
        tensors[len(tensors)] = st.data
        return TensorSpec(st.dtype, st.shape, key=len(tensors) - 1)

    return _map_small(tree, leaf), tensors


def write_common(path: Path, state: TorchDistState, open_file) -> None:
    """``common.pt`` of ``state``."""
    tree, tensors = _tree(state)
    write_torch_file(path, tree, tensors, open_file=open_file)


def common_bytes(state: TorchDistState) -> _Verbatim:
    """megatron-core 0.19's ``common_state`` bytes entry of ``state``: a torch.save archive of ``[tree]``."""
    tree, tensors = _tree(state)
    with tempfile.TemporaryDirectory(prefix="reshard-common-") as tmp:
        file = Path(tmp) / "archive"
        # read back at once: through the page cache
        write_torch_file(file, [tree], tensors, open_file=lambda p, n: OutputFile(p, n, fsync=False, direct=False))
        return _Verbatim(COMMON_ENTRY, None, file.read_bytes())


def metadata_json(common_entry: bool) -> dict[str, Any]:
    """``metadata.json`` as the release whose common state form ``common_entry`` says writes it."""
    backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    return backend if common_entry else backend | {"common_backend": "torch", "common_backend_version": 1}
