"""Fuzzing the parsers of untrusted input: the spec and topology languages and the header readers of
safetensors, DCP ``.metadata`` and torch zip files. Whatever the bytes, the only exception allowed is
reshard's own error type (a clear message), never a crash of another kind."""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.errors import ReshardError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.function_scoped_fixture])

SPEC_WORDS = ["let", "index", "logical", "section", "per", "states", "flat", "blob", "include", "as", "=", "->", "@",
              "first", "last", "(", ")", "[", "]", "|", ":", "/", "~", "{i}", "{i/pp}", "{e/ep}", "{i@pp+1}", "{=n+1}",
              "tp", "pp", "dp", "ep", "h", "g", "f", "n", "2", "0", "*", "//", "+", "-", "pad", "chunk", "zero",
              "reverse", "align", "buckets", "split", "coalesce", "only", "except", "*.x.*", "a.{i}.w", "scalar",
              "cdiv(", "lcm(", ",", "#", "\n", "  "]


@FUZZ
@given(st.lists(st.sampled_from(SPEC_WORDS) | st.text(max_size=4), max_size=40))
def test_the_spec_parser_and_resolver_only_raise_spec_errors(words):
    from reshard.layout import resolve
    from reshard.spec import parse_spec
    from reshard.topology import Topology

    text = " ".join(words)
    try:
        spec = parse_spec(text)
        resolve(spec, Topology(tp=2, pp=2, dp=2), {"h": 4, "g": 2, "f": 6, "n": 3})
    except ReshardError:
        pass


@FUZZ
@given(st.text(alphabet="tpdcevzrsalyougnE0123456789=,+|-", max_size=60))
def test_the_topology_parser_only_raises_topology_errors(text):
    from reshard.topology import parse_topology

    try:
        parse_topology(text)
    except ReshardError:
        pass


def _mutations(data: bytes):
    """Byte flips, truncations and splices of a valid file."""
    return st.one_of(
        st.integers(0, len(data)).map(lambda n: data[:n]),
        st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), min_size=1, max_size=8).map(
            lambda flips: bytes(_flip(data, flips))),
        st.tuples(st.integers(0, len(data)), st.binary(max_size=64)).map(lambda t: data[:t[0]] + t[1] + data[t[0]:]),
    )


def _flip(data: bytes, flips) -> bytearray:
    out = bytearray(data)
    for at, value in flips:
        out[at] = value
    return out


def _safetensors_bytes() -> bytes:
    from reshard.safetensors_io import SafetensorsWriter

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "a.safetensors"
        with SafetensorsWriter(path, {"w": ("float32", (2, 3)), "b": ("bfloat16", (4,))}, {"format": "pt"}) as w:
            w.write("w", bytes(24))
            w.write("b", bytes(8))
        return path.read_bytes()


SAFETENSORS = _safetensors_bytes()


def _read(tmp_path_factory, data: bytes, name: str, reader) -> None:
    """``reader`` of a file holding ``data``: it may refuse with reshard's error, nothing else."""
    path = tmp_path_factory.mktemp("fuzz") / name
    path.write_bytes(data)
    try:
        reader(path)
    except ReshardError:
        pass


@FUZZ
@given(_mutations(SAFETENSORS))
def test_the_safetensors_header_reader_only_raises_format_errors(tmp_path_factory, data):
    from reshard.safetensors_io import read_header

    _read(tmp_path_factory, data, "x.safetensors", read_header)


def _torch_bytes() -> bytes:
    from reshard.torch_types import TensorSpec
    from reshard.torch_write import write_torch_file

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "a.pt"
        write_torch_file(path, {"w": TensorSpec("float32", (3,), key="w"), "step": 3, "names": ["a", "b"]},
                         {"w": bytes(12)})
        return path.read_bytes()


TORCH = _torch_bytes()


@FUZZ
@given(_mutations(TORCH))
def test_the_torch_zip_reader_only_raises_format_errors(tmp_path_factory, data):
    from reshard.torchfile import read_torch_file

    _read(tmp_path_factory, data, "x.pt", read_torch_file)


def _dcp_metadata_bytes() -> bytes:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as d:
        dcp.save({"w": torch.zeros(4, 2), "step": 3}, checkpoint_id=d)
        with open(f"{d}/.metadata", "rb") as f:
            return f.read()


@FUZZ
@given(data=st.data())
def test_the_dcp_metadata_reader_only_raises_format_errors(data):
    from reshard.dcp_metadata import parse_metadata

    raw = _DCP.get("bytes")
    if raw is None:
        raw = _DCP["bytes"] = _dcp_metadata_bytes()
    try:
        parse_metadata(data.draw(_mutations(raw)))
    except ReshardError:
        pass


_DCP: dict[str, bytes] = {}


def test_a_pickle_that_would_run_code_is_refused_by_every_reader(tmp_path):
    """The fuzzers' one hard rule, checked directly: a __reduce__ payload never runs."""
    from reshard.dcp_metadata import parse_metadata

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(ReshardError):
        parse_metadata(pickle.dumps(Payload()))
    assert not marker.exists()
