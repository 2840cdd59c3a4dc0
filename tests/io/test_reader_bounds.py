"""Every integer a reader takes from a file is checked before use: against the file's real size, for
overflow, for sign, and as shape x dtype arithmetic. A bad one is a CheckpointFormatError naming the
file, the field, the value and the limit, never a ValueError from ``seek`` or a multi-gigabyte read.

Each test here pins one rule, most of them found by fuzzing (tests/fuzz_readers.py); the fuzzed
files themselves are replayed from tests/fuzz_regressions/.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import re
import resource
import struct
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fuzz_readers import zip64_entries
from reshard.errors import CheckpointFormatError

torch = pytest.importorskip("torch")

from reshard.io.dcp_metadata import parse_metadata, read_metadata  # noqa: E402
from reshard.io.safetensors_io import read_header  # noqa: E402
from reshard.io.torchfile import TensorSpec, TorchFileWriter, read_torch_file  # noqa: E402

U64_MAX = 2**64 - 1


def refused(reader, *args, match: str, **kwargs) -> str:
    """The message ``reader`` refuses with; ``match`` is its expected start after the file's name."""
    with pytest.raises(CheckpointFormatError) as e:
        reader(*args, **kwargs)
    assert re.match(match, str(e.value)), str(e.value)
    return str(e.value)


# -------------------------------------------------------------------------------------------- torch zip


def torch_file(tmp_path: Path, name: str = "x.pt", zip64: bool = False) -> Path:
    path = tmp_path / name
    torch.save({"w": torch.arange(4, dtype=torch.float32), "step": 3}, path)
    if zip64:
        path.write_bytes(zip64_entries(path.read_bytes()))
    return path


class Layout:
    """Where the fields of a torch.save file's zip end records and central directory are."""

    def __init__(self, data: bytes) -> None:
        self.eocd = data.rindex(b"PK\x05\x06")
        self.locator = self.eocd - 20
        self.eocd64 = struct.unpack_from("<Q", data, self.locator + 8)[0]
        self.count, _, self.cd_size, self.cd_offset = struct.unpack_from("<QQQQ", data, self.eocd64 + 24)
        self.entries: dict[str, int] = {}
        at = self.cd_offset
        for _ in range(self.count):
            n, x, c = struct.unpack_from("<HHH", data, at + 28)
            self.entries[data[at + 46:at + 46 + n].decode()] = at
            at += 46 + n + x + c


def patched(path: Path, *edits: tuple[int, str, int]) -> Path:
    """``path`` with each ``(offset, struct format, value)`` written over its bytes."""
    data = bytearray(path.read_bytes())
    for at, fmt, value in edits:
        struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))
    return path


def test_a_local_header_offset_past_the_end_names_record_value_and_file_size(tmp_path):
    """The crash a user hit: a zip64 header offset reached ``seek`` and escaped as a ValueError."""
    path = torch_file(tmp_path, zip64=True)
    z = Layout(path.read_bytes())
    entry = z.entries["x/data/0"]
    patched(path, (entry + 46 + len("x/data/0") + 4 + 16, "<Q", U64_MAX))  # the extra field's header offset

    refused(read_torch_file, path, match=re.escape(
        f"{path}: zip local header offset of record 'x/data/0' is {U64_MAX}, past the end of the file "
        f"({path.stat().st_size} bytes)"))


def test_a_local_header_that_runs_past_the_end_is_refused(tmp_path):
    path = torch_file(tmp_path)
    size = path.stat().st_size
    z = Layout(path.read_bytes())
    patched(path, (z.entries["x/data/0"] + 42, "<I", size - 10))

    refused(read_torch_file, path, match=re.escape(
        f"{path}: zip local header offset of record 'x/data/0' is {size - 10}, and its 30 bytes run past the end "
        f"of the file ({size} bytes)"))


@pytest.mark.parametrize("field, offset, value, message", [
    ("central directory offset", lambda z: z.eocd64 + 48, U64_MAX,
     "zip central directory offset is 18446744073709551615, past the end of the space before the end records"),
    ("central directory size", lambda z: z.eocd64 + 40, 2**63,
     r"zip central directory offset is \d+, and its 9223372036854775808 bytes run past the end of the space "
     r"before the end records"),
    ("entry count", lambda z: z.eocd64 + 32, 2**40,
     r"zip end record counts 1099511627776 entries, more than its \d+-byte central directory holds"),
    ("zip64 end record offset", lambda z: z.locator + 8, U64_MAX,
     "zip64 end record offset is 18446744073709551615, past the end of the space before the zip64 end locator"),
    ("zip64 end record size", lambda z: z.eocd64 + 4, U64_MAX,
     "zip64 end record size is 18446744073709551615; it must be at least 44 and end before the zip64 end locator"),
], ids=["central directory offset", "central directory size", "entry count", "zip64 end record offset",
        "zip64 end record size"])
def test_zip_end_records_out_of_range_are_refused_before_anything_is_read(tmp_path, field, offset, value, message):
    path = torch_file(tmp_path)
    z = Layout(path.read_bytes())
    patched(path, (offset(z), "<Q", value), *([(z.eocd64 + 24, "<Q", value)] if field == "entry count" else []))

    refused(read_torch_file, path, match=re.escape(f"{path}: ") + message)


def test_a_stored_record_whose_two_sizes_differ_is_refused_before_reading(tmp_path):
    """``zipfile`` would read ``file_size`` bytes: 16 EiB from a 2 KB file."""
    path = torch_file(tmp_path, zip64=True)
    entry = Layout(path.read_bytes()).entries["x/data.pkl"]
    patched(path, (entry + 46 + len("x/data.pkl") + 4, "<Q", U64_MAX))  # uncompressed size

    refused(read_torch_file, path, match=re.escape(
        f"{path}: zip size of record 'x/data.pkl' is {U64_MAX}, past torch's int64 limit"))


def test_a_compressed_size_larger_than_the_rest_of_the_file_is_refused(tmp_path):
    path = torch_file(tmp_path)
    size = path.stat().st_size
    entry = Layout(path.read_bytes()).entries["x/data/0"]
    patched(path, (entry + 20, "<I", 0xFFFFFFFE), (entry + 24, "<I", 0xFFFFFFFE))

    refused(read_torch_file, path, match=re.escape(f"{path}: zip compressed size of record 'x/data/0' is 4294967294, "
                                                   "more than the ") + r"\d+ bytes after its local header")
    assert size == path.stat().st_size


def test_a_zip64_extra_field_too_short_for_its_values_is_refused(tmp_path):
    path = torch_file(tmp_path, zip64=True)
    entry = Layout(path.read_bytes()).entries["x/data/0"]
    patched(path, (entry + 46 + len("x/data/0") + 2, "<H", 16))  # 3 values wanted, 2 given (the rest is a bogus field)

    refused(read_torch_file, path, match=re.escape(
        f"{path}: zip64 extra field of record 'x/data/0' is 16 bytes, too short for the 3 values its entry leaves"))


def test_an_extra_field_running_past_its_entry_is_refused(tmp_path):
    path = torch_file(tmp_path, zip64=True)
    entry = Layout(path.read_bytes()).entries["x/data/0"]
    patched(path, (entry + 46 + len("x/data/0") + 2, "<H", 0xFFFF))

    refused(read_torch_file, path, match=re.escape(
        f"{path}: zip extra field 0x0001 of record 'x/data/0' is 65535 bytes, past the end of its 28-byte extra data"))


def test_a_deflated_record_claiming_more_than_deflate_can_make_is_refused(tmp_path):
    path = tmp_path / "z.pt"
    good = torch_file(tmp_path)
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED
                         if info.filename.endswith("data.pkl") else zipfile.ZIP_STORED)
    assert read_torch_file(path)["step"] == 3  # deflated data.pkl is read
    entry = path.read_bytes().rindex(b"x/data.pkl") - 46  # its central directory entry
    patched(path, (entry + 24, "<I", 0xFFFFFFFE))

    refused(read_torch_file, path, match=re.escape(
        f"{path}: zip size of record 'x/data.pkl' is 4294967294, more than deflate makes of its"))


def test_an_archive_at_an_offset_must_lie_inside_the_file(tmp_path):
    path = torch_file(tmp_path)
    size = path.stat().st_size

    refused(read_torch_file, path, offset=-1, length=10, match=re.escape(f"{path} (archive at bytes -1..9): "
                                                                         "archive offset is -1, negative"))
    refused(read_torch_file, path, offset=0, length=size + 1, match=re.escape(
        f"{path} (archive at bytes 0..{size + 1}): archive offset is 0, and its {size + 1} bytes run past the end of "
        f"the file ({size} bytes)"))
    refused(read_torch_file, path, offset=2**64, match=re.escape(
        f"{path}: archive offset is {2**64}, past torch's int64 limit"))


def test_an_archive_inside_a_larger_file_is_bounded_by_its_own_length(tmp_path):
    """A .distcp chunk's offsets are checked against the chunk, not against the file holding it."""
    inner = torch_file(tmp_path, zip64=True).read_bytes()
    z = Layout(inner)
    entry = z.entries["x/data/0"]
    bad = bytearray(inner)
    # an offset inside the file, but not inside the archive
    struct.pack_into("<Q", bad, entry + 46 + len("x/data/0") + 4 + 16, len(inner) + 100)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"\0" * 64 + bytes(bad) + b"\0" * 4096)
    assert read_torch_file(tmp_path / "x.pt")["step"] == 3

    refused(read_torch_file, path, offset=64, length=len(inner), match=re.escape(
        f"{path} (archive at bytes 64..{64 + len(inner)}): zip local header offset of record 'x/data/0' is "
        f"{len(inner) + 100}, past the end of the archive ({len(inner)} bytes)"))


class SparseFile:
    """The write side of an ``OutputFile`` over a file left sparse wherever nothing is written."""

    def __init__(self, path: Path, size: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, size)

    def pwrite(self, data, offset: int) -> None:
        view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n


def test_a_real_file_past_4_gib_reads_its_zip64_sizes_and_offsets(tmp_path):
    """A 4 GiB + 4 KiB storage, then one whose header is past 4 GiB: every zip64 path, in a sparse file."""
    tree = {"big": TensorSpec("uint8", (2**32 + 4096,), key="big"), "tail": TensorSpec("int32", (4,), key="tail")}
    path = tmp_path / "big.pt"
    sparse = SparseFile(path, TorchFileWriter.measure(tree, archive_name="big"))
    out = TorchFileWriter(path, tree, file=sparse)  # never closed: big's bytes stay a hole of zeros, CRCs 0
    out.write("tail", np.arange(4, dtype=np.int32))
    os.close(sparse.fd)

    got = read_torch_file(path)
    assert got["big"].storage_nbytes == 2**32 + 4096 and got["tail"].data_offset > 2**32
    with path.open("rb") as f:
        f.seek(got["tail"].data_offset)
        assert f.read(16) == np.arange(4, dtype=np.int32).tobytes()
    assert torch.load(path, mmap=True, weights_only=True)["tail"].tolist() == [0, 1, 2, 3]

    data_len = path.stat().st_size
    with path.open("r+b") as f:  # the tail's zip64 header offset, one byte flipped to past the end
        f.seek(data_len - 4096)
        tail = f.read()
        at = tail.rindex(b"big/data/1") + len(b"big/data/1") + 4  # its central directory entry's zip64 field
        f.seek(data_len - 4096 + at + 7)
        f.write(b"\x7f")
    offset = struct.unpack_from("<Q", tail, at)[0] | (0x7F << 56)
    refused(read_torch_file, path, match=re.escape(
        f"{path}: zip local header offset of record 'big/data/1' is {offset}, past the end of the file ({data_len} "
        "bytes)"))
    path.unlink()  # 4 GiB apparent size: do not leave it for pytest's kept temporary directories


# -------------------------------------------------------------------------------------------- torch pickle


def zip_pickle(tmp_path: Path, data: bytes, storages: dict[str, bytes] | None = None) -> Path:
    path = tmp_path / "p.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data)
        for key, raw in (storages or {}).items():
            z.writestr(f"archive/data/{key}", raw)
    return path


def tensor_pickle(offset, size, stride, *, dtype="FloatStorage", numel=4, key="0") -> bytes:
    """torch's pickle of ``_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``."""

    class Storage:
        pass

    class Rebuild:
        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, collections.OrderedDict())

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", getattr(torch, dtype), key, "cpu", numel) if obj is storage else None

    storage = Storage()
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"t": Rebuild()})
    return buf.getvalue()


def test_a_memo_index_that_would_make_the_unpickler_write_gigabytes_is_refused_at_once(tmp_path):
    """LONG_BINPUT 2**30 makes CPython's unpickler zero-fill a 16 GiB memo table."""
    path = zip_pickle(tmp_path, b"\x80\x02N" + b"r" + struct.pack("<I", 2**30) + b".")
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()

    refused(read_torch_file, path, match=re.escape(
        f"{path}: data.pkl is not a pickle reshard can read (UnpicklingError: memo index 1073741824 at byte 3 is "
        "past the 0 memo entries stored before it"))
    assert time.perf_counter() - start < 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


def test_a_byte_count_past_the_end_of_the_pickle_is_refused_before_it_is_allocated(tmp_path):
    path = zip_pickle(tmp_path, b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"ab.")

    refused(read_torch_file, path, match=re.escape(
        f"{path}: data.pkl is not a pickle reshard can read (UnpicklingError: BINBYTES8 at byte 2 counts "
        f"{2**62} bytes, but only 3 remain in the pickle)"))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_the_pickle_scan_lets_through_what_every_protocol_writes(protocol):
    from reshard.io.pickle_scan import check_pickle

    shared = [1.5, "x"]
    value = {"a": list(range(300)), "b": b"y" * 70_000, "c": bytearray(3), "d": (shared, shared), "e": 10**30,
             "f": {frozenset([1]), None, True}, "g": "\u00e9" * 300}
    check_pickle(pickle.dumps(value, protocol=protocol))
    with pytest.raises(pickle.UnpicklingError, match=r"FRAME at byte 2 counts 1099511627776 bytes, but only 2 remain"):
        check_pickle(b"\x80\x04\x95" + struct.pack("<Q", 2**40) + b"N.")


def test_a_storage_numel_past_int64_is_refused(tmp_path):
    path = zip_pickle(tmp_path, tensor_pickle(0, (4,), (1,), numel=2**63), {"0": bytes(16)})

    refused(read_torch_file, path, match=re.escape(
        f"{path}: storage '0' numel is {2**63}, past torch's int64 limit ({2**63 - 1})"))


@pytest.mark.parametrize("offset, size, stride, message", [
    (2**64, (1,), (1,), f"a float32 tensor of storage 0: storage offset is {2**64}, past torch's int64 limit"),
    (0, (2**63,), (0,), f"a float32 tensor of storage 0: size dim 0 is {2**63}, past torch's int64 limit"),
    (0, (0, 2**62, 4), (1, 1, 1), "a float32 tensor of storage 0: size [0, 4611686018427387904, 4] spans more than "
                                  "9223372036854775807 bytes"),
    (0, (2**40, 2**40), (0, 0), "a float32 tensor of storage 0: size [1099511627776, 1099511627776] spans more than"),
    (0, (1,), (2**63,), f"a float32 tensor of storage 0: stride 0 is {2**63}, past torch's int64 limit"),
    (5, (0,), (1,), "a float32 tensor of storage 0: storage offset is 5, past the end of the storage (16 bytes) "
                    "even though the tensor is empty"),
    (1, (2, 2), (2, 1), r"a float32 tensor of shape \[2, 2\], stride \[2, 1\] at storage offset 1 needs 20 bytes of "
                        "storage 0, which holds 16"),
], ids=["offset", "dim", "empty-overflow", "broadcast-overflow", "stride", "empty-offset", "past-storage"])
def test_tensor_offsets_sizes_and_strides_keep_every_element_inside_its_storage(tmp_path, offset, size, stride,
                                                                                 message):
    path = zip_pickle(tmp_path, tensor_pickle(offset, size, stride), {"0": bytes(16)})

    refused(read_torch_file, path, match=re.escape(f"{path}: ") + (message if "\\" in message else re.escape(message)))


def test_a_tensor_dtype_that_is_not_a_name_is_refused(tmp_path):
    """An unhashable dtype once reached ``dtype in _ITEMSIZE``, a TypeError."""
    # _rebuild_tensor_v3(storage, 0, (1,), (1,), False, None, [1], OrderedDict()): a list where a torch dtype belongs
    data = tensor_pickle(0, (1,), (1,), dtype="UntypedStorage").replace(b"_rebuild_tensor_v2", b"_rebuild_tensor_v3")
    data = data.replace(b"\x89ccollections", b"\x89N]K\x01accollections")  # hooks None, then dtype [1]
    path = zip_pickle(tmp_path, data, {"0": bytes(4)})

    refused(read_torch_file, path, match=re.escape(f"{path}: tensor dtype [1] is not supported"))


def test_a_pickle_nested_deeper_than_any_checkpoint_is_refused(tmp_path):
    path = zip_pickle(tmp_path, b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b".")

    refused(read_torch_file, path, match=re.escape(f"{path}: data.pkl nests containers more than 100 deep"))


def test_an_error_about_a_huge_shared_value_shows_a_short_excerpt_of_it(tmp_path):
    """64 levels of t[i] = (t[i-1], t[i-1]): a full repr would be 2**64 items long."""
    levels = b"".join(b"h%ch%c\x86q%c" % (i - 1, i - 1, i) for i in range(1, 65))
    path = zip_pickle(tmp_path, b"\x80\x02)q\x00" + levels + b"Q.")  # BINPERSID of it

    message = refused(read_torch_file, path, match=re.escape(f"{path}: unsupported persistent id (((<tuple>, <tuple>)"))
    assert len(message) < 200


def test_a_storage_key_that_is_not_ascii_is_named(tmp_path):
    data = tensor_pickle(0, (1,), (1,)).replace(b"X\x01\x00\x00\x000", b"C\x01\xff")  # key b'\xff' as bytes
    path = zip_pickle(tmp_path, data, {"0": bytes(16)})

    refused(read_torch_file, path, match=re.escape(f"{path}: storage key b'\\xff' is not ASCII"))


# -------------------------------------------------------------------------------------------- safetensors


def safetensors_file(tmp_path: Path, header: dict, data: bytes = b"", name: str = "x.safetensors",
                     raw: bytes | None = None) -> Path:
    text = raw if raw is not None else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / name
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


def test_a_json_integer_too_long_for_python_is_refused_as_a_format_error(tmp_path):
    """Python refuses to convert integers past 4300 digits with a ValueError, not a JSON error."""
    header = b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,0]}}'
    path = safetensors_file(tmp_path, {}, raw=header)

    refused(read_header, path, match=re.escape(
        f"{path}: header holds an integer of 5000 digits, longer than a u64 (20 digits)"))


@pytest.mark.parametrize("shape, message", [
    ([2**63], f"shape dim 0 is {2**63}, past torch's int64 limit"),
    ([0, 2**62, 4], "shape [0, 4611686018427387904, 4] spans more than 9223372036854775807 bytes"),
])
def test_a_safetensors_shape_past_int64_is_refused_even_when_empty(tmp_path, shape, message):
    path = safetensors_file(tmp_path, {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})

    refused(read_header, path, match=re.escape(f"{path}: tensor 'a': {message}"))


def test_a_safetensors_shape_of_a_million_dims_is_refused_in_linear_time(tmp_path):
    shape = [2**20] * 1_000_000
    path = safetensors_file(tmp_path, {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}}, bytes(4))
    start = time.perf_counter()

    refused(read_header, path, match=re.escape(f"{path}: tensor 'a': shape [1048576, 1048576,"))
    assert time.perf_counter() - start < 5


def test_a_safetensors_offset_outside_the_file_is_refused(tmp_path):
    path = safetensors_file(tmp_path, {})
    size = path.stat().st_size

    refused(read_header, path, offset=-1, match=re.escape(f"{path}: safetensors offset is -1, negative"))
    refused(read_header, path, offset=2**70, match=re.escape(f"{path}: safetensors offset is {2**70}, past torch's"))
    refused(read_header, path, offset=size + 1, match=re.escape(
        f"{path}: safetensors offset is {size + 1}, past the end of the file ({size} bytes)"))


def test_a_tensor_name_with_a_lone_surrogate_escape_is_refused(tmp_path):
    path = safetensors_file(tmp_path, {}, raw=b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
                            data=b"x")

    refused(read_header, path, match=re.escape(f"{path}: tensor name '\\ud800' holds a lone surrogate escape"))


# -------------------------------------------------------------------------------------------- DCP .metadata


@pytest.fixture
def dcp_dir(tmp_path):
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"w": torch.zeros(4, 2), "step": 3}, checkpoint_id=str(root))
    return root


def edit_metadata(root: Path, edit) -> Path:
    md = pickle.loads((root / ".metadata").read_bytes())
    edit(md)
    (root / ".metadata").write_bytes(pickle.dumps(md))
    return root / ".metadata"


def _storage_of(md, fqn):
    return next(k for k in md.storage_data if k.fqn == fqn)


def _set_storage(**fields):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def edit(md):
        index = _storage_of(md, "w")
        old = md.storage_data[index]
        md.storage_data[index] = _StorageInfo(**{"relative_path": old.relative_path, "offset": old.offset,
                                                 "length": old.length, **fields})
    return edit


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..", "", "a\x00b", "sub\\..\\x"])
def test_a_storage_path_that_leaves_the_checkpoint_directory_is_refused(dcp_dir, name):
    path = edit_metadata(dcp_dir, _set_storage(relative_path=name))

    refused(read_metadata, dcp_dir, match=re.escape(
        f"{path}: the storage of 'w' names {name!r}, which is not a file in the checkpoint directory"))


@pytest.mark.parametrize("fields, message", [
    ({"offset": -1}, "the storage offset of 'w' is -1, negative"),
    ({"length": 2**64}, f"the storage length of 'w' is {2**64}, past torch's int64 limit"),
    ({"offset": 2**40}, r"the storage offset of 'w' in __0_0\.distcp is 1099511627776, past the end of "
                        r"__0_0\.distcp \(\d+ bytes\)"),
    ({"length": 2**40}, r"the storage offset of 'w' in __0_0\.distcp is \d+, and its 1099511627776 bytes run past "
                        r"the end of __0_0\.distcp \(\d+ bytes\)"),
], ids=["negative offset", "length past int64", "offset past the file", "length past the file"])
def test_a_storage_range_outside_its_file_is_refused(dcp_dir, fields, message):
    path = edit_metadata(dcp_dir, _set_storage(**fields))

    refused(read_metadata, dcp_dir, match=re.escape(f"{path}: ") + (message if "\\" in message else re.escape(message)))


@pytest.mark.parametrize("field, value, message", [
    ("chunks", 5, "'w' has chunks 5, expected a list"),
    ("size", torch.Size([2**63, 2]), f"'w' size [0] is {2**63}, past torch's int64 limit"),
    ("size", torch.Size([0, 2**62]), "'w' size [0, 4611686018427387904] spans more than 9223372036854775807 bytes"),
], ids=["chunks not a list", "dim past int64", "empty but overflowing"])
def test_tensor_sizes_and_chunk_lists_are_checked(dcp_dir, field, value, message):
    path = edit_metadata(dcp_dir, lambda md: setattr(md.state_dict_metadata["w"], field, value))

    refused(read_metadata, dcp_dir, match=re.escape(f"{path}: {message}"))


def test_transform_descriptors_that_are_not_a_list_of_strings_are_refused(dcp_dir):
    path = edit_metadata(dcp_dir, _set_storage(transform_descriptors=7))

    refused(read_metadata, dcp_dir, match=re.escape(
        f"{path}: the storage of 'w' has transform_descriptors 7, expected a list of strings"))


def test_a_metadata_pickled_on_python_3_13_names_its_paths_from_pathlib_local_and_is_read(dcp_dir):
    """torch's FileSystemWriter keeps the checkpoint's path in ``.metadata``; Python 3.13 pickles pathlib's classes
    as ``pathlib._local``'s, so every DCP checkpoint saved there names them."""
    before = read_metadata(dcp_dir)
    data = re.sub(rb"cpathlib(\._local)?\nPosixPath\n", b"cpathlib._local\nPosixPath\n",
                  pickle.dumps(pickle.loads((dcp_dir / ".metadata").read_bytes()), protocol=2))
    assert b"cpathlib._local\nPosixPath\n" in data
    (dcp_dir / ".metadata").write_bytes(data)
    assert read_metadata(dcp_dir) == before


def test_a_metadata_pickle_cannot_change_a_function_for_later_files():
    """BUILD on torch.Size with slot state {'__defaults__': ((1, 2),)}: the next torch.Size() would be (1, 2)."""
    data = b"\x80\x02ctorch\nSize\nN}X\x0c\x00\x00\x00__defaults__K\x01K\x02\x86\x85s\x86b."

    with pytest.raises(CheckpointFormatError, match="the pickle sets state on _torch_size"):
        parse_metadata(data)
    assert parse_metadata.__globals__["_torch_size"]() == ()


def test_a_memo_index_bomb_in_metadata_is_refused():
    with pytest.raises(CheckpointFormatError, match=r"not a pickle reshard can read \(UnpicklingError: memo index"):
        parse_metadata(b"\x80\x04N" + b"r" + struct.pack("<I", 2**30) + b".")


def test_object_state_that_is_not_a_dict_of_fields_is_refused():
    # MetadataIndex NEWOBJ, then BUILD (None, [1, 2]): a slot state that is not a dict
    data = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81N]q\x00(K\x01K\x02e\x86b.")

    with pytest.raises(CheckpointFormatError, match="Metadata has state tuple, expected a dict of fields"):
        parse_metadata(data)


def test_a_namespace_whose_attribute_names_are_not_strings_is_refused(tmp_path):
    """Found by bench/fuzz.py (torch-pickle): such a Namespace escaped as TypeError when copied."""
    import argparse

    import torch

    ns = argparse.Namespace(seq_length=8)
    ns.__dict__[7] = "seven"
    torch.save({"args": ns}, tmp_path / "x.pt")
    with pytest.raises(CheckpointFormatError, match=r"x\.pt: .*argparse\.Namespace attribute name 7 is not a string"):
        read_torch_file(tmp_path / "x.pt")
