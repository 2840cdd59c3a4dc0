"""Per-tensor overhead: 100,000 small tensors against a few large ones of the same bytes, in bytes per second.

Generates two Hugging Face safetensors checkpoints of a model no family describes (``model_type``
``"custom"``, its layout derived from the safetensors header), each about ``--mib`` MiB of fp32:

- **many**: ``--tensors`` small tensors (100,000 of 10 KiB at the default size; DeepSeek-V3's release
  holds about 90,000 tensors);
- **few**: 64 large tensors.

Then converts each, in a fresh interpreter, ``--repeat`` rounds interleaved:

- Hugging Face -> Hugging Face in shards of a quarter of the checkpoint (every tensor copied into a new
  file set);
- Hugging Face -> PyTorch DCP at dp=2 (FSDP2's ``Shard(0)``: every tensor split in two).

Prints wall time (the whole process, imports and planning included), MiB/s, and each "many" run's time per
byte over its "few" twin's (the target: at most 1.5); and, for reference, the same figures for the plain
``safetensors`` library: ``load_file`` of the one file and ``save_file`` of its tensors, fsynced.

    python bench/small_tensors.py [--tensors 100000] [--mib 1000] [--repeat 3] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from any_model import write_hf  # noqa: E402
from convert_memory import child, dir_size  # noqa: E402

CUSTOM = {"model_type": "custom", "architectures": ["CustomModel"]}
PLAIN = "safetensors load_file + save_file"


def shapes(count: int, total: int) -> list[tuple[str, tuple[int, ...]]]:
    """``count`` fp32 tensors of ``total`` bytes in all, in blocks of ten (rows of 64 elements)."""
    rows = max(1, total // (count * 256))
    return [(f"blocks.{k // 10}.part{k % 10}.weight", (rows, 64)) for k in range(count)]


def convert(src: Path, dst: Path, fmt: str, to: str | None, shard: str | None) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    seconds, _, _ = child("import json, reshard\n"
                          f"reshard.convert({str(src)!r}, {str(dst)!r}, format={fmt!r}, to={to!r}, "
                          f"max_shard_size={shard!r}, workers=1)\n_out = {{}}")
    return seconds


def plain(src: Path, dst: Path) -> float:
    """``safetensors.torch``'s ``load_file`` of the checkpoint's one file, then ``save_file`` of it into ``dst``,
    fsynced: the per-tensor cost of the plain library (its reading and writing in Rust, a torch tensor each)."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    os.sync()
    seconds, _, _ = child("import json, os\nfrom safetensors.torch import load_file, save_file\n"
                          f"save_file(load_file({str(src / 'model.safetensors')!r}), {str(dst / 'model.safetensors')!r})\n"
                          f"fd = os.open({str(dst / 'model.safetensors')!r}, os.O_RDONLY)\nos.fsync(fd)\nos.close(fd)\n"
                          "_out = {}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=100_000, help="the small tensors of the 'many' checkpoint")
    ap.add_argument("--mib", type=int, default=1000, help="the size of each checkpoint")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the table shows medians")
    ap.add_argument("--tiny", action="store_true", help="1,000 tensors and 16 MiB, one round: a smoke test")
    args = ap.parse_args()
    if args.tiny:
        args.tensors, args.mib, args.repeat = 1000, 16, 1
    total = args.mib << 20
    with tempfile.TemporaryDirectory(prefix="reshard-bench-", dir=os.environ.get("TMPDIR")) as tmp:
        tmp = Path(tmp)
        sources = {"many": tmp / "many", "few": tmp / "few"}
        write_hf(sources["many"], CUSTOM, shapes(args.tensors, total), "float32")
        write_hf(sources["few"], CUSTOM, shapes(64, total), "float32")
        sizes = {k: dir_size(v) for k, v in sources.items()}
        quarter = f"{max(1, total // 4 >> 20)}MiB"
        runs = {"hf -> hf (4 shards)": ("hf", None, quarter), "hf -> dcp dp=2": ("dcp", "dp=2", None),
                PLAIN: None}
        times: dict[tuple[str, str], list[float]] = {(r, k): [] for r in runs for k in sources}
        for _ in range(args.repeat):
            for run, how in runs.items():
                for kind, src in sources.items():
                    times[run, kind].append(plain(src, tmp / "out") if how is None else convert(src, tmp / "out", *how))
        shutil.rmtree(tmp / "out", ignore_errors=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
        print(f"checkpoints: many = {args.tensors:,} tensors, few = 64 tensors; {sizes['many'] / 2**20:.0f} and "
              f"{sizes['few'] / 2**20:.0f} MiB fp32\n")
        print("| conversion | checkpoint | tensors | wall s | MiB/s | time per byte vs few |")
        print("|---|---|---:|---:|---:|---:|")
        for run in runs:
            for kind, count in (("few", 64), ("many", args.tensors)):
                per_byte = (med[run, kind] / sizes[kind]) / (med[run, "few"] / sizes["few"])
                print(f"| {run} | {kind} | {count:,} | {med[run, kind]:.2f} | "
                      f"{sizes[kind] / 2**20 / med[run, kind]:.0f} | {per_byte:.2f} |")
        print(f"\nmedians of {args.repeat} rounds, interleaved; wall time is the whole process (imports, opening, "
              "planning, writing, the manifest); target: time per byte of 'many' at most 1.5 x 'few'; the last rows "
              "are the plain safetensors library's load_file + save_file (one file, fsynced), for reference")


if __name__ == "__main__":
    main()
