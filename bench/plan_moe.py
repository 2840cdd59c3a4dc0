"""Plan a DeepSeek-V3-shaped mixture of experts from metadata alone and print the figures.

DeepSeek-V3's widths (hidden 7168, 128 heads of multi-latent attention, 256 routed experts of width 2048 and a
shared one per layer, the first 3 layers dense) at 64 layers, without the multi-token-prediction layer.
Source: Megatron-core ``tp=1,pp=16,dp=64,ep=64`` with the distributed optimizer (fp32 main params and Adam
exp_avg / exp_avg_sq; the experts' buffers per expert data-parallel rank); destination ``tp=1,pp=8,dp=32,ep=32``.

    python bench/plan_moe.py [--validate] [--curve]

``--curve`` also plans the same model at 16, 32 and 48 layers: the time per fragment made stays flat.
"""

from __future__ import annotations

import argparse

from planbench import curve, report

SIZES = {"h": 7168, "heads": 128, "ql": 1536, "kvl": 512, "nope": 128, "rope": 64, "vd": 128, "f": 18432,
         "fe": 2048, "experts": 256, "shared": 1, "dense": 3, "vocab": 129280, "layers": 64, "hf_layers": 64,
         "vocab_div": 128, "bucket_size": 0}
SRC = "tp=1,pp=16,dp=64,ep=64"
DST = "tp=1,pp=8,dp=32,ep=32"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--validate", action="store_true", help="also time Plan.validate()")
    ap.add_argument("--curve", action="store_true", help="also time resolving and planning at 16 to 64 layers")
    args = ap.parse_args()
    report("megatron-deepseek_v3-ep-distopt", SRC, DST, SIZES, labels=("pp16 ep64 dp64", "pp8 ep32 dp32"),
           validate=args.validate, total_target="< 5 s", rss_target="< 1 GiB")
    if args.curve:
        curve("megatron-deepseek_v3-ep-distopt", SRC, DST,
              [{**SIZES, "layers": n, "hf_layers": n} for n in (16, 32, 48, 64)], vary="layers")


if __name__ == "__main__":
    main()
