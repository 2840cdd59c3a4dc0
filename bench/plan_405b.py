"""Plan a Llama-405B-shaped checkpoint from metadata alone and print the figures.

Source: Megatron-core tp=8, pp=16, dp=64 with the distributed optimizer (ZeRO-1,
fp32 main params and Adam exp_avg / exp_avg_sq); destination tp=8, pp=8, dp=128.
126 layers do not divide over 16 or 8 stages, so the first and last stages hold
one layer fewer, as Megatron's uneven pipeline layouts do.

    python bench/plan_405b.py [--validate]
"""

from __future__ import annotations

import argparse

from planbench import report

SIZES = {"h": 16384, "heads": 128, "g": 8, "hd": 128, "f": 53248, "vocab": 128256, "layers": 126,
         "vocab_div": 128, "bucket_size": 0}
SRC = "tp=8,pp=16,dp=64,zero=1,stages=7+" + "+".join(["8"] * 14) + "+7"
DST = "tp=8,pp=8,dp=128,zero=1,stages=15+" + "+".join(["16"] * 6) + "+15"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--validate", action="store_true", help="also time Plan.validate()")
    args = ap.parse_args()
    report("megatron-llama-distopt", SRC, DST, SIZES, labels=("tp8 pp16 dp64", "tp8 pp8 dp128"),
           validate=args.validate, total_target="< 2 s", rss_target="< 2 GiB")


if __name__ == "__main__":
    main()
