"""Output files: the checksum taken while writing is that of the bytes on disk, whatever the write order,
and write failures are named errors that leave no file."""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest

from reshard.errors import CheckpointFormatError
from reshard.execution.session import WriteSession
from reshard.io.checksum import file_digest
from reshard.io.storage import OutputFile
from reshard.io.torch_types import TensorSpec
from reshard.io.torch_write import TorchFileWriter


def test_sequential_writes_are_checksummed_without_reading_back(tmp_path):
    f = OutputFile(tmp_path / "a", size=3000)
    f.pwrite(b"h" * 100, 0)  # a header, then data streamed after it
    for lo in range(100, 3000, 700):
        f.pwrite(os.urandom(min(700, 3000 - lo)), lo)
    assert f.close() == file_digest(tmp_path / "a") and f.read_back == 0


@pytest.mark.parametrize("seed", range(6))
def test_any_write_order_overwrites_and_holes_still_give_the_files_checksum(tmp_path, seed):
    rng = random.Random(seed)
    size = 5000
    session = WriteSession()
    f = session.open(tmp_path / "a", size=size if seed % 2 else None)
    for _ in range(12):
        lo = rng.randrange(0, size - 1)
        f.pwrite(os.urandom(rng.randrange(1, min(900, size - lo) + 1)), lo)
    if seed % 2 == 0:  # without a size the file ends where the last byte was written
        f.pwrite(b"end", size - 3)
    digest = f.close()
    assert digest == file_digest(tmp_path / "a") == session.digest(tmp_path / "a")
    assert WriteSession().digest(tmp_path / "a") is None  # another session never sees it


def test_a_file_read_back_through_small_chunks_gives_its_checksum(tmp_path, monkeypatch):
    """Written over its checksummed prefix, the file is read back whole for its checksum, through one buffer of
    a chunk's size reused (``_CHUNK`` made small here): the same digest as the bytes on disk."""
    from reshard.io import storage

    monkeypatch.setattr(storage, "_CHUNK", 1000)
    data = os.urandom(10_500)
    f = OutputFile(tmp_path / "a", size=len(data))
    f.pwrite(data[:5000], 0)
    f.pwrite(data[5000:], 5000)
    f.pwrite(data[100:200], 100)  # into the checksummed prefix: read back whole at close
    assert f.close() == file_digest(tmp_path / "a") and f.read_back == len(data)


def test_bytes_read_back_land_in_the_buffer_given_and_a_short_file_is_named(tmp_path):
    data = os.urandom(5000)
    f = OutputFile(tmp_path / "a", size=len(data))
    f.pwrite(data, 0)
    buf = np.zeros(8192, dtype=np.uint8)
    got = f.pread(3000, 1000, memoryview(buf))
    assert bytes(got) == data[1000:4000] and np.shares_memory(np.frombuffer(got, dtype=np.uint8), buf)
    assert bytes(f.pread(10, 4990)) == data[4990:]
    with pytest.raises(CheckpointFormatError, match=r"a: ends at byte 5000, expected 5010"):
        f.pread(20, 4990)
    f.close()


def test_a_torch_file_is_checksummed_as_it_streams(tmp_path):
    """Headers and descriptors are read back (a few hundred bytes); tensor bytes are never read back."""
    tree = {"a": TensorSpec("float32", (1000,), key="a"), "b": TensorSpec("bfloat16", (3, 500), key="b"),
            "empty": TensorSpec("float32", (0,), key="e"), "step": 7}
    data = {"a": os.urandom(4000), "b": os.urandom(3000), "e": b""}
    session = WriteSession()
    with TorchFileWriter(tmp_path / "t.pt", tree, open_file=session.open) as w:
        out = w._out
        for key in w.entries:
            for lo in range(0, len(data[key]), 512):
                w.write(key, data[key][lo:lo + 512])
    assert session.digest(tmp_path / "t.pt") == file_digest(tmp_path / "t.pt")
    assert out.read_back < 2000 < len(data["a"]) and not out._rehash
    import torch
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)
    assert loaded["a"].numpy().tobytes() == data["a"] and loaded["step"] == 7
    import zipfile

    assert zipfile.ZipFile(tmp_path / "t.pt").testzip() is None  # CRCs and data descriptors are right


def test_write_errors_name_the_file_and_leave_nothing(tmp_path):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(CheckpointFormatError, match=r"plain/x: cannot create \(Not a directory\)"):
        OutputFile(tmp_path / "plain" / "x")
    f = OutputFile(tmp_path / "y")
    os.close(f._fd)  # the descriptor goes bad under it, as a failing disk would
    f._fd = os.open(os.devnull, os.O_RDONLY)
    with pytest.raises(CheckpointFormatError, match=r"y: cannot write 3 bytes at byte 0 \(Bad file descriptor\)"):
        f.pwrite(b"abc", 0)
    f.abort()
    assert not (tmp_path / "y").exists()


def test_stream_item_overlaps_filling_and_writing_and_keeps_the_order():
    """Windows are written in order, each while the next is filled, and a failing write surfaces."""
    payload = np.arange(1_000_000, dtype=np.uint32)  # windows of 1.2 MB: over the size handed to the writer
    threads = set()

    def fill(item, lo, hi):
        return memoryview(payload[lo:hi].copy()).cast("B")

    got = []

    def write(data):
        threads.add(threading.current_thread().name)
        got.append(bytes(data))

    with WriteSession(window_bytes=4 * 299_999) as session:
        session.stream_item(fill, "item", 1_000_000, "float32", write)
        session.stream_item(fill, "again", 1_000_000, "float32", write)  # overlaps the last window of the first
    assert b"".join(got) == payload.tobytes() * 2 and len(got) == 8
    assert any(t.startswith("reshard-write") for t in threads)

    def broken(data):
        raise CheckpointFormatError("disk full")

    for n in (1_000_000, 299_999):  # raised by the next window's wait, or at the session's end
        with pytest.raises(CheckpointFormatError, match="disk full"), WriteSession(window_bytes=4 * 299_999) as session:
            session.stream_item(fill, "item", n, "float32", broken)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_manifest_checksums_every_tensor_and_verify_names_the_one_that_changed(tmp_path, workers):
    import json

    import reshard
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "src", to="tp=2,pp=2")
    reshard.convert(tmp_path / "src", tmp_path / "dst", to="tp=1,pp=2", workers=workers)
    files = json.loads((tmp_path / "dst" / "reshard.json").read_text())["files"]
    dst = reshard.open_checkpoint(tmp_path / "dst")
    rel = "iter_0000000/mp_rank_00_001/model_optim_rng.pt"
    mine = {str(it): loc for it, loc in dst.where.items() if str(loc.path).endswith(rel)}
    assert set(files[rel]["tensors"]) == set(mine)  # every stored tensor of the file, weights and Adam state
    label, loc = max(mine.items(), key=lambda kv: dst.layout.items[next(i for i in dst.where if str(i) == kv[0])].numel)
    path = tmp_path / "dst" / rel
    data = bytearray(path.read_bytes())
    data[loc.offset + 5] ^= 1  # one bit inside that tensor
    path.write_bytes(bytes(data))
    result = reshard.verify(tmp_path / "dst")
    assert not result.identical
    assert result.differences[0].startswith(f"{rel}: xxh3_128_64k ")
    assert [d for d in result.differences[1:] if "tensor" in d] == [
        d for d in result.differences[1:] if d.startswith(f"  tensor {label}: xxh3_128 ")] and len(result.differences) == 2


@pytest.mark.parametrize("after", [0, 3, 40])
def test_a_full_disk_mid_conversion_is_named_and_leaves_no_output(tmp_path, monkeypatch, after):
    """ENOSPC injected into the storage layer after some writes: a clear error naming the file, and
    neither the destination nor the temporary directory it was built in remains."""
    import errno

    import reshard
    import reshard.io.storage
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "src", to="tp=2,pp=2")
    calls = [0]
    real = os.pwrite

    def full(fd, data, offset):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(reshard.io.storage.os, "pwrite", full)
    with pytest.raises(reshard.ReshardError, match=r"model_optim_rng\.pt: cannot write .*No space left on device"):
        reshard.convert(tmp_path / "src", tmp_path / "dst", to="tp=1,pp=2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_manifests_carry_logical_checksums_that_verify_compares_without_reading_tensors(tmp_path):
    """A tensor stored whole gets the xxh3-128 of its row-major bytes (what hashing the torch tensor
    gives) in the manifest; two checkpoints of other layouts whose manifests both carry it are compared
    by it, and everything else by value."""
    import json

    import torch
    import xxhash
    from safetensors.torch import load_file

    import reshard
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "src", to="tp=2,pp=2")
    reshard.convert(tmp_path / "src", tmp_path / "a", to="tp=1,pp=1")
    reshard.convert(tmp_path / "src", tmp_path / "b", to="tp=2,pp=1")
    reshard.convert(tmp_path / "b", tmp_path / "c", to="tp=1,pp=1")
    reshard.convert(tmp_path / "b", tmp_path / "hf", format="hf")
    logical = json.loads((tmp_path / "hf" / "reshard.json").read_text())["logical"]["param"]
    assert set(logical) == set(reshard.inspect(tmp_path / "hf")["tensors"])  # hf stores every tensor whole
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    hf = reshard.open_checkpoint(tmp_path / "hf")
    stored = {f.tensor: f.item.key for f in hf.layout.fragments if f.item in hf.where}
    for name, entry in logical.items():
        t = weights[stored[name]]
        assert entry["dtype"] == str(t.dtype).removeprefix("torch.")
        assert xxhash.xxh3_128(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() == entry["xxh3_128"]

    # Megatron holds the embedding inside a vocabulary padded for tp, gate and up as halves of one fused
    # weight: their ranges are checksummed on their own, and agree with the hf manifest's. Only the
    # interleaved q, k, v are left to values.
    in_a = json.loads((tmp_path / "a" / "reshard.json").read_text())["logical"]["param"]
    assert {n: e["xxh3_128"] for n, e in in_a.items()} == {n: logical[n]["xxh3_128"] for n in in_a}
    assert sorted(set(logical) - set(in_a)) == sorted(
        n for n in logical if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj"))

    both = reshard.verify(tmp_path / "a", tmp_path / "c")
    whole = sum(len(v) for v in json.loads((tmp_path / "a" / "reshard.json").read_text())["logical"].values())
    assert both and both.by_checksum == whole > 0 and both.compared > whole  # the rest by value
    assert reshard.verify(tmp_path / "src", tmp_path / "c").by_checksum == 0  # the fixture has no manifest

    # A manifest whose logical checksum was edited is not believed over the bytes: values decide.
    manifest = json.loads((tmp_path / "c" / "reshard.json").read_text())
    name = next(iter(manifest["logical"]["param"]))
    manifest["logical"]["param"][name]["xxh3_128"] = "0" * 32
    (tmp_path / "c" / "reshard.json").write_text(json.dumps(manifest))
    edited = reshard.verify(tmp_path / "a", tmp_path / "c")
    assert edited and edited.by_checksum == whole - 1

    # A flipped bit in c: c no longer matches its manifest, so nothing of it is taken on checksum,
    # and the value comparison names the tensor.
    c = reshard.open_checkpoint(tmp_path / "c")
    loc = next(c.where[f.item] for f in c.layout.fragments if f.tensor == name and f.state == "param")
    data = bytearray(loc.path.read_bytes())
    data[loc.offset] ^= 0x40
    loc.path.write_bytes(bytes(data))
    broken = reshard.verify(tmp_path / "a", tmp_path / "c")
    assert not broken and broken.by_checksum == 0
    assert broken.differences[0].startswith(f"{name} [param]: first difference at ")


def test_permission_denied_on_a_later_file_is_named_and_leaves_no_output(tmp_path, monkeypatch):
    """EACCES injected when the second rank file is created (root ignores chmod, so the storage layer
    is where the fault goes in)."""
    import errno

    import reshard
    import reshard.io.storage
    from reshard.fixtures import make_fixture

    make_fixture(tmp_path / "src", to="tp=2,pp=2")
    created = []
    real = os.open

    def denied(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and str(path).endswith(".pt"):
            created.append(path)
            if len(created) == 2:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(reshard.io.storage.os, "open", denied)
    with pytest.raises(reshard.ReshardError, match=r"mp_rank_00_001/model_optim_rng\.pt: cannot create \(Permission denied\)"):
        reshard.convert(tmp_path / "src", tmp_path / "dst", to="tp=1,pp=4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_small_filesystem_filling_up_mid_conversion_leaves_nothing(tmp_path):
    """A real 2 MiB tmpfs (in a private mount namespace) under a 4.5 MiB conversion, where the machine
    allows mounting one."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from reshard.fixtures import make_fixture

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to mount a small filesystem with")
    make_fixture(tmp_path / "src", to="tp=2,pp=2")
    small = tmp_path / "small"
    small.mkdir()
    root = Path(__file__).resolve().parents[2]
    script = (f"mount -t tmpfs -o size=2m tmpfs {small} || exit 77; "
              f"{sys.executable} -m cli.main convert {tmp_path / 'src'} {small / 'dst'} --to tp=1,pp=4; "
              f"echo \"exit=$?\"; ls -A {small}; echo end")
    proc = subprocess.run([unshare, "-m", "sh", "-c", script], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {proc.stderr.strip()[:200]}")
    lines = proc.stdout.split()
    assert lines == ["exit=2", "end"], proc.stdout  # exit 2 and the filesystem left empty
    assert "model_optim_rng.pt: cannot write" in proc.stderr and "No space left on device" in proc.stderr


def test_ranges_inside_a_streamed_item_are_checksummed_across_windows():
    import xxhash

    data = os.urandom(40_000)
    ranges = [(0, 4), (4, 9_999), (10_000, 10_004), (12_001, 39_996), (39_996, 40_000)]
    out = bytearray()
    with WriteSession(segments={"item": ranges}, window_bytes=4 * 333) as session:
        session.stream_item(lambda item, lo, hi: data[lo * 4:hi * 4], "item", 10_000, "float32", out.extend)
    assert bytes(out) == data and session.item_digests()["item"] == xxhash.xxh3_128(data).hexdigest()
    assert session.segment_digests() == {("item", lo, hi): xxhash.xxh3_128(data[lo:hi]).hexdigest()
                                         for lo, hi in ranges}


def test_a_tensor_without_elements_is_streamed_as_one_empty_window():
    """Its writer still sees the (empty) write that completes the tensor: a zip record's data descriptor
    follows a tensor's last bytes, which for an empty tensor are none."""
    asked, wrote = [], []
    with WriteSession() as session:
        session.stream_item(lambda item, lo, hi: asked.append((item, lo, hi)) or b"", "empty", 0, "float32",
                            wrote.append)
    assert asked == [("empty", 0, 0)] and wrote == [b""]
