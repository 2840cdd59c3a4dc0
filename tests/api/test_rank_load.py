"""``reshard.load`` of one rank: that rank of a full conversion, bit for bit, read in few coalesced reads,
filled in place on any number of threads, on the device asked for."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import stored_bytes

import reshard
import reshard.api.loading as loading
from fixtures import make_fixture
from reshard.api.planning import _plan
from reshard.api.sinks import StagedSink, ThreadCopies
from reshard.errors import ReshardError
from reshard.execution.coalescing import Coalescing

# (name, source format, source topology, target format, target topology, rank)
CASES = [
    ("hf->megatron tp2pp2 rank 3", "hf", "tp=1", "megatron", "tp=2,pp=2", 3),
    ("dcp dp2->megatron tp2pp2 rank 1", "dcp", "dp=2", "megatron", "tp=2,pp=2", 1),
    ("deepspeed zero2 dp2->megatron tp2pp2 rank 2", "deepspeed", "dp=2,zero=2", "megatron", "tp=2,pp=2", 2),
]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def key(item) -> tuple:
    return (item.section, item.unit, item.chunk, item.state, item.key)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each case's source, and the stored bytes of its full conversion."""
    out = {}
    for name, fmt, topo, dst_fmt, dst_topo, _ in CASES:
        base = tmp_path_factory.mktemp(fmt)
        make_fixture(base / "src", format=fmt, to=topo, model="tiny-llama")
        reshard.convert(base / "src", base / "all", to=dst_topo, format=dst_fmt)
        out[name] = (base / "src", stored_bytes(base / "all"))
    return out


@pytest.mark.parametrize("name,fmt,topo,dst_fmt,dst_topo,rank", CASES, ids=[c[0] for c in CASES])
def test_a_ranks_load_is_that_rank_of_a_full_conversion_bit_for_bit(checkpoints, name, fmt, topo, dst_fmt, dst_topo, rank):
    src, written = checkpoints[name]
    mine = reshard.load(src, to=dst_topo, rank=rank, format=dst_fmt)
    assert mine.tensors
    for item, tensor in mine.tensors.items():
        assert raw(tensor) == written[key(item)], item
    coords = mine.topology.coords(rank)
    theirs = {k for k in written if all(coords.get(a) == c for a, c in k[1])}
    assert {key(it) for it in mine.tensors} == theirs
    needed = _plan(src, dst_topo, dst_fmt, None, None, None, None, rank=rank).needed_bytes()
    # the tiny model's rows are far below RANK_LOAD.free_gap: the other rank's halves are read through
    assert needed <= mine.bytes_read <= 2 * needed


def test_a_ranks_plan_holds_only_its_items_and_is_proven(checkpoints):
    src, _ = checkpoints[CASES[0][0]]
    whole = _plan(src, "tp=2,pp=2", "megatron", None, None, None, None)
    mine = _plan(src, "tp=2,pp=2", "megatron", None, None, None, None, rank=3)
    coords = whole.target.topology.coords(3)
    assert set(mine.plan.dst_items) == {it for it in whole.plan.dst_items if all(coords.get(a) == c for a, c in it.unit)}
    assert set(mine.plan.copies) == {c for c in whole.plan.copies if c.dst in mine.plan.dst_items}
    assert 0 < len(mine.plan.copies) < len(whole.plan.copies) / 3
    mine.plan.validate()
    with pytest.raises(ReshardError, match=r"rank 4 is outside world_size 4 of tp=2,pp=2"):
        reshard.load(src, to="tp=2,pp=2", rank=4, format="megatron")


def test_coalescing_reads_row_split_weights_in_a_few_reads(checkpoints, monkeypatch):
    # Rank 3 needs the second half of each row of the row-parallel weights (o_proj, down_proj): one run per row.
    src, _ = checkpoints[CASES[0][0]]
    loads = {}
    for name, how in [("default", loading.RANK_LOAD), ("slack", Coalescing(slack=0.25)), ("exact", Coalescing())]:
        monkeypatch.setattr(loading, "RANK_LOAD", how)
        loads[name] = reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", threads=1)
    needed = _plan(src, "tp=2,pp=2", "megatron", None, None, None, None, rank=3).needed_bytes()
    default, slack, exact = loads["default"], loads["slack"], loads["exact"]
    assert exact.bytes_read == needed
    assert needed < slack.bytes_read <= 1.25 * needed  # no free gaps: the slack bounds what is read through
    assert slack.reads * 10 < exact.reads, (slack.reads, exact.reads)
    # the default reads through every gap of a tiny model's rows: fewer reads still, within twice the bytes
    assert default.reads < slack.reads and slack.bytes_read < default.bytes_read <= 2 * needed
    for item, tensor in exact.tensors.items():
        assert torch.equal(tensor, slack.tensors[item]), item
        assert torch.equal(tensor, default.tensors[item]), item


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("staged", [False, True], ids=["in place", "staged"])
def test_threads_and_staging_fill_the_same_tensors(checkpoints, monkeypatch, threads, staged):
    """Windows of 4 KiB cut every tensor into many, filled on 1 or 3 threads, in place or (``staged``, the
    path of a CUDA device, run on the CPU) through staging buffers copied to the tensors."""
    src, written = checkpoints[CASES[0][0]]
    monkeypatch.setattr(loading, "_WINDOW", 4096)
    if staged:
        monkeypatch.setattr(loading, "_sink", lambda torch, dev, threads: StagedSink(torch, dev, threads, 4096,
                                                                                     ThreadCopies()))
    mine = reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", threads=threads)
    assert any(t.numel() * t.element_size() > 4 * 4096 for t in mine.tensors.values())
    for item, tensor in mine.tensors.items():
        assert raw(tensor) == written[key(item)], item


class _SlowCopies(ThreadCopies):
    """Each copy starts 2 ms late: a staging buffer filled again before its copy is done would show in the data."""

    def copy(self, dst, src):
        def late():
            time.sleep(0.002)
            dst.copy_(src)

        done = self.pool.submit(late)
        self.pending.append(done)
        return done


class _FailingCopies(ThreadCopies):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.copies = fail_at, 0

    def copy(self, dst, src):
        self.copies += 1
        if self.copies == self.fail_at:
            def fail():
                raise RuntimeError("the copy to the device failed")

            done = self.pool.submit(fail)
            self.pending.append(done)
            return done
        return super().copy(dst, src)


def test_a_staging_buffer_is_filled_again_only_once_its_copy_is_done(checkpoints, monkeypatch):
    src, written = checkpoints[CASES[0][0]]
    monkeypatch.setattr(loading, "_WINDOW", 4096)
    copies = _SlowCopies()
    monkeypatch.setattr(loading, "_sink", lambda torch, dev, threads: StagedSink(torch, dev, threads, 4096, copies))
    mine = reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", threads=3)
    assert len(copies.pending) == 0 and copies.pool._shutdown
    for item, tensor in mine.tensors.items():
        assert raw(tensor) == written[key(item)], item


def test_a_failed_copy_fails_the_load_and_leaves_no_copy_running(checkpoints, monkeypatch):
    src, _ = checkpoints[CASES[0][0]]
    monkeypatch.setattr(loading, "_WINDOW", 4096)
    copies = _FailingCopies(fail_at=3)
    monkeypatch.setattr(loading, "_sink", lambda torch, dev, threads: StagedSink(torch, dev, threads, 4096, copies))
    with pytest.raises(RuntimeError, match="the copy to the device failed"):
        reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", threads=2)
    assert copies.copies > 3 and copies.pool._shutdown  # the failure surfaced where its buffer came back
    assert not [t for t in threading.enumerate() if t.name.startswith("reshard-copy")]


def test_tensors_are_made_on_the_device_asked_for(checkpoints):
    src, _ = checkpoints[CASES[0][0]]
    default = reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron")
    for device in ("cpu", torch.device("cpu")):
        mine = reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", device=device)
        for item, tensor in mine.tensors.items():
            assert tensor.device == torch.device("cpu")
            assert torch.equal(tensor, default.tensors[item]), item
    with pytest.raises(ReshardError, match=r"device 'nowhere'"):
        reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", device="nowhere")
    if not torch.cuda.is_available():
        with pytest.raises(ReshardError, match=r"device 'cuda': CUDA is not available here"):
            reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", device="cuda")
    with pytest.raises(ReshardError, match=r"threads must be an integer of at least 1, got 0"):
        reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", threads=0)
