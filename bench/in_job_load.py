"""Loading inside a job at a new world size: ``load_into`` on each of 4 FSDP2 ranks from a Megatron tp2pp2 checkpoint.

Generates a Megatron-core checkpoint (torch format, tp=2, pp=2) of a Llama-shaped model with bf16 weights, fp32
master params and Adam moments (hidden 512, ffn 1408, GQA 8/2 heads, vocab 8000, 4 layers: about 266 MiB), then
starts a gloo job of 4 ranks on this host (forked from this process, which imported torch and transformers once).
Each rank builds transformers' ``LlamaForCausalLM``, shards it with FSDP2 (``fully_shard`` per layer, then the
root), makes its Adam optimizer and calls ``reshard.torch.load_into(model, optimizer, SRC)``: every rank reads
the bytes of its own shards of the model and of the optimizer state, nothing else.

Prints a markdown table, one row per rank: the load's wall time, the bytes it read, its share (the elements its
shards hold, in the checkpoint's dtypes: what it must read at least), their ratio, and its read calls.

With ``--device cuda`` the job is one NCCL rank on the GPU (NCCL takes one rank per GPU): the model and its Adam
state live on the GPU and are filled through pinned staging buffers, copies overlapped with the reads.

    python bench/in_job_load.py [--tiny] [--keep DIR] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORLD = 4
SIZES = {"h": 512, "heads": 8, "g": 2, "hd": 64, "f": 1408, "vocab": 8000, "layers": 4, "vocab_div": 128}
TINY = {"h": 64, "heads": 4, "g": 2, "hd": 16, "f": 160, "vocab": 1000, "layers": 4, "vocab_div": 128}


def generate(src: Path, sizes: dict[str, int]) -> None:
    import fixtures
    from rank_load import warm

    if src.exists():
        return
    fixtures.MODELS["bench-llama"] = fixtures.Model("hf-llama", sizes)
    fixtures.make_fixture(src, format="megatron", to="tp=2,pp=2", model="bench-llama")
    warm(src)


def _rank(rank: int, port: int, src: str, sizes: dict[str, int], out: str, world: int, device: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from reshard.torch import load_into

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    config = LlamaConfig(hidden_size=sizes["h"], intermediate_size=sizes["f"], num_attention_heads=sizes["heads"],
                         num_key_value_heads=sizes["g"], head_dim=sizes["hd"], num_hidden_layers=sizes["layers"],
                         vocab_size=sizes["vocab"], tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float().to(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    dist.barrier()
    t0 = time.perf_counter()
    report = load_into(model, optimizer, src)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    row = {"rank": rank, "seconds": seconds, "read": report.bytes_read, "share": report.share, "reads": report.reads}
    Path(out, f"rank{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    os._exit(0)  # no teardown of gloo: the work is done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a checkpoint of a few MiB (a smoke test)")
    ap.add_argument("--keep", type=Path, help="write the checkpoint under this directory and keep it")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the model lives: cpu, 4 gloo ranks; cuda, one NCCL rank on the GPU")
    args = ap.parse_args()
    world = 1 if args.device == "cuda" else WORLD
    import importlib

    import torch.multiprocessing as mp

    for name in ("transformers.models.llama.modeling_llama", "reshard.torch"):  # once, before the ranks fork
        importlib.import_module(name)

    sizes = TINY if args.tiny else SIZES
    base = args.keep or Path(tempfile.mkdtemp(prefix="reshard-bench-load-", dir=os.environ.get("TMPDIR")))
    try:
        src = base / ("meg-tiny" if args.tiny else "meg")
        generate(src, sizes)
        total = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        out = base / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(port, str(src), sizes, str(out), world, args.device), nprocs=world,
                           start_method="fork")
        rows = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    mib = 1 << 20
    print(f"Megatron tp=2,pp=2 checkpoint of {total / mib:.0f} MiB (bf16 weights, fp32 masters and Adam moments) "
          f"loaded into a transformers Llama under FSDP2 at {world} rank{'s' if world > 1 else ''}"
          f"{' on the GPU' if args.device == 'cuda' else ''}; {platform.machine()}, "
          f"{os.cpu_count()} cores.\n")
    print("| rank | load (s) | read (MiB) | share (MiB) | read / share | reads |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {r['seconds']:.2f} | {r['read'] / mib:.1f} | {r['share'] / mib:.1f} | "
              f"{r['read'] / r['share']:.2f} | {r['reads']} |")
    print(f"\nTogether the ranks read {sum(r['read'] for r in rows) / total:.2f} of the checkpoint's bytes.")
    if any(r["read"] > 1.25 * r["share"] for r in rows):
        sys.exit("a rank read more than 1.25 times its share")


if __name__ == "__main__":
    main()
