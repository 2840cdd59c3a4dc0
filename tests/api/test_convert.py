"""End to end: fixtures written as simulated ranks, converted through files, checked bit for bit.

Each conversion is checked two ways: ``verify`` rebuilds every logical tensor
and state from both checkpoints and compares them, and every destination
item's stored bytes (padding included) must equal those of a fixture
written directly at the destination topology.
"""

from __future__ import annotations


import pytest

import reshard
from conftest import stored_bytes
from reshard.fixtures import STATES, make_fixture
from reshard.errors import CheckpointFormatError, ReshardError, TopologyError


MEGATRON = [
    # (model, source topology, destination topology): what the pair exercises
    ("tiny-llama", "tp=2,pp=2", "tp=1,pp=4"),                       # pipeline restaging, tp merge
    ("tiny-llama", "tp=1,pp=1", "tp=4,pp=2"),                       # grow; vocab padding 1152 -> 1536
    ("tiny-llama", "tp=4,pp=1", "tp=2,pp=1"),                       # shrink; padding 1536 -> 1280
    ("tiny-llama", "tp=1,pp=3,stages=1+2+1", "tp=2,pp=2"),          # uneven stages
    ("tiny-llama", "tp=2,pp=2", "tp=1,pp=2,vpp=2"),                 # virtual pipeline chunks
    ("tiny-llama", "tp=2,pp=2,dp=2,zero=1", "tp=1,pp=1,dp=3,zero=1"),  # distributed optimizer, params straddle dp ranks
    ("tiny-llama", "tp=1,pp=1,dp=2,zero=1", "tp=2,pp=2,zero=0"),    # distributed -> per-parameter optimizer
    ("tiny-llama-tied", "tp=1,pp=1", "tp=2,pp=2"),                  # tied embedding gains a last-stage copy
    ("tiny-llama-tied", "tp=2,pp=4", "tp=1,pp=1"),                  # ... and loses it, read once
    ("tiny-gpt2", "tp=2,pp=2", "tp=1,pp=4"),                        # GPT-2 style: biases, LayerNorm, positions
    ("tiny-gpt2", "tp=1,pp=1", "tp=4,pp=2"),                        # per-head QKV split over tp; padding grows
]


@pytest.mark.parametrize("model,src_topo,dst_topo", MEGATRON, ids=[f"{m}:{a}->{b}" for m, a, b in MEGATRON])
def test_megatron_conversion_matches_a_checkpoint_written_at_the_destination(tmp_path, model, src_topo, dst_topo):
    src, dst, direct = tmp_path / "src", tmp_path / "dst", tmp_path / "direct"
    make_fixture(src, format="megatron", to=src_topo, model=model)
    result = reshard.convert(src, dst, to=dst_topo)
    assert (dst / "reshard.json").exists()
    check = reshard.verify(src, dst)
    assert check.identical, check.differences
    assert check.compared > 0
    make_fixture(direct, format="megatron", to=dst_topo, model=model)
    assert stored_bytes(dst) == stored_bytes(direct)
    # Only bytes the destination needs are read (a source byte two destination files need is read for each), and gaps
    # of at most 16 KiB between them (the other tp ranks' parts of the rows of a row-split weight).
    needed = sum(c.numel * reshard.formats.base.itemsize(result.report.source.where[c.src].dtype)
                 for c in result.report.plan.copies)
    assert result.bytes_read - result.gap_bytes <= needed


DEEPSPEED = [
    ("tiny-llama", "dp=2,zero=2", "dp=3,zero=2"),   # grow to a dp that splits params across ranks
    ("tiny-llama", "dp=4,zero=1", "dp=1,zero=1"),   # shrink to one rank
    ("tiny-llama", "dp=3,zero=2", "dp=2,zero=1"),   # ZeRO-2 -> ZeRO-1
]


@pytest.mark.parametrize("model,src_topo,dst_topo", DEEPSPEED, ids=[f"{m}:{a}->{b}" for m, a, b in DEEPSPEED])
def test_deepspeed_conversion_matches_a_checkpoint_written_at_the_destination(tmp_path, model, src_topo, dst_topo):
    src, dst, direct = tmp_path / "src", tmp_path / "dst", tmp_path / "direct"
    make_fixture(src, format="deepspeed", to=src_topo, model=model)
    reshard.convert(src, dst, to=dst_topo)
    check = reshard.verify(src, dst)
    assert check.identical, check.differences
    make_fixture(direct, format="deepspeed", to=dst_topo, model=model)
    assert stored_bytes(dst) == stored_bytes(direct)


def test_megatron_with_optimizer_moves_to_deepspeed_and_back(tmp_path):
    src, ds, back = tmp_path / "src", tmp_path / "ds", tmp_path / "back"
    make_fixture(src, format="megatron", to="tp=2,pp=2", model="tiny-llama")
    reshard.convert(src, ds, format="deepspeed", to="dp=2,zero=2")
    check = reshard.verify(src, ds)
    assert check.identical, check.differences
    reshard.convert(ds, back, format="megatron", to="tp=1,pp=2")
    assert reshard.verify(src, back).identical


def test_megatron_to_hf_and_back_keeps_the_weights(tmp_path):
    src, hf, back = tmp_path / "src", tmp_path / "hf", tmp_path / "back"
    make_fixture(src, format="megatron", to="tp=2,pp=2", model="tiny-llama")
    reshard.convert(src, hf, format="hf")
    assert (hf / "config.json").exists()
    assert reshard.verify(src, hf, states=("param",))
    reshard.convert(hf, back, format="megatron", to="tp=2,pp=1")
    assert reshard.verify(src, back, states=("param",))
    lost = reshard.verify(src, back)  # the optimizer state did not travel through hf
    assert not lost.identical
    assert all("only in the first checkpoint" in d for d in lost.differences)


def test_verify_names_the_tensor_and_position_of_a_one_element_difference(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_fixture(a, format="megatron", to="tp=2", model="tiny-llama")
    make_fixture(b, format="megatron", to="tp=1", model="tiny-llama")
    src = reshard.open_checkpoint(b)
    item = next(it for it in src.where if it.key == "decoder.layers.1.mlp.linear_fc2.weight" and it.state == "param")
    loc = src.where[item]
    with loc.path.open("r+b") as f:  # flip one bit of element [3, 5] of the stored [h, f] tensor
        f.seek(loc.offset + (3 * 160 + 5) * 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    result = reshard.verify(a, b)
    assert not result.identical
    assert result.differences == ("model.layers.1.mlp.down_proj.weight [param]: first difference at (3, 5) (1 elements differ)",)


def test_load_reads_about_one_ranks_share(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2,pp=2", model="tiny-llama")
    total = sum(len(b) for b in stored_bytes(src).values())
    mine = reshard.load(src, to="tp=4,pp=2", rank=5)
    assert {it.unit for it in mine.tensors} == {(("tp", 1), ("pp", 1))}
    share = sum(t.numel() * t.element_size() for t in mine.tensors.values())
    assert share < total / 6
    # the tiny model's gaps between the runs it needs (the other half of each row of a row-split weight) are
    # under RANK_LOAD.free_gap: read through, at most once more the share
    assert share < mine.bytes_read <= 2 * share
    # The returned tensors are what a full conversion writes for that rank.
    reshard.convert(src, tmp_path / "all", to="tp=4,pp=2")
    written = stored_bytes(tmp_path / "all")
    for item, tensor in mine.tensors.items():
        key = (item.section, item.unit, item.chunk, item.state, item.key)
        assert tensor.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes() == written[key]


def test_a_failed_conversion_leaves_no_destination(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_fixture(src, format="megatron", to="tp=2", model="tiny-llama")
    from reshard.formats import megatron

    real = megatron.FORMAT.write

    def dies_halfway(target, out, fill, *args, **kw):
        real(target, out, fill, *args, **kw)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(megatron.FORMAT, "write", dies_halfway)
    with pytest.raises(OSError):
        reshard.convert(src, dst, to="tp=1")
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


def test_bad_inputs_are_clear_errors_and_write_nothing(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2", model="tiny-llama")
    with pytest.raises(TopologyError, match=r"linear_proj.weight: \(g qpg hd\)\(64\) is not divisible by tp\(3\)"):
        reshard.convert(src, tmp_path / "x", to="tp=3")
    with pytest.raises(CheckpointFormatError, match="destination is inside the source"):
        reshard.convert(src, src / "inner", to="tp=1")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(CheckpointFormatError, match="destination exists and is not empty"):
        reshard.convert(src, tmp_path / "full", to="tp=1")
    with pytest.raises(ReshardError, match="not a checkpoint reshard recognizes"):
        reshard.convert(tmp_path / "full", tmp_path / "y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "src"]


PROGRESS = [
    # (source format, source topology, destination format, destination topology)
    ("megatron", "tp=2,pp=2", "megatron", "tp=1,pp=4"),              # vocabulary padding in the destination
    ("megatron", "tp=1,pp=1,dp=2,zero=1", "deepspeed", "dp=3,zero=2"),  # flat buffers with end padding
    ("deepspeed", "dp=2,zero=1", "ucp", None),                        # fp32 copies filled apart from the stream
    ("megatron", "tp=2,pp=1", "hf", None),
    ("hf", "tp=1", "dcp", "dp=2"),
]


@pytest.mark.parametrize("src_fmt,src_topo,dst_fmt,dst_topo", PROGRESS, ids=[f"{a}->{c}" for a, _, c, _ in PROGRESS])
@pytest.mark.parametrize("workers", [1, 2])
def test_progress_rises_to_exactly_the_bytes_the_plan_moves(tmp_path, src_fmt, src_topo, dst_fmt, dst_topo, workers):
    """Every call counts more than the last and the last is (total, total): padding the writers add, and fills
    made apart from the stream, never push a bar past its end or leave it short."""
    make_fixture(tmp_path / "src", format=src_fmt, to=src_topo, states=("param",) if src_fmt == "hf" else STATES)
    calls: list[tuple[int, int]] = []
    reshard.convert(tmp_path / "src", tmp_path / "dst", format=dst_fmt, to=dst_topo, workers=workers,
                    progress=lambda done, total: calls.append((done, total)))
    total = reshard.plan(tmp_path / "src", format=dst_fmt, to=dst_topo).needed_bytes()
    assert calls and calls[-1] == (total, total) and total > 0
    assert all(a[0] < b[0] and a[1] == total for a, b in zip(calls, calls[1:]))


def test_the_cyclic_collector_rests_while_bytes_move_and_runs_again_after(tmp_path):
    """The plan's objects live until the conversion ends; the collector's passes over them cost a sixth of a
    100,000-tensor conversion, so it is paused while bytes move, and on again once the conversion returns."""
    import gc

    make_fixture(tmp_path / "src", format="hf", states=("param",))
    during: list[bool] = []
    assert gc.isenabled()
    reshard.convert(tmp_path / "src", tmp_path / "dst", format="hf", progress=lambda done, total: during.append(
        gc.isenabled()))
    assert during and not any(during) and gc.isenabled()
