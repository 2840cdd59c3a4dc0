"""Object storage: an S3-compatible server (moto) on loopback; sources read through s3fs with range requests,
destinations uploaded file by file in parts (S3 multipart uploads), the manifest last."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

import reshard
from fixtures import make_fixture
from reshard.errors import ReshardError
from reshard.io.safetensors_io import read_header

pytestmark = pytest.mark.interop

BUCKET = "ckpts"


class _RequestLog:
    """WSGI middleware recording each object GET (its path and its Range header) and each object write (method,
    path, query)."""

    def __init__(self, app) -> None:
        self.app = app
        self.gets: list[tuple[str, str | None]] = []
        self.writes: list[tuple[str, str, str]] = []

    def __call__(self, environ, start_response):
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        if path.strip("/").count("/") >= 1:  # an object, not a listing
            if method == "GET":
                self.gets.append((path, environ.get("HTTP_RANGE")))
            elif method in ("PUT", "POST"):
                self.writes.append((method, path, environ.get("QUERY_STRING", "")))
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


def _download(fs, url: str, local: Path) -> Path:
    fs.invalidate_cache()
    fs.get(url.removeprefix("s3://") + "/", str(local), recursive=True)
    return local


def test_a_conversion_to_s3_uploads_what_a_local_one_writes_manifest_last(s3, tmp_path):
    fs, log = s3
    make_fixture(tmp_path / "src", format="hf")
    log.writes.clear()
    result = reshard.convert(tmp_path / "src", f"s3://{BUCKET}/out-meg", to="tp=2,pp=2", format="megatron")
    assert str(result.path) == f"s3://{BUCKET}/out-meg"
    puts = [p for m, p, _ in log.writes if m == "PUT"]
    assert puts[-1].endswith("/out-meg/reshard.json") and len(puts) == len(set(puts))  # each once, manifest last
    reshard.convert(tmp_path / "src", tmp_path / "local", to="tp=2,pp=2", format="megatron")
    got = _download(fs, f"s3://{BUCKET}/out-meg", tmp_path / "down")
    assert _tree(got) == _tree(tmp_path / "local")
    assert reshard.verify(got)  # the manifest describes the uploaded bytes
    assert not list(Path(tempfile.gettempdir()).glob("reshard-upload-*"))  # the local copy is gone

    from typer.testing import CliRunner

    from reshard.cli.main import app

    out = CliRunner().invoke(app, ["convert", str(tmp_path / "src"), f"s3://{BUCKET}/cli-meg", "--to", "tp=2,pp=2",
                                   "--format", "megatron", "--workers", "1"])
    assert out.exit_code == 0, out.output
    assert _tree(_download(fs, f"s3://{BUCKET}/cli-meg", tmp_path / "cli")) == _tree(tmp_path / "local")
    with pytest.raises(ReshardError, match="destination exists and is not empty"):
        reshard.convert(tmp_path / "src", f"s3://{BUCKET}/out-meg", to="tp=2", format="megatron")
    with pytest.raises(ReshardError, match="resume continues a local conversion"):
        reshard.convert(tmp_path / "src", f"s3://{BUCKET}/other", to="tp=2", format="megatron", resume=True)


def test_a_large_file_goes_up_in_parts(s3, tmp_path):
    fs, log = s3
    from reshard.io.location import as_path
    from reshard.io.upload import MIN_PART, upload_tree

    (tmp_path / "big").mkdir()
    data = bytes(range(256)) * (12 * (1 << 20) // 256 + 7)  # 12 MiB and a bit: three parts of 5 MiB
    (tmp_path / "big" / "blob.bin").write_bytes(data)
    (tmp_path / "big" / "reshard.json").write_text("{}")
    log.writes.clear()
    sizes = upload_tree(tmp_path / "big", as_path(f"s3://{BUCKET}/big"), last="reshard.json", part_size=MIN_PART)
    assert sizes == {"blob.bin": len(data), "reshard.json": 2}
    parts = [q for m, p, q in log.writes if p.endswith("/blob.bin") and "partNumber" in q]
    assert len(parts) == 3, log.writes
    fs.invalidate_cache()
    assert fs.cat_file(f"{BUCKET}/big/blob.bin") == data


def test_a_failed_upload_leaves_nothing_in_the_bucket(s3, tmp_path, monkeypatch):
    fs, _ = s3
    import reshard.io.upload as upload

    make_fixture(tmp_path / "src", format="hf")

    def refuse(remote, size):
        raise ReshardError(f"{remote}: refused")

    monkeypatch.setattr(upload, "_check_size", refuse)
    with pytest.raises(ReshardError, match="refused"):
        reshard.convert(tmp_path / "src", f"s3://{BUCKET}/failed", to="tp=2", format="megatron")
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/failed")


def test_a_format_read_only_locally_is_named(s3, tmp_path):
    fs, _ = s3
    make_fixture(tmp_path / "meg", format="megatron", to="tp=2")
    url = _upload(fs, tmp_path / "meg", "meg")
    with pytest.raises(ReshardError, match="not a checkpoint reshard reads from object storage .*hf, dcp.* local copy"):
        reshard.convert(url, tmp_path / "out", to="tp=1")
