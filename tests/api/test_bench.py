"""The benchmark runs end to end (bench/run.py --tiny), and its figures hold the bounds the README states."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_benchmark_runs_and_reads_each_needed_byte_once():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--tiny"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    sections = {part.split("\n", 1)[0]: part for part in out.stdout.split("## ")[1:]}
    for title, load_row in (("Megatron conversion", "reshard.load rank 3 of 8 (tp=2,pp=2,dp=2)"),
                            ("DeepSpeed conversion", "reshard.load rank 3 of 8 (dp=8)")):
        rows = {m.group(1).strip(): [c.strip() for c in m.group(2).split("|")]
                for m in re.finditer(r"^\| ([^|]+) \|(.*)\|$", sections[title], re.M)}
        for run in ("reshard convert --workers 1", "reshard convert --workers 2"):
            wall, ratio, rss, read, read_ratio, written = rows[run]
            assert float(read_ratio) <= 1.05 and float(rss) < 1.0, (title, run)  # each byte once, within 1 GiB
        assert float(rows["reshard convert --workers 1"][5]) <= 1.1, title  # the output written once
        assert float(rows[load_row][4]) <= 1.1, title  # a rank reads its share
        assert all(float(rows[f"disk: the same bytes written directly, {n}"][1]) > 0 for n in ("1 thread", "2 threads"))
        assert "--workers 2 / --workers 1: " in sections[title] and "the disk alone" in sections[title]
    assert "**total (resolve + plan)**" in sections["Planning a 405B-shaped checkpoint"]
    for title in ("Where a conversion's time goes", "Where a Hugging Face to Megatron conversion's time goes"):
        breakdown = sections[title]
        assert all(f"| {thread} | rest: " in breakdown for thread in ("main", "writer", "sync")), title
        assert "| CPU s |" in breakdown and "**wall**" in breakdown, title
    copies = sections["Moving bytes unchanged: read and write, or copy_file_range"]
    assert all(f"| {way} |" in copies for way in ("read + write, xxh3 of the buffer", "copy_file_range, no checksum"))
    small = sections["Many small tensors against a few large ones"]
    assert "| hf -> hf (4 shards) | many | 1,000 |" in small and "| hf -> dcp dp=2 | few | 64 |" in small
    assert "round trip byte-identical: True" in sections["Models no family describes"]
    assert "weights are byte-identical" in sections["A mixture of experts at ep=8 under a memory budget"]
    assert "byte-identical to the one-process conversion's: True" in sections["A conversion across torchrun ranks"]
