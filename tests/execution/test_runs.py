"""Runs of small tensors: filled side by side in one buffer, read and written with one call, bit-exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import layouts, logical_values

import reshard
import reshard.execution.session as session_module
from reshard.core.dtypes import itemsize
from reshard.core.layout import Item
from reshard.core.planner import plan
from reshard.execution.arrays import apply, scatter
from reshard.execution.coalescing import Coalescing
from reshard.execution.executor import ByteReader, PlanFill
from reshard.execution.session import Slot, WriteSession
from reshard.formats.base import Located
from reshard.io.safetensors_io import SafetensorsWriter, read_header

SMALL = """
logical a = n
logical b = n
logical c = r k
logical d = n
logical e = n
section model per tp
a = n
b = n
c = r k
d = n
e = n
"""
TRANSPOSED = """
logical a = n
logical b = n
logical w = o i
logical d = n
section model per tp
a = n
b = n
w_t -> w = i o
d = n
"""


def stored(tmp_path, items: dict, order: list[Item], gaps: dict[Item, int] | None = None,
           dtypes: dict[Item, str] | None = None) -> dict[Item, Located]:
    """Items one after the other in one file, in ``order``, with ``gaps[item]`` bytes of garbage before one."""
    path = tmp_path / "blob.bin"
    where = {}
    with path.open("wb") as f:
        for item in order:
            f.write(b"\xee" * (gaps or {}).get(item, 0))
            where[item] = Located(path, f.tell(), (dtypes or {}).get(item, "float32"))
            f.write(items[item].tobytes())
    return where


def fill_packed(fill: PlanFill, dst, order: list[Item], frame: int = 8) -> tuple[np.ndarray, dict[Item, int]]:
    """``fill_run`` of ``order``'s items into one buffer, ``frame`` bytes of 0xAB before each (framing that must
    stay as it is); returns the buffer and where each item starts in it."""
    at, requests, where = 0, [], {}
    for item in order:
        at += frame
        where[item] = at
        requests.append((item, 0, dst.items[item].numel, at))
        at += dst.items[item].numel * itemsize(fill.dtypes[item])
    buf = np.full(at, 0xAB, dtype=np.uint8)
    fill.fill_run(requests, buf)
    return buf, where


def check_packed(buf: np.ndarray, where: dict[Item, int], want: dict[Item, np.ndarray], frame: int = 8) -> None:
    for item, at in where.items():
        assert buf[at:at + want[item].nbytes].tobytes() == want[item].tobytes(), item
        assert (buf[at - frame:at] == 0xAB).all(), f"the framing before {item} was overwritten"


def small_case(tmp_path, text=SMALL, sizes=None, **stored_kw):
    src, dst = layouts(text, sizes or {"n": 40, "r": 6, "k": 5, "o": 6, "i": 4}, "tp=1", "tp=1")
    items = scatter(src, logical_values(src))
    return src, dst, items


def test_a_run_of_adjacent_small_tensors_is_one_read(tmp_path):
    src, dst, items = small_case(tmp_path)
    order = sorted(items)
    p = plan(src, dst)
    where = stored(tmp_path, items, order)
    want = apply(p, items)
    with ByteReader() as reader:
        buf, at = fill_packed(PlanFill(p, where, reader), dst, sorted(dst.items))
        assert reader.reads == 1 and reader.bytes_read == sum(a.nbytes for a in items.values())
    check_packed(buf, at, want)


def test_a_gap_in_the_source_breaks_the_read_in_two(tmp_path):
    src, dst, items = small_case(tmp_path)
    order = sorted(items)
    p = plan(src, dst)
    where = stored(tmp_path, items, order, gaps={order[3]: 13})  # garbage never read into the output
    with ByteReader() as reader:
        buf, at = fill_packed(PlanFill(p, where, reader), dst, sorted(dst.items))
        assert reader.reads == 2 and reader.bytes_read == sum(a.nbytes for a in items.values())
    check_packed(buf, at, apply(p, items))


@pytest.mark.parametrize("free_gap, reads", [(12, 2), (13, 1), (1 << 20, 1)])
def test_a_gap_up_to_free_gap_is_read_through_into_the_discard_buffer(tmp_path, free_gap, reads):
    src, dst, items = small_case(tmp_path)
    order = sorted(items)
    p = plan(src, dst)
    where = stored(tmp_path, items, order, gaps={order[3]: 13})  # garbage read through, never into the output
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader, coalescing=Coalescing(free_gap=free_gap))
        buf, at = fill_packed(fill, dst, sorted(dst.items))
        assert reader.reads == reads
        assert reader.gap_bytes == (13 if reads == 1 else 0)
        assert reader.bytes_read - reader.gap_bytes == sum(a.nbytes for a in items.values())
    check_packed(buf, at, apply(p, items))


def test_tensors_adjacent_in_the_source_in_another_order_in_the_run_are_one_vectored_read(tmp_path):
    src, dst, items = small_case(tmp_path)
    p = plan(src, dst)
    where = stored(tmp_path, items, sorted(items))
    with ByteReader() as reader:
        buf, at = fill_packed(PlanFill(p, where, reader), dst, sorted(dst.items, reverse=True), frame=0)
        assert reader.reads == 1
    check_packed(buf, at, apply(p, items), frame=0)


def test_a_tensor_that_changes_geometry_in_the_middle_of_a_run_is_gathered_in_place(tmp_path):
    """``w`` is stored transposed and written row-major: its elements come one by one, through the span
    buffer, while the tensors around it are read straight into the run."""
    src, dst, items = small_case(tmp_path, TRANSPOSED)
    p = plan(src, dst)
    where = stored(tmp_path, items, sorted(items))
    with ByteReader() as reader:
        buf, at = fill_packed(PlanFill(p, where, reader), dst, sorted(dst.items))
        assert reader.reads <= 3  # before w, w itself (one span), after w
    check_packed(buf, at, apply(p, items))


def test_a_run_of_mixed_element_sizes_keeps_each_tensor_s_bits(tmp_path):
    """A 2-byte tensor between 4-byte ones: each lands at its own byte offset, however aligned, bits unchanged."""
    src, dst, items = small_case(tmp_path)
    order = sorted(items)
    half = {order[1], order[2]}
    items = {it: (a.view(np.uint32) >> 16).astype(np.uint16) if it in half else a for it, a in items.items()}
    p = plan(src, dst)
    where = stored(tmp_path, items, order, dtypes={it: "bfloat16" for it in half})
    with ByteReader() as reader:
        fill = PlanFill(p, where, reader)
        assert {fill.dtypes[it] for it in dst.items} == {"float32", "bfloat16"}
        buf, at = fill_packed(fill, dst, sorted(dst.items), frame=3)  # odd offsets
        assert reader.reads == 1
    check_packed(buf, at, apply(p, items), frame=3)


def test_a_run_zeroes_the_padding_of_a_tensor_partly_mapped(tmp_path):
    text = "logical a = n\nlogical w = m\nsection model per tp\na = n\nw = m~(8*tp)/tp\n"
    src, dst = layouts(text, {"n": 12, "m": 30}, "tp=1", "tp=4")
    items = scatter(src, logical_values(src))
    p = plan(src, dst)
    where = stored(tmp_path, items, sorted(items))
    rank3 = [it for it in sorted(dst.items) if it.unit == (("tp", 3),)]
    assert any(dst.items[it].mapped < dst.items[it].numel for it in rank3)
    with ByteReader() as reader:
        buf, at = fill_packed(PlanFill(p, where, reader), dst, rank3)
    check_packed(buf, at, apply(p, items))


def _slot(name: str, start: int, size: int, gap: int = 0) -> Slot:
    item = Item("s", (), 0, "param", name)
    return Slot(item, size // 4, "float32", start + gap, start + gap, start + gap + size, key=name)


def test_runs_group_touching_small_slots_within_the_run_size_and_leave_others_alone():
    slots, at = [], 0
    for name, size, gap in [("a", 16, 0), ("b", 16, 0), ("c", 1000, 0), ("d", 16, 0), ("e", 16, 4), ("f", 16, 0),
                            ("g", 16, 0), ("h", 16, 0), ("i", 16, 0)]:
        slots.append(_slot(name, at, size, gap))
        at = slots[-1].end
    with WriteSession(window_bytes=96) as session:  # runs of at most 48 bytes, slots of at most 48
        runs = [[s.key for s in run] for run in session.runs(slots)]
    # c is too large for any run; e lies apart from d (a gap of 4); f..i hold 64 bytes, over 48 together
    assert runs == [["a", "b"], ["c"], ["d"], ["e", "f", "g"], ["h", "i"]]


def test_runs_leave_alone_the_tensors_other_processes_write_or_write_in_pieces():
    slots = [_slot(n, 16 * k, 16) for k, n in enumerate("abcdef")]
    items = {s.key: s.item for s in slots}
    with WriteSession(window_bytes=1 << 20, skip=[items["b"]], pieces={items["d"]: (0, 2)},
                      read_back=[items["e"]]) as session:
        runs = [[s.key for s in run] for run in session.runs(slots)]
    assert runs == [["a"], ["b"], ["c"], ["d"], ["e"], ["f"]]


def test_a_run_from_a_plain_fill_matches_tensor_by_tensor_streaming(tmp_path):
    """A fill without ``fill_run`` (a format's test double) is asked tensor by tensor; the bytes written and the
    checksums are those ``stream_item`` gives."""
    values = {f"t{k}": np.arange(k + 1, dtype=np.float32) + 10 * k for k in range(6)}
    slots, at = [], 0
    for name, arr in values.items():
        slots.append(Slot(Item("s", (), 0, "param", name), arr.size, "float32", at, at, at + arr.nbytes, key=name))
        at += arr.nbytes

    def fill(item, lo, hi):
        return memoryview(values[item.key][lo:hi]).cast("B")

    written = {}
    with WriteSession(window_bytes=1 << 20) as one:
        for s in slots:
            one.stream_item(fill, s.item, s.numel, s.dtype, lambda data, s=s: written.setdefault(s.key, bytes(data)))
    got = []
    with WriteSession(window_bytes=1 << 20) as run:
        (whole,) = list(run.runs(slots))
        run.stream_run(fill, whole, lambda run, data: got.append((len(run), bytes(data))))
    assert got == [(6, b"".join(written[s.key] for s in slots))]
    assert run.item_digests() == one.item_digests()


def write_hf(root, tensors: dict[str, np.ndarray]) -> None:
    """A Hugging Face checkpoint of a model no family describes: its layout comes from the safetensors header."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "custom", "architectures": ["CustomModel"]}))
    spec = {n: ({np.dtype(np.float32): "float32", np.dtype(np.uint16): "bfloat16"}[a.dtype], a.shape)
            for n, a in tensors.items()}
    with SafetensorsWriter(root / "model.safetensors", spec, {"format": "pt"}) as w:
        for name in w.order:
            w.write(name, tensors[name].tobytes())


def read_tensors(root) -> dict[str, bytes]:
    out = {}
    for path in sorted(root.glob("*.safetensors")):
        header = read_header(path)
        data = path.read_bytes()
        for name, t in header.tensors.items():
            out[name] = data[t.data_offset:t.data_offset + t.nbytes]
    return out


def read_tree(root) -> dict[str, bytes]:
    files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    manifest = json.loads(files.pop("reshard.json"))
    manifest.pop("created")
    files["reshard.json"] = json.dumps(manifest, sort_keys=True).encode()
    return files


@pytest.fixture
def many(tmp_path):
    """1,500 small tensors of assorted shapes and two dtypes, a large one and an empty one among them."""
    rng = np.random.default_rng(5)
    tensors = {}
    for k in range(1500):
        shape = [(3, 4), (7,), (1,), (2, 2, 5), (64,)][k % 5]
        arr = rng.integers(0, 2**16, int(np.prod(shape)), dtype=np.uint16).reshape(shape)
        tensors[f"blocks.{k // 10}.part{k % 10}.weight"] = arr if k % 7 == 3 else arr.astype(np.float32)
    tensors["blocks.70.large.weight"] = rng.random((300, 256), dtype=np.float32)  # 300 KiB: streamed alone
    tensors["blocks.71.empty.weight"] = np.zeros((0, 4), dtype=np.float32)
    write_hf(tmp_path / "src", tensors)
    return tmp_path / "src", tensors


@pytest.mark.parametrize("run_bytes", [None, 5000], ids=["runs", "runs-of-5000-bytes"])
@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_many_small_tensors_convert_bit_exactly_and_as_tensor_by_tensor_streaming_does(tmp_path, monkeypatch, many,
                                                                                        to, run_bytes):
    """Runs cut wherever the run size is reached (``runs-of-5000-bytes``: a few tensors or DCP archives each, a
    run's end falling anywhere) give the same files as no runs at all."""
    src, tensors = many
    kw = dict(format=to, to="dp=2" if to == "dcp" else None, max_shard_size="20KiB" if to == "hf" else None)
    sizes = []
    real = PlanFill.fill_run

    def counting(self, requests, buf):
        sizes.append(len(buf))
        return real(self, requests, buf)

    monkeypatch.setattr(PlanFill, "fill_run", counting)
    if run_bytes:
        monkeypatch.setattr(session_module, "_RUN", run_bytes)
    batched = reshard.convert(src, tmp_path / "runs", workers=1, **kw)
    assert len(sizes) >= (20 if run_bytes else 2) and max(sizes) <= (run_bytes or session_module._RUN)
    # every byte read once; for dcp, each rank's half of each tensor, and the other half between them read through
    assert batched.bytes_read - batched.gap_bytes == sum(a.nbytes for a in tensors.values())
    assert (batched.gap_bytes > 0) == (to == "dcp")
    if to == "hf":
        got = read_tensors(tmp_path / "runs")
        assert got == {n: a.tobytes() for n, a in tensors.items()}  # every tensor, element for element
    else:
        assert reshard.verify(src, tmp_path / "runs")
    monkeypatch.setattr(session_module, "_SMALL", -1)  # no runs: every tensor streamed alone
    reshard.convert(src, tmp_path / "alone", workers=1, **kw)
    assert read_tree(tmp_path / "runs") == read_tree(tmp_path / "alone")  # files, manifest, checksums


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_many_small_tensors_with_two_workers_match_one(tmp_path, many, to):
    """Workers split the files between them, and a file at its tensors (DCP at dp=1: one ``.distcp``): runs stay
    within each worker's share, and the finishing process gets the CRCs of the archives framed in runs."""
    src, _ = many
    kw = dict(format=to, to="dp=1" if to == "dcp" else None, max_shard_size="200KiB" if to == "hf" else None)
    reshard.convert(src, tmp_path / "one", workers=1, **kw)
    reshard.convert(src, tmp_path / "two", workers=2, **kw)
    assert read_tree(tmp_path / "one") == read_tree(tmp_path / "two")
