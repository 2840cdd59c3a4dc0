"""Time resolving and planning one conversion from metadata alone and print the figures as a markdown table:
what ``plan_405b.py`` and ``plan_moe.py`` share; and how that time grows with the model (``curve``)."""

from __future__ import annotations

import gc
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reshard.core.planner import plan  # noqa: E402
from reshard.core.resolve import resolve  # noqa: E402
from reshard.core.topology import parse_topology  # noqa: E402
from reshard.formats.specs import layout_spec  # noqa: E402


def report(spec_name: str, src_text: str, dst_text: str, sizes: Mapping[str, int], *, labels: tuple[str, str],
           validate: bool, total_target: str, rss_target: str) -> None:
    """Resolve ``spec_name`` at both topologies, plan between them (and with ``validate`` check the plan), and
    print each step's seconds, the total against ``total_target`` and the peak RSS against ``rss_target``;
    ``labels`` name the source and destination in the table."""
    spec = layout_spec(spec_name)
    t0 = time.perf_counter()
    src = resolve(spec, parse_topology(src_text), sizes)
    t1 = time.perf_counter()
    dst = resolve(spec, parse_topology(dst_text), sizes)
    t2 = time.perf_counter()
    p = plan(src, dst)
    t3 = time.perf_counter()
    rows = [(f"resolve source ({labels[0]})", t1 - t0, f"{len(src.fragments):,} fragments, {len(src.items):,} items"),
            (f"resolve destination ({labels[1]})", t2 - t1,
             f"{len(dst.fragments):,} fragments, {len(dst.items):,} items"),
            ("plan", t3 - t2, f"{len(p.copies):,} copies")]
    if validate:
        checked = p.validate()
        detail = f"{checked['runs']:,} runs checked for overlap"
        if checked.get("unchecked_items"):
            detail += f", {checked['unchecked_items']} items over budget"
        rows.append(("validate", time.perf_counter() - t3, detail))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    elements = sum(c.numel for c in p.copies)
    print(describe())
    print(f"{src_text}  ->  {dst_text}")
    print(f"elements planned: {elements:,} ({elements * 4 / 2**40:.2f} TiB at 4 bytes)\n")
    print("| step | seconds | detail |")
    print("|---|---:|---|")
    for name, secs, detail in rows:
        print(f"| {name} | {secs:.2f} | {detail} |")
    print(f"| **total (resolve + plan)** | **{t3 - t0:.2f}** | target {total_target} |")
    print(f"| peak RSS | {rss:.2f} GiB | target {rss_target} |")


def curve(spec_name: str, src_text: str, dst_text: str, sizes: Sequence[Mapping[str, int]], *, vary: str,
          repeat: int = 2) -> None:
    """Resolve both topologies and plan at each of ``sizes`` (a model grown along ``vary``), best of ``repeat``
    runs, and print a markdown table of the seconds against the fragments and copies made: planning work grows
    linearly with them when the time per fragment stays flat."""
    spec = layout_spec(spec_name)
    print(f"\n{src_text}  ->  {dst_text}, by {vary}\n")
    print(f"| {vary} | fragments (src + dst) | copies | seconds (resolve + plan) | microseconds per fragment |")
    print("|---:|---:|---:|---:|---:|")
    for point in sizes:
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            src = resolve(spec, parse_topology(src_text), point)
            dst = resolve(spec, parse_topology(dst_text), point)
            p = plan(src, dst)
            best = min(best, time.perf_counter() - t0)
            fragments, copies = len(src.fragments) + len(dst.fragments), len(p.copies)
            del src, dst, p
            gc.collect()
        print(f"| {point[vary]} | {fragments:,} | {copies:,} | {best:.2f} | {best / fragments * 1e6:.2f} |")
