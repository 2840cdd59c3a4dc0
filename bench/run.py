"""Every benchmark in one run, each printing its markdown table.

- ``breakdown.py``: where one conversion's wall time goes (planning, reads, checksums, CRC-32, writes, fsync,
  the rest), per thread, with the CPU time of each: Megatron -> Megatron, and Hugging Face -> Megatron;
- ``baselines.py``: reshard against ``cp -r && sync``, ``safetensors`` load + save, DCP's ``dcp_to_torch_save``
  and ``dcp.load``, page cache dropped before each run where it can be (not with ``--tiny``);
- ``direct_writes.py``: a conversion's output written directly to the disk (``O_DIRECT``, reshard's way) against
  through the page cache, with the page cache just freed and as found;
- ``copy_paths.py``: moving a file's bytes unchanged, through the process (read, checksum, write) against the
  kernel's ``copy_file_range``, with and without a checksum through ``mmap``;
- ``small_tensors.py``: 100,000 small tensors against 64 large ones of the same bytes, in bytes per second,
  with the plain ``safetensors`` library and a bare Python loop (the floor of Python per tensor) beside;
- ``convert_memory.py``, three times: a Megatron checkpoint with the distributed optimizer, tp=2,pp=2 ->
  tp=1,pp=4, a DeepSpeed ZeRO-2 one, dp=2 -> dp=4, and a Hugging Face one to Megatron tp=2,pp=2, against
  ``cp -r``, with ``--workers`` 1, 2, 4 and 8 (the curve; 1 and 2 with ``--tiny``), and ``reshard.load`` of
  one rank; peak RSS at two sizes (Megatron);
- ``deepspeed_universal.py``: DeepSpeed ZeRO-2 dp=2 -> dp=4 against ``ds_to_universal``
  (where deepspeed is installed);
- ``dcp_load.py``: one rank's share of a PyTorch DCP checkpoint, ``reshard.load`` against
  ``dcp.load`` (where torch is installed);
- ``plan_405b.py``: planning a Llama-405B-shaped checkpoint from metadata alone;
- ``plan_moe.py``: planning a DeepSeek-V3-shaped mixture of experts (64 layers, 256 experts) from metadata
  alone, ep=64,pp=16 -> ep=32,pp=8 (not with ``--tiny``);
- ``any_model.py``: a model no family describes: 100,000 tensors planned from a derived layout, and a
  Qwen2-shaped model to DCP and back against ``cp -r``.
- ``moe_memory.py``: 256 experts per layer, Hugging Face -> Megatron ep=8,pp=4 -> back under a memory
  budget: peak RSS against the budget, byte-identical round trip; and (not with ``--tiny``) DeepSeek-V3's full
  tensor count and layout (61 layers, MTP) at its training layout pp=16, ep=64 under 1 GiB.
- ``rank_load.py``: ``reshard.load`` of rank 3 of tp=2,pp=2 from a 1.92 GiB Hugging Face checkpoint, against
  reading every file whole and ``safetensors`` ``load_file`` + ``clone``, in one process, warm cache; and
  with ``--cold`` (the page cache dropped before each run) where the page cache can be dropped (root);
- ``torchrun.py``: ``torchrun -m reshard convert`` at 1, 2 and 4 ranks on this host: wall time and the
  ratio to one rank, outputs byte-identical to one process's.
- ``in_job_load.py``: ``load_into`` on each of 4 FSDP2 ranks of a transformers Llama from a Megatron tp2pp2
  checkpoint with Adam state: per rank, the bytes read over its share.

    python bench/run.py            # the README's tables (about 20 minutes, about 30 GB of disk)
    python bench/run.py --tiny     # a smoke test of the same scripts on checkpoints of a few MiB
"""

from __future__ import annotations

import argparse
import compileall
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from rank_load import can_drop_caches  # noqa: E402  (root: the page cache can be dropped)


def importable(module: str) -> bool:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, env=env).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small checkpoints, one round: a smoke test")
    args = ap.parse_args()
    small = ["--tiny", "--repeat", "1"] if args.tiny else []
    cold = can_drop_caches()
    curve = ["--workers", "1,2"] if args.tiny else []  # the whole curve (1, 2, 4, 8) on real sizes
    steps: list[tuple[str, list[str]]] = [
        ("Megatron conversion", ["convert_memory.py", *small, *curve, *([] if args.tiny else ["--rss-scale", "4"])]),
        ("DeepSpeed conversion", ["convert_memory.py", "--source", "deepspeed", *small, *curve]),
        ("Hugging Face to Megatron conversion", ["convert_memory.py", "--source", "hf", *small, *curve]),
        ("Where a conversion's time goes", ["breakdown.py", *(["--tiny"] if args.tiny else [])]),
        ("Where a Hugging Face to Megatron conversion's time goes",
         ["breakdown.py", "--source", "hf", *(["--tiny"] if args.tiny else [])]),
        ("Writing directly or through the page cache", ["direct_writes.py", *(["--tiny"] if args.tiny else [])]),
        ("Moving bytes unchanged: read and write, or copy_file_range",
         ["copy_paths.py", *(["--tiny"] if args.tiny else [])]),
        ("Many small tensors against a few large ones", ["small_tensors.py", *(["--tiny"] if args.tiny else [])]),
        ("Planning a 405B-shaped checkpoint", ["plan_405b.py", "--validate"]),
        ("Models no family describes", ["any_model.py", *(["--tiny"] if args.tiny else [])]),
        ("A mixture of experts at ep=8 under a memory budget", ["moe_memory.py", *(["--tiny"] if args.tiny else [])]),
        ("A conversion across torchrun ranks", ["torchrun.py", *(["--tiny"] if args.tiny else [])]),
        ("One rank's load against reading everything", ["rank_load.py", *small]),
    ]
    if not args.tiny:  # seconds and most of a GiB: no smoke test
        steps.insert(6, ("Planning a DeepSeek-V3-shaped mixture of experts", ["plan_moe.py", "--validate", "--curve"]))
        steps.append(("DeepSeek-V3's full tensor count at its training layout", [
            "moe_memory.py", "--layers", "61", "--mtp", "1", "--budget", "1GiB",
            "--to", "tp=1,pp=16,dp=64,ep=64,stages=4+4+4+4+4+4+4+4+4+4+4+4+4+3+3+3"]))
        steps.append(("Against the plain ways", ["baselines.py"]))
    if not args.tiny and cold:
        steps.insert(3, ("Where a conversion's time goes, caches dropped", ["breakdown.py", "--cold"]))
        steps.append(("One rank's load against reading everything, caches dropped", ["rank_load.py", "--cold"]))
    if importable("transformers"):
        steps.append(("Loading inside a job at world size 4", ["in_job_load.py", *(["--tiny"] if args.tiny else [])]))
    if not args.tiny and importable("deepspeed"):
        steps.append(("DeepSpeed ZeRO-2 against ds_to_universal", ["deepspeed_universal.py"]))
    if not args.tiny and importable("torch"):
        steps.append(("One rank of a DCP checkpoint against dcp.load", ["dcp_load.py"]))
    # Byte-compiled first, as pip leaves an installed package: where bytecode is not written
    # (PYTHONDONTWRITEBYTECODE), every child process (each worker too) would compile reshard's modules again,
    # some 0.1 s of CPU each, and the tables would count it.
    for package in ("reshard", "cli"):
        compileall.compile_dir(str(HERE.parent / package), quiet=1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    failed = []
    for title, cmd in steps:
        print(f"## {title}\n", flush=True)
        code = subprocess.run([sys.executable, str(HERE / cmd[0]), *cmd[1:]], env=env).returncode
        if code:
            failed.append(f"{cmd[0]} (exit {code})")
        print(flush=True)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
