"""``check_memoize_pickle`` decides exactly as ``check_pickle`` does: the same pickles pass, the same fail, with
the same message; and a ``.metadata`` as DCP writes it is decided by the fast loop alone."""

from __future__ import annotations

import pickle
import random
import struct

import pytest

import reshard.io.dcp_scan as dcp_scan
from reshard.io.dcp_metadata import DcpChunk, DcpMetadata, DcpStorage, DcpTensor
from reshard.io.dcp_pickle import encode_metadata
from reshard.io.dcp_scan import check_memoize_pickle
from reshard.io.pickle_scan import check_pickle


def outcome(check, data: bytes) -> str:
    try:
        check(data)
    except pickle.UnpicklingError as e:
        return f"refused: {e}"
    return "passed"


def same_verdict(data: bytes) -> str:
    expected = outcome(check_pickle, data)
    assert outcome(check_memoize_pickle, data) == expected, data[:80]
    return expected


def metadata_pickle(n: int = 300) -> bytes:
    md = DcpMetadata()
    for i in range(n):
        key = f"layers.{i}.weight"
        md.tensors[key] = DcpTensor("bfloat16", (8, 4), (DcpChunk((0, 0), (4, 4)), DcpChunk((4, 0), (4, 4))))
        md.storage[(key, (0, 0))] = DcpStorage("__0_0.distcp", 100 * i, 50)
        md.storage[(key, (4, 0))] = DcpStorage("__1_0.distcp", 100 * i, 2**40)
        md.planner_data[key] = ("layers", str(i), "weight", "é" * 300)
    return b"".join(encode_metadata(md))


def test_a_dcp_metadata_pickle_is_decided_without_the_careful_walk(monkeypatch):
    data = metadata_pickle()
    monkeypatch.setattr(dcp_scan, "check_pickle", lambda d: pytest.fail("handed to check_pickle"))
    check_memoize_pickle(data)


def test_a_run_longer_than_one_match_is_stepped_over_without_the_careful_walk(monkeypatch):
    """Runs are matched at most ``_RUN_LENGTH`` opcodes at a time (Python 3.10 has no possessive repeat): a longer
    one is matched again, not handed to ``check_pickle``; one cut off by its argument still is, and refused."""
    run = (b"N" + b"h\x01" + b"J\x00\x00\x00\x00") * dcp_scan._RUN_LENGTH  # three times the bound
    data = b"\x80\x04\x95" + struct.pack("<Q", 2 + len(run)) + b"]\x94" + run + b"0" * (3 * len(run) // 7) + b"."
    assert same_verdict(data) == "passed"
    monkeypatch.setattr(dcp_scan, "check_pickle", lambda d: pytest.fail("handed to check_pickle"))
    check_memoize_pickle(data)
    monkeypatch.undo()
    assert same_verdict(b"\x80\x04" + run + b"J\x00\x00").startswith("refused")


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickles_of_every_protocol_get_the_same_verdict(protocol):
    value = {"a": [1, 2.5, -(2**70), None, True, b"x" * 300, "y" * 70_000, (1, 2, 3, 4)], "b": {1, 2},
             3: bytearray(b"z")}
    assert same_verdict(pickle.dumps(value, protocol)) == "passed"


@pytest.mark.parametrize("data", [
    b"\x80\x04N" + b"r" + struct.pack("<I", 2**30) + b".",  # memo index bomb
    b"\x80\x04Nq\x05.",  # BINPUT past the memo entries stored
    b"\x80\x04B" + struct.pack("<I", 2**31) + b".",  # a count past the end
    b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b".",
    b"\x80\x04\x8c\x10abc.",
    b"\x80\x04\x95" + struct.pack("<Q", 2**40) + b"N.",  # FRAME past the end
    b"\x80\x09N.",  # protocol past the highest
    b"\x80\x04\xffN.",  # no such opcode
    b"\x80\x04N",  # no STOP
    b"\x80\x04h",  # argument cut off
    b"\x80\x04T\xff\xff\xff\xff.",  # negative count
    b"(lp0\nI1\naI2\na.",  # protocol 0: PUT lines
], ids=["LONG_BINPUT bomb", "BINPUT", "BINBYTES", "BINBYTES8", "SHORT_BINUNICODE", "FRAME", "PROTO", "bad opcode",
        "no STOP", "truncated BINGET", "BINSTRING negative", "protocol 0"])
def test_hostile_and_odd_pickles_get_the_same_verdict(data):
    same_verdict(data)


def test_mutated_metadata_pickles_get_the_same_verdict():
    data = metadata_pickle(40)
    rng = random.Random(11)
    verdicts = set()
    for _ in range(400):
        mutated = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        if rng.random() < 0.3:
            del mutated[rng.randrange(len(mutated)):]
        verdicts.add(same_verdict(bytes(mutated)).split(":")[0])
    assert verdicts == {"passed", "refused"}
