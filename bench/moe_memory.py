"""A DeepSeek-V3-shaped mixture of experts, Hugging Face -> Megatron (ep, pp) -> back, under a memory budget:
peak RSS against the budget, wall time, bytes.

Generates a Hugging Face checkpoint (bf16, one ``model.safetensors``) shaped like DeepSeek-V3 (the
``deepseek_v3`` family): multi-latent attention with q and kv compression, the first layers dense, then
256 routed experts per layer (top-8, in 8 groups) plus a shared expert and a router with its score
correction bias; small widths, so that about 25,000 tensors (about 0.8 GiB, more than the default 512 MiB
budget) go through the planner and the writers in under a minute on 2 cores. Then, each in a fresh
interpreter with ``--memory-budget``:

- ``reshard convert`` to Megatron at tp=1,pp=4,dp=8,ep=8 (32 ranks; experts split 32 per ep rank), or at
  ``--to``;
- ``reshard convert`` of that back to Hugging Face.

Prints a markdown table (wall time, peak RSS of the converting process, bytes read and written, the
budget) and fails unless every peak stays under the budget and the weights that come back are
byte-identical to the generated ones.

    python bench/moe_memory.py [--layers 32] [--experts 256] [--mtp 0] [--to TOPOLOGY] [--budget 512MiB]
                               [--keep DIR] [--tiny]

DeepSeek-V3's full tensor count and layout (61 layers, the first 3 dense, one MTP layer, at its training
layout pp=16, ep=64; 1,024 rank files)::

    python bench/moe_memory.py --layers 61 --mtp 1 --budget 1GiB \
        --to tp=1,pp=16,dp=64,ep=64,stages=4+4+4+4+4+4+4+4+4+4+4+4+4+3+3+3
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_memory import child, dir_size  # noqa: E402  (the same fresh-interpreter measurement)
from rank_load import warm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET = "tp=1,pp=4,dp=8,ep=8"
TOPK = 8


def sizes_for(layers: int, experts: int, tiny: bool, mtp: int = 0) -> dict:
    """DeepSeek-V3's shape at small widths (fe: each routed expert's width; the first 3 layers dense; ``mtp``
    multi-token-prediction layers after the decoder's, as DeepSeek-V3's release holds one)."""
    common = {"ql": 48, "kvl": 32, "nope": 16, "rope": 8, "vd": 16, "shared": 1, "vocab_div": 128,
              "experts": experts}
    if tiny:
        return {**common, "h": 64, "heads": 4, "f": 96, "fe": 16, "dense": 1, "vocab": 1000, "layers": 4,
                "hf_layers": 4}
    # hf_layers: the layers the files hold, multi-token-prediction ones included
    return {**common, "h": 256, "heads": 8, "f": 512, "fe": 64, "dense": 3, "vocab": 8000, "layers": layers,
            "hf_layers": layers + mtp}


def generate(src: Path, sizes: dict) -> float:
    """Write the Hugging Face checkpoint in a child process; its seconds."""
    hints = {"num_experts_per_tok": TOPK, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
             "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    t0 = time.perf_counter()
    child(f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); import fixtures\n"
          f"fixtures.MODELS['bench-moe'] = fixtures.Model('hf-deepseek_v3', {sizes!r}, {hints!r})\n"
          f"fixtures.make_fixture({str(src)!r}, format='hf', model='bench-moe', states=('param',))\n"
          "_out = {}")
    warm(src)
    return time.perf_counter() - t0


def convert(src: Path, dst: Path, fmt: str, to: str | None, budget: str) -> tuple[float, float, dict]:
    """One conversion in a fresh interpreter: (seconds, peak RSS in GiB, figures with read/output bytes)."""
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()
    return child("import json, reshard\n"
                 f"r = reshard.convert({str(src)!r}, {str(dst)!r}, format={fmt!r}, to={to!r}, "
                 f"memory_budget={budget!r})\n"
                 "_out = {'read': r.bytes_read, 'output': r.bytes_written, 'files': len(r.files)}")


def same_weights(a: Path, b: Path) -> list[str]:
    """The safetensors files of ``a`` that ``b`` lacks or holds different bytes of (empty: identical)."""
    names = sorted(p.name for p in a.glob("*.safetensors"))
    return [n for n in names if not (b / n).is_file() or not filecmp.cmp(a / n, b / n, shallow=False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (a multiple of pp=4, or give stages=)")
    ap.add_argument("--experts", type=int, default=256, help="routed experts per layer (a multiple of ep=8)")
    ap.add_argument("--mtp", type=int, default=0, help="multi-token-prediction layers (DeepSeek-V3: 1)")
    ap.add_argument("--to", default=TARGET, help=f"the Megatron topology (default {TARGET})")
    ap.add_argument("--budget", default="512MiB", help="--memory-budget of each conversion")
    ap.add_argument("--keep", type=Path, help="write under this directory and keep the files")
    ap.add_argument("--tiny", action="store_true", help="4 narrow layers (a smoke test)")
    args = ap.parse_args()
    import reshard
    from reshard.core.units import parse_size
    budget = parse_size(args.budget, "budget")
    sizes = sizes_for(args.layers, args.experts, args.tiny, args.mtp)
    base = args.keep or Path(tempfile.mkdtemp(prefix="reshard-bench-", dir=os.environ.get("TMPDIR")))
    src, meg, back = base / "hf", base / "megatron", base / "back"
    try:
        if not src.exists():
            print(f"generated {src} in {generate(src, sizes):.1f} s", file=sys.stderr)
        size = dir_size(src)
        runs = [("HF -> Megatron " + args.to, *convert(src, meg, "megatron", args.to, args.budget)),
                ("Megatron -> HF", *convert(meg, back, "hf", None, args.budget))]
        tensors = len(reshard.open_checkpoint(src).layout.tensors)
        print(describe())
        mtp = sizes["hf_layers"] - sizes["layers"]
        print(f"checkpoint: DeepSeek-V3 shape, {sizes['layers']} layers ({sizes['dense']} dense{f', + {mtp} MTP' if mtp else ''}) x "
              f"{sizes['experts']} routed experts (top-{TOPK}) + {sizes['shared']} shared, MLA, "
              f"{tensors:,} tensors, {size / 2**20:.0f} MiB bf16; memory budget {budget / 2**20:.0f} MiB\n")
        print("| conversion | wall s | peak RSS MiB | budget MiB | peak / budget | read MiB | written MiB | files |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for title, seconds, rss, f in runs:
            print(f"| {title} | {seconds:.1f} | {rss * 1024:.0f} | {budget / 2**20:.0f} | {rss * 2**30 / budget:.2f} "
                  f"| {f['read'] / 2**20:.0f} | {f['output'] / 2**20:.0f} | {f['files']} |")
        over = [title for title, _, rss, _ in runs if rss * 2**30 > budget]
        differ = same_weights(src, back)
        print(f"\npeak RSS: the converting process's (getrusage ru_maxrss); the round trip's weights are "
              f"{'byte-identical' if not differ else 'DIFFERENT'} to the generated ones")
        if over or differ:
            sys.exit(f"over the budget: {over}; weights differ: {differ}")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
