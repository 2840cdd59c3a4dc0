"""A real DeepSpeed pipeline-engine checkpoint of a custom ``PipelineModule`` no family describes, resharded to
another dp at the same pp without a spec, a config.json or sizes, and resumed by the pipeline engine's own
``load_checkpoint``.

The layer list (``tests/ds_pipe_jobs.py``) has an embedding, Linear layers with a bias, an activation module
(an empty layer file), a frozen Linear (in no model file), a norm beside persistent and non-persistent buffers,
a function layer (no file) and a head, over 2 stages, AdamW in two param groups per stage. Every rank trains
on the same batch, so the run resumed at dp=1 must match the uninterrupted dp=2 run bit for bit: the state it
loads, the next ``train_batch``'s loss and every weight and state after it.
"""

from __future__ import annotations

import ds_pipe_jobs
import numpy as np
import pytest
from conftest import require

import reshard
from reshard.execution.arrays import gather

pytestmark = [pytest.mark.interop, pytest.mark.slow]


def read_logical(path) -> dict:
    """Every logical tensor and state of a checkpoint as reshard reads it, bf16 as its bits (as the jobs dump it)."""
    src = reshard.open_checkpoint(path)
    items = {}
    for item, loc in src.where.items():
        dtype = np.int16 if loc.dtype == "bfloat16" else np.dtype(loc.dtype)
        items[item] = np.fromfile(loc.path, dtype=dtype, count=src.layout.items[item].numel, offset=loc.offset)
    return gather(src.layout, items)


def assert_same(dump: dict, want: dict, prefix: str) -> int:
    """``dump``'s entries under ``prefix`` equal ``want``'s bit for bit; how many there were."""
    keys = sorted(k for k in dump if k.startswith(prefix + ":"))
    assert keys == sorted(k for k in want if k.startswith(prefix + ":"))
    for key in keys:
        assert dump[key].dtype == want[key].dtype and dump[key].shape == want[key].shape, key
        np.testing.assert_array_equal(dump[key], want[key], err_msg=key)
    return len(keys)


def test_a_custom_pipeline_resumes_at_another_dp_bit_exactly(tmp_path):
    """bf16 weights in the layer files, fp32 masters and Adam's moments in each stage's optimizer files."""
    require("deepspeed")
    dtype = "bf16"
    ds_pipe_jobs.run(tmp_path, 4, "save", tmp_path / "ckpt", tmp_path / "saved.npz", pp=2, dtype=dtype)
    uninterrupted = dict(np.load(tmp_path / "saved.npz"))
    src = reshard.open_checkpoint(tmp_path / "ckpt")
    assert (src.spec_name, str(src.topology)) == ("deepspeed-pipe-derived", "tp=1,pp=2,dp=2,zero=1")
    logical = read_logical(tmp_path / "ckpt")
    for key, value in uninterrupted.items():  # reshard reads what DeepSpeed held when it saved
        if key.startswith("state:"):
            _, name, state = key.split(":")
            assert logical[(name, state)].tobytes() == value.tobytes(), key

    result = reshard.convert(tmp_path / "ckpt", tmp_path / "dp1", to="pp=2,dp=1")
    assert result.report.target.spec_name == "deepspeed-pipe-derived"
    ds_pipe_jobs.run(tmp_path, 2, "load", tmp_path / "dp1", tmp_path / "resumed.npz", pp=2, dtype=dtype)
    resumed = dict(np.load(tmp_path / "resumed.npz"))
    loaded = assert_same(resumed, uninterrupted, "state")
    assert loaded == 4 * 6 + 3  # weights, masters and moments of 6 trained params; 2 frozen params, 1 buffer
    np.testing.assert_array_equal(resumed["loss"], uninterrupted["loss"])
    assert assert_same(resumed, uninterrupted, "after") == loaded
