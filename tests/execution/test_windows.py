"""The write session's windows: filled in buffers of its own, reused, two of them in flight on the writer thread
while the next is filled, none reused before its write has ended, each lying in memory at its file offset's place
within a page (so that a direct write takes it without a copy), and a failure raised only once every write in
flight has ended."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from reshard.errors import CheckpointFormatError
from reshard.execution.session import WriteSession
from reshard.io import storage
from reshard.io.torch_write import TensorSpec, TorchFileWriter

MIB = 1 << 20
PAGE = 4096


class Source:
    """A fill with ``fill_into`` (as ``PlanFill`` has): the item's elements from ``payload``; counts the windows
    asked for and can hold one back until told."""

    def __init__(self, payload: np.ndarray) -> None:
        self.payload = payload
        self.asked: list[tuple[int, int]] = []
        self.asked_third = threading.Event()

    def __call__(self, item, lo, hi):
        raise AssertionError("a fill with fill_into is filled in place")

    def fill_into(self, item, lo, hi, out) -> None:
        self.asked.append((lo, hi))
        if len(self.asked) == 3:
            self.asked_third.set()
        out.view(np.uint8)[:] = self.payload[lo:hi].view(np.uint8)


def test_two_windows_are_in_flight_while_the_next_is_filled_and_no_buffer_is_reused_before_its_write_ends():
    """The first write waits until the third window is being filled: that only happens with two windows in
    flight. Every write sleeps before it reads its window, so a buffer reused too early would show in the bytes."""
    payload = np.arange(3_000_000, dtype=np.uint32)  # 12 MB: windows of 1.2 MB, over the size handed to the writer
    source = Source(payload)
    rng = random.Random(7)
    got: list[bytes] = []
    waited = []

    def write(data):
        if not got and not waited:
            waited.append(source.asked_third.wait(10))
        time.sleep(rng.random() * 0.01)
        got.append(bytes(data))

    with WriteSession(window_bytes=4 * 300_000) as session:
        session.stream_item(source, "item", len(payload), "float32", write)
        session.stream_item(source, "again", len(payload), "float32", write)
    assert waited == [True]
    assert b"".join(got) == payload.tobytes() * 2 and len(got) == 20


@pytest.mark.parametrize("at", [0, 64, 4000, 4096 + 2, 123_456])
def test_windows_lie_in_memory_at_their_file_offsets_place_within_a_page(at):
    payload = np.arange(1_000_000, dtype=np.uint16)
    source = Source(payload)
    places: list[tuple[int, int]] = []  # (file offset, address) of each window
    got: list[bytes] = []
    written = 0

    def write(data):
        nonlocal written
        places.append((at + written, np.frombuffer(data, dtype=np.uint8).ctypes.data))
        got.append(bytes(data))
        written += len(data)

    with WriteSession(window_bytes=2 * 250_000 + 6) as session:  # windows of 500,006 bytes: off a page
        session.stream_item(source, "item", len(payload), "bfloat16", write, at=at)
    assert written == payload.nbytes and len(places) == 4 and b"".join(got) == payload.tobytes()
    assert all(offset % PAGE == address % PAGE for offset, address in places)


def test_a_torch_file_written_through_the_session_goes_to_the_disk_without_a_copy(tmp_path, monkeypatch):
    """The tensors of a torch.save archive start 64 bytes apart, anywhere in a page: each window is placed so that
    its direct write's whole pages are aligned in memory, and the file holds exactly the tensors' bytes."""
    copied = []
    real = storage.OutputFile._pages

    def pages(self, direct, view, offset, a0, a1):
        copied.append(storage._address(view[a0 - offset:a1 - offset]) % PAGE != 0)
        return real(self, direct, view, offset, a0, a1)

    monkeypatch.setattr(storage.OutputFile, "_pages", pages)
    tensors = {"a": np.arange(3 * MIB + 5, dtype=np.uint8), "b": np.arange(5 * MIB // 4 + 3, dtype=np.float32)}
    tree = {name: TensorSpec("uint8" if name == "a" else "float32", t.shape, key=name) for name, t in tensors.items()}
    with WriteSession(window_bytes=2 * MIB) as session:
        with TorchFileWriter(tmp_path / "x.pt", tree, open_file=session.open) as w:
            for name, t in tensors.items():
                source = Source(t)
                session.stream_item(source, name, t.size, str(t.dtype), lambda data, k=name: w.write(k, data),
                                    at=w.entries[name][0])
    if not copied:
        pytest.skip("this file system refuses O_DIRECT: no direct write to check")
    assert copied and not any(copied)
    back = torch.load(tmp_path / "x.pt", weights_only=True)
    for name, t in tensors.items():
        assert np.array_equal(back[name].numpy(), t)


def test_a_failed_write_is_raised_once_every_write_in_flight_has_ended():
    """The second of three windows fails while the third is in flight: ``settle`` (which a file's ``close``
    calls before it closes the descriptor) raises the failure only once the third write has ended too."""
    payload = np.arange(900_000, dtype=np.uint32)  # three windows of 1.2 MB
    ended: list[int] = []

    def write(data):
        k = len(ended)
        if k == 1:
            time.sleep(0.05)
            ended.append(k)
            raise CheckpointFormatError("disk full")
        if k == 2:
            time.sleep(0.3)
        ended.append(k)

    session = WriteSession(window_bytes=4 * 300_000)
    try:
        session.stream_item(Source(payload), "item", len(payload), "float32", write)  # the failure not seen yet
        with pytest.raises(CheckpointFormatError, match="disk full"):
            session.settle()
        assert ended == [0, 1, 2]  # the third write had ended when the failure was raised
        session.settle()  # nothing left in flight
    finally:
        session.close()


def test_a_small_window_behind_windows_in_flight_follows_them_without_waiting_for_them():
    """A layer norm after a large tensor: the small window is handed to the writer thread behind the large one's
    windows, in order, instead of waiting for them to end first (which left the disk idle until the next window
    was filled). The large tensor's last write holds back until the small tensor is handed over; the bytes come
    out in order."""
    big = np.arange(600_000, dtype=np.uint32)  # 2.4 MB: two windows of 1.2 MB, each handed to the writer
    small = np.arange(1000, dtype=np.uint16)  # 2 KB: written by the caller where nothing is in flight
    after = np.arange(700_000, dtype=np.uint32)
    sources = {"big": Source(big), "small": Source(small), "after": Source(after)}
    handed = threading.Event()
    got: list[tuple[str, bytes]] = []
    held = []

    def write_to(name):
        def write(data):
            if name == "big" and len(got) == 1:  # the big tensor's second window
                held.append(handed.wait(10))
            got.append((name, bytes(data)))
        return write

    with WriteSession(window_bytes=4 * 300_000) as session:
        session.stream_item(sources["big"], "big", len(big), "float32", write_to("big"))
        session.stream_item(sources["small"], "small", len(small), "bfloat16", write_to("small"))
        handed.set()
        session.stream_item(sources["after"], "after", len(after), "float32", write_to("after"))
    assert held == [True]
    assert [n for n, _ in got] == ["big", "big", "small", "after", "after", "after"]
    assert b"".join(d for _, d in got) == big.tobytes() + small.tobytes() + after.tobytes()


def test_a_small_window_with_nothing_in_flight_is_written_by_the_caller():
    small = np.arange(1000, dtype=np.uint16)
    threads = []
    with WriteSession(window_bytes=4 * MIB) as session:
        session.stream_item(Source(small), "small", len(small), "bfloat16",
                            lambda data: threads.append(threading.current_thread()))
    assert threads == [threading.current_thread()]
