"""DeepSpeed ZeRO-2 dp=2 -> dp=4: reshard convert against DeepSpeed's own ds_to_universal, in one run.

Generates a Llama-shaped DeepSpeed ZeRO-2 checkpoint (bf16 weights, fp32 master
copy, Adam exp_avg / exp_avg_sq; about 1.2 GiB at the default scale) as two dp
ranks would save it, then measures, each in its own process tree:

- ``reshard convert SRC DST --to dp=4``: a checkpoint DeepSpeed loads at dp=4;
- ``reshard convert SRC DST --format ucp``: the universal folder ds_to_universal writes;
- ``ds_to_universal --inject_missing_state``: the universal folder DeepSpeed
  loads at dp=4 with ``load_universal`` (its own route to a new dp).

and ``cp -r && sync`` of the source, the floor. For each, with the page cache dropped before it where it can be
(root; ``sync`` first): wall time and its ratio to the floor, peak RSS summed over the process tree (sampled
every 50 ms: ds_to_universal runs worker processes), and bytes read from and written to storage, counted by
the kernel for the process and every child it waited for (``wait4``'s rusage; temporary files included), next to
the source's and the final output's size.

    python bench/deepspeed_universal.py [--scale 1.0] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from machine import describe

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from rank_load import can_drop_caches, drop_caches  # noqa: E402  (root: the page cache can be dropped)


def _tree(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def _field(pid: int, name: str, key: str) -> int:
    try:
        with open(f"/proc/{pid}/{name}") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``cmd`` in its own session: wall seconds, peak summed RSS (bytes), bytes written by the tree."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss = 0
            for pid in _tree(proc.pid):
                rss += _field(pid, "status", "VmRSS:") * 1024
            peak[0] = max(peak[0], rss)
            time.sleep(0.05)

    t0 = time.perf_counter()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # storage bytes of the process and every child it reaped, once each
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{cmd[:4]} failed:\n{output.decode(errors='replace')[-3000:]}")
    return {"seconds": seconds, "rss": peak[0], "read": usage.ru_inblock * 512, "written": usage.ru_oublock * 512}


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the layer count (1.0: about 1.2 GiB)")
    ap.add_argument("--keep", type=Path, help="write under this directory and keep the files")
    args = ap.parse_args()
    try:
        subprocess.run([sys.executable, "-c", "import deepspeed"], check=True, capture_output=True,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"})
    except subprocess.CalledProcessError:
        sys.exit("deepspeed is not importable here; install it (DS_BUILD_OPS=0 pip install deepspeed)")
    layers = max(2, round(6 * args.scale))
    sizes = {"h": 1024, "heads": 16, "g": 4, "hd": 64, "f": 2816, "vocab": 32000, "layers": layers}
    base = args.keep or Path(tempfile.mkdtemp(prefix="reshard-ds-bench-", dir=os.environ.get("TMPDIR")))
    src, dst, ucp, ours_ucp = base / "src", base / "dst", base / "universal", base / "universal-reshard"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    try:
        if not src.exists():
            gen = (f"import fixtures\nfixtures.MODELS['bench-llama'] = fixtures.Model('hf-llama', {sizes!r})\n"
                   f"fixtures.make_fixture({str(src)!r}, format='deepspeed', to='dp=2,zero=2', model='bench-llama')\n")
            subprocess.run([sys.executable, "-c", gen], check=True, cwd=ROOT, env=env)
        source = size_of(src)
        cold = can_drop_caches()
        runs = []
        for name, out, cmd in (
            ("cp -r && sync", base / "copy", ["bash", "-c", f"cp -r {src} {base / 'copy'} && sync"]),
            ("reshard convert --to dp=4", dst,
             [sys.executable, "-m", "reshard.cli.main", "convert", str(src), str(dst), "--to", "dp=4"]),
            ("reshard convert --format ucp", ours_ucp,
             [sys.executable, "-m", "reshard.cli.main", "convert", str(src), str(ours_ucp), "--format", "ucp"]),
            ("ds_to_universal --inject_missing_state", ucp,
             [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
              str(src / (src / "latest").read_text().strip()), "--output_folder", str(ucp), "--inject_missing_state"]),
        ):
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            if cold:
                drop_caches()
            figures = measure(cmd, env)
            runs.append((name, figures, size_of(out)))
            if out == base / "copy":
                shutil.rmtree(out, ignore_errors=True)
        gib = 2**30
        floor = runs[0][1]["seconds"]
        print(describe())
        print(f"checkpoint: DeepSpeed ZeRO-2 dp=2, {source / gib:.2f} GiB (bf16 weights, fp32 master, Adam); "
              f"{'page cache dropped before each run' if cold else 'warm page cache (not root)'}\n")
        print("| run | wall s | x floor | peak RSS GiB | read GiB | read / needed | written GiB | output GiB "
              "| written / output |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, f, out_size in runs:
            print(f"| {name} | {f['seconds']:.1f} | {f['seconds'] / floor:.2f} | {f['rss'] / gib:.2f} "
                  f"| {f['read'] / gib:.2f} | {f['read'] / source:.2f} | {f['written'] / gib:.2f} "
                  f"| {out_size / gib:.2f} | {f['written'] / max(out_size, 1):.2f} |")
        runs = runs[1:]
        theirs = runs[-1][1]
        for name, ours, _ in runs[:-1]:
            print(f"\n{name}: {theirs['seconds'] / ours['seconds']:.1f}x faster than ds_to_universal, "
                  f"{theirs['rss'] / max(ours['rss'], 1):.1f}x less peak memory, "
                  f"{theirs['written'] / max(ours['written'], 1):.1f}x fewer bytes written")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
