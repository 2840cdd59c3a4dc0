"""The streaming executor: windows of destination items filled from file spans, bit-exactly."""

from __future__ import annotations

import pytest
from conftest import layouts, logical_values

from reshard.execution.arrays import apply, scatter
from reshard.formats.specs import layout_spec
from reshard.errors import CheckpointFormatError
from reshard.execution.executor import ByteReader, PlanFill
from reshard.formats.base import Located
from reshard.core.resolve import resolve
from reshard.core.planner import plan
from reshard.core.topology import parse_topology


def write_items(tmp_path, items: dict, dtype: str) -> dict:
    """Store items back to back (with gaps) in one file; return where each one is."""
    path = tmp_path / "blob.bin"
    where = {}
    with path.open("wb") as f:
        for k, (item, arr) in enumerate(sorted(items.items())):
            f.write(b"\xee" * (k % 7))  # garbage between items must never be read into outputs
            where[item] = Located(path, f.tell(), dtype)
            f.write(arr.tobytes())
    return where


def fill_all(fill, infos, window: int) -> dict:
    out = {}
    for item, info in infos.items():
        parts = [bytes(fill(item, lo, min(lo + window, info.numel))) for lo in range(0, info.numel, window)]
        out[item] = b"".join(parts)
    return out


@pytest.mark.parametrize("direct", [False, True], ids=["gathered", "direct"])
@pytest.mark.parametrize("window", [1, 7, 64, 1 << 20])
def test_windows_of_any_size_reproduce_the_in_memory_plan(tmp_path, window, direct, monkeypatch):
    """Runs gathered into a buffer and scattered, or (``direct``, with the run threshold lowered to one
    element) read straight into the destination window where both sides are contiguous; a window filled from
    one contiguous run is read straight into it either way."""
    import reshard.execution.executor

    if direct:
        monkeypatch.setattr(reshard.execution.executor, "_DIRECT_RUN", 4)
    reads_direct = []
    real = reshard.execution.executor.PlanFill._read_direct

    def counting(self, region, out, at, dst_strides, alone=False):
        done = real(self, region, out, at, dst_strides, alone)
        reads_direct.append((done, alone))
        return done

    monkeypatch.setattr(reshard.execution.executor.PlanFill, "_read_direct", counting)
    spec = layout_spec("megatron-llama-distopt")
    sizes = {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "layers": 4, "vocab_div": 8, "bucket_size": 0}
    src = resolve(spec, parse_topology("tp=2,pp=2,dp=2"), sizes)
    dst = resolve(spec, parse_topology("tp=1,pp=4,dp=3"), sizes)
    values = logical_values(src, ("param", "master", "exp_avg", "exp_avg_sq"))
    items = scatter(src, values)
    p = plan(src, dst)
    want = apply(p, items)
    where = write_items(tmp_path, items, "float32")
    with ByteReader() as reader:
        got = fill_all(PlanFill(p, where, reader), dst.items, window)
    for item, arr in want.items():
        assert got[item] == arr.tobytes(), item
    assert any(done for done, _ in reads_direct)  # a region alone in its window is read straight in anyway
    assert any(done and not alone for done, alone in reads_direct) == (direct and window > 1)


def test_sparse_strided_regions_read_run_by_run(tmp_path):
    # A transposed store read into row-major windows touches one element per row of the source.
    text = """
logical w = o i
section model per tp
w_t -> w = i o/tp
"""
    src, dst = layouts(text, {"o": 64, "i": 48}, "tp=1", "tp=4")
    values = logical_values(src)
    items = scatter(src, values)
    p = plan(src, dst)
    where = write_items(tmp_path, items, "float32")
    want = apply(p, items)
    for window, bound in ((100, 4), (1 << 20, 1)):
        with ByteReader() as reader:
            got = fill_all(PlanFill(p, where, reader), dst.items, window)
            read = reader.bytes_read
        for item, arr in want.items():
            assert got[item] == arr.tobytes()
        # Whole-item windows read each source byte exactly once; tiny windows re-read at most a few times.
        assert read <= bound * sum(a.nbytes for a in items.values())


def test_a_rank_share_reads_about_its_bytes_only(tmp_path):
    text = """
logical w = r c
section model per tp
w = r/tp c
"""
    src, dst = layouts(text, {"r": 800, "c": 50}, "tp=2", "tp=8")
    values = logical_values(src)
    items = scatter(src, values)
    p = plan(src, dst)
    where = write_items(tmp_path, items, "float32")
    mine = [it for it in dst.items if it.unit == (("tp", 5),)]
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader)
        for it in mine:
            fill(it, 0, dst.items[it].numel)
        assert reader.bytes_read == 800 * 50 * 4 // 8


def test_a_truncated_source_file_is_a_clear_error(tmp_path):
    text = "logical w = n\nsection model per tp\nw = n/tp\n"
    src, dst = layouts(text, {"n": 64}, "tp=2", "tp=1")
    items = scatter(src, logical_values(src))
    where = write_items(tmp_path, items, "float32")
    path = next(iter(where.values())).path
    path.write_bytes(path.read_bytes()[:100])
    with ByteReader() as reader, pytest.raises(CheckpointFormatError, match=r"blob.bin: file ends at byte \d+, expected \d+ more bytes"):
        PlanFill(plan(src, dst), where, reader)(next(iter(dst.items)), 0, 64)
