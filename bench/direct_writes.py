"""Writing a conversion's output directly to the disk (``O_DIRECT``) or through the page cache, side by side.

reshard writes each window of at least 1 MiB directly, its partial pages at either end through the page cache
(``reshard.io.storage``). This converts the generated Megatron checkpoint of ``convert_memory.py`` (tp=2,pp=2
with the distributed optimizer, about 2.6 GiB, ``--source megatron``; or its Hugging Face twin to Megatron
tp=2,pp=2, ``--source hf``) both ways, each run in a fresh interpreter, ``--repeat`` rounds interleaved, under
two conditions:

- **freed page cache**: just before the run, a scratch file as large as the output is written through the page
  cache and removed, so that the run finds that much memory the kernel has just used and freed;
- **as found**: nothing before the run but removing the last run's output (a direct run's output was never in
  the page cache, so the run after it finds no memory freed).

Prints per way and condition the median wall time, user and system CPU seconds of the process, each round's
wall time, and ``cp -r && sync`` of the same source under the same conditions.

    python bench/direct_writes.py [--source megatron|hf] [--repeat 3] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from convert_memory import CASES, TARGET_FORMAT, dir_size, generate, sizes_for  # noqa: E402

ROOT = HERE.parent
WAYS = {"direct (reshard's)": True, "page cache": False}


def free_page_cache(scratch: Path, nbytes: int) -> None:
    """Write ``nbytes`` to ``scratch`` through the page cache, sync, and remove it."""
    block = os.urandom(8 << 20)
    with open(scratch, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
    os.sync()
    scratch.unlink()


def run(cmd: list[str]) -> tuple[float, float, float]:
    """Wall, user and system seconds of ``cmd`` (its children included)."""
    before = os.times()
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = os.times()
    return wall, after.children_user - before.children_user, after.children_system - before.children_system


def convert(src: Path, dst: Path, target: str, fmt: str | None, direct: bool) -> tuple[float, float, float]:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    code = ("import reshard\n"
            f"reshard.convert({str(src)!r}, {str(dst)!r}, to={target!r}, format={fmt!r}, workers=1, "
            f"direct_io={direct})")
    return run([sys.executable, "-c", code])


def copy(src: Path, dst: Path) -> tuple[float, float, float]:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    return run(["bash", "-c", f"cp -r '{src}' '{dst}' && sync"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", choices=["megatron", "hf"], default="megatron", help="the generated checkpoint")
    ap.add_argument("--repeat", type=int, default=3, help="rounds, interleaved; the table shows medians")
    ap.add_argument("--tiny", action="store_true", help="a checkpoint of a few MiB, one round: a smoke test")
    args = ap.parse_args()
    if args.tiny:
        args.repeat = 1
    with tempfile.TemporaryDirectory(prefix="reshard-bench-", dir=os.environ.get("TMPDIR")) as tmp:
        tmp = Path(tmp)
        src = tmp / "src"
        generate(src, sizes_for(1.0, args.tiny), args.source)
        target, fmt = CASES[args.source][1], TARGET_FORMAT.get(args.source)
        size = dir_size(src)
        runs = [*((way, cond) for cond in ("freed", "found") for way in WAYS), ("cp -r && sync", "freed"),
                ("cp -r && sync", "found")]
        figures: dict[tuple[str, str], list[tuple[float, float, float]]] = {r: [] for r in runs}
        for _ in range(args.repeat):
            for way, cond in runs:
                out = tmp / "out"
                shutil.rmtree(out, ignore_errors=True)
                if cond == "freed":
                    free_page_cache(tmp / "scratch", size)
                figures[way, cond].append(copy(src, out) if way.startswith("cp") else
                                          convert(src, out, target, fmt, WAYS[way]))
        shutil.rmtree(tmp / "out", ignore_errors=True)
    conds = {"freed": "freed page cache", "found": "as found"}
    print(describe())
    print(f"checkpoint: {args.source} -> {target}, {size / 2**30:.2f} GiB; one worker; medians of {args.repeat} "
          "rounds, interleaved\n")
    print("| writes | condition | wall s | user s | system s | vs cp -r && sync | rounds (wall s) |")
    print("|---|---|---:|---:|---:|---:|---|")
    for way, cond in runs:
        rows = figures[way, cond]
        wall, user, system = (statistics.median(x[k] for x in rows) for k in range(3))
        floor = statistics.median(x[0] for x in figures["cp -r && sync", cond])
        print(f"| {way} | {conds[cond]} | {wall:.2f} | {user:.2f} | {system:.2f} | {wall / floor:.2f} | "
              f"{', '.join(f'{x[0]:.2f}' for x in rows)} |")


if __name__ == "__main__":
    main()
