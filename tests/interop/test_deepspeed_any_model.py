"""Real DeepSpeed checkpoints of a model no family describes, resharded without a spec and resumed by
DeepSpeed's own ``load_checkpoint`` (not a universal checkpoint) at another dp and ZeRO stage.

The model (``tests/ds_jobs.py``) has an embedding tied to the output head, Linear layers with biases, a
LayerNorm, a frozen Linear, a persistent float buffer, a persistent int64 buffer and a non-persistent one,
trained with AdamW in one param group or two (weight decay on weights only, as transformers' Trainer
groups them). Each run dumps the state DeepSpeed holds (weights, fp32 masters, Adam's moments, frozen
params, buffers), then the loss of one more step and the weights and states after it. Every rank trains
on the same batch, so runs at dp 2 and 4 average the same gradients and a resumed run must match the
uninterrupted one bit for bit: the state it loads, its loss and everything after its step.
"""

from __future__ import annotations

import ds_jobs
import numpy as np
import pytest
from conftest import require

import reshard
from reshard.execution.arrays import gather

pytestmark = [pytest.mark.interop, pytest.mark.slow]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Real checkpoints at dp=2 after two steps, with the uninterrupted run's dump, one per option set."""
    cache = {}

    def get(stage: int, dtype: str, groups: int, frozen: bool = True, buffers: bool = True):
        require("deepspeed")
        key = (stage, dtype, groups, frozen, buffers)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"ds-custom-z{stage}-{dtype}-g{groups}")
            ds_jobs.run(root, 2, "save", root / "ckpt", root / "dump.npz", stage=stage, dtype=dtype, groups=groups,
                        frozen=frozen, buffers=buffers)
            cache[key] = root / "ckpt", dict(np.load(root / "dump.npz"))
        return cache[key]

    return get


def read_logical(path) -> dict:
    """Every logical tensor and state of a checkpoint as reshard reads it, values as the files hold them."""
    src = reshard.open_checkpoint(path)
    items = {}
    for item, loc in src.where.items():
        dtype = np.int16 if loc.dtype == "bfloat16" else np.dtype(loc.dtype)  # bf16 as the jobs dump it: its bits
        items[item] = np.fromfile(loc.path, dtype=dtype, count=src.layout.items[item].numel, offset=loc.offset)
    return gather(src.layout, items)


def assert_same(dump: dict, want: dict, prefix: str, *, subset: bool = False) -> int:
    """``dump``'s entries under ``prefix`` equal ``want``'s bit for bit (``subset``: ``dump`` may hold fewer, as a
    ZeRO-3 run holds no training-dtype weights of trained params); how many there were."""
    keys = sorted(k for k in dump if k.startswith(prefix + ":"))
    if subset:
        assert set(keys) <= set(want)
    else:
        assert keys == sorted(k for k in want if k.startswith(prefix + ":"))
    for key in keys:
        assert dump[key].dtype == want[key].dtype and dump[key].shape == want[key].shape, key
        np.testing.assert_array_equal(dump[key], want[key], err_msg=key)
    return len(keys)


def assert_reads_what_deepspeed_holds(path, dump: dict, stage: int) -> None:
    """reshard's reading of ``path`` equals the state DeepSpeed held when it saved it."""
    logical = read_logical(path)
    compared = 0
    for key, value in dump.items():
        if not key.startswith("state:"):
            continue
        _, name, state = key.split(":")
        if stage == 3 and state == "param" and (name, "param") not in logical:
            continue  # a trained param's bf16 weights: ZeRO-3 stores only the fp32 masters
        got = logical[(name, state)]
        assert got.tobytes() == value.tobytes(), key
        compared += 1
    assert compared >= 4 * 5  # master, exp_avg, exp_avg_sq of the trained params at least, and the buffers


def resume(tmp_path, src, to: str, *, stage: int, dtype: str, groups: int, **model) -> dict:
    """Reshard ``src`` to ``to`` without a spec, then DeepSpeed loads it and takes a step; its dump."""
    result = reshard.convert(src, tmp_path / "out", to=to)
    assert result.report.source.spec_name == "deepspeed-derived"
    topo = result.report.target.topology
    ds_jobs.run(tmp_path, topo.dp, "load", tmp_path / "out", tmp_path / "dump.npz", stage=stage, dtype=dtype,
                groups=groups, **model)
    return dict(np.load(tmp_path / "dump.npz"))


CASES = [
    # (saved at dp=2: stage, dtype, param groups; resharded to)
    (2, "bf16", 2, "dp=4"),  # HF-Trainer-style groups, bf16 weights, frozen params, buffers, a tied head
    (3, "bf16", 2, "dp=4"),  # ZeRO-3: per-param partitions, frozen fragments, buffers in every rank's file
    (1, "bf16acc", 2, "dp=4"),  # BF16_Optimizer: the master partitions whole, all padding on the last rank
]


@pytest.mark.parametrize("stage,dtype,groups,to", CASES, ids=[f"z{s}-{d}-g{g}-{t}" for s, d, g, t in CASES])
def test_a_custom_model_resumes_at_another_dp_bit_exactly(saved, tmp_path, stage, dtype, groups, to):
    src, uninterrupted = saved(stage, dtype, groups)
    assert_reads_what_deepspeed_holds(src, uninterrupted, stage)
    resumed = resume(tmp_path, src, to, stage=int(to.partition("zero=")[2] or stage), dtype=dtype, groups=groups)
    loaded = assert_same(resumed, uninterrupted, "state")
    assert loaded >= 3 * 7 + 2  # every trained param's master and moments, the frozen params, the buffers
    np.testing.assert_array_equal(resumed["loss"], uninterrupted["loss"])
    assert assert_same(resumed, uninterrupted, "after") == loaded


def test_zero2_to_zero3_at_dp3_and_back_to_zero2(saved, tmp_path):
    """Two param groups, a tied head, frozen params and buffers through ZeRO-3 at dp=3 and back to ZeRO-2 at
    dp=2: ZeRO-3 keeps the trained params only as fp32 masters (their weights are made from them) and the frozen
    params and buffers as they are."""
    src, uninterrupted = saved(2, "fp32", 2)
    at3 = resume(tmp_path / "z3", src, "dp=3,zero=3", stage=3, dtype="fp32", groups=2)
    assert assert_same(at3, uninterrupted, "state", subset=True) >= 3 * 7 + 2
    np.testing.assert_array_equal(at3["loss"], uninterrupted["loss"])  # the same weights: the same loss
    back = resume(tmp_path / "z2", tmp_path / "z3" / "out", "dp=2,zero=2", stage=2, dtype="fp32", groups=2)
    assert_same(back, uninterrupted, "state")
    np.testing.assert_array_equal(back["loss"], uninterrupted["loss"])
    assert_same(back, uninterrupted, "after")


@pytest.mark.parametrize("stage", [2, 3])
def test_the_masters_and_frozen_params_equal_zero_to_fp32s(saved, stage):
    """DeepSpeed's own consolidation (zero_to_fp32, frozen params included) against reshard's reading."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src, dump = saved(stage, "bf16", 2)
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(src))
    logical = read_logical(src)
    frozen = {"frozen.weight", "frozen.bias", "scale", "seen"}  # and the buffers, as they are
    assert set(theirs) == {n for n, s in logical if s == "master"} | frozen | {"head.weight"}
    for name, value in theirs.items():
        state = "param" if name in frozen else "master"
        ours = logical[("embed.weight" if name == "head.weight" else name, state)]
        want = value.detach().contiguous()
        if want.dtype == torch.bfloat16:
            want = want.view(torch.int16)
        assert ours.tobytes() == want.numpy().tobytes(), name


def test_a_universal_folder_keeps_frozen_params_and_buffers_as_ds_to_universal_does(saved, tmp_path):
    """ZeRO-2 at dp=2 (a frozen Linear, persistent and non-persistent buffers, a tied head) to a universal
    folder: reshard's equals ds_to_universal's tensor for tensor, and DeepSpeed's load_universal at dp=3 loads
    every param, frozen param, buffer and Adam state from it exactly as from ds_to_universal's."""
    import torch
    from formats.test_format_deepspeed import ds_to_universal

    src, uninterrupted = saved(2, "bf16", 2)
    tag = (src / "latest").read_text().strip()
    reshard.convert(src, tmp_path / "ours", format="ucp")
    ds_to_universal(src, tmp_path / "theirs" / tag)
    (tmp_path / "theirs" / "latest_universal").write_text(tag)
    ours, theirs = tmp_path / "ours" / tag, tmp_path / "theirs" / tag
    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*.pt"))
    assert files == sorted(p.relative_to(ours) for p in ours.rglob("*.pt"))
    assert {"zero/frozen.weight/fp32.pt", "zero/scale/fp32.pt", "zero/seen/fp32.pt",
            "zero/head.weight/fp32.pt"} <= {str(f) for f in files}

    def same(a, b, where):
        if torch.is_tensor(a):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
        elif isinstance(a, dict):
            assert list(a) == list(b), where
            for k in a:
                same(a[k], b[k], f"{where}[{k!r}]")
        else:
            assert a == b, where

    for rel in files:
        a, b = torch.load(ours / rel, weights_only=False), torch.load(theirs / rel, weights_only=False)
        if rel.name == "optimizer_state.pt":
            assert a.keys() == b.keys() and a["param_groups"] == b["param_groups"], rel
        elif rel.name == "mp_rank_00_model_states.pt":
            assert a.keys() == b.keys(), rel
            for key in ("module", "frozen_param_fragments"):
                same(a[key], b[key], f"{rel}:{key}")
            assert (a["buffer_names"], a["shared_params"], a["frozen_param_shapes"]) == \
                (b["buffer_names"], b["shared_params"], b["frozen_param_shapes"])
        else:
            same(a, b, str(rel))
    loaded = {}
    for name in ("ours", "theirs"):
        ds_jobs.run(tmp_path / name, 3, "load", tmp_path / name, tmp_path / f"{name}.npz", stage=2, dtype="bf16",
                    groups=2, options={"RESHARD_DS_UNIVERSAL": "1"})
        loaded[name] = dict(np.load(tmp_path / f"{name}.npz"))
    assert loaded["ours"].keys() == loaded["theirs"].keys()
    for key, value in loaded["theirs"].items():
        assert loaded["ours"][key].tobytes() == value.tobytes(), key
    assert assert_same(loaded["ours"], uninterrupted, "state") >= 3 * 7 + 2
