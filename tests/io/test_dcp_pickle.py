"""``.metadata`` as reshard writes it is byte for byte ``pickle.dumps`` of torch's own DCP classes.

The oracle below builds those objects (``TensorStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``,
``torch.Size`` ...) from a ``DcpMetadata`` and pickles them; ``encode_metadata`` emits the opcodes
itself. Each case stresses one rule of the pickler: memo numbering (BINGET / LONG_BINGET, identity
not equality), integer widths, str lengths, SETITEM(S) / APPEND(S) batches of 1000, and FRAMEs.
"""

from __future__ import annotations

import pickle
import random

import pytest

torch = pytest.importorskip("torch")

from reshard.io.dcp_metadata import (  # noqa: E402
    DcpChunk,
    DcpMetadata,
    DcpStorage,
    DcpTensor,
    read_metadata,
    write_metadata,
)
from reshard.io.dcp_pickle import encode_metadata  # noqa: E402


def oracle(md: DcpMetadata) -> bytes:
    """``pickle.dumps`` of the torch objects ``write_metadata`` describes (what ``dcp.save`` would write)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm: dict = {}
    for key, t in md.tensors.items():
        sdm[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, t.dtype)), size=torch.Size(t.size),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in t.chunks])
    for key in md.byte_entries:
        sdm[key] = BytesStorageMetadata()
    storage = {}
    for (fqn, offset), s in md.storage.items():
        index = MetadataIndex(fqn) if offset is None else MetadataIndex(fqn, torch.Size(offset), 0)
        storage[index] = _StorageInfo(s.relative_path, s.offset, s.length, list(s.transforms) if s.transforms else None)
    return pickle.dumps(Metadata(state_dict_metadata=sdm, planner_data=dict(md.planner_data), storage_data=storage,
                                 version=md.version))


def fresh(text: str) -> str:
    """An equal str that is a new object (the pickler memoizes by identity, so this one is spelled out again)."""
    return "".join(list(text))


def tensor_md(n: int, *, chunks: int = 2, dtype: str = "float32", rows: int = 8, path: str = "__0_0.distcp",
              shared_path: bool = True) -> DcpMetadata:
    """``n`` tensors of ``rows`` x 4, each split in ``chunks`` row blocks stored back to back, with planner paths."""
    md = DcpMetadata()
    offset = 0
    for i in range(n):
        key = f"model.layers.{i}.weight"
        step = -(-rows // chunks)
        parts = tuple(DcpChunk((r, 0), (min(step, rows - r), 4)) for r in range(0, rows, step))
        md.tensors[key] = DcpTensor(dtype, (rows, 4), parts)
        for c in parts:
            length = 16 * c.sizes[0] + 300
            md.storage[(key, c.offsets)] = DcpStorage(path if shared_path else fresh(path), offset, length)
            offset += length
        md.planner_data[key] = tuple(key.split("."))
    return md


def check(md: DcpMetadata) -> bytes:
    data = b"".join(encode_metadata(md))
    expected = oracle(md)
    if data != expected:
        at = next((i for i, (a, b) in enumerate(zip(data, expected)) if a != b), min(len(data), len(expected)))
        pytest.fail(f"first difference at byte {at} of {len(expected)}: {data[at - 16:at + 16]!r} != "
                    f"{expected[at - 16:at + 16]!r}")
    return data


def test_a_small_checkpoint_of_tensors_and_bytes_entries_pickles_as_torch_does():
    md = tensor_md(3)
    md.byte_entries += ["optim.step", "optim.param_groups"]
    md.storage[("optim.step", None)] = DcpStorage("__0_0.distcp", 5000, 40)
    md.storage[("optim.param_groups", None)] = DcpStorage("__1_0.distcp", 0, 900)
    md.planner_data.update({"optim.step": ("optim", "step"), "optim.param_groups": ("optim", "param_groups")})
    check(md)


DTYPES = ["float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool", "complex64"] + [
    name for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]


def test_every_dtype_and_its_first_use_midway_pickles_as_torch_does():
    md = DcpMetadata()
    for i, dtype in enumerate(DTYPES * 2):  # each dtype's global first appears after other tensors
        key = f"t{i}"
        md.tensors[key] = DcpTensor(dtype, (2,), (DcpChunk((0,), (2,)),))
        md.storage[(key, (0,))] = DcpStorage("__0_0.distcp", 100 * i, 100)
    check(md)


@pytest.mark.parametrize("size, chunks", [
    ((), [((), ())]),  # 0-d
    ((0, 4), [((0, 0), (0, 4))]),  # no elements
    ((0,), []),  # no chunk at all
    ((7, 3, 2, 5), [((0, 0, 0, 0), (7, 3, 2, 5))]),  # more than 3 dims: MARK ... TUPLE
    ((2**40, 70000, 65535, 256), [((0, 0, 0, 0), (2**40, 70000, 65535, 256))]),
], ids=["0-d", "empty", "no chunks", "4-d", "wide dims"])
def test_tensors_of_any_rank_and_size_pickle_as_torch_does(size, chunks):
    md = DcpMetadata()
    md.tensors["x"] = DcpTensor("float32", size, tuple(DcpChunk(o, s) for o, s in chunks))
    md.tensors["y"] = DcpTensor("float32", (3,), (DcpChunk((0,), (3,)),))
    for o, _ in chunks:
        md.storage[("x", o)] = DcpStorage("__0_0.distcp", 0, 10)
    md.storage[("y", (0,))] = DcpStorage("__0_0.distcp", 10, 10)
    check(md)


@pytest.mark.parametrize("n", [0, 1, 2, 999, 1000, 1001, 2000, 2500])
def test_dicts_of_every_batch_count_pickle_as_torch_does(n):
    """SETITEM for one item; SETITEMS per 1000, and an empty batch after a full last one."""
    check(tensor_md(n, chunks=1))


@pytest.mark.parametrize("chunks", [1, 2, 3, 1000, 1001, 2001])
def test_chunk_lists_of_every_batch_count_pickle_as_torch_does(chunks):
    """APPEND for one chunk; APPENDS per 1000 without an empty batch after a full one."""
    check(tensor_md(2, chunks=chunks, rows=chunks))


@pytest.mark.parametrize("value", [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1])
def test_storage_offsets_and_lengths_of_every_width_pickle_as_torch_does(value):
    md = tensor_md(2)
    key = next(iter(md.storage))
    md.storage[key] = DcpStorage("__0_0.distcp", value, value)
    check(md)


def test_planner_data_of_nested_tuples_ints_strings_and_atoms_pickles_as_torch_does():
    md = tensor_md(2)
    shared, shared_list = ("optim", "state"), ["optim", ("lr", 1)]
    md.planner_data.update({
        "a": ("optim", "param_groups", 0, "lr"), "b": (("x", 1), ("y", (2, 3, (4,)))), "c": (),
        "d": (-1, -(2**31), -(2**31) - 1, 2**70, -(2**70), -(2**2100), 2**2100, True, False, None, 1.5, -0.0),
        "e": shared, "f": shared, "g": ["list", ("in", "it")], "h": ("0", "0", "", ""),
        "i": shared_list, "j": (shared_list, shared_list), "k": [], "l": [7], "m": list(range(2500)),
    })
    check(md)


def test_strings_of_every_length_and_script_pickle_as_torch_does():
    """SHORT_BINUNICODE under 256 bytes of UTF-8, BINUNICODE above, outside any frame from 64 KiB."""
    md = tensor_md(1)
    for i, key in enumerate(["k" * 255, "k" * 256, "é" * 128, "ключ.вес", "重み", "emoji 🙂", "lone \ud800",
                             "x" * 70_000, "y" * 65_536, "z" * 65_535]):
        md.tensors[key] = DcpTensor("float32", (1,), (DcpChunk((0,), (1,)),))
        md.storage[(key, (0,))] = DcpStorage(f"__{i}_0.distcp", 0, 4)
        md.planner_data[key] = (key,)
    check(md)


def test_transforms_pickle_as_torch_does():
    md = tensor_md(3)
    keys = list(md.storage)
    md.storage[keys[0]] = DcpStorage("__0_0.distcp", 0, 10, ("zstd",))
    md.storage[keys[1]] = DcpStorage("__0_0.distcp", 10, 10, ("zstd", "crc"))
    check(md)


@pytest.mark.parametrize("shared_path", [True, False], ids=["one path object", "a path object per entry"])
def test_memo_references_past_256_and_frames_past_64_kib_pickle_as_torch_does(shared_path):
    data = check(tensor_md(3000, chunks=3, shared_path=shared_path))
    assert len(data) > 5 * 65536 and b"j" in data


def test_random_checkpoints_pickle_as_torch_does():
    rng = random.Random(7)
    for _ in range(20):
        md = DcpMetadata(version=rng.choice([None, "1.0.0"]))  # dcp.save records "1.0.0", as reshard does
        names = [f"p{i}.{rng.choice(['w', 'b', 'exp_avg'])}" for i in range(rng.randrange(0, 400))]
        for key in names:
            rank = rng.randrange(0, 4)
            dims = tuple(rng.choice([0, 1, 3, 300, 70000, 2**33]) for _ in range(rank))
            parts = tuple(DcpChunk((0,) * rank, dims) for _ in range(rng.randrange(0, 3)))
            md.tensors[key] = DcpTensor(rng.choice(DTYPES), dims, parts)
            for c in parts[:1]:
                path = rng.choice(["__0_0.distcp", fresh("__1_0.distcp")])
                md.storage[(key, c.offsets)] = DcpStorage(path, rng.randrange(0, 2**rng.randrange(1, 60)), 999)
            if rng.random() < 0.5:
                md.planner_data[key] = tuple(key.split("."))
        for i in range(rng.randrange(0, 3)):
            md.byte_entries.append(f"extra.{i}")
            md.storage[(f"extra.{i}", None)] = DcpStorage("__0_0.distcp", i, 1)
        check(md)


def test_what_write_metadata_writes_reads_back_unchanged(tmp_path):
    md = tensor_md(5, chunks=3)
    md.byte_entries.append("step")
    md.storage[("step", None)] = DcpStorage("__0_0.distcp", 0, 8, ("zstd",))
    (tmp_path / "__0_0.distcp").write_bytes(bytes(1 << 16))
    write_metadata(tmp_path, md)
    assert (tmp_path / ".metadata").read_bytes() == oracle(md)
    back = read_metadata(tmp_path)
    assert (back.tensors, back.byte_entries, back.storage, back.planner_data) == (
        md.tensors, md.byte_entries, md.storage, md.planner_data)


def test_a_dcp_target_records_the_version_dcp_save_writes(tmp_path):
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    from fixtures import make_fixture

    make_fixture(tmp_path / "src", format="hf", to="tp=1", model="tiny-llama")
    import reshard

    reshard.convert(tmp_path / "src", tmp_path / "dcp", format="dcp", to="dp=2")
    assert read_metadata(tmp_path / "dcp").version == CURRENT_DCP_VERSION
    with (tmp_path / "dcp" / ".metadata").open("rb") as f:
        assert pickle.load(f).version == CURRENT_DCP_VERSION  # torch's own reading of it (a file reshard wrote)
