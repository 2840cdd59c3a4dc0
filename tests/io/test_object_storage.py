"""Sources in object storage: an S3-compatible server (moto) on loopback, read through s3fs with range requests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import reshard
from fixtures import make_fixture
from reshard.errors import ReshardError
from reshard.io.safetensors_io import read_header

pytestmark = pytest.mark.interop

BUCKET = "ckpts"


class _RequestLog:
    """WSGI middleware recording each object GET: its path and its Range header."""

    def __init__(self, app) -> None:
        self.app = app
        self.gets: list[tuple[str, str | None]] = []

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if environ["REQUEST_METHOD"] == "GET" and path.strip("/").count("/") >= 1:  # an object, not a listing
            self.gets.append((path, environ.get("HTTP_RANGE")))
        return self.app(environ, start_response)


@pytest.fixture(scope="module")
def s3():
    """(an s3fs filesystem on a moto server on 127.0.0.1, the server's request log); reshard's ``s3://`` URLs
    reach the same server through fsspec's configuration."""
    pytest.importorskip("s3fs")
    import fsspec.config
    import s3fs
    from moto.server import ThreadedMotoServer

    log: list[_RequestLog] = []

    class Server(ThreadedMotoServer):
        def _server_entry(self) -> None:
            from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
            from werkzeug.serving import make_server

            log.append(_RequestLog(DomainDispatcherApplication(create_backend_app)))
            self._server = make_server(self._ip_address, self._port, log[0], True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    server = Server(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing",
               "client_kwargs": {"region_name": "us-west-2"}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(fsspec.config.conf, "s3", options)
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir(BUCKET)
        yield fs, log[0]
    server.stop()


def _upload(fs, local: Path, name: str) -> str:
    for f in sorted(local.rglob("*")):
        if f.is_file():
            fs.pipe_file(f"{BUCKET}/{name}/{f.relative_to(local)}", f.read_bytes())
    fs.invalidate_cache()
    return f"s3://{BUCKET}/{name}"


def _tree(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*"))
            if f.is_file() and f.name != "reshard.json"}


@pytest.mark.parametrize("fmt,to,dst_format", [("hf", "tp=2,pp=2", "megatron"), ("dcp", None, "hf")])
def test_conversion_from_s3_equals_the_local_one(s3, tmp_path, fmt, to, dst_format):
    fs, _ = s3
    local = tmp_path / "src"
    make_fixture(local, format=fmt, **({"to": "dp=2", "states": ("master",)} if fmt == "dcp" else {}))
    url = _upload(fs, local, f"conv-{fmt}")
    reshard.convert(url, tmp_path / "from_s3", to=to, format=dst_format)
    reshard.convert(local, tmp_path / "from_disk", to=to, format=dst_format)
    a, b = _tree(tmp_path / "from_s3"), _tree(tmp_path / "from_disk")
    assert a.keys() == b.keys() and a
    assert all(a[k] == b[k] for k in a)
    if fmt == "hf":  # the command line takes the URL as it is
        from typer.testing import CliRunner

        from reshard.cli.main import app

        out = CliRunner().invoke(app, ["convert", url, str(tmp_path / "cli"), "--to", to, "--format", dst_format,
                                       "--workers", "1"])
        assert out.exit_code == 0, out.output
        assert _tree(tmp_path / "cli") == b


def test_one_rank_load_reads_only_range_requests(s3, tmp_path):
    fs, log = s3
    local = tmp_path / "src"
    make_fixture(local, format="hf")
    url = _upload(fs, local, "load-hf")
    log.gets.clear()
    mine = reshard.load(url, to="tp=4", format="megatron", rank=1)
    gets = list(log.gets)
    want = reshard.load(local, to="tp=4", format="megatron", rank=1)
    assert mine.tensors.keys() == want.tensors.keys()
    assert all(mine.tensors[k].equal(want.tensors[k]) for k in want.tensors)

    assert gets and all(rng is not None for _, rng in gets), [g for g in gets if g[1] is None]
    spans = [tuple(map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", rng).groups())) for _, rng in gets]
    fetched = sum(b - a + 1 for a, b in spans)
    share = sum(t.numel() * t.element_size() for t in mine.tensors.values())
    headers = sum(read_header(f).data_start for f in local.glob("*.safetensors"))
    small = sum(f.stat().st_size for f in local.iterdir() if f.suffix != ".safetensors")
    assert mine.bytes_read <= 1.25 * share
    assert fetched <= 1.25 * share + headers + small
    total = sum(f.stat().st_size for f in local.glob("*.safetensors"))
    assert share < total / 3  # the rank read its quarter, not the checkpoint


def test_a_url_destination_is_refused(s3, tmp_path):
    make_fixture(tmp_path / "src", format="hf")
    with pytest.raises(ReshardError, match="object storage .* works as a source only"):
        reshard.convert(tmp_path / "src", f"s3://{BUCKET}/out", to="tp=2", format="megatron")


def test_a_format_read_only_locally_is_named(s3, tmp_path):
    fs, _ = s3
    make_fixture(tmp_path / "meg", format="megatron", to="tp=2")
    url = _upload(fs, tmp_path / "meg", "meg")
    with pytest.raises(ReshardError, match="not a checkpoint reshard reads from object storage .*hf, dcp.* local copy"):
        reshard.convert(url, tmp_path / "out", to="tp=1")
