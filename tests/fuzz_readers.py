"""Fuzz targets for the low-level readers of untrusted files: torch zip + pickle, safetensors, DCP.

Each seed is written by the real library (``torch.save``, ``safetensors.torch.save_file``,
``torch.distributed.checkpoint.save``), so mutations start from the bytes users actually have.
Each check reads the file the way reshard does, then reads every tensor's bytes back through
``ByteReader`` (what the executor copies with), after checking they lie in their storage and file.

- ``torch-zip``: a torch.save file, and the same file with every central directory entry moved
  to zip64 extra fields (what a file past 4 GiB has), read with ``read_torch_file``.
- ``torch-pickle``: only ``data.pkl`` is mutated; the check zips it with the seed's storage
  records, so mutations reach storage keys, numels, offsets, sizes, strides and dtypes.
- ``dcp-distcp``: a ``.distcp`` file, each chunk read at the offset and length ``.metadata`` gives.
- ``safetensors``: a file, and the same bytes at an offset inside a larger file (DCP's blobs).
- ``dcp-metadata``: ``.metadata``, read with ``read_metadata`` (storage entries checked against files).
"""

from __future__ import annotations

import argparse
import struct
import zipfile
from pathlib import Path

from fuzzing import Target


def _state_dict():
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    return {
        "w": base,
        "view": base[1:, 1:3],  # a storage offset and strides
        "col": base.t(),  # strides (1, 4)
        "empty": base[6:],  # no elements, storage offset at the end
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "f8": torch.ones(3).to(torch.float8_e4m3fn),  # _rebuild_tensor_v3 with an UntypedStorage
        "ids": torch.arange(7),
        "scalar": torch.tensor(2.5),
        "p": torch.nn.Parameter(torch.ones(3)),
        "args": argparse.Namespace(tensor_model_parallel_size=2, seq_length=8),
        "np": np.arange(4, dtype=np.int32),
        "nested": [{"step": 3, "lr": 1e-3}, ("a", b"b", None, True)],
    }


def _read_tensor(reader, ref, file_size: int) -> None:
    """Reads every byte of ``ref`` as reshard reads an item, after checking it lies in its storage and file."""
    storage_start = ref.data_offset - ref.storage_offset * ref.itemsize
    assert 0 <= storage_start and storage_start + ref.storage_nbytes <= file_size, (ref, file_size)
    if 0 in ref.shape:
        assert ref.storage_offset * ref.itemsize <= ref.storage_nbytes, ref
        return
    last = ref.storage_offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
    assert (last + 1) * ref.itemsize <= ref.storage_nbytes, ref
    span = ref.nbytes if ref.is_contiguous else (last + 1 - ref.storage_offset) * ref.itemsize
    reader.read_into(ref.path, ref.data_offset, memoryview(bytearray(span)))


def _read_torch(path: Path, **where) -> None:
    from reshard.execution.executor import ByteReader
    from reshard.io.torch_types import TensorRef, map_tensors
    from reshard.io.torchfile import read_torch_file

    refs: list[TensorRef] = []
    map_tensors(read_torch_file(path, **where), refs.append)
    size = path.stat().st_size
    with ByteReader() as reader:
        for ref in refs:
            _read_tensor(reader, ref, size)


# --- torch-zip ----------------------------------------------------------------------------------


def zip64_entries(data: bytes) -> bytes:
    """The torch.save file ``data`` with each central directory entry's sizes and header offset
    stored as 0xFFFFFFFF and given in a zip64 extra field instead, as in a file past 4 GiB."""
    eocd = data.rindex(b"PK\x05\x06")
    z64 = struct.unpack_from("<Q", data, eocd - 12)[0]  # the zip64 locator's pointer to the zip64 end record
    count, _, _, cd_offset = struct.unpack_from("<QQQQ", data, z64 + 24)
    entries, at = [], cd_offset
    for _ in range(count):
        fixed = bytearray(data[at:at + 46])
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", fixed, 28)
        csize, usize = struct.unpack_from("<II", fixed, 20)
        offset = struct.unpack_from("<I", fixed, 42)[0]
        name = data[at + 46:at + 46 + name_len]
        old_extra = data[at + 46 + name_len:at + 46 + name_len + extra_len]
        extra = struct.pack("<HHQQQ", 1, 24, usize, csize, offset) + old_extra
        struct.pack_into("<II", fixed, 20, 0xFFFFFFFF, 0xFFFFFFFF)
        struct.pack_into("<I", fixed, 42, 0xFFFFFFFF)
        struct.pack_into("<H", fixed, 30, len(extra))
        struct.pack_into("<H", fixed, 6, 45)  # version needed to extract: zip64
        comment = data[at + 46 + name_len + extra_len:at + 46 + name_len + extra_len + comment_len]
        entries.append(bytes(fixed) + name + extra + comment)
        at += 46 + name_len + extra_len + comment_len
    cd = b"".join(entries)
    end = (struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, count, count, len(cd), cd_offset)
           + struct.pack("<IIQI", 0x07064B50, 0, cd_offset + len(cd), 1)
           + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    return data[:cd_offset] + cd + end


def _build_torch(root: Path) -> None:
    import torch

    torch.save(_state_dict(), root / "model.pt")
    (root / "model64.pt").write_bytes(zip64_entries((root / "model.pt").read_bytes()))
    loaded = torch.load(root / "model64.pt", weights_only=False)  # a real zip64 torch file, not our own dialect
    assert torch.equal(loaded["view"], _state_dict()["view"])


def _check_torch(root: Path, scratch: Path) -> None:
    _read_torch(root / "model.pt")
    _read_torch(root / "model64.pt")


# --- torch-pickle -------------------------------------------------------------------------------

_RECORDS: dict[Path, dict[str, bytes]] = {}


def _build_torch_pickle(root: Path) -> None:
    import torch

    torch.save(_state_dict(), root / "records.pt")
    with zipfile.ZipFile(root / "records.pt") as z:
        (root / "data.pkl").write_bytes(z.read("records/data.pkl"))


def _check_torch_pickle(root: Path, scratch: Path) -> None:
    records = _RECORDS.get(root)
    if records is None:
        with zipfile.ZipFile(root / "records.pt") as z:
            records = _RECORDS[root] = {i.filename: z.read(i) for i in z.infolist()}
    path = scratch / "records.pt"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in records.items():
            z.writestr(name, (root / "data.pkl").read_bytes() if name == "records/data.pkl" else data)
    _read_torch(path)


# --- dcp-distcp ---------------------------------------------------------------------------------


def _build_dcp(root: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    dcp.save({"w": torch.randn(4, 2, generator=g), "b": torch.ones(3, dtype=torch.bfloat16), "step": 3,
              "opt": {"lr": 1e-3, "betas": (0.9, 0.95)}, "name": "x"}, checkpoint_id=str(root))


def _check_distcp(root: Path, scratch: Path) -> None:
    import os

    from reshard.io.dcp_metadata import read_metadata
    from reshard.execution.executor import ByteReader
    from reshard.io.safetensors_io import read_header

    md = read_metadata(root)
    for s in md.storage.values():
        file = root / s.relative_path
        with open(file, "rb") as f:
            magic = os.pread(f.fileno(), 4, s.offset)
        if magic == b"PK\x03\x04":  # as reshard.formats.dcp reads a chunk: an archive, else a safetensors blob
            _read_torch(file, offset=s.offset, length=s.length)
        else:
            header = read_header(file, offset=s.offset)
            with ByteReader() as reader:
                for t in header.tensors.values():
                    reader.read_into(file, t.data_offset, memoryview(bytearray(t.nbytes)))


def _distcp_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.distcp"))


# --- safetensors --------------------------------------------------------------------------------

_PREFIX = b"\x00" * 13 + b"some other data before the blob" + b"\xff" * 20


def _build_safetensors(root: Path) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({"a.weight": torch.randn(4, 3, generator=g), "a.bias": torch.randn(3, generator=g).to(torch.bfloat16),
               "ids": torch.arange(5, dtype=torch.int64), "empty": torch.zeros(0, 2), "one": torch.tensor(1.0)},
              str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "blob.bin").write_bytes(_PREFIX + (root / "model.safetensors").read_bytes())


def _check_safetensors(root: Path, scratch: Path) -> None:
    from reshard.execution.executor import ByteReader
    from reshard.io.safetensors_io import read_header

    for name, offset in (("model.safetensors", 0), ("blob.bin", len(_PREFIX))):
        path = root / name
        header = read_header(path, offset=offset)
        size = path.stat().st_size
        with ByteReader() as reader:
            for t in header.tensors.values():
                assert header.data_start <= t.data_offset and t.data_offset + t.nbytes <= size, (t, size)
                reader.read_into(path, t.data_offset, memoryview(bytearray(t.nbytes)))


# --- dcp-metadata -------------------------------------------------------------------------------


def _check_dcp_metadata(root: Path, scratch: Path) -> None:
    from reshard.io.dcp_metadata import read_metadata

    md = read_metadata(root)
    for key, t in md.tensors.items():  # what read_metadata promises the format adapter
        for c in t.chunks:
            assert all(0 <= o and o + n <= d for o, n, d in zip(c.offsets, c.sizes, t.size, strict=True)), (key, c)
    for s in md.storage.values():
        assert "/" not in s.relative_path and s.relative_path not in ("", ".", ".."), s
        file = root / s.relative_path
        if file.is_file():
            assert 0 <= s.offset and s.offset + s.length <= file.stat().st_size, s


TARGETS: tuple[Target, ...] = (
    Target("torch-zip", "torch.save file (views, bf16, float8, Parameter, Namespace, numpy), plain and zip64 "
           "-> read_torch_file, every tensor's bytes", _build_torch, _check_torch),
    Target("torch-pickle", "torch.save's data.pkl alone, zipped with its storages -> read_torch_file, every "
           "tensor's bytes", _build_torch_pickle, _check_torch_pickle, mutable=lambda root: [root / "data.pkl"]),
    Target("dcp-distcp", "dcp.save .distcp -> each chunk's archive at its offset -> read_torch_file, every "
           "tensor's bytes", _build_dcp, _check_distcp, mutable=_distcp_files),
    Target("safetensors", "safetensors.torch.save_file file, alone and at an offset -> read_header, every "
           "tensor's bytes", _build_safetensors, _check_safetensors),
    Target("dcp-metadata", "dcp.save .metadata -> read_metadata", _build_dcp, _check_dcp_metadata,
           mutable=lambda root: [root / ".metadata"]),
)
