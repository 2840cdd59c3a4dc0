"""megatron-core 0.19's torch_dist common state: inside the DCP files as the ``common_state`` entry, no ``common.pt``.

Checkpoints here are written by one-process ``dcp.save`` as megatron-core 0.19 lays them out (a list of one dict
saved under ``common_state/shard_0_1``, ``metadata.json`` naming no common backend); real ones of 0.19.2 are in
``test_mcore_dist_*.py``'s ``mcore-0.19.2`` cases.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mcore_releases import common_state
from torch.distributed.checkpoint import DefaultSavePlanner
from test_format_mcore_dist import check_hf, flat, no_family_checkpoint, synthetic

import reshard
from reshard.errors import CheckpointFormatError

ENTRY = "common_state/shard_0_1"


def as_0_19(path, common: object | None = None) -> None:
    """Move ``path``'s ``common.pt`` into its DCP files as megatron-core 0.19 saves it (or ``common`` instead)."""
    stored = flat(path, path.parent, path.name)
    common = [torch.load(path / "common.pt", weights_only=False)] if common is None else common
    shutil.rmtree(path)
    # Not flattened: the entry is one object, a torch.save archive of it, as megatron-core's ShardedObject
    dcp.save({**stored, ENTRY: common}, checkpoint_id=path, planner=DefaultSavePlanner(flatten_state_dict=False))
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))


def test_a_family_checkpoint_with_its_common_state_in_the_dcp_files_converts_and_keeps_that_form(tmp_path):
    ref = synthetic(tmp_path / "src")
    as_0_19(tmp_path / "src")
    src = reshard.open_checkpoint(tmp_path / "src")
    assert src.spec_name == "mcore-dist-llama" and src.topology.tp == 2 and src.progress.iteration == 10
    reshard.convert(tmp_path / "src", tmp_path / "hf", format="hf")
    check_hf(tmp_path / "hf", ref)
    reshard.convert(tmp_path / "src", tmp_path / "tp1", format="mcore-dist", to="tp=1")
    assert not (tmp_path / "tp1" / "common.pt").exists()
    assert json.loads((tmp_path / "tp1" / "metadata.json").read_text()) == {"sharded_backend": "torch_dist",
                                                                           "sharded_backend_version": 1}
    common = common_state(tmp_path / "tp1")  # as megatron-core's load_common_state_dict reads it
    assert common["args"].tensor_model_parallel_size == 1 and common["iteration"] == 10
    assert reshard.verify(tmp_path / "src", tmp_path / "tp1").identical
    reshard.convert(tmp_path / "tp1", tmp_path / "hf1", format="hf")
    check_hf(tmp_path / "hf1", ref)
    reshard.convert(tmp_path / "hf", tmp_path / "from-hf", format="mcore-dist", to="tp=2")  # no source form: common.pt
    assert (tmp_path / "from-hf" / "common.pt").is_file()


def test_a_model_of_no_family_carries_its_common_state_entry_once(tmp_path):
    saved = no_family_checkpoint(tmp_path / "src")
    want = torch.load(tmp_path / "src" / "common.pt", weights_only=False)
    as_0_19(tmp_path / "src")
    assert reshard.open_checkpoint(tmp_path / "src").spec_name == "mcore-dist-derived"
    reshard.convert(tmp_path / "src", tmp_path / "dist", format="mcore-dist", to="tp=2,dp=3")
    back = flat(tmp_path / "dist", tmp_path, "dist")
    assert back.keys() == {*saved, ENTRY}
    for k, v in saved.items():
        assert (torch.equal(back[k], v) and back[k].dtype == v.dtype) if torch.is_tensor(v) else back[k] == v, k
    common = common_state(tmp_path / "dist")
    assert vars(common["args"]) == vars(want["args"]) and common["iteration"] == 10
    assert common["optimizer"] == want["optimizer"]


@pytest.mark.parametrize("common", [{"args": None}, ["a", "b"]], ids=["dict", "list-of-two"])
def test_a_common_state_entry_that_is_not_a_list_of_one_dict_is_refused_naming_it(tmp_path, common):
    synthetic(tmp_path / "src")
    as_0_19(tmp_path / "src", common)
    with pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp: 'common_state/shard_0_1' should hold a list of "
                                                    r"one dict \(the common state, as megatron-core 0\.19 saves it\)"):
        reshard.open_checkpoint(tmp_path / "src")
