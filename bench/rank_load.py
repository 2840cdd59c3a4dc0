"""One rank's load against reading the whole checkpoint, in one process, warm cache or (``--cold``) caches dropped.

Generates a Hugging Face Llama-shaped checkpoint (bf16, hidden 2048, ffn 5632,
GQA 16/4 heads, vocab 32000; about 1.92 GiB at 20 layers, in five safetensors
shards: the 2 GiB checkpoint a rank's load is judged on), reads it once to warm
the page cache, then measures in this one process, interleaved, ``--repeat``
rounds each:

- every shard read whole (``readinto`` one reused buffer);
- ``safetensors.torch.load_file`` of every shard plus a ``clone()`` of every tensor;
- ``reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron")`` on 1 and 2 threads (the default), and on 4 and 8
  where this process may use that many cores;
- new memory of the rank's share alone (``numpy.empty``, as the load allocates, and a write per page): what the
  load's returned tensors cost before a byte is read, and the whole-file reads into one reused buffer do not;
- where CUDA is present, also onto the GPU: ``load_file(device="cuda")`` of every shard, and the rank's share by
  ``reshard.load(..., device="cuda")`` and by a host load followed by ``.to("cuda")``.

Prints a markdown table: median wall time, its ratio to the faster way of
reading everything, bytes read over the rank's share, read calls. With ``--cold``
the page cache is dropped before every measurement (``sync`` and
``/proc/sys/vm/drop_caches``, which needs root; the bench fails without it).

    python bench/rank_load.py [--layers 20] [--repeat 5] [--keep DIR] [--tiny] [--cold]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from machine import describe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def generate(src: Path, layers: int, tiny: bool, shard: str = "400MiB") -> None:
    """A Hugging Face Llama-shaped checkpoint at ``src`` in safetensors shards of ``shard`` (kept if there)."""
    import fixtures
    import reshard

    if src.exists():
        return
    sizes = ({"h": 128, "heads": 4, "g": 2, "hd": 32, "f": 352, "vocab": 1000, "layers": 4, "vocab_div": 128} if tiny else
             {"h": 2048, "heads": 16, "g": 4, "hd": 128, "f": 5632, "vocab": 32000, "layers": layers, "vocab_div": 128})
    fixtures.MODELS["bench-llama"] = fixtures.Model("hf-llama", sizes)
    one = src.with_name(src.name + "-one")
    fixtures.make_fixture(one, format="hf", to="tp=1", model="bench-llama", states=("param",))
    reshard.convert(one, src, format="hf", max_shard_size="200KiB" if tiny else shard)
    shutil.rmtree(one)
    warm(src)


def can_drop_caches() -> bool:
    """Whether this process may drop the page cache (root)."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def warm(path: Path) -> None:
    """Read every file under ``path`` once, into the page cache. A checkpoint reshard writes goes to the disk
    directly (``O_DIRECT``) and is not in the page cache after: a bench that means to start warm reads it first."""
    chunk = bytearray(8 << 20)
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(chunk):
                pass


def drop_caches() -> None:
    """Write dirty pages back and drop the page cache, so the next reads come from the disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def cuda_runs(torch, load_file, src: Path, files: list[Path]) -> dict:
    """Where CUDA is present: everything read onto the GPU by safetensors, and rank 3's share onto the GPU by
    ``reshard.load(device="cuda")`` (staging buffers, copies overlapped) and by a host load then ``.to("cuda")``."""
    import reshard

    def safetensors_gpu() -> dict:
        for f in files:
            _ = load_file(f, device="cuda")
        torch.cuda.synchronize()
        return {}

    def to_gpu(staged: bool):
        def run() -> dict:
            m = reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", device="cuda" if staged else None)
            tensors = m.tensors.values() if staged else [t.to("cuda") for t in m.tensors.values()]
            torch.cuda.synchronize()
            return {"read": m.bytes_read, "reads": m.reads, "share": sum(t.numel() * t.element_size() for t in tensors)}
        return run

    return {"safetensors load_file(device='cuda'), every file": safetensors_gpu,
            "reshard.load rank 3 onto the GPU (device='cuda'), 2 threads": to_gpu(True),
            "reshard.load rank 3 on the host, then .to('cuda')": to_gpu(False)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20, help="decoder layers (20: about 1.92 GiB)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the table shows medians")
    ap.add_argument("--keep", type=Path, help="write the checkpoint under this directory and keep it")
    ap.add_argument("--tiny", action="store_true", help="a checkpoint of a few MiB (a smoke test)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every measurement (root)")
    args = ap.parse_args()
    import torch
    from safetensors.torch import load_file

    import reshard
    from reshard.api.sinks import usable_cores

    base = args.keep or Path(tempfile.mkdtemp(prefix="reshard-bench-", dir=os.environ.get("TMPDIR")))
    src = base / "hf"
    try:
        generate(src, args.layers, args.tiny)
        files = sorted(src.glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        buf = bytearray(max(f.stat().st_size for f in files))

        def whole() -> dict:
            view = memoryview(buf)
            for f in files:
                with f.open("rb", buffering=0) as fh:
                    fh.readinto(view[:f.stat().st_size])
            return {}

        def safetensors_clone() -> dict:
            for f in files:
                _ = {k: v.clone() for k, v in load_file(f).items()}
            return {}

        def load(threads: int):
            def run() -> dict:
                m = reshard.load(src, to="tp=2,pp=2", rank=3, format="megatron", threads=threads)
                share = sum(t.numel() * t.element_size() for t in m.tensors.values())
                return {"read": m.bytes_read, "reads": m.reads, "share": share}
            return run

        share_bytes = load(1)()["share"]

        def fresh() -> dict:  # what the load cannot avoid besides reading: new memory for the tensors it returns
            out = np.empty(share_bytes, dtype=np.uint8)  # as the load allocates: numpy's, with huge pages
            out[::4096] = 0
            return {"fresh": True}

        runs = {"read every file whole (readinto one buffer)": whole,
                "safetensors load_file + clone, every file": safetensors_clone,
                "reshard.load rank 3 of tp=2,pp=2, 1 thread": load(1),
                "reshard.load rank 3 of tp=2,pp=2, 2 threads": load(2),
                **{f"reshard.load rank 3 of tp=2,pp=2, {n} threads": load(n) for n in (4, 8) if usable_cores() >= n},
                "new memory for the share alone (no read: numpy empty, a write per page)": fresh}
        if torch.cuda.is_available():
            runs.update(cuda_runs(torch, load_file, src, files))
        for run in runs.values():  # warm the page cache and the imports
            run()
        times: dict[str, list[float]] = {name: [] for name in runs}
        figures: dict[str, dict] = {}
        for _ in range(args.repeat):
            for name, run in runs.items():
                if args.cold:
                    drop_caches()
                t0 = time.perf_counter()
                figures[name] = run()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        floor = min(med["read every file whole (readinto one buffer)"], med["safetensors load_file + clone, every file"])
        print(describe())
        print(f"checkpoint: Hugging Face Llama-shaped, {len(files)} safetensors shards, {total / 2**20:.0f} MiB; "
              f"{'caches dropped before each run' if args.cold else 'warm cache'}\n")
        print("| run | wall s | vs reading everything | read MiB | read / share | read calls |")
        print("|---|---:|---:|---:|---:|---:|")
        for name in runs:
            f = figures[name]
            read = " | | " if "fresh" in f else f"{f['read'] / 2**20:.0f} | {f['read'] / f['share']:.2f} | {f['reads']}" \
                if f else f"{total / 2**20:.0f} | | {len(files)}"
            print(f"| {name} | {med[name]:.3f} | {med[name] / floor:.2f} | {read} |")
        print(f"\nmedians of {args.repeat} rounds, interleaved; the rank's share is {share_bytes / 2**20:.0f} MiB "
              f"({share_bytes / total:.2f} of the checkpoint: the floor of the ratio); 'vs reading everything' is "
              f"against the faster of the first two rows; the last row is the share's new memory alone, which the "
              f"load's tensors need and the whole-file reads, into one reused buffer, do not")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
