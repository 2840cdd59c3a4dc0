"""reshard against the plain ways of doing the same work: a copy, safetensors load + save, DCP's own tools.

Generates a Hugging Face Llama-shaped checkpoint (bf16, hidden 2048, ffn 5632, GQA 16/4 heads, vocab 32000;
about 2 GiB at 20 layers, 400 MiB safetensors shards) and a PyTorch DCP checkpoint of the same weights (FSDP2
at dp=4, written by ``reshard convert``; untimed). Then runs each command in a fresh process, with the page
cache dropped before each where it can be (root; ``sync`` first), ``--repeat`` rounds:

- ``cp -r && sync`` of each source: the floor of a conversion;
- ``cat`` of each source's files into /dev/null: the floor of a load;
- ``safetensors`` ``load_file`` + ``save_file`` of every shard, and ``sync``;
- ``reshard convert`` hf -> hf (the same layout) and hf -> megatron tp=2,pp=2;
- DCP's ``dcp_to_torch_save`` (one ``torch.save`` file of every tensor), and ``sync``, against
  ``reshard convert`` dcp -> hf (one safetensors file set of every tensor);
- ``dcp.load`` of every tensor in one process (no process group) into tensors made for it, against
  ``reshard.load(..., to="dp=1", rank=0)``.

Per command: wall time of the whole process (its imports in their own column), its ratio to the floor, peak
RSS, bytes read from storage over the bytes the work needs (the source), and bytes sent to storage over the
output's size (from the kernel's accounting of the process and its children: ``wait4``'s rusage).

    python bench/baselines.py [--layers 20] [--repeat 3] [--keep DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import rank_load  # noqa: E402  (its checkpoint and its way of dropping the page cache)
from convert_memory import dir_size  # noqa: E402

def run(argv: list[str], cold: bool) -> dict:
    """Run ``argv`` once (from a cold cache if ``cold``): wall, peak RSS and storage bytes of it and its children."""
    if cold:
        rank_load.drop_caches()
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        _, status, usage = os.wait4(p.pid, 0)  # the exit status and rusage, collected here rather than by Popen
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        if p.returncode:
            err.seek(0)
            sys.exit(f"failed: {' '.join(argv)}\n{err.read().decode()[-2000:]}")
    return {"wall": wall, "rss": usage.ru_maxrss * 1024, "read": usage.ru_inblock * 512,
            "written": usage.ru_oublock * 512}


def python(imports: str, body: str) -> list[str]:
    return [sys.executable, "-c", f"{imports}\n{body}\n"]


def generate(base: str, layers: int, tiny: bool) -> None:
    """The Hugging Face checkpoint (``rank_load.py``'s, in 400 MiB shards) and its DCP twin under ``base``."""
    import reshard

    hf, dcp = Path(base) / "hf", Path(base) / "dcp"
    if hf.exists() and dcp.exists():
        return
    rank_load.generate(hf, layers, tiny, shard="400MiB")
    reshard.convert(hf, dcp, format="dcp", to="dp=4")
    (dcp / "reshard.json").unlink()  # a plain DCP directory, as dcp.save leaves it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20, help="decoder layers (20: about 2 GiB)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the table shows medians")
    ap.add_argument("--keep", type=Path, help="write under this directory and keep the files")
    ap.add_argument("--tiny", action="store_true", help="a checkpoint of a few MiB (a smoke test)")
    args = ap.parse_args()
    base = args.keep or Path(tempfile.mkdtemp(prefix="reshard-bench-", dir=os.environ.get("TMPDIR")))
    out = base / "out"
    try:
        hf, dcp = base / "hf", base / "dcp"
        # In a child: a process started by a large parent reports the parent's peak RSS as its own.
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import baselines; "
                        f"baselines.generate({str(base)!r}, {args.layers}, {args.tiny})"], check=True, cwd=ROOT)
        shards = sorted(hf.glob("*.safetensors"))
        plain_dcp = "import torch.distributed.checkpoint as dcp\nfrom torch.distributed.checkpoint.format_utils import dcp_to_torch_save"
        load_all = (f"r = dcp.FileSystemReader({str(dcp)!r}); md = r.read_metadata()\n"
                    "sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items() "
                    "if hasattr(m, 'size')}\n"
                    f"dcp.load(sd, storage_reader=r, no_dist=True)")
        # (name, floor, source, command, output) per row; the floor names the row it is measured against
        rows = [
            ("cp -r && sync (hf)", None, hf, ["sh", "-c", f"cp -r {hf} {out} && sync"], out),
            ("cat every file (hf)", None, hf, ["sh", "-c", f"cat {hf}/* > /dev/null"], None),
            ("safetensors load_file + save_file, every shard, sync", "cp -r && sync (hf)", hf, python(
                "import os\nfrom safetensors.torch import load_file, save_file",
                f"os.makedirs({str(out)!r})\n"
                f"for f in {[str(s) for s in shards]!r}:\n"
                f"    save_file(load_file(f), os.path.join({str(out)!r}, os.path.basename(f)), metadata={{'format': 'pt'}})\n"
                "os.sync()"), out),
            ("reshard convert hf -> hf", "cp -r && sync (hf)", hf, python(
                "import reshard", f"reshard.convert({str(hf)!r}, {str(out)!r}, format='hf', workers=1)"), out),
            ("reshard convert hf -> megatron tp=2,pp=2", "cp -r && sync (hf)", hf, python(
                "import reshard", f"reshard.convert({str(hf)!r}, {str(out)!r}, format='megatron', to='tp=2,pp=2', "
                "workers=1)"), out),
            ("python -c 'import torch' (a part of each torch row)", None, None, python("import torch", ""), None),
            ("cp -r && sync (dcp)", None, dcp, ["sh", "-c", f"cp -r {dcp} {out} && sync"], out),
            ("cat every file (dcp)", None, dcp, ["sh", "-c", f"cat {dcp}/* > /dev/null"], None),
            ("dcp_to_torch_save, sync", "cp -r && sync (dcp)", dcp, python(
                f"import os\n{plain_dcp}",
                f"os.makedirs({str(out)!r})\ndcp_to_torch_save({str(dcp)!r}, {str(out / 'model.pt')!r})\nos.sync()"), out),
            ("reshard convert dcp -> hf", "cp -r && sync (dcp)", dcp, python(
                "import reshard", f"reshard.convert({str(dcp)!r}, {str(out)!r}, format='hf', workers=1)"), out),
            ("dcp.load of every tensor, one process", "cat every file (dcp)", dcp, python(
                f"import torch\n{plain_dcp}", load_all), None),
            ("reshard.load to dp=1, rank 0", "cat every file (dcp)", dcp, python(
                "import reshard", f"m = reshard.load({str(dcp)!r}, to='dp=1', rank=0)"), None),
        ]
        cold = rank_load.can_drop_caches() and not args.tiny
        got: dict[str, list[dict]] = {name: [] for name, *_ in rows}
        outputs: dict[str, int] = {}
        for _ in range(args.repeat):
            for name, _floor, _src, argv, dest in rows:
                shutil.rmtree(out, ignore_errors=True)
                got[name].append(run(argv, cold))
                if dest is not None:
                    outputs[name] = dir_size(dest)
        shutil.rmtree(out, ignore_errors=True)
        med = {name: statistics.median(r["wall"] for r in rs) for name, rs in got.items()}
        print(describe())
        print('page cache dropped before every run' if cold else 'warm page cache')
        print(f"sources: hf {dir_size(hf) / 2**30:.2f} GiB in {len(shards)} safetensors shards; dcp (FSDP2 dp=4) "
              f"{dir_size(dcp) / 2**30:.2f} GiB\n")
        print("| run | wall s | × floor | peak RSS GiB | read GiB | read / needed | written / output |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, floor, src, _argv, dest in rows:
            last = got[name][-1]
            ratio = f"{med[name] / med[floor]:.2f}" if floor else "1.00" if any(r[1] == name for r in rows) else ""
            read = max(r["read"] for r in got[name])
            per_needed = f"{read / dir_size(src):.2f}" if src is not None else ""
            written = f"{last['written'] / outputs[name]:.2f}" if dest is not None and outputs[name] else ""
            print(f"| {name} | {med[name]:.2f} | {ratio} | {max(r['rss'] for r in got[name]) / 2**30:.2f} "
                  f"| {read / 2**30:.2f} | {per_needed} | {written} |")
        print(f"\nmedians of {args.repeat} rounds; '× floor' is against cp -r && sync of the same source for a "
              "conversion and cat of its files for a load; read and written are what the kernel counted for the "
              "process and its children (with a warm cache, reads from the page cache count nothing)")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
