"""A conversion across torchrun ranks: ``torchrun --nproc-per-node N -m reshard convert`` at 1, 2 and 4 ranks.

Converts the generated Llama-shaped Megatron checkpoint of ``convert_memory.py`` (distributed
optimizer, ``tp=2,pp=2`` -> ``tp=1,pp=4``: 8 destination files) on this host, with:

- ``cp -r`` of the source on the same disk, for scale;
- ``reshard convert --workers 1`` in one process, no torchrun;
- ``torchrun --standalone --nproc-per-node N -m reshard convert … --workers 1`` for N = 1, 2, 4 (one
  rank is a plain one-process conversion: torchrun starts no process group for it).

Figures: the command's wall time (torchrun's start and each rank's imports included), the
conversion's own time as rank 0 reports it (joining the process group, planning, writing, the
manifest), both as medians of ``--repeat`` rounds, and the ratio of each to one rank. Each round
runs every measurement back to back. The outputs are checked byte-identical to the one-process
conversion's (the manifest's creation time aside).

    python bench/torchrun.py [--scale 1.0] [--repeat 3] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from convert_memory import CASES, dir_size, generate, sizes_for

from reshard.io.checksum import file_digest

from machine import describe

RANKS = (1, 2, 4)


def run(cmd: list[str]) -> tuple[float, float]:
    """Run a conversion command; (its wall seconds, the conversion's own seconds from its report)."""
    os.sync()
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    found = re.findall(r"^wrote .* in ([0-9.]+) s, ", out.stdout, re.M)
    if len(found) != 1:
        sys.exit(f"{' '.join(cmd)}: expected one report (rank 0's), got:\n{out.stdout[-2000:]}")
    return wall, float(found[0])


def contents(path: Path) -> dict:
    """Every file's checksum; the manifest as JSON without its creation time."""
    out: dict = {str(p.relative_to(path)): file_digest(p) for p in sorted(path.rglob("*")) if p.is_file()}
    manifest = json.loads((path / "reshard.json").read_text())
    manifest.pop("created")
    return {**out, "reshard.json": manifest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the layer count (1.0: about 2.6 GiB)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every run; the table shows medians")
    ap.add_argument("--tiny", action="store_true", help="a checkpoint of a few MiB, one round, 1 and 2 ranks (a smoke test)")
    args = ap.parse_args()
    repeat = 1 if args.tiny else args.repeat
    counts = RANKS[:2] if args.tiny else RANKS  # the smoke test: 1 and 2 ranks
    source_topo, target, _ = CASES["megatron"]
    base = Path(tempfile.mkdtemp(prefix="reshard-bench-torchrun-", dir=os.environ.get("TMPDIR")))
    src, copy, one = base / "src", base / "copy", base / "one"
    try:
        generate(src, sizes_for(args.scale, args.tiny), "megatron")
        size = dir_size(src)
        convert = [sys.executable, "-m", "reshard", "convert", str(src)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        run([*convert, str(one), "--to", target, "--workers", "1"])
        reference, written = contents(one), sum(1 for p in one.rglob("*") if p.is_file())
        shutil.rmtree(one)
        runs: dict[str, list[str]] = {"alone": [*convert, str(base / "dst"), "--to", target, "--workers", "1"]}
        for n in counts:
            runs[f"ranks{n}"] = [*torchrun, "--nproc-per-node", str(n), *runs["alone"][1:]]
        cp_runs: list[float] = []
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        same = True
        for k in range(repeat):
            order = ["cp", *runs]
            for name in order[k % len(order):] + order[:k % len(order)]:  # each round starts one later
                os.sync()
                if name == "cp":
                    t0 = time.perf_counter()
                    subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
                    os.sync()
                    cp_runs.append(time.perf_counter() - t0)
                    shutil.rmtree(copy)
                    continue
                times[name].append(run(runs[name]))
                same = same and contents(base / "dst") == reference
                shutil.rmtree(base / "dst")
        alone = times["alone"]
        ranks = {n: times[f"ranks{n}"] for n in counts}
        cp_s = statistics.median(cp_runs)
        print(describe())
        print(f"checkpoint: Megatron (distributed optimizer) {source_topo} -> {target}, {size / 2**30:.2f} GiB, "
              f"{written} files written\n")
        print("| run | wall s | vs 1 rank | convert s | vs 1 rank |")
        print("|---|---:|---:|---:|---:|")
        print(f"| cp -r | {cp_s:.1f} | | | |")
        wall1 = statistics.median(w for w, _ in ranks[1])
        conv1 = statistics.median(c for _, c in ranks[1])
        wall, conv = statistics.median(w for w, _ in alone), statistics.median(c for _, c in alone)
        print(f"| reshard convert --workers 1 (no torchrun) | {wall:.1f} | {wall / wall1:.2f} | {conv:.1f} | "
              f"{conv / conv1:.2f} |")
        for n in counts:
            wall, conv = statistics.median(w for w, _ in ranks[n]), statistics.median(c for _, c in ranks[n])
            print(f"| torchrun, {n} rank{'s' if n > 1 else ''} | {wall:.1f} | {wall / wall1:.2f} | {conv:.1f} | "
                  f"{conv / conv1:.2f} |")
        print(f"\nmedians of {repeat} round{'s' if repeat > 1 else ''}, each starting one run later than the last; wall: "
              "the whole command (torchrun's start and the ranks' imports included), convert: the conversion as "
              f"rank 0 reports it; every output byte-identical to the one-process conversion's: {same}")
        print("convert s per round: " + "; ".join(f"{name}: {', '.join(f'{c:.1f}' for _, c in rs)}"
                                                  for name, rs in times.items()))
        if not same:
            sys.exit("outputs differ")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
