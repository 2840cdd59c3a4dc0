"""Models reshard has no family for: a layout derived from the checkpoint alone, at scale and at disk speed.

Two tables, measured in one run:

- **100,000 tensors.** A Hugging Face safetensors checkpoint of a model no family describes
  (``model_type`` ``"custom"``), ``--tensors`` small tensors of assorted shapes. Timed: opening it
  (the layout derived from the safetensors header, resolved), and planning its conversion to DCP at
  dp=8 (FSDP2's layout, derived from the names and shapes) from metadata alone.
- **A Qwen2-shaped model** (``model_type`` ``"qwen2_shaped"``: no family, so every tensor is read under its
  own name): a bf16 safetensors checkpoint of about ``--gib`` GiB, converted to DCP at dp=4 and back
  to safetensors, each against ``cp -r`` of the same bytes on the same disk; the round trip is
  checked byte for byte.

    python bench/any_model.py [--tensors 100000] [--gib 1.0] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reshard  # noqa: E402
from reshard.io.safetensors_io import SafetensorsWriter  # noqa: E402
from rank_load import warm  # noqa: E402


def write_hf(root: Path, config: dict, tensors: list[tuple[str, tuple[int, ...]]], dtype: str, seed: int = 0) -> int:
    """One safetensors file of ``tensors`` (random bytes) and a config.json; the bytes written."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    size = {"float32": 4, "bfloat16": 2}[dtype]
    total = 0
    with SafetensorsWriter(root / "model.safetensors", {n: (dtype, s) for n, s in tensors}, {"format": "pt"}) as w:
        shapes = dict(tensors)
        for name in w.order:
            n = int(np.prod(shapes[name], dtype=np.int64)) * size
            w.write(name, rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            total += n
    return total


def many_tensors(count: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes = [(16, 8), (8,), (4, 4, 2), (32,), (3, 5)]
    return [(f"blocks.{k // 10}.part{k % 10}.weight", shapes[k % len(shapes)]) for k in range(count)]


def qwen2_like(gib: float) -> list[tuple[str, tuple[int, ...]]]:
    h, f, vocab, kv = 1024, 2816, 32000, 256
    per_layer = 2 * (h * h + 2 * kv * h + h * h + 3 * f * h)
    layers = max(1, int((gib * 2**30 - 2 * 2 * vocab * h) / per_layer))
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.q_proj.bias", (h,)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.k_proj.bias", (kv,)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.bias", (kv,)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)), (p + "mlp.gate_proj.weight", (f, h)),
                (p + "mlp.up_proj.weight", (f, h)), (p + "mlp.down_proj.weight", (h, f))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def cp_r(src: Path, dst: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tiny", action="store_true", help="1,000 tensors and 16 MiB: a smoke test")
    args = ap.parse_args()
    if args.tiny:
        args.tensors, args.gib = 1000, 1 / 64
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        tmp = Path(tmp)
        src = tmp / "many"
        write_hf(src, {"model_type": "custom", "architectures": ["CustomModel"]}, many_tensors(args.tensors), "float32")
        t_open, source = timed(lambda: reshard.open_checkpoint(src))
        t_plan, report = timed(lambda: reshard.plan(src, format="dcp", to="dp=8"))
        print(f"**A derived layout of {args.tensors:,} tensors (no family, no spec)**\n")
        print("| step | seconds | detail |\n|---|---:|---|")
        print(f"| open (header -> derived layout, resolved) | {t_open:.2f} | {len(source.layout.tensors):,} tensors |")
        print(f"| plan to DCP dp=8 (open, derive target, resolve, plan, validate) | {t_plan:.2f} | "
              f"{len(report.plan.copies):,} copies |")
        print(f"| peak RSS | {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB | |\n")

        src = tmp / "qwen2"
        size = write_hf(src, {"model_type": "qwen2_shaped", "architectures": ["Qwen2ForCausalLM"]}, qwen2_like(args.gib),
                        "bfloat16")
        t_cp = cp_r(src, tmp / "copy")
        t_to, _ = timed(lambda: reshard.convert(src, tmp / "dcp", format="dcp", to="dp=4"))
        warm(tmp / "dcp")  # as cp -r reads: from the page cache
        t_back, _ = timed(lambda: reshard.convert(tmp / "dcp", tmp / "back", format="hf"))
        same = (tmp / "back" / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
        print(f"**A Qwen2-shaped model, {size / 2**30:.2f} GiB bf16 (no family: every tensor by its own name)**\n")
        print("| run | wall s | vs cp -r |\n|---|---:|---:|")
        print(f"| cp -r | {t_cp:.2f} | 1.00 |")
        print(f"| hf -> dcp dp=4 | {t_to:.2f} | {t_to / t_cp:.2f} |")
        print(f"| dcp dp=4 -> hf | {t_back:.2f} | {t_back / t_cp:.2f} |")
        print(f"\nround trip byte-identical: {same}")
        shutil.rmtree(tmp, ignore_errors=True)
        if not same:
            sys.exit("the round trip changed the checkpoint")


if __name__ == "__main__":
    main()
