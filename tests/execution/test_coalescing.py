"""Coalesced reads: nearby runs of one file read as one span, within the slack, bit-exactly."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import layouts, logical_values

import reshard.execution.reader as reader_module
from reshard.core.planner import plan
from reshard.execution.arrays import apply, scatter
from reshard.execution.coalescing import Coalescing, GapBudget, conversion
from reshard.execution.executor import ByteReader, PlanFill
from reshard.errors import ReshardError
from reshard.formats.base import Located

ROW_SPLIT = """
logical w = r c
section model per tp
w = r c/tp
"""
TRANSPOSED = """
logical w = o i
section model per tp
w_t -> w = i o/tp
"""


def stored(tmp_path, items: dict) -> dict:
    """Items back to back in one file, with a few bytes of garbage between them."""
    path = tmp_path / "blob.bin"
    where = {}
    with path.open("wb") as f:
        for k, (item, arr) in enumerate(sorted(items.items())):
            f.write(b"\xee" * (k % 5))
            where[item] = Located(path, f.tell(), "float32")
            f.write(arr.tobytes())
    return where


def case(tmp_path, text: str, sizes: dict, src: str, dst: str):
    a, b = layouts(text, sizes, src, dst)
    items = scatter(a, logical_values(a))
    p = plan(a, b)
    return p, stored(tmp_path, items), apply(p, items), b


@pytest.mark.parametrize("in_place", [512, 1 << 40], ids=["vectored", "span buffer"])
@pytest.mark.parametrize("slack", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("window", [37, 1 << 20])
def test_coalesced_fills_are_bit_exact_and_read_within_the_slack(tmp_path, in_place, slack, window):
    p, where, want, dst = case(tmp_path, ROW_SPLIT, {"r": 64, "c": 256}, "tp=1", "tp=2")
    needed = sum(c.numel * 4 for c in p.copies)
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader, coalescing=Coalescing(slack=slack, in_place_run=in_place))
        for item, info in dst.items.items():
            got = b"".join(bytes(fill(item, lo, min(lo + window, info.numel))) for lo in range(0, info.numel, window))
            assert got == want[item].tobytes(), item
    assert reader.bytes_read <= (1 + slack) * needed
    if slack == 0:
        assert reader.bytes_read == needed
    if slack == 1.0 and window > 64 * 256:  # whole items: each half-row split is one read per item
        assert reader.reads == 2


def test_a_transposed_store_is_gathered_through_the_span_buffer(tmp_path):
    p, where, want, dst = case(tmp_path, TRANSPOSED, {"o": 64, "i": 48}, "tp=1", "tp=4")
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader, coalescing=Coalescing(slack=3.0))
        for item, info in dst.items.items():
            assert bytes(fill(item, 0, info.numel)) == want[item].tobytes()
    assert reader.reads == 4  # each item: one span through the whole source, three quarters of it gaps


def test_fit_gaps_spends_the_slack_on_the_smallest_gaps_of_all_windows(tmp_path):
    p, where, want, dst = case(tmp_path, ROW_SPLIT, {"r": 64, "c": 256}, "tp=1", "tp=4")
    windows = [(item, 0, info.numel) for item, info in dst.items.items()]
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader, coalescing=Coalescing(slack=3.0))
        assert fill.fit_gaps(windows) == 3 * 64 * 4  # the three other ranks' quarter rows
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader, coalescing=Coalescing(slack=0.5))
        assert fill.fit_gaps(windows) == 0  # gaps of one size are read through all or none: 252 of them do not fit
        out = np.empty(64 * 64, dtype=np.uint32)
        for item, lo, hi in windows:
            fill.fill_into(item, lo, hi, out)
            assert out.tobytes() == want[item].tobytes()


@pytest.mark.parametrize("free_gap", [0, 3 * 64 * 4 - 1, 3 * 64 * 4])
def test_gaps_up_to_free_gap_are_read_through_without_spending_the_slack(tmp_path, free_gap):
    # tp=4 of 64 rows of 256 floats: each rank reads a quarter row, then skips the others' 768 bytes.
    p, where, want, dst = case(tmp_path, ROW_SPLIT, {"r": 64, "c": 256}, "tp=1", "tp=4")
    windows = [(item, 0, info.numel) for item, info in dst.items.items()]
    needed = sum(c.numel * 4 for c in p.copies)
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader, coalescing=Coalescing(slack=0.5, free_gap=free_gap))
        assert fill.fit_gaps(windows) == free_gap  # no larger gap fits the slack
        out = np.empty(64 * 64, dtype=np.uint32)
        for item, lo, hi in windows:
            fill.fill_into(item, lo, hi, out)
            assert out.tobytes() == want[item].tobytes()
    if free_gap >= 3 * 64 * 4:  # every gap read through: one read per item, at most 4 times the bytes
        assert reader.reads == 4 and needed < reader.bytes_read < 4 * needed
    else:  # no gap fits: one read per quarter row, every byte needed
        assert reader.reads == 4 * 64 and reader.bytes_read == needed


@pytest.mark.parametrize("window", [256, 64 * 256 * 4])
def test_a_conversion_reads_through_small_gaps_in_spans_within_its_window(tmp_path, window):
    # tp=4 of 64 rows of 256 floats: each rank needs a quarter row of 256 bytes, then 768 bytes of the others'.
    p, where, want, dst = case(tmp_path, ROW_SPLIT, {"r": 64, "c": 256}, "tp=1", "tp=4")
    needed = sum(c.numel * 4 for c in p.copies)
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader, coalescing=conversion(window))
        for item, info in dst.items.items():
            assert bytes(fill(item, 0, info.numel)) == want[item].tobytes()
    assert reader.bytes_read - reader.gap_bytes == needed  # every needed byte once, besides the gaps
    if window == 256:  # no span longer than the window: each quarter row alone
        assert reader.reads == 4 * 64 and reader.gap_bytes == 0
    else:  # one span per rank, through the 63 gaps between its quarter rows
        assert reader.reads == 4 and reader.gap_bytes == 4 * 63 * 768


def test_coalescing_refuses_a_free_gap_outside_zero_to_max_gap():
    for bad in (-1, (1 << 20) + 1):
        with pytest.raises(ReshardError, match="free_gap"):
            Coalescing(free_gap=bad)


def test_fill_into_zeroes_padding_and_refuses_a_wrong_buffer(tmp_path):
    text = "logical w = n\nsection model per tp\nw = n~(8*tp)/tp\n"
    p, where, want, dst = case(tmp_path, text, {"n": 30}, "tp=1", "tp=4")
    item = next(it for it, info in dst.items.items() if info.mapped < info.numel)  # the last rank: 6 of 8 mapped
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader)
        out = np.full(dst.items[item].numel, 0xFFFFFFFF, dtype=np.uint32)
        fill.fill_into(item, 0, len(out), out)
        assert out.tobytes() == want[item].tobytes()
        with pytest.raises(ReshardError, match=r"need a writable contiguous 1-D buffer"):
            fill.fill_into(item, 0, len(out), np.empty(len(out), dtype=np.uint16))


def test_gap_budget_takes_the_gaps_that_fit(monkeypatch):
    budget = GapBudget(10)
    assert budget.take(np.array([3, 3, 5])) == 2 and budget.left == 4
    assert budget.take(np.array([5])) == 0 and budget.left == 4


def test_vectored_reads_go_on_after_short_reads(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    data = os.urandom(5000)
    path.write_bytes(data)
    real = os.preadv

    def short(fd, buffers, offset):  # at most 7 bytes a call, as a pipe or a network file system might
        first = buffers[0]
        return real(fd, [first[:7]], offset) if len(first) else 0

    monkeypatch.setattr(reader_module.os, "preadv", short)
    bufs = [memoryview(bytearray(n)) for n in (10, 0, 33, 4000)]
    with ByteReader() as reader:
        reader.read_vectored(path, 100, bufs)
        assert reader.bytes_read == 4043
    assert b"".join(bytes(b) for b in bufs) == data[100:4143]
