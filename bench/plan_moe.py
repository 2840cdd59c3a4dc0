"""Plan a DeepSeek-V3-shaped mixture of experts from metadata alone and print the figures.

DeepSeek-V3's widths (hidden 7168, 128 heads of multi-latent attention, 256 routed experts of width 2048 and a
shared one per layer, the first 3 layers dense) at 64 layers, without the multi-token-prediction layer.
Source: Megatron-core ``tp=1,pp=16,dp=64,ep=64`` with the distributed optimizer (fp32 main params and Adam
exp_avg / exp_avg_sq; the experts' buffers per expert data-parallel rank); destination ``tp=1,pp=8,dp=32,ep=32``.

    python bench/plan_moe.py [--validate]
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reshard.core.planner import plan  # noqa: E402
from reshard.core.resolve import resolve  # noqa: E402
from reshard.core.topology import parse_topology  # noqa: E402
from reshard.formats.specs import layout_spec  # noqa: E402

SIZES = {"h": 7168, "heads": 128, "ql": 1536, "kvl": 512, "nope": 128, "rope": 64, "vd": 128, "f": 18432,
         "fe": 2048, "experts": 256, "shared": 1, "dense": 3, "vocab": 129280, "layers": 64, "hf_layers": 64,
         "vocab_div": 128, "bucket_size": 0}
SRC = "tp=1,pp=16,dp=64,ep=64"
DST = "tp=1,pp=8,dp=32,ep=32"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--validate", action="store_true", help="also time Plan.validate()")
    args = ap.parse_args()
    spec = layout_spec("megatron-deepseek_v3-ep-distopt")
    t0 = time.perf_counter()
    src = resolve(spec, parse_topology(SRC), SIZES)
    t1 = time.perf_counter()
    dst = resolve(spec, parse_topology(DST), SIZES)
    t2 = time.perf_counter()
    p = plan(src, dst)
    t3 = time.perf_counter()
    rows = [("resolve source (pp16 ep64 dp64)", t1 - t0, f"{len(src.fragments):,} fragments, {len(src.items):,} items"),
            ("resolve destination (pp8 ep32 dp32)", t2 - t1, f"{len(dst.fragments):,} fragments, {len(dst.items):,} items"),
            ("plan", t3 - t2, f"{len(p.copies):,} copies")]
    if args.validate:
        report = p.validate()
        rows.append(("validate", time.perf_counter() - t3, f"{report['runs']:,} runs checked for overlap"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    elements = sum(c.numel for c in p.copies)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{SRC}  ->  {DST}")
    print(f"elements planned: {elements:,} ({elements * 4 / 2**40:.2f} TiB at 4 bytes)\n")
    print("| step | seconds | detail |")
    print("|---|---:|---|")
    for name, secs, detail in rows:
        print(f"| {name} | {secs:.2f} | {detail} |")
    print(f"| **total (resolve + plan)** | **{t3 - t0:.2f}** | target < 5 s |")
    print(f"| peak RSS | {rss:.2f} GiB | target < 1 GiB |")


if __name__ == "__main__":
    main()
