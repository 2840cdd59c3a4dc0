"""Plan a Llama-405B-shaped checkpoint from metadata alone and print the figures.

Source: Megatron-core tp=8, pp=16, dp=64 with the distributed optimizer (ZeRO-1,
fp32 main params and Adam exp_avg / exp_avg_sq); destination tp=8, pp=8, dp=128.
126 layers do not divide over 16 or 8 stages, so the first and last stages hold
one layer fewer, as Megatron's uneven pipeline layouts do.

    python bench/plan_405b.py [--validate]
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reshard.formats.specs import layout_spec  # noqa: E402
from reshard.core.resolve import resolve
from reshard.core.planner import plan  # noqa: E402
from reshard.core.topology import parse_topology  # noqa: E402

SIZES = {"h": 16384, "heads": 128, "g": 8, "hd": 128, "f": 53248, "vocab": 128256, "layers": 126,
         "vocab_div": 128, "bucket_size": 0}
SRC = "tp=8,pp=16,dp=64,zero=1,stages=7+" + "+".join(["8"] * 14) + "+7"
DST = "tp=8,pp=8,dp=128,zero=1,stages=15+" + "+".join(["16"] * 6) + "+15"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--validate", action="store_true", help="also time Plan.validate()")
    args = ap.parse_args()
    spec = layout_spec("megatron-llama-distopt")
    rows = []
    t0 = time.perf_counter()
    src = resolve(spec, parse_topology(SRC), SIZES)
    t1 = time.perf_counter()
    dst = resolve(spec, parse_topology(DST), SIZES)
    t2 = time.perf_counter()
    p = plan(src, dst)
    t3 = time.perf_counter()
    rows.append(("resolve source (tp8 pp16 dp64)", t1 - t0, f"{len(src.fragments):,} fragments, {len(src.items):,} items"))
    rows.append(("resolve destination (tp8 pp8 dp128)", t2 - t1, f"{len(dst.fragments):,} fragments, {len(dst.items):,} items"))
    rows.append(("plan", t3 - t2, f"{len(p.copies):,} copies"))
    if args.validate:
        report = p.validate()
        detail = f"{report['runs']:,} runs checked for overlap, {report['unchecked_items']} items over budget"
        rows.append(("validate", time.perf_counter() - t3, detail))
    total = t3 - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    elements = sum(c.numel for c in p.copies)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{SRC}  ->  {DST}")
    print(f"elements planned: {elements:,} ({elements * 4 / 2**40:.2f} TiB at 4 bytes)\n")
    print("| step | seconds | detail |")
    print("|---|---:|---|")
    for name, secs, detail in rows:
        print(f"| {name} | {secs:.2f} | {detail} |")
    print(f"| **total (resolve + plan)** | **{total:.2f}** | target < 2 s |")
    print(f"| peak RSS | {rss:.2f} GiB | target < 2 GiB |")


if __name__ == "__main__":
    main()
