"""Load one rank's share of a DCP checkpoint saved as large chunks: reshard.load against dcp.load.

Saves, with real ``dcp.save`` in one process, a checkpoint of fp32 tensors
stored as whole chunks (1 GiB in all by default), once with 64 MiB chunks and
once with 256 MiB chunks. Then, for rank 3 of 8 under FSDP2's ``Shard(0)``
layout (1/8 of every tensor's rows, 128 MiB):

- ``reshard.load(ckpt, to="dp=8", rank=3)`` in a fresh process;
- real ``dcp.load`` in a gloo job of 8 ranks in which rank 3 loads its rows
  into ``DTensor`` shards (the other ranks load nothing, so the machine's two
  cores serve rank 3 alone) and is the one measured.

Both report the load's wall time and the process's peak RSS above what it held
before the load (torch imported, buffers allocated), as a markdown table.

    python bench/dcp_load.py [--total-mib 1024] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import describe

ROOT = Path(__file__).resolve().parent.parent
RANKS, RANK = 8, 3

_SAVE = """
import sys, torch, torch.distributed.checkpoint as dcp, warnings
warnings.simplefilter("ignore")
rows, cols, count, out = {rows}, {cols}, {count}, {out!r}
gen = torch.Generator().manual_seed(0)
sd = {{f"w{{k}}": torch.randn(rows, cols, generator=gen) for k in range(count)}}
dcp.save({{"model": sd}}, checkpoint_id=out)
"""

_RESHARD = """
import json, time, torch, reshard
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
before = hwm()
t0 = time.perf_counter()
state = reshard.load({ckpt!r}, to="dp={ranks}", rank={rank})
seconds = time.perf_counter() - t0
share = sum(t.numel() * t.element_size() for t in state.tensors.values())
print(json.dumps({{"seconds": seconds, "peak": hwm(), "before": before, "share": share, "read": state.bytes_read}}))
"""

_DCP = """
import json, os, sys, time, torch, torch.distributed as dist, warnings
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
warnings.simplefilter("ignore")

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

def run(rank, world, ckpt, port, rows, cols, count, measured):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = {{}}
    if rank == measured:  # Shard(0) with torch.chunk sizes, as FSDP2 lays parameters out
        step = -(-rows // world)
        n = max(0, min(step, rows - rank * step))
        for k in range(count):
            local = torch.empty(n, cols)
            sd[f"w{{k}}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(rows, cols),
                                               stride=(cols, 1))
    before = hwm()
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load({{"model": sd}}, checkpoint_id=ckpt)
    seconds = time.perf_counter() - t0
    if rank == measured:
        share = sum(v.to_local().numel() * 4 for v in sd.values())
        print(json.dumps({{"seconds": seconds, "peak": hwm(), "before": before, "share": share}}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads sometimes abort at interpreter exit

if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(run, args=({ranks}, {ckpt!r}, {port}, {rows}, {cols}, {count}, {rank}), nprocs={ranks})
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python(code: str, cwd: Path) -> dict:
    path = cwd / "job.py"
    path.write_text(code)
    out = subprocess.run([sys.executable, str(path)], check=True, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--total-mib", type=int, default=1024, help="checkpoint size (MiB)")
    ap.add_argument("--keep", type=Path, help="write under this directory and keep the files")
    args = ap.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="reshard-dcp-bench-", dir=os.environ.get("TMPDIR")))
    base.mkdir(parents=True, exist_ok=True)
    cols = 4096
    rows_out = []
    try:
        for chunk_mib in (64, 256):
            rows = chunk_mib * 2**20 // (cols * 4)
            count = max(1, args.total_mib // chunk_mib)
            ckpt = base / f"chunks-{chunk_mib}MiB"
            if not (ckpt / ".metadata").exists():
                _python(_SAVE.format(rows=rows, cols=cols, count=count, out=str(ckpt)), base)
            subprocess.run(["sync"], check=False)
            ours = _python(_RESHARD.format(ckpt=str(ckpt), ranks=RANKS, rank=RANK), base)
            theirs = _python(_DCP.format(ckpt=str(ckpt), ranks=RANKS, rank=RANK, port=_free_port(), rows=rows,
                                         cols=cols, count=count), base)
            rows_out.append((chunk_mib, count, ours, theirs))
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    mib = 2**20
    print(describe())
    print(f"rank {RANK} of {RANKS} loads 1/{RANKS} of every tensor (FSDP2 Shard(0)).\n")
    print("| chunk size | checkpoint | share | reshard.load time | reshard RSS growth | dcp.load time "
          "| dcp.load RSS growth | time ratio (reshard / dcp) | RSS ratio (dcp / reshard) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for chunk_mib, count, ours, theirs in rows_out:
        grow_ours = max(ours["peak"] - ours["before"], 0) / mib
        grow_theirs = max(theirs["peak"] - theirs["before"], 0) / mib
        print(f"| {chunk_mib} MiB | {count * chunk_mib} MiB | {ours['share'] / mib:.0f} MiB "
              f"| {ours['seconds']:.2f} s | {grow_ours:.0f} MiB | {theirs['seconds']:.2f} s | {grow_theirs:.0f} MiB "
              f"| {ours['seconds'] / theirs['seconds']:.2f} | {grow_theirs / max(grow_ours, 1):.1f} |")
    print(f"\nreshard read {rows_out[-1][2]['read'] / mib:.0f} MiB for a {rows_out[-1][2]['share'] / mib:.0f} MiB share "
          "at the largest chunk size.")


if __name__ == "__main__":
    main()
