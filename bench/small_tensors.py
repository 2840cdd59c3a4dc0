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
``safetensors`` library (``load_file`` of the one file and ``save_file`` of its tensors, fsynced), and for a bare
Python loop that does only what any converter in Python must per tensor (``bare_copy``: the header, the
offsets' check, the shards, an xxh3-128 of each tensor, the index; its output checked against the source).

    python bench/small_tensors.py [--tensors 100000] [--mib 1000] [--repeat 3] [--tiny]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from machine import describe

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from any_model import write_hf  # noqa: E402
from convert_memory import child, dir_size  # noqa: E402
from rank_load import warm  # noqa: E402

CUSTOM = {"model_type": "custom", "architectures": ["CustomModel"]}
PLAIN = "safetensors load_file + save_file"
BARE = "bare Python loop, hf -> hf (4 shards)"


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


def bare(src: Path, dst: Path, shard: int) -> float:
    """``bare_copy`` of ``src`` into ``dst`` in a fresh interpreter: its wall seconds."""
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    seconds, _, _ = child(f"import json, sys; sys.path.insert(0, {str(HERE)!r})\nfrom small_tensors import bare_copy\n"
                          f"bare_copy({str(src)!r}, {str(dst)!r}, {shard})\n_out = {{}}")
    return seconds


def bare_copy(src: str, dst: str, shard: int) -> None:
    """The least a converter in Python does per tensor, for Hugging Face -> Hugging Face: parse the one file's
    header, check each tensor's offsets against its shape and dtype, lay the tensors out in shards of at most
    ``shard`` bytes in file order, copy them in buffers of whole tensors (at most 4 MiB, a larger tensor alone)
    with an xxh3-128 of each, and write each shard's header, the index and the digests (compact JSON), each file
    fsynced. No plan, no resume journal, no logical checksums, no other format: the floor of Python per tensor
    on this machine, against which reshard's own per-tensor cost shows."""
    import json
    import struct

    import xxhash

    from reshard.core.dtypes import ITEMSIZE, SAFETENSORS_CODES  # the one dtype table (7 ms to import)

    out = Path(dst)
    out.mkdir(parents=True, exist_ok=True)
    fi = os.open(Path(src) / "model.safetensors", os.O_RDONLY)
    n = struct.unpack("<Q", os.pread(fi, 8, 0))[0]
    header = json.loads(os.pread(fi, n, 8))
    header.pop("__metadata__", None)
    tensors = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    end = 0
    for name, t in tensors:
        lo, hi = t["data_offsets"]
        if lo != end or hi - lo != math.prod(t["shape"]) * ITEMSIZE[SAFETENSORS_CODES[t["dtype"]]]:
            raise ValueError(f"{src}: tensor {name} has offsets {lo}, {hi}")
        end = hi
    shards: list[list[tuple[str, dict]]] = [[]]
    held = 0
    for name, t in tensors:
        size = t["data_offsets"][1] - t["data_offsets"][0]
        if shards[-1] and held + size > shard:
            shards.append([])
            held = 0
        shards[-1].append((name, t))
        held += size
    digests: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    buffer = memoryview(bytearray(4 << 20))
    for k, part in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        first = part[0][1]["data_offsets"][0]
        entries = {name: {"dtype": t["dtype"], "shape": t["shape"],
                          "data_offsets": [t["data_offsets"][0] - first, t["data_offsets"][1] - first]}
                   for name, t in part}
        weight_map.update(dict.fromkeys(entries, file))
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        fo = os.open(out / file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(fo, struct.pack("<Q", len(text)) + text, 0)
        at, j = 8 + len(text), 0
        while j < len(part):  # a run of whole tensors that fits the buffer, or one larger tensor alone
            lo, e = part[j][1]["data_offsets"][0], j + 1
            while e < len(part) and part[e][1]["data_offsets"][1] - lo <= len(buffer):
                e += 1
            hi = part[e - 1][1]["data_offsets"][1]
            digest = xxhash.xxh3_128() if hi - lo > len(buffer) else None
            for start in range(lo, hi, len(buffer)):
                view = buffer[:min(len(buffer), hi - start)]
                if os.preadv(fi, [view], 8 + n + start) != len(view):
                    raise ValueError(f"{src}: short read")
                if digest is not None:
                    digest.update(view)
                else:
                    for name, t in part[j:e]:
                        a, b = t["data_offsets"]
                        digests[name] = xxhash.xxh3_128_hexdigest(view[a - lo:b - lo])
                os.pwrite(fo, view, at)
                at += len(view)
            if digest is not None:
                digests[part[j][0]] = digest.hexdigest()
            j = e
        os.fsync(fo)
        os.close(fo)
    os.close(fi)
    for file, obj in (("model.safetensors.index.json", {"metadata": {"total_size": end}, "weight_map": weight_map}),
                      ("digests.json", digests)):
        fd = os.open(out / file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, json.dumps(obj, separators=(",", ":")).encode())
        os.fsync(fd)
        os.close(fd)


def same_tensors(a: Path, b: Path) -> bool:
    """Whether the Hugging Face checkpoints ``a`` and ``b`` hold the same tensors, byte for byte."""
    from safetensors import safe_open

    def load(path: Path) -> dict:
        out = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(file, "numpy") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
        return out

    x, y = load(a), load(b)
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and x[k].tobytes() == y[k].tobytes() for k in x)


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
        for src in sources.values():
            warm(src)
        sizes = {k: dir_size(v) for k, v in sources.items()}
        quarter = f"{max(1, total // 4 >> 20)}MiB"
        runs = {"hf -> hf (4 shards)": ("hf", None, quarter), "hf -> dcp dp=2": ("dcp", "dp=2", None),
                PLAIN: None, BARE: "bare"}
        times: dict[tuple[str, str], list[float]] = {(r, k): [] for r in runs for k in sources}
        for round_ in range(args.repeat):
            for run, how in runs.items():
                for kind, src in sources.items():
                    if how is None:
                        seconds = plain(src, tmp / "out")
                    elif how == "bare":
                        seconds = bare(src, tmp / "out", total // 4)
                        if round_ == 0 and not same_tensors(src, tmp / "out"):
                            raise SystemExit(f"{BARE}: the {kind} copy differs from its source")
                    else:
                        seconds = convert(src, tmp / "out", *how)
                    times[run, kind].append(seconds)
        shutil.rmtree(tmp / "out", ignore_errors=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(describe())
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
              "are the plain safetensors library's load_file + save_file (one file, fsynced), and a bare Python loop "
              "doing only what any converter in Python must per tensor (bare_copy), for reference")


if __name__ == "__main__":
    main()
