"""Convert a generated multi-GiB checkpoint and print wall time, peak RSS and bytes read.

Generates a Llama-shaped Megatron checkpoint (bf16 weights, fp32 master copy,
Adam exp_avg / exp_avg_sq; about 2.8 GiB at the default size) at tp=2,pp=2,
then converts it to tp=1,pp=4 with ``reshard convert`` in a child process
and reports that process's figures next to ``cp -r`` of the same source.

    python bench/convert_memory.py [--scale 1.0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent



def child(code: str) -> tuple[float, float, dict]:
    """Run ``code`` in a fresh interpreter; return (seconds, its peak RSS in GiB, its JSON output)."""
    code += ("\nimport resource as _r; print(json.dumps({**_out, 'rss': _r.getrusage(_r.RUSAGE_SELF).ru_maxrss, "
             "'rss_children': _r.getrusage(_r.RUSAGE_CHILDREN).ru_maxrss}))")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return seconds, figures["rss"] / 2**20, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the layer count (1.0: about 2.8 GiB)")
    ap.add_argument("--keep", type=Path, help="write under this directory and keep the files")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every run; the table shows medians")
    args = ap.parse_args()
    layers = max(4, round(12 * args.scale / 4) * 4)
    sizes = {"h": 1024, "heads": 16, "g": 4, "hd": 64, "f": 2816, "vocab": 32000, "layers": layers, "vocab_div": 128}
    base = args.keep or Path(tempfile.mkdtemp(prefix="reshard-bench-", dir=os.environ.get("TMPDIR")))
    src, dst, copy = base / "src", base / "dst", base / "copy"
    for p in (dst, copy):
        shutil.rmtree(p, ignore_errors=True)
    try:
        if not src.exists():
            # In a child: a process forked from a large parent reports the parent's peak RSS as its own.
            t0 = time.perf_counter()
            gen = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); import fixtures\n"
                   f"fixtures.MODELS['bench-llama'] = fixtures.Model('hf-llama', {sizes!r})\n"
                   f"fixtures.make_fixture({str(src)!r}, format='megatron', to='tp=2,pp=2', model='bench-llama')\n"
                   "_out = {}")
            child(gen)
            print(f"generated {src} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        # The disk's speed drifts from minute to minute on a shared machine: every round runs
        # cp -r and both conversions back to back, and the table shows each run's median.
        cp_times: list[float] = []
        conv: dict[int, list[tuple[float, float, dict]]] = {1: [], 2: []}
        for _ in range(args.repeat):
            shutil.rmtree(copy, ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
            os.sync()
            cp_times.append(time.perf_counter() - t0)
            for workers in (1, 2):
                shutil.rmtree(dst, ignore_errors=True)
                os.sync()
                code = (
                    "import json, reshard\n"
                    f"r = reshard.convert({str(src)!r}, {str(dst)!r}, to='tp=1,pp=4', workers={workers})\n"
                    "_out = {'read': r.bytes_read, 'written': r.bytes_written}"
                )
                seconds, rss, figures = child(code)
                if workers > 1:  # the main process plus each worker at the largest worker's peak: an upper bound
                    rss += workers * figures["rss_children"] / 2**20
                conv[workers].append((seconds, rss, figures))
        cp_seconds = statistics.median(cp_times)
        runs = [(w, statistics.median(r[0] for r in rs), max(r[1] for r in rs), rs[0][2]) for w, rs in conv.items()]
        out_size = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
        print(f"checkpoint: Megatron tp=2,pp=2 -> tp=1,pp=4, {size / 2**30:.2f} GiB (bf16 weights, fp32 master, Adam)\n")
        print("| run | wall s | vs cp -r | peak RSS GiB | read GiB | read / source | written GiB |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        print(f"| cp -r | {cp_seconds:.1f} | 1.00 | | {size / 2**30:.2f} | 1.00 | {size / 2**30:.2f} |")
        for workers, seconds, rss, figures in runs:
            print(f"| reshard convert --workers {workers} | {seconds:.1f} | {seconds / cp_seconds:.2f} | {rss:.2f} "
                  f"| {figures['read'] / 2**30:.2f} | {figures['read'] / size:.2f} | {out_size / 2**30:.2f} |")
        print(f"\nmedians of {args.repeat} rounds (cp -r: {', '.join(f'{t:.1f}' for t in cp_times)} s; --workers 1: "
              f"{', '.join(f'{r[0]:.1f}' for r in conv[1])} s); peak RSS is the largest seen, with --workers 2 the "
              "main process plus 2 x the largest worker's peak (an upper bound)")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
