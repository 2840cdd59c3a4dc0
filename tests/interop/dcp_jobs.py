"""Real PyTorch DCP checkpoints written and read by real FSDP2 / tensor parallel / 2-D jobs (CPU, gloo).

Importable without side effects (nothing heavy is imported at module level) and
runnable as a script::

    python tests/interop/dcp_jobs.py save OUT MODE WORLD [--dp N] [--tp N] [--steps 2]
                                          [--dtype float32] [--config-out PATH]
    python tests/interop/dcp_jobs.py load CKPT MODE WORLD DUMP [--dp N] [--tp N] [--dtype D]
                                          [--no-train-step]
    python tests/interop/dcp_jobs.py reference CKPT OUT.pt

The model is a tiny transformers ``LlamaForCausalLM`` (``CONFIG``; GQA with 8
query and 4 key/value heads, untied embeddings). ``MODE`` says how it is
parallelized over ``WORLD`` ranks:

- ``fsdp``: 1-D mesh ``(WORLD,)``; ``fully_shard`` on every decoder layer, then
  on the root.
- ``tp``: 1-D mesh ``(WORLD,)``; ``parallelize_module`` on every decoder layer
  with ``ColwiseParallel`` for q/k/v/gate/up and ``RowwiseParallel`` for
  o/down. Norms, embeddings and ``lm_head`` stay plain (replicated) tensors.
  The heads must split evenly: ``WORLD`` in 1, 2, 4.
- ``2d``: mesh ``(dp, tp)`` named ``("dp", "tp")``, ``WORLD = dp * tp``; the TP
  plan above on the ``tp`` submesh, then ``fully_shard`` on the ``dp`` submesh
  (layers, then root). Colwise weights end up as ``(_StridedShard(0), Shard(0))``.

``save`` / ``load`` run this file in a fresh Python process in its own session
(killed, with anything it leaves behind, when the job ends or times out). That
process imports torch and transformers once, picks a free TCP port (a socket
bound to port 0) and forks one gloo rank per process
(``torch.multiprocessing.start_processes``; set ``DCP_JOBS_START=spawn`` to
spawn them instead). Ranks run with one thread each, ``HF_HUB_OFFLINE=1``.

- ``save``: ``make_model(seed=0)``, parallelized, ``Adam(lr=1e-3)``, ``steps``
  training steps on deterministic random token batches (the same on every
  rank), then ``dcp.save({"model": msd, "optim": osd})`` of
  ``get_state_dict(model, opt)``. Rank 0 writes the model's Hugging Face
  ``config.json`` to ``config_out``, by default ``OUT/config.json`` inside the
  checkpoint directory (DCP ignores files it did not list in ``.metadata``;
  reshard's DCP reader looks there, or in the parent).
- ``load``: ``make_model(seed=1)`` (other values, so loading must overwrite
  them), parallelized at the given mesh, ``Adam(lr=1e-3)``, then
  ``get_state_dict`` (which initializes Adam's state with a zero-gradient,
  ``lr=0`` step), ``dcp.load`` into those dicts, ``set_state_dict``. Then the
  state is read back with ``get_state_dict``, every DTensor gathered with
  ``full_tensor()``, and rank 0 ``torch.save``s a flat dict under DCP's own
  flat keys to ``DUMP`` *before* any training::

      "model.model.layers.0.self_attn.q_proj.weight": tensor,
      "optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg": tensor,  # also exp_avg_sq, step
      "optim.param_groups.0.lr": 0.001,  # betas, eps, ..., params (a list of FQNs)

  With ``train_step`` one more training step then runs on every rank and the
  dump is rewritten with ``"loss_after_step": float`` added (nothing else in it
  changes).
- ``reference``: torch's own ``dcp_to_torch_save`` of a checkpoint, returned
  flattened to the same keys (``flatten``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Keyword arguments of transformers' LlamaConfig. "dtype" is transformers 5's name for the old "torch_dtype"
# (which now warns that it is deprecated); config.json carries it as "dtype".
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 300,
    "tie_word_embeddings": False,
    "dtype": "float32",
}
MODES = ("fsdp", "tp", "2d")
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
LR = 1e-3
BATCH = (2, 16)  # sequences x tokens per training step
SAVE_SEED, LOAD_SEED = 0, 1
DTYPES = ("float32", "bfloat16", "float16")
JOB_TIMEOUT = 600.0


# -- the model ---------------------------------------------------------------------------------------------


def make_model(seed: int = SAVE_SEED, dtype: str = "float32"):
    """The tiny ``LlamaForCausalLM`` of ``CONFIG``, its weights drawn after ``torch.manual_seed(seed)``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**CONFIG, "dtype": dtype})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.train()
    return model


def mesh_dims(mode: str, world: int, dp: int | None = None, tp: int | None = None) -> tuple[int, int]:
    """``(dp, tp)`` of a job, checked: ``fsdp`` is ``(world, 1)``, ``tp`` is ``(1, world)``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if world < 1:
        raise ValueError(f"world must be >= 1, not {world}")
    if mode == "fsdp":
        want = (world, 1)
    elif mode == "tp":
        want = (1, world)
    else:
        if dp is None and tp is None:
            tp = 2 if world % 2 == 0 else 1
        if dp is None:
            dp = world // tp if tp and world % tp == 0 else 0
        if tp is None:
            tp = world // dp if dp and world % dp == 0 else 0
        want = (dp, tp)
    if (dp is not None and dp != want[0]) or (tp is not None and tp != want[1]) or want[0] * want[1] != world:
        raise ValueError(f"mode {mode} at world {world} cannot have dp={dp}, tp={tp}")
    heads = (CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["intermediate_size"])
    if any(h % want[1] for h in heads):
        raise ValueError(f"tp={want[1]} does not divide the heads / intermediate size {heads}")
    return want


# -- helpers for the parent (no torch.distributed job) ---------------------------------------------------------


def flatten(nested: Mapping, prefix: str = "") -> dict[str, Any]:
    """A nested state dict under DCP's flat key names (``optim.state.<fqn>.exp_avg``, ``optim.param_groups.0.lr``).

    Mappings are walked (keys as ``str``); a list is walked by index only when it holds a mapping, a tensor or
    such a list (``param_groups`` is; ``params``, a list of FQN strings, is a leaf); tuples are leaves.
    """
    out: dict[str, Any] = {}

    def walk(path: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{path}{k}.", v)
        elif isinstance(value, list) and _walks_into(value):
            for i, v in enumerate(value):
                walk(f"{path}{i}.", v)
        else:
            out[path[:-1]] = value

    walk(prefix, nested)
    return out


def _walks_into(items: list) -> bool:
    torch = sys.modules.get("torch")
    for v in items:
        if isinstance(v, Mapping) or (torch is not None and isinstance(v, torch.Tensor)):
            return True
        if isinstance(v, list) and _walks_into(v):
            return True
    return False


def reference(ckpt_dir: str | os.PathLike, out_path: str | os.PathLike) -> dict[str, Any]:
    """torch's own consolidation (``dcp_to_torch_save``) of ``ckpt_dir`` into ``out_path``, returned flattened."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt_dir, out_path)
    return flatten(torch.load(out_path, weights_only=True))


def metadata(ckpt_dir: str | os.PathLike):
    """The checkpoint's ``.metadata`` (torch's ``Metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt_dir)).read_metadata()


def chunk_boxes(ckpt_dir: str | os.PathLike, key: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``(file, offsets, sizes)`` of every stored chunk of tensor ``key`` (a flat key), by file then offsets."""
    md = metadata(ckpt_dir)
    boxes = []
    for index, info in md.storage_data.items():
        if index.fqn == key:
            chunk = md.state_dict_metadata[key].chunks[index.index]
            assert tuple(chunk.offsets) == tuple(index.offset), (chunk, index)
            boxes.append((info.relative_path, tuple(chunk.offsets), tuple(chunk.sizes)))
    return sorted(boxes)


def checkpoint_dtype(ckpt_dir: str | os.PathLike) -> str:
    """The dtype name (``"float32"``, ...) of the checkpoint's token embedding."""
    props = metadata(ckpt_dir).state_dict_metadata["model.model.embed_tokens.weight"].properties
    return str(props.dtype).removeprefix("torch.")


def save(out_dir: str | os.PathLike, mode: str, world: int, dp: int | None = None, tp: int | None = None,
         steps: int = 2, dtype: str = "float32", config_out: str | os.PathLike | None = None) -> None:
    """A real DCP checkpoint in ``out_dir`` from a ``mode`` job of ``world`` ranks after ``steps`` Adam steps.

    The model's ``config.json`` goes to ``config_out`` (default ``out_dir/config.json``). Raises
    ``RuntimeError`` with the job's output if it fails.
    """
    dp, tp = mesh_dims(mode, world, dp, tp)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}")
    config_out = Path(config_out) if config_out is not None else Path(out_dir) / "config.json"
    _run(["save", str(out_dir), mode, str(world), "--dp", str(dp), "--tp", str(tp), "--steps", str(steps),
          "--dtype", dtype, "--config-out", str(config_out)])


def load(ckpt_dir: str | os.PathLike, mode: str, world: int, dump_path: str | os.PathLike, dp: int | None = None,
         tp: int | None = None, train_step: bool = True, dtype: str | None = None) -> None:
    """Real ``dcp.load`` of ``ckpt_dir`` by a ``mode`` job of ``world`` ranks; full state to ``dump_path``.

    ``dtype`` (of the fresh model) defaults to the checkpoint's. Raises ``RuntimeError`` with the job's output
    if it fails.
    """
    dp, tp = mesh_dims(mode, world, dp, tp)
    dtype = dtype or checkpoint_dtype(ckpt_dir)
    args = ["load", str(ckpt_dir), mode, str(world), str(dump_path), "--dp", str(dp), "--tp", str(tp),
            "--dtype", dtype]
    _run([*args, *([] if train_step else ["--no-train-step"])])


# Failures worth one more run: the port picked was taken before rank 0 bound it, or a rank died of a
# signal (gloo on CPU has been seen to crash in teardown).
_FLAKY = re.compile(r"(?i)address already in use|EADDRINUSE|terminated with signal|Signal \d+ \(SIG")


def _run(argv: list[str], timeout: float = JOB_TIMEOUT) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    code, output = _run_once(cmd, env, timeout)
    if code and _FLAKY.search(output):
        first = output
        code, output = _run_once(cmd, env, timeout)
        output = f"{first}\n--- ran the job again ---\n{output}"
    if code:
        raise RuntimeError(f"dcp job {' '.join(argv)} failed (exit {code}):\n{output[-6000:]}")


def _run_once(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            try:  # whatever the job left behind goes with it
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        out.seek(0)
        text = out.read().decode(errors="replace")
    if code == -1:
        text += f"\n--- timed out after {timeout:.0f} s ---"
    return code, text


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- inside the ranks ----------------------------------------------------------------------------------------


def _parallelize(model, mode: str, dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mode == "fsdp":
        dp_mesh, tp_mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",)), None
    elif mode == "tp":
        dp_mesh, tp_mesh = None, init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    if tp_mesh is not None:
        plan = {**{name: ColwiseParallel() for name in COLWISE}, **{name: RowwiseParallel() for name in ROWWISE}}
        for layer in model.model.layers:
            parallelize_module(layer, tp_mesh, plan)
    if dp_mesh is not None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def _batch(step: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, CONFIG["vocab_size"], BATCH, generator=gen)


def _train_step(model, opt, step: int) -> float:
    tokens = _batch(step)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach().float().item())


def _full_state(model, opt) -> dict[str, Any]:
    """``get_state_dict`` of the job flattened to DCP's keys, DTensors gathered (a collective: all ranks call it)."""
    import copy

    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, opt)
    out = {}
    for key, value in flatten({"model": msd, "optim": osd}).items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    return out


def _write(obj: dict, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _rank(rank: int, world: int, port: int, job: argparse.Namespace) -> None:
    import datetime
    import math

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    dtype = job.dtype
    if job.action == "save":
        model = _parallelize(make_model(SAVE_SEED, dtype), job.mode, job.dp, job.tp)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        for step in range(job.steps):
            loss = _train_step(model, opt, step)
            if not math.isfinite(loss):
                raise RuntimeError(f"rank {rank}: loss {loss} at step {step}")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=job.path)
        if rank == 0:
            config = model.config
            config.dtype = dtype
            Path(job.config_out).parent.mkdir(parents=True, exist_ok=True)
            config.to_json_file(job.config_out)
    else:
        model = _parallelize(make_model(LOAD_SEED, dtype), job.mode, job.dp, job.tp)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        msd, osd = get_state_dict(model, opt)  # creates Adam's state (step 1 at lr 0, zero moments) to load into
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=job.path)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        dump = _full_state(model, opt)
        if rank == 0:
            _write(dump, Path(job.dump))
        if job.train_step:
            loss = _train_step(model, opt, 10_000)
            if rank == 0:
                _write({**dump, "loss_after_step": loss}, Path(job.dump))
    dist.barrier()
    # No destroy_process_group(): gloo's teardown is the one place these jobs have crashed after finishing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    for action in ("save", "load"):
        s = sub.add_parser(action)
        s.add_argument("path", help="the checkpoint directory")
        s.add_argument("mode", choices=MODES)
        s.add_argument("world", type=int)
        if action == "load":
            s.add_argument("dump", help="torch file of the loaded state, flat keys")
            s.add_argument("--no-train-step", dest="train_step", action="store_false")
            s.add_argument("--dtype", choices=DTYPES, default=None, help="default: the checkpoint's")
        else:
            s.add_argument("--steps", type=int, default=2)
            s.add_argument("--dtype", choices=DTYPES, default="float32")
            s.add_argument("--config-out", default=None, help="default: PATH/config.json")
        s.add_argument("--dp", type=int, default=None)
        s.add_argument("--tp", type=int, default=None)
        s.add_argument("--port", type=int, default=None, help="default: a free one")
    r = sub.add_parser("reference")
    r.add_argument("path")
    r.add_argument("out")
    return p


def main(argv: list[str] | None = None) -> None:
    job = _parser().parse_args(argv)
    if job.action == "reference":
        reference(job.path, job.out)
        return
    job.dp, job.tp = mesh_dims(job.mode, job.world, job.dp, job.tp)
    if job.action == "save" and job.config_out is None:
        job.config_out = str(Path(job.path) / "config.json")
    if job.action == "load" and job.dtype is None:
        job.dtype = checkpoint_dtype(job.path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Import the heavy parts once, here, so forked ranks start warm.
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.multiprocessing as mp
    import transformers.models.llama.modeling_llama  # noqa: F401

    start = os.environ.get("DCP_JOBS_START", "fork")
    port = job.port or free_port()
    mp.start_processes(_rank, args=(job.world, port, job), nprocs=job.world, join=True, start_method=start)


if __name__ == "__main__":
    main()
