"""Convert a generated multi-GiB checkpoint: wall time against cp -r, peak RSS, bytes read and written.

Generates a Llama-shaped checkpoint (bf16 weights, fp32 master copy and Adam
exp_avg / exp_avg_sq; about 2.6 GiB at the default scale), ``--source megatron``:
Megatron at tp=2,pp=2 with the distributed optimizer (``distrib_optim.pt``), or
``--source deepspeed``: DeepSpeed ZeRO-2 at dp=2, as its ranks would save it; or
``--source hf``: a Hugging Face Llama's bf16 weights in safetensors shards of 400 MiB
(1.92 GiB at the default scale, ``rank_load.py``'s checkpoint). Then measures, each in
a fresh interpreter:

- ``cp -r`` of the source on the same disk (the same bytes read and written);
- ``reshard convert`` to tp=1,pp=4 (DeepSpeed: dp=4; Hugging Face: Megatron tp=2,pp=2, whose row-split
  weights take half of each row) with each of ``--workers`` (default 1, 2, 4 and 8: the curve, each point
  against ``cp -r``);
- ``reshard.load`` of rank 3 of 8 at tp=2,pp=2,dp=2 (DeepSpeed: dp=8; Hugging Face: of 4 at
  tp=2,pp=2), what a rank of a resized job reads;
- the disk's own write speed: as many bytes as the source written directly (``O_DIRECT``, as reshard writes) from
  one page-aligned buffer of 8 MiB on 1 and on 2 threads, and fsynced, with no reading and no checksums: the least
  time any writer of those bytes takes here, against which more workers are measured;
- with ``--rss-scale S``, one more conversion of a checkpoint S times as large, for peak
  memory at a second size.

Figures: wall time (medians of ``--repeat`` rounds, each round running every
measurement back to back: a shared machine's disk speed drifts), its ratio to
``cp -r``, peak RSS, bytes read over the bytes needed (the source for a
conversion, the rank's share for a load), and bytes written (``/proc/self/io``)
over the output's size.

    python bench/convert_memory.py [--source megatron|deepspeed] [--scale 1.0] [--repeat 3] [--rss-scale 2]
                                   [--workers 1,2,4,8] [--keep DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_load import warm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# Per source format: the topology it is saved at, the conversion's target, and (topology, rank) to load.
CASES = {
    "megatron": ("tp=2,pp=2,dp=1,zero=1", "tp=1,pp=4", ("tp=2,pp=2,dp=2", 3)),
    "deepspeed": ("dp=2,zero=2", "dp=4", ("dp=8", 3)),
    "hf": ("(unsharded)", "tp=2,pp=2", ("tp=2,pp=2", 3)),
}
NAMES = {"megatron": "Megatron (distributed optimizer)", "deepspeed": "DeepSpeed ZeRO-2",
         "hf": "Hugging Face safetensors"}
TARGET_FORMAT = {"hf": "megatron"}
"""The format a source is converted to, where not its own."""
STATES = {"hf": "bf16 weights"}
"""What a source holds, where not the weights, master copy and Adam state."""


def child(code: str) -> tuple[float, float, dict]:
    """Run ``code`` in a fresh interpreter; return (seconds, its peak RSS in GiB, its JSON output ``_out``
    with ``rss``, ``rss_children`` (KiB) and ``written``, the bytes it sent to storage)."""
    code += ("\nimport resource as _r\n"
             "_w = int(next(l.split()[1] for l in open('/proc/self/io') if l.startswith('write_bytes:')))\n"
             "print(json.dumps({**_out, 'rss': _r.getrusage(_r.RUSAGE_SELF).ru_maxrss, "
             "'rss_children': _r.getrusage(_r.RUSAGE_CHILDREN).ru_maxrss, 'written': _w}))")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return seconds, figures["rss"] / 2**20, figures


def generate(src: Path, sizes: dict, fmt: str) -> None:
    """The checkpoint of ``fmt`` at ``sizes`` (kept if there), read once into the page cache."""
    if not src.exists():
        _generate(src, sizes, fmt)
    warm(src)


def _generate(src: Path, sizes: dict, fmt: str) -> None:
    if fmt == "hf":  # rank_load.py's checkpoint: the same layer count per scale as its 20 layers at 1.0
        child(f"import sys, json; sys.path.insert(0, {str(ROOT / 'bench')!r}); from rank_load import generate\n"
              f"generate(__import__('pathlib').Path({str(src)!r}), {max(1, round(20 * sizes['layers'] / 12))}, "
              f"{sizes['h'] < 1024})\n_out = {{}}")
        return
    # In a child: a process forked from a large parent reports the parent's peak RSS as its own.
    t0 = time.perf_counter()
    child(f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); import fixtures\n"
          f"fixtures.MODELS['bench-llama'] = fixtures.Model('hf-llama', {sizes!r})\n"
          f"fixtures.make_fixture({str(src)!r}, format={fmt!r}, to={CASES[fmt][0]!r}, model='bench-llama')\n"
          "_out = {}")
    print(f"generated {src} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def convert(src: Path, dst: Path, workers: int, target: str, fmt: str | None = None) -> tuple[float, float, dict]:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    seconds, rss, figures = child(
        "import json, reshard\n"
        f"r = reshard.convert({str(src)!r}, {str(dst)!r}, to={target!r}, format={fmt!r}, workers={workers})\n"
        "_out = {'read': r.bytes_read, 'output': r.bytes_written}")
    if workers > 1:  # the main process plus each worker at the largest worker's peak: an upper bound
        rss += workers * figures["rss_children"] / 2**20
        figures["written"] = None  # the workers' writes are not the main process's
    return seconds, rss, figures


def disk_floor(path: Path, nbytes: int, threads: int) -> float:
    """Seconds to write ``nbytes`` (rounded up to whole 8 MiB blocks, as direct writes need) into a new file at
    ``path`` directly (``O_DIRECT``) from one page-aligned buffer of 8 MiB per thread, ``threads`` writing
    interleaved blocks, then fsync it; through the page cache where the file system refuses direct writes. The
    file is removed after."""
    import mmap
    import threading

    block = 8 << 20
    blocks = -(-nbytes // block)
    os.sync()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError:
        fd = os.open(path, flags, 0o644)
    buffers = [mmap.mmap(-1, block) for _ in range(threads)]
    for b in buffers:
        b.write(os.urandom(4096) * (block // 4096))

    def write(k: int) -> None:
        for i in range(k, blocks, threads):
            os.pwrite(fd, buffers[k], i * block)

    try:
        t0 = time.perf_counter()
        workers = [threading.Thread(target=write, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def sizes_for(scale: float, tiny: bool) -> dict:
    if tiny:  # a smoke test's checkpoint: a few MiB
        return {"h": 128, "heads": 4, "g": 2, "hd": 32, "f": 352, "vocab": 1000, "layers": 4, "vocab_div": 128}
    layers = max(4, round(12 * scale / 4) * 4)
    return {"h": 1024, "heads": 16, "g": 4, "hd": 64, "f": 2816, "vocab": 32000, "layers": layers, "vocab_div": 128}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", choices=sorted(CASES), default="megatron", help="the generated checkpoint's format")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the layer count (1.0: about 2.6 GiB)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every run; the table shows medians")
    ap.add_argument("--rss-scale", type=float, help="also convert a checkpoint this many times as large")
    ap.add_argument("--keep", type=Path, help="write under this directory and keep the files")
    ap.add_argument("--tiny", action="store_true", help="a checkpoint of a few MiB (a smoke test)")
    ap.add_argument("--workers", default="1,2,4,8", help="the worker counts to convert with (comma-separated)")
    args = ap.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    source_topo, target, (load_topo, load_rank) = CASES[args.source]
    base = args.keep or Path(tempfile.mkdtemp(prefix="reshard-bench-", dir=os.environ.get("TMPDIR")))
    src, dst, copy = base / "src", base / "dst", base / "copy"
    for p in (dst, copy):
        shutil.rmtree(p, ignore_errors=True)
    try:
        generate(src, sizes_for(args.scale, args.tiny), args.source)
        size = dir_size(src)
        cp_runs: list[tuple[float, int]] = []
        conv: dict[int, list[tuple[float, float, dict]]] = {w: [] for w in counts}
        loads: list[tuple[float, float, dict]] = []
        floors: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(args.repeat):
            shutil.rmtree(copy, ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
            os.sync()
            cp_runs.append((time.perf_counter() - t0, dir_size(copy)))
            for threads, runs in floors.items():
                runs.append(disk_floor(base / "floor.bin", size, threads))
            for workers in counts:
                conv[workers].append(convert(src, dst, workers, target, TARGET_FORMAT.get(args.source)))
            loads.append(child(
                "import json, reshard\n"
                f"m = reshard.load({str(src)!r}, to={load_topo!r}, rank={load_rank}, "
                f"format={TARGET_FORMAT.get(args.source)!r})\n"
                "_out = {'read': m.bytes_read, 'share': sum(t.numel() * t.element_size() for t in m.tensors.values())}"))
        cp_seconds = statistics.median(t for t, _ in cp_runs)
        floor = min(map(statistics.median, floors.values()))  # the faster of 1 and 2 threads
        out_size = dir_size(dst)
        print(describe())
        into = f"Megatron {target}" if args.source in TARGET_FORMAT else target
        print(f"checkpoint: {NAMES[args.source]} {source_topo} -> {into}, {size / 2**30:.2f} GiB "
              f"({STATES.get(args.source, 'bf16 weights, fp32 master copy, Adam')})\n")
        print("| run | wall s | vs cp -r | peak RSS GiB | read GiB | read / needed | written / output |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        print(f"| cp -r | {cp_seconds:.1f} | 1.00 | | {size / 2**30:.2f} | 1.00 | 1.00 |")
        for threads, runs in floors.items():
            seconds = statistics.median(runs)
            print(f"| disk: the same bytes written directly, {threads} thread{'s' if threads > 1 else ''} | "
                  f"{seconds:.1f} | {seconds / cp_seconds:.2f} | | | | |")
        for workers, rs in conv.items():
            seconds = statistics.median(r[0] for r in rs)
            rss = max(r[1] for r in rs)
            f = rs[-1][2]
            written = f"{f['written'] / out_size:.2f}" if f["written"] is not None else "(workers)"
            print(f"| reshard convert --workers {workers} | {seconds:.1f} | {seconds / cp_seconds:.2f} | {rss:.2f} "
                  f"| {f['read'] / 2**30:.2f} | {f['read'] / size:.2f} | {written} |")
        seconds = statistics.median(r[0] for r in loads)
        f = loads[-1][2]
        ranks = math.prod(int(d.split("=")[1]) for d in load_topo.split(","))
        print(f"| reshard.load rank {load_rank} of {ranks} ({load_topo}) | {seconds:.1f} | {seconds / cp_seconds:.2f} | "
              f"{max(r[1] for r in loads):.2f} | {f['read'] / 2**30:.2f} | {f['read'] / f['share']:.2f} | |")
        print(f"\nmedians of {args.repeat} rounds (cp -r: {', '.join(f'{t:.1f}' for t, _ in cp_runs)} s; "
              f"--workers {counts[0]}: {', '.join(f'{r[0]:.1f}' for r in conv[counts[0]])} s; disk, 1 and 2 threads: "
              f"{', '.join(f'{t:.2f}' for t in floors[1])} and {', '.join(f'{t:.2f}' for t in floors[2])} s, "
              f"{size / floor / 1e9:.2f} GB/s at best); peak RSS is the largest "
              "seen, with N workers the main process plus N x the largest worker's peak (an upper bound); "
              f"the load's needed bytes are its share, {f['share'] / 2**30:.2f} GiB")
        one = statistics.median(r[0] for r in conv[counts[0]])
        for workers in counts[1:]:
            print(f"--workers {workers} / --workers {counts[0]}: "
                  f"{statistics.median(r[0] for r in conv[workers]) / one:.2f}; the disk alone, writing the same bytes "
                  f"with nothing to read or check, takes {floor / one:.2f} of --workers {counts[0]}'s wall")
        if args.rss_scale:
            big = base / f"src-x{args.rss_scale:g}"
            generate(big, sizes_for(args.scale * args.rss_scale, args.tiny), args.source)
            seconds, rss, _ = convert(big, dst, counts[0], target, TARGET_FORMAT.get(args.source))
            print(f"\npeak RSS at a second size: {dir_size(big) / 2**30:.2f} GiB converted in {seconds:.1f} s at "
                  f"{rss:.2f} GiB peak (--workers {counts[0]}), against {max(r[1] for r in conv[counts[0]]):.2f} GiB at "
                  f"{size / 2**30:.2f} GiB")
            shutil.rmtree(big, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
