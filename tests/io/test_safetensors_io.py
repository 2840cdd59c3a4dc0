"""Tests of reshard.io.safetensors_io: header validation, the streaming writer, HF shard planning."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import require
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import CheckpointFormatError, ReshardError
from reshard.core.units import parse_size
from reshard.io import safetensors_io
from reshard.io.safetensors_io import SafetensorsWriter, plan_shards, read_header

SUPPORTED = ("BOOL, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16, I32, U32, F32, "
             "C64, F64, I64, U64")
NOT_COUNTS = "tensor 'w': shape must be a list of non-negative integers, got"


def _raw(path: Path, header: bytes, data: bytes = b"", n: int | None = None) -> Path:
    """A file: 8-byte length (``n``, default the header's), header bytes, data bytes."""
    path.write_bytes(struct.pack("<Q", len(header) if n is None else n) + header + data)
    return path


def _hdr(obj: dict) -> bytes:
    return json.dumps(obj).encode()


def _t(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# (id, header bytes, data bytes, header length override, expected message after "<path>: ")
MALFORMED = [
    ("length-past-end", b"{}", b"", 100, "header length 100 runs past the end of the file (10 bytes)"),
    ("length-over-limit", b"{}", b"", 100_000_001, "header length 100000001 exceeds the limit of 100000000 bytes"),
    ("empty-header", b"", b"", None, "header must begin with '{', found an empty header"),
    ("array-header", b"[]", b"", None, "header must begin with '{', found '['"),
    ("leading-space", b' {"a": 1}', b"", None, "header must begin with '{', found ' '"),
    ("not-utf8", b'{"\xff": 1}', b"", None, "header is not valid UTF-8 (invalid start byte at byte 10)"),
    ("not-json", b'{"a": }', b"", None, "header is not valid JSON: Expecting value at line 1 column 7"),
    ("trailing-garbage", b"{}  x", b"", None, "header is not valid JSON: Extra data at line 1 column 5"),
    ("nested-too-deeply", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", None,
     "header is not valid JSON: nested too deeply"),
    ("duplicate-tensor", b'{"w": ' + _hdr(_t("U8", [1], 0, 1)) + b', "w": ' + _hdr(_t("U8", [1], 1, 2)) + b"}",
     b"ab", None, "header has key 'w' twice"),
    ("metadata-not-object", _hdr({"__metadata__": ["pt"]}), b"", None,
     "__metadata__ must be an object of strings, got an array"),
    ("metadata-not-string", _hdr({"__metadata__": {"format": 1}}), b"", None,
     "__metadata__ value of 'format' must be a string, got a number"),
    ("entry-not-object", _hdr({"w": [0, 4]}), b"", None,
     "tensor 'w': entry must be an object with dtype, shape and data_offsets, got an array"),
    ("missing-fields", _hdr({"w": {"dtype": "F32"}}), b"", None, "tensor 'w': missing 'shape', 'data_offsets'"),
    ("unexpected-field", _hdr({"w": {**_t("U8", [1], 0, 1), "crc": 7}}), b"a", None,
     "tensor 'w': unexpected key 'crc' (expected dtype, shape, data_offsets)"),
    ("unknown-dtype", _hdr({"w": _t("F17", [1], 0, 4)}), b"abcd", None,
     f"tensor 'w': unsupported dtype \"F17\" (supported: {SUPPORTED})"),
    ("sub-byte-dtype", _hdr({"w": _t("F4", [2], 0, 1)}), b"a", None,
     f"tensor 'w': unsupported dtype \"F4\" (supported: {SUPPORTED})"),
    ("dtype-not-string", _hdr({"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}}), b"abcd", None,
     f"tensor 'w': unsupported dtype 4 (supported: {SUPPORTED})"),
    ("negative-dim", _hdr({"w": _t("U8", [-1], 0, 0)}), b"", None, f"{NOT_COUNTS} [-1]"),
    ("float-dim", _hdr({"w": _t("U8", [2.0], 0, 2)}), b"ab", None, f"{NOT_COUNTS} [2.0]"),
    ("bool-dim", _hdr({"w": _t("U8", [True], 0, 1)}), b"a", None, f"{NOT_COUNTS} [true]"),
    ("shape-not-list", _hdr({"w": {"dtype": "U8", "shape": 3, "data_offsets": [0, 3]}}), b"abc", None,
     f"{NOT_COUNTS} 3"),
    ("three-offsets", _hdr({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}), b"a", None,
     "tensor 'w': data_offsets must be two non-negative integers, got [0, 1, 2]"),
    ("negative-offset", _hdr({"w": _t("U8", [1], -1, 0)}), b"", None,
     "tensor 'w': data_offsets must be two non-negative integers, got [-1, 0]"),
    ("end-before-begin", _hdr({"w": _t("U8", [0], 4, 0)}), b"abcd", None,
     "tensor 'w': data_offsets [4, 0] end before they begin"),
    ("size-mismatch", _hdr({"w": _t("F32", [2, 3], 0, 20)}), bytes(20), None,
     "tensor 'w': data_offsets [0, 20] hold 20 bytes but F32 [2, 3] needs 24"),
    ("past-byte-buffer", _hdr({"w": _t("F32", [2], 0, 8)}), bytes(4), None,
     "tensor 'w': data_offsets [0, 8] end past the byte buffer (4 bytes)"),
    ("overlap", _hdr({"a": _t("U8", [4], 0, 4), "b": _t("U8", [4], 2, 6)}), bytes(6), None,
     "tensors 'a' [0, 4] and 'b' [2, 6] overlap"),
    ("empty-inside-other", _hdr({"a": _t("U8", [4], 0, 4), "e": _t("U8", [0], 2, 2)}), bytes(4), None,
     "tensors 'a' [0, 4] and 'e' [2, 2] overlap"),
    ("hole-between", _hdr({"a": _t("U8", [2], 0, 2), "b": _t("U8", [2], 4, 6)}), bytes(6), None,
     "byte buffer bytes [2, 4) belong to no tensor (between 'a' and 'b')"),
    ("hole-at-start", _hdr({"b": _t("U8", [2], 2, 4)}), bytes(4), None,
     "byte buffer bytes [0, 2) belong to no tensor (before 'b')"),
    ("hole-at-end", _hdr({"a": _t("U8", [2], 0, 2)}), bytes(5), None,
     "byte buffer bytes [2, 5) belong to no tensor (after 'a')"),
    ("data-without-tensors", b"{}", bytes(3), None,
     "byte buffer bytes [0, 3) belong to no tensor (the header names no tensors)"),
]


@pytest.mark.parametrize(("header", "data", "n", "message"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_header_is_rejected_with_its_reason(
    tmp_path: Path, header: bytes, data: bytes, n: int | None, message: str
) -> None:
    path = _raw(tmp_path / "bad.safetensors", header, data, n)
    with pytest.raises(CheckpointFormatError) as e:
        read_header(path)
    assert str(e.value) == f"{path}: {message}"


def test_file_shorter_than_the_length_field_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x02\x00")
    with pytest.raises(CheckpointFormatError) as e:
        read_header(path)
    assert str(e.value) == f"{path}: file is 2 bytes, shorter than the 8-byte header length"


def test_missing_file_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match=r"nope\.safetensors: cannot read \(No such file or directory\)$"):
        read_header(tmp_path / "nope.safetensors")


def test_valid_header_gives_absolute_offsets_in_file_order(tmp_path: Path) -> None:
    # Header order differs from data order; the header is space-padded as the spec allows.
    header = _hdr({"__metadata__": {"format": "pt"}, "b": _t("BF16", [2], 8, 12), "s": _t("I64", [], 0, 8),
                   "e": _t("F32", [0, 3], 12, 12)}) + b"   "
    path = _raw(tmp_path / "ok.safetensors", header, bytes(range(12)))
    h = read_header(path)
    start = 8 + len(header)
    assert h.data_start == start and h.file_size == start + 12
    assert list(h.tensors) == ["s", "b", "e"]
    assert h.tensors["s"].dtype == "int64" and h.tensors["s"].shape == () and h.tensors["s"].data_offset == start
    assert (h.tensors["b"].dtype, h.tensors["b"].data_offset, h.tensors["b"].nbytes) == ("bfloat16", start + 8, 4)
    assert h.tensors["e"].numel == 0 and h.tensors["e"].nbytes == 0
    assert dict(h.metadata or {}) == {"format": "pt"}


def test_empty_file_without_metadata_is_valid(tmp_path: Path) -> None:
    h = read_header(_raw(tmp_path / "empty.safetensors", b"{}      "))
    assert dict(h.tensors) == {} and h.metadata is None


# --- writer --------------------------------------------------------------------------

def _tensor_bytes(t) -> bytes:
    """A torch tensor's raw row-major bytes."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _write(path: Path, tensors: dict, metadata: dict | None = None, window: int = 1 << 20) -> None:
    with SafetensorsWriter(path, {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in tensors.items()},
                           metadata=metadata) as w:
        for name in w.order:
            data = _tensor_bytes(tensors[name])
            for at in range(0, len(data), window):
                w.write(name, data[at:at + window])


def _mixed_tensors() -> dict:
    import torch
    return {
        "model.b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a": torch.arange(3, dtype=torch.bfloat16),
        'odd \u00e9 "name"\n': torch.tensor(5, dtype=torch.int64),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
        "i8": torch.arange(-3, 2, dtype=torch.int8),
        "f8": torch.zeros(2, dtype=torch.float8_e4m3fn),
        "c": torch.ones(2, dtype=torch.complex64),
        "d": torch.full((1,), 0.5, dtype=torch.float64),
        "u16": torch.tensor([1, 65535], dtype=torch.int32).to(torch.uint16),
        "a2": torch.arange(5, dtype=torch.bfloat16),
    }


def test_writer_output_is_byte_identical_to_safetensors_save_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    tensors = _mixed_tensors()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    _write(tmp_path / "ours.safetensors", tensors, {"format": "pt"}, window=3)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    save_file(tensors, str(tmp_path / "ref-nometa.safetensors"))
    _write(tmp_path / "ours-nometa.safetensors", tensors)
    assert (tmp_path / "ours-nometa.safetensors").read_bytes() == (tmp_path / "ref-nometa.safetensors").read_bytes()


def test_writer_output_loads_with_safe_open(tmp_path: Path) -> None:
    import safetensors
    tensors = _mixed_tensors()
    path = tmp_path / "ours.safetensors"
    _write(path, tensors, {"format": "pt"})
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert _tensor_bytes(got) == _tensor_bytes(t)


def test_read_header_agrees_with_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    with SafetensorsWriter(path, {"x": ("float32", (2, 2)), "y": ("bfloat16", (3,)), "z": ("int64", ())}) as w:
        planned = dict(w.tensors)
        w.write("y", bytes(6))
        w.write("x", bytes(8))
        w.write("z", bytes(8))
        w.write("x", bytes(8))
    h = read_header(path)
    assert dict(h.tensors) == planned
    assert list(h.tensors) == ["z", "x", "y"]  # widest dtype first, then by name
    assert h.file_size == w.size == path.stat().st_size


def test_writer_interleaves_tensors_and_lands_every_byte(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    a = np.arange(10, dtype=np.float32)
    b = np.arange(7, dtype=np.int16)
    with SafetensorsWriter(path, {"a": ("float32", (10,)), "b": ("int16", (7,))}) as w:
        w.write("a", a[:4].tobytes())
        w.write("b", b[:3].tobytes())
        w.write("a", memoryview(a[4:]))
        w.write("b", b[3:].tobytes())
    h = read_header(path)
    raw = path.read_bytes()
    for name, arr in (("a", a), ("b", b)):
        t = h.tensors[name]
        assert raw[t.data_offset:t.data_offset + t.nbytes] == arr.tobytes()


def test_incomplete_file_is_removed_and_named(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    w = SafetensorsWriter(path, {"a": ("float32", (2,)), "b": ("uint8", (3,)), "e": ("float32", (0,))})
    w.write("a", bytes(8))
    w.write("b", b"x")
    with pytest.raises(CheckpointFormatError) as e:
        w.close()
    assert str(e.value) == f"{path}: incomplete, tensors not fully written: 'b' (1 of 3 bytes)"
    assert not path.exists()


def test_error_inside_the_context_removes_the_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    with pytest.raises(RuntimeError, match="boom"), SafetensorsWriter(path, {"a": ("uint8", (4,))}) as w:
        w.write("a", b"ab")
        raise RuntimeError("boom")
    assert not path.exists()


def test_writing_past_a_tensor_or_to_an_unknown_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    with SafetensorsWriter(path, {"a": ("uint8", (4,))}) as w:
        w.write("a", b"abc")
        with pytest.raises(CheckpointFormatError) as e:
            w.write("a", b"de")
        assert str(e.value) == f"{path}: tensor 'a': writing 2 bytes at byte 3 overflows its 4 bytes"
        with pytest.raises(CheckpointFormatError) as e:
            w.write("b", b"x")
        assert str(e.value) == f"{path}: tensor 'b' is not in this file"
        w.write("a", b"d")
    assert read_header(path).tensors["a"].nbytes == 4


def test_writer_rejects_unknown_dtype_before_creating_the_file(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    with pytest.raises(CheckpointFormatError, match=r"tensor 'a': unsupported dtype 'float4' \(supported: bool, "):
        SafetensorsWriter(path, {"a": ("float4", (4,))})
    assert not path.exists()


@pytest.mark.parametrize(("shape", "shown"), [((True, 2), "(True, 2)"), ((2.0, 2), "(2.0, 2)"), ((-1, 2), "(-1, 2)")])
def test_writer_rejects_a_shape_equal_to_a_valid_one_seen_before(tmp_path: Path, shape: tuple, shown: str) -> None:
    # Shapes are checked once per shape; (True, 2) and (2.0, 2) equal (1, 2) and (2, 2) but are no shapes.
    tensors = {"a": ("float32", (1, 2)), "b": ("float32", (2, 2)), "c": ("float32", shape)}
    with pytest.raises(CheckpointFormatError, match=rf"tensor 'c': shape must be non-negative integers, got "
                                                    rf"{re.escape(shown)}"):
        SafetensorsWriter(tmp_path / "w.safetensors", tensors)


def test_writer_places_tensors_of_shared_shapes_as_read_header_reads_them(tmp_path: Path) -> None:
    tensors = {f"t{k}": (["float32", "bfloat16", "int8"][k % 3], [(2, 3), (3,), (), (0, 4)][k % 4]) for k in range(24)}
    path = tmp_path / "w.safetensors"
    with SafetensorsWriter(path, tensors, metadata={"format": "pt"}) as w:
        placed = dict(w.tensors)
        for name, info in placed.items():
            w.write(name, bytes(info.nbytes))
    assert dict(read_header(path).tensors) == placed
    assert {n: (i.dtype, i.shape) for n, i in placed.items()} == {n: (d, tuple(sh)) for n, (d, sh) in tensors.items()}


_DTYPE_NAMES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8).filter(lambda s: s != "__metadata__"),
    st.tuples(st.sampled_from(_DTYPE_NAMES), st.lists(st.integers(0, 3), max_size=3)),
    max_size=6,
))
def test_writer_matches_save_file_for_arbitrary_tensors(tmp_path_factory: pytest.TempPathFactory, spec: dict) -> None:
    import torch
    from safetensors.torch import save_file
    tmp = tmp_path_factory.mktemp("prop")
    tensors = {}
    for k, name in enumerate(sorted(spec)):
        dtype, shape = spec[name]
        t = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) + k
        tensors[name] = t.to(getattr(torch, dtype))
    save_file(tensors, str(tmp / "ref.safetensors"), metadata={"format": "pt"})
    _write(tmp / "ours.safetensors", tensors, {"format": "pt"}, window=5)
    assert (tmp / "ours.safetensors").read_bytes() == (tmp / "ref.safetensors").read_bytes()


def test_names_json_must_escape_are_escaped_as_save_file_escapes_them(tmp_path: Path) -> None:
    """The header writes a plain name between quotes as it is, and any other through JSON's encoder."""
    import torch
    from safetensors.torch import save_file
    names = ['q"uote', "back\\slash", "tab\t", "new\nline", "del\x7f", "sep\u2028", "é", "😀", "ctl\x01", "a.b-c_9"]
    tensors = {n: torch.full((2,), float(k)) for k, n in enumerate(names)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    _write(tmp_path / "ours.safetensors", tensors, {"format": "pt"}, window=5)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


# --- shard planning ----------------------------------------------------------------------

def test_one_shard_is_model_safetensors_without_index() -> None:
    p = plan_shards([("a", 10), ("b", 20)], "5GB")
    assert p.shards == (("model.safetensors", ("a", "b")),)
    assert not p.sharded and p.total_size == 30


def test_shards_split_in_order_and_big_tensors_stand_alone() -> None:
    # limit 10: [6] [6+2] then 12 > limit goes alone *before* the open shard, as huggingface_hub does.
    p = plan_shards([("a", 6), ("b", 6), ("c", 2), ("big", 12), ("d", 2)], 10)
    assert p.shards == (
        ("model-00001-of-00003.safetensors", ("a",)),
        ("model-00002-of-00003.safetensors", ("big",)),
        ("model-00003-of-00003.safetensors", ("b", "c", "d")),
    )
    assert p.total_size == 28
    assert json.loads(p.index_json(total_parameters=7)) == {
        "metadata": {"total_parameters": 7, "total_size": 28},
        "weight_map": {"a": "model-00001-of-00003.safetensors", "big": "model-00002-of-00003.safetensors",
                       "b": "model-00003-of-00003.safetensors", "c": "model-00003-of-00003.safetensors",
                       "d": "model-00003-of-00003.safetensors"},
    }
    assert p.index_json().startswith('{\n  "metadata": {\n    "total_size": 28\n  },\n  "weight_map": {\n    "a": ')


@pytest.mark.interop
@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=12), st.integers(1, 50))
def test_shard_plan_matches_huggingface_hub(sizes: list[int], limit: int) -> None:
    hub = require("huggingface_hub")
    state = {f"t{k}": n for k, n in enumerate(sizes)}
    if not state:
        return  # huggingface_hub returns no file at all; we write one empty model.safetensors
    ref = hub.split_state_dict_into_shards_factory(state, get_storage_size=lambda n: n,
                                                   filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
    ours = plan_shards(state.items(), limit)
    assert {f: list(names) for f, names in ours.shards} == ref.filename_to_tensors
    assert ours.total_size == ref.metadata["total_size"]
    assert ours.sharded == ref.is_sharded


@pytest.mark.parametrize(("text", "expected"), [
    ("5GB", 5 * 10**9), ("50KB", 50_000), (" 1.5mb ", 1_500_000), (123, 123),  # decimal, as huggingface_hub
    ("5GiB", 5 << 30), ("2G", 2 << 30), ("512MiB", 512 << 20),  # binary
])
def test_parse_size_reads_decimal_and_binary_units(text, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("5XB", "max_shard_size: cannot read '5XB' as a size (write e.g. 1073741824, 512MiB, 1GiB, 5GB)"),
    ("-1GB", "max_shard_size must be positive, got -1GB"),
    (0, "max_shard_size must be positive, got 0"),
    (1.5, "max_shard_size: cannot read 1.5 as a size (write e.g. 1073741824, 512MiB, 1GiB, 5GB)"),
])
def test_parse_size_rejects_nonsense(text, message: str) -> None:
    with pytest.raises(ReshardError) as e:
        parse_size(text, "max_shard_size")
    assert str(e.value) == message


def _compact(header: bytes) -> bytes:
    """The header as safetensors writers lay it out (no spaces), where it is JSON at all."""
    try:
        return json.dumps(json.loads(header), separators=(",", ":")).encode()
    except (ValueError, RecursionError):
        return header


COMPACT_MALFORMED = [
    ("duplicate-tensor", b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
     b'"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"ab", "header has key 'w' twice"),
    ("duplicate-field", b'{"w":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}}', b"a",
     "header has key 'dtype' twice"),
    ("duplicate-metadata-key", b'{"__metadata__":{"a":"1","a":"2"}}', b"", "header has key 'a' twice"),
    ("long-integer", b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,' + b"1" * 21 + b"]}}", b"a",
     "header holds an integer of 21 digits, longer than a u64 (20 digits)"),
    ("lone-surrogate-name", b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"a",
     "tensor name '\\ud800' holds a lone surrogate escape, not Unicode text"),
    ("strides-past-int64", b'{"w":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', b"",
     None),
    # the fast path reads each object as its (key, value) pairs: an array of pairs is still no object
    ("entry-array-of-pairs", b'{"w":[["dtype","U8"],["shape",[1]],["data_offsets",[0,1]]]}', b"a",
     "tensor 'w': entry must be an object with dtype, shape and data_offsets, got an array"),
    ("metadata-array-of-pairs", b'{"__metadata__":[["format","pt"]]}', b"",
     "__metadata__ must be an object of strings, got an array"),
    ("shape-object", b'{"w":{"dtype":"U8","shape":{"0":1},"data_offsets":[0,1]}}', b"a",
     f'{NOT_COUNTS} {{"0": 1}}'),
    ("offsets-object", b'{"w":{"dtype":"U8","shape":[1],"data_offsets":{"0":0,"1":1}}}', b"a",
     'tensor \'w\': data_offsets must be two non-negative integers, got {"0": 0, "1": 1}'),
    ("empty-between-out-of-order", b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
     b'"e":{"dtype":"U8","shape":[0],"data_offsets":[1,1]}}', b"ab", "tensors 'a' [0, 2] and 'e' [1, 1] overlap"),
]


@pytest.mark.parametrize(("header", "data", "n"), [c[1:4] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_compact_malformed_header_gets_the_careful_checks_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, header: bytes, data: bytes, n: int | None
) -> None:
    # A compact header is first checked by read_header's fast path; what it refuses must read the same.
    compact = _compact(header)
    path = _raw(tmp_path / "bad.safetensors", compact, data, None if n is None else n - len(header) + len(compact))
    fast, careful = _both_refusals(path, monkeypatch)
    assert fast == careful


@pytest.mark.parametrize(("header", "data", "message"), [c[1:] for c in COMPACT_MALFORMED],
                         ids=[c[0] for c in COMPACT_MALFORMED])
def test_compact_header_breaking_a_rule_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, header: bytes, data: bytes, message: str | None
) -> None:
    path = _raw(tmp_path / "bad.safetensors", header, data)
    fast, careful = _both_refusals(path, monkeypatch)
    assert fast == careful
    if message is not None:
        assert fast == f"{path}: {message}"


def _both_refusals(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """``read_header``'s message for ``path``, through the fast path, then with the careful checks alone."""
    with pytest.raises(CheckpointFormatError) as fast:
        read_header(path)
    monkeypatch.setattr(safetensors_io, "_valid_header", lambda *args: None)
    with pytest.raises(CheckpointFormatError) as careful:
        read_header(path)
    return str(fast.value), str(careful.value)


def test_fast_and_careful_header_checks_read_the_same_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.safetensors"
    _write(path, _mixed_tensors(), metadata={"format": "pt"})
    header = (b'{"b":{"dtype":"U8","shape":[2,0],"data_offsets":[3,3]},'
              b'"a":{"dtype":"I16","shape":[1],"data_offsets":[1,3]},"c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}  ')
    padded = _raw(tmp_path / "padded.safetensors", header, b"xyz")
    checked, real = [], safetensors_io._valid_header
    monkeypatch.setattr(safetensors_io, "_valid_header", lambda *args: checked.append(real(*args)) or checked[-1])
    fast = [read_header(path), read_header(padded)]
    assert len(checked) == 2 and None not in checked  # both took the fast path
    calls = []
    monkeypatch.setattr(safetensors_io, "_valid_header", lambda *args: calls.append(args) or None)
    careful = [read_header(path), read_header(padded)]
    assert len(calls) == 2
    assert fast == careful
    assert [list(h.tensors) for h in fast] == [list(h.tensors) for h in careful]
    assert list(fast[1].tensors) == ["c", "a", "b"]
    assert fast[1].tensors["a"].data_offset == 8 + len(header) + 1 and fast[1].metadata is None


@pytest.mark.parametrize("header", [
    # fields in another order, spaces and newlines between tokens: still one reading, the fast one
    b'{"b": {"shape": [2, 0], "data_offsets": [3, 3], "dtype": "U8"},\n "a": {"dtype": "I16", "data_offsets": [1, 3], '
    b'"shape": [1]}, "__metadata__": {"format": "pt"}, "c": {"data_offsets": [0, 1], "dtype": "U8", "shape": [1]}}',
    # tensors without bytes at one offset, listed against name order, after the tensor that starts there
    b'{"c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"z":{"dtype":"U8","shape":[0],"data_offsets":[1,1]},'
    b'"y":{"dtype":"U8","shape":[0],"data_offsets":[1,1]},"a":{"dtype":"I16","shape":[1],"data_offsets":[1,3]},'
    b'"b":{"dtype":"U8","shape":[2,0],"data_offsets":[3,3]}}',
])
def test_fast_path_reads_any_layout_of_a_valid_header_as_the_careful_path_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, header: bytes) -> None:
    path = _raw(tmp_path / "h.safetensors", header, b"xyz")
    checked, real = [], safetensors_io._valid_header
    monkeypatch.setattr(safetensors_io, "_valid_header", lambda *args: checked.append(real(*args)) or checked[-1])
    fast = read_header(path)
    assert len(checked) == 1 and checked[0] is not None
    monkeypatch.setattr(safetensors_io, "_valid_header", lambda *args: None)
    careful = read_header(path)
    assert fast == careful and list(fast.tensors) == list(careful.tensors)
    assert list(fast.tensors)[0] == "c" and list(fast.tensors)[-1] == "b"
