"""Object storage: an S3-compatible server (moto) on loopback; sources read through s3fs with range requests,
destinations uploaded file by file in parts (S3 multipart uploads), the manifest last."""

from __future__ import annotations

import re
import tempfile
import warnings
from pathlib import Path

import pytest

import reshard
import reshard.api.loading as loading
from fixtures import make_fixture
from reshard.errors import ReshardError
from reshard.execution.coalescing import Coalescing
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


def test_one_rank_load_reads_only_range_requests(s3, tmp_path, monkeypatch):
    # Gaps read through within the slack only: every row of the tiny model is below RANK_LOAD.free_gap, which
    # would read a tp=4 rank's row-split weights whole (tests/api/test_rank_load.py covers free gaps).
    monkeypatch.setattr(loading, "RANK_LOAD", Coalescing(slack=0.25))
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


def test_a_directory_in_the_bucket_that_is_no_checkpoint_is_refused_naming_it(s3, tmp_path):
    fs, _ = s3
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a checkpoint")
    url = _upload(fs, tmp_path / "notes", "notes")
    with pytest.raises(ReshardError, match=rf"^{url}: not a checkpoint reshard recognizes \(looked for: megatron, "
                                           r"deepspeed, hf, mcore-dist, mcore-fsdp, dcp, ucp\)$"):
        reshard.convert(url, tmp_path / "out", to="tp=1")
    with pytest.raises(ReshardError, match=rf"^{url}-missing: no such checkpoint directory in object storage$"):
        reshard.convert(f"{url}-missing", tmp_path / "out", to="tp=1")
    assert not (tmp_path / "out").exists()


def _no_family_fsdp_dtensor(path: Path) -> None:
    """A Megatron-FSDP fsdp_dtensor checkpoint (``dcp.save`` in this process) whose args name no model family."""
    import argparse

    import torch
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(3)
    shapes = {"embedding.word_embeddings.weight": (12, 8), "decoder.layers.0.mlp.linear_fc1.weight": (16, 8),
              "decoder.final_layernorm.weight": (8,)}
    with warnings.catch_warnings():  # dcp.save says it saves in this one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {f"module.{k}": torch.randn(v, generator=gen) for k, v in shapes.items()},
                  "optimizer": {"state": {f"module.module.{k}": {"exp_avg": torch.randn(v, generator=gen),
                                                                 "step": torch.tensor(4.0)} for k, v in shapes.items()}},
                  "args": argparse.Namespace(num_layers=1, hidden_size=8, swiglu=False), "iteration": 4,
                  "checkpoint_version": 3.0}, checkpoint_id=path)


def _source(tmp_path: Path, fmt: str, to: str | None) -> Path:
    """A local checkpoint of ``fmt``: the fixture model at ``to``; UCP converted from a DeepSpeed one."""
    local = tmp_path / "src"
    if fmt == "ucp":
        make_fixture(tmp_path / "ds", format="deepspeed", to=to)
        reshard.convert(tmp_path / "ds", local, format="ucp")
    elif fmt == "mcore-fsdp":
        _no_family_fsdp_dtensor(local)
    else:
        make_fixture(local, format=fmt, to=to)
    return local


@pytest.mark.parametrize("fmt,to,dst_format", [("megatron", "tp=2,pp=2", "hf"), ("deepspeed", "dp=2", "dcp"),
                                               ("mcore-dist", "tp=2", "hf"), ("deepspeed", "zero=3,dp=2", "hf"),
                                               ("ucp", "dp=2", "hf"), ("mcore-fsdp", None, "dcp"),
                                               ("megatron", "tp=2,dp=2,zero=1", "dcp"), ("deepspeed", "pp=2,dp=2", "hf")])
def test_more_sources_from_s3_equal_the_local_ones(s3, tmp_path, fmt, to, dst_format):
    fs, log = s3
    local = _source(tmp_path, fmt, to)
    url = _upload(fs, local, f"more-{fmt}-{to}")
    log.gets.clear()
    reshard.convert(url, tmp_path / "from_s3", format=dst_format, workers=1)
    gets = list(log.gets)
    reshard.convert(local, tmp_path / "from_disk", format=dst_format)
    a, b = _tree(tmp_path / "from_s3"), _tree(tmp_path / "from_disk")
    assert a.keys() == b.keys() and a
    assert all(a[k] == b[k] for k in a)
    if fmt == "megatron":  # every object GET is a range request: only the bytes the reader needs are fetched
        assert gets and all(rng is not None for _, rng in gets), [g for g in gets if g[1] is None]


def test_worker_processes_read_a_url_source(s3, tmp_path, monkeypatch):
    fs, _ = s3
    import reshard.api.converting as converting

    make_fixture(tmp_path / "src", format="megatron", to="tp=2")
    url = _upload(fs, tmp_path / "src", "workers-megatron")
    started: list[int] = []

    def counted(shares, progress=None):
        started.append(len(shares))
        return run_shares(shares, progress)

    run_shares = converting.run_shares
    monkeypatch.setattr(converting, "run_shares", counted)
    reshard.convert(url, tmp_path / "two", format="hf", max_shard_size="100KB", workers=2)
    assert started == [2]  # two worker processes, each reading its share from the bucket
    reshard.convert(tmp_path / "src", tmp_path / "one", format="hf", max_shard_size="100KB", workers=1)
    a, b = _tree(tmp_path / "two"), _tree(tmp_path / "one")
    assert len(a) > 2 and a == b


def test_a_small_torch_file_is_read_in_one_range_request(s3, tmp_path):
    """The zip end records are read with the bytes before them (64 KiB and a bit): of a small file, all of it, so
    its pickle and its records' headers come from that one read."""
    import torch

    from reshard.io.location import as_path
    from reshard.io.torchfile import read_torch_file

    fs, log = s3
    (tmp_path / "t").mkdir()
    torch.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": torch.tensor(7.0), "lr": 0.5},
               tmp_path / "t" / "state.pt")
    url = _upload(fs, tmp_path / "t", "small-torch")
    log.gets.clear()
    got = read_torch_file(as_path(f"{url}/state.pt"))
    gets = list(log.gets)
    want = read_torch_file(tmp_path / "t" / "state.pt")
    assert got["lr"] == want["lr"] == 0.5
    assert [(r.shape, r.dtype, r.data_offset) for r in (got["w"], got["step"])] == \
        [(r.shape, r.dtype, r.data_offset) for r in (want["w"], want["step"])]
    size = (tmp_path / "t" / "state.pt").stat().st_size
    assert gets == [(f"/{BUCKET}/small-torch/state.pt", f"bytes=0-{size - 1}")]
