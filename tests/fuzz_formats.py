"""Fuzz targets for whole checkpoints: one per format, read through the public API.

Each seed is a small checkpoint of the tiny Llama (tiny Mixtral for expert parallelism) as the
format's ranks write it (or, for the manifest, a finished conversion). Most checks convert it to
another topology, so the sizes that drive slicing (numel, partition counts, bucket ranges, chunk
boxes) are all exercised; a few go through ``inspect``, ``plan`` and ``load`` instead.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from fuzzing import Target


def _unchecked(build: Callable[[Path], None]) -> Callable[[Path], None]:
    """``build``, then every torch archive's ``data.pkl`` CRC-32 zeroed in the zip central directory.

    A zero CRC means "not recorded" (``torch.serialization.set_crc32_options(False)``) and readers skip
    the check, so a mutated pickle reaches the format adapter instead of failing its checksum.
    """

    def wrapped(root: Path) -> None:
        build(root)
        for path in root.rglob("*"):
            if path.is_file() and path.suffix in (".pt", ".distcp"):
                data = bytearray(path.read_bytes())
                at = 0
                while (at := data.find(b"PK\x01\x02", at)) >= 0 and at + 46 <= len(data):
                    n = struct.unpack_from("<H", data, at + 28)[0]
                    if bytes(data[at + 46:at + 46 + n]).endswith(b"data.pkl"):
                        data[at + 16:at + 20] = bytes(4)
                    at += 4
                path.write_bytes(bytes(data))

    return wrapped


def _fixture(format: str, to: str, model: str = "tiny-llama"):
    def build(root: Path) -> None:
        from reshard.fixtures import make_fixture

        make_fixture(root / "ckpt", format=format, to=to, model=model)

    return _unchecked(build)


def _converted(format: str, to: str, into: str, into_to: str | None = None, **options):
    """A checkpoint written by ``reshard.convert`` from a fixture (formats fixtures do not write directly)."""

    def build(root: Path) -> None:
        import reshard
        from reshard.fixtures import make_fixture

        make_fixture(root / "src", format=format, to=to)
        reshard.convert(root / "src", root / "ckpt", to=into_to, format=into, **options)
        (root / "ckpt" / "reshard.json").unlink()  # no longer true once the CRCs are zeroed
        shutil.rmtree(root / "src")

    return _unchecked(build)


def _convert(to: str | None, format: str | None = None):
    def check(root: Path, scratch: Path) -> None:
        import reshard

        reshard.convert(root / "ckpt", scratch / "out", to=to, format=format)

    return check


def _inspect(root: Path, scratch: Path) -> None:
    import reshard

    reshard.inspect(root / "ckpt")


def _plan(to: str, format: str | None = None):
    def check(root: Path, scratch: Path) -> None:
        import reshard

        reshard.plan(root / "ckpt", to=to, format=format).to_json()

    return check


def _load(to: str, rank: int, format: str | None = None):
    def check(root: Path, scratch: Path) -> None:
        import reshard

        reshard.load(root / "ckpt", to=to, rank=rank, format=format)

    return check


def _build_manifest(root: Path) -> None:
    import reshard
    from reshard.fixtures import make_fixture

    make_fixture(root / "src", format="megatron", to="tp=2,pp=1")
    reshard.convert(root / "src", root / "ckpt", to="tp=1,pp=1")


def _check_manifest(root: Path, scratch: Path) -> None:
    import reshard

    reshard.verify(root / "ckpt")


TARGETS: tuple[Target, ...] = (
    Target("megatron", "Megatron tp=2,pp=2 with distributed optimizer -> convert tp=1,pp=2",
           _fixture("megatron", "tp=2,pp=2,dp=2,zero=1"), _convert("tp=1,pp=2,dp=1")),
    Target("megatron-ep", "Megatron Mixtral ep=2, plain optimizer (dense + expert) -> convert ep=1",
           _fixture("megatron", "tp=1,pp=1,dp=2,ep=2", "tiny-mixtral"), _convert("tp=1,pp=1,dp=2,ep=1")),
    Target("megatron-ep-distopt", "Megatron Mixtral ep=2 with distributed optimizer -> convert ep=1",
           _fixture("megatron", "tp=1,pp=1,dp=2,ep=2,zero=1", "tiny-mixtral"), _convert("tp=1,pp=1,dp=2,ep=1,zero=1")),
    Target("deepspeed", "DeepSpeed ZeRO-2 dp=2 -> convert dp=3", _fixture("deepspeed", "dp=2,zero=2"),
           _convert("dp=3")),
    Target("deepspeed-zero3", "DeepSpeed ZeRO-3 dp=2 -> convert dp=3", _fixture("deepspeed", "dp=2,zero=3"),
           _convert("dp=3")),
    Target("deepspeed-pipe", "DeepSpeed pipeline engine pp=2,dp=2 (ZeRO-1) -> convert pp=1,dp=2",
           _fixture("deepspeed", "pp=2,dp=2,zero=1"), _convert("pp=1,dp=2,zero=1")),
    Target("hf", "HF safetensors + config.json -> convert megatron tp=2", _fixture("hf", "tp=1"),
           _convert("tp=2", "megatron")),
    Target("hf-sharded", "HF safetensors shards + index -> inspect",
           _converted("hf", "tp=1", "hf", max_shard_size=40000), _inspect),
    Target("dcp", "DCP FSDP2 dp=2 -> convert dp=3", _fixture("dcp", "dp=2"), _convert("dp=3")),
    Target("mcore-dist", "Megatron torch_dist tp=2 -> convert tp=1", _fixture("mcore-dist", "tp=2"), _convert("tp=1")),
    Target("ucp", "DeepSpeed universal folder -> convert deepspeed dp=2",
           _converted("deepspeed", "dp=2,zero=2", "ucp"), _convert("dp=2", "deepspeed")),
    Target("inspect-deepspeed", "DeepSpeed pipeline engine tp=2,pp=2 (layer files per tp rank) -> inspect",
           _fixture("deepspeed", "tp=2,pp=2,dp=1,zero=1"), _inspect),
    Target("plan-megatron", "Megatron tp=2 (plain optimizer) -> plan tp=1,pp=2", _fixture("megatron", "tp=2,pp=1,dp=1"),
           _plan("tp=1,pp=2")),
    Target("load-dcp", "DCP FSDP2 dp=2 -> load rank 1 of megatron tp=2", _fixture("dcp", "dp=2"),
           _load("tp=2", 1, "megatron")),
    Target("manifest", "a finished conversion's reshard.json -> verify", _build_manifest, _check_manifest,
           mutable=lambda root: [root / "ckpt" / "reshard.json"]),
)
