"""Real megatron-core ``torch_dist`` checkpoints written on this CPU machine (gloo, no CUDA).

Importable without side effects and runnable as a script::

    python tests/interop/mcore_dist_job.py save OUT TP PP [--world N] [--optimizer [SHARDING]]
                                               [--training-dict] [--padded-vocab N] [--local-dump DIR]
    python tests/interop/mcore_dist_job.py dump OUT FILE.pt

``save`` runs this file in a fresh Python process (its own session, killed with
everything it leaves behind), which spawns ``world`` gloo ranks with
``torch.multiprocessing.spawn`` (``world = tp * pp * dp``; default ``dp = 1``).
Each rank builds its pipeline stage of a small Llama-style megatron-core
``GPTModel`` (GQA, SwiGLU, RMSNorm, no biases, untied output layer, rotary,
vocabulary padded to a multiple of ``128 * tp`` as Megatron-LM pads it) with the
local (non Transformer-Engine) layer spec and megatron-core's CPU
initialization, and saves it with ``megatron.core.dist_checkpointing.save``
(default ``torch_dist`` strategy).

Initialization is deterministic and independent of tp: every rank seeds
``torch.manual_seed(SEED)``, and with ``use_cpu_initialization`` megatron-core
draws each full (global, unsplit) weight and keeps this rank's slice. Stages of
a pipeline draw only their own layers, so values differ between pp sizes, and
the padded vocabulary changes the embedding's draw (pass ``padded_vocab_size``
to pin it when comparing tp sizes).

What is saved:

- weights only (default): ``model.sharded_state_dict()`` itself (``common.pt``
  is then ``{}``);
- ``training_dict=True``: Megatron-LM's training layout ``{"model": ...,
  "iteration": 1, "checkpoint_version": 3.0}`` with Megatron-LM's
  ``content_metadata``;
- ``optimizer``: the training layout plus ``"optimizer"``: the model is
  wrapped in megatron-core's ``DistributedDataParallel`` with the distributed
  optimizer (Adam), every parameter gets a deterministic fake gradient (no
  forward pass: it needs CUDA), one optimizer step runs, and the optimizer's
  ``sharded_state_dict`` in the requested ``distrib_optim_sharding_type``
  (``True`` means ``dp_reshardable``, Megatron-LM's default; or
  ``"fully_reshardable"``) is saved too.

CUDA calls megatron-core makes on these paths are stubbed in every rank (see
``_stub_cuda`` and ``_stub_cuda_for_optimizer``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

SEED = 1234
SIZES = {"hidden": 64, "ffn": 160, "heads": 8, "groups": 4, "head_dim": 8, "vocab": 300, "layers": 2, "seq": 64}
VOCAB_DIVISIBLE_BY = 128
# distrib_optim_sharding_type values megatron-core 0.16.1 can save ('fully_sharded_model_space' fails there:
# "ShardedTensor.flattened_range is not supported").
SHARDINGS = ("dp_reshardable", "fully_reshardable")
CHECKPOINT_VERSION = 3.0
ITERATION = 1


def padded_vocab(tp: int, vocab: int = SIZES["vocab"]) -> int:
    """Megatron-LM's padding: up to a multiple of ``make_vocab_size_divisible_by * tp``."""
    multiple = VOCAB_DIVISIBLE_BY * tp
    return -(-vocab // multiple) * multiple


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save(out_dir, tp: int, pp: int, *, world: int | None = None, optimizer: bool | str = False,
         training_dict: bool = False, layers: int = SIZES["layers"], padded_vocab_size: int | None = None,
         local_dump=None, timeout: float = 600) -> float:
    """Write a real torch_dist checkpoint to ``out_dir`` with ``world`` (default ``tp * pp``) gloo ranks.

    ``optimizer``: False (weights only), True (distributed-optimizer state in Megatron-LM's default
    ``dp_reshardable`` format) or a sharding type from ``SHARDINGS``. ``local_dump``: a directory where
    each rank also writes its module ``state_dict()`` (the tensors as megatron holds them in memory) to
    ``rank{r}.pt`` with its ``tp``/``pp``/``dp`` coordinates. Returns the job's wall time in seconds.
    """
    world = world or tp * pp
    if world % (tp * pp):
        raise ValueError(f"world {world} is not a multiple of tp*pp={tp * pp}")
    sharding = optimizer if isinstance(optimizer, str) else ("dp_reshardable" if optimizer else "")
    if sharding and sharding not in SHARDINGS:
        raise ValueError(f"unknown optimizer sharding {sharding!r}; one of {SHARDINGS}")
    cmd = [sys.executable, os.path.abspath(__file__), "save", str(out_dir), str(tp), str(pp),
           "--world", str(world), "--layers", str(layers)]
    if sharding:
        cmd += ["--optimizer", sharding]
    if training_dict:
        cmd += ["--training-dict"]
    if padded_vocab_size:
        cmd += ["--padded-vocab", str(padded_vocab_size)]
    if local_dump:
        cmd += ["--local-dump", str(local_dump)]
    return _run(cmd, timeout)


def dump_full(out_dir, path) -> None:
    """Every tensor of the checkpoint in full (global shape) under its flat DCP key, via torch's
    ``dcp_to_torch_save``, into the torch file ``path``. Non-tensor entries come out too: the
    ``_extra_state/shard_*`` objects as ``io.BytesIO`` and the ``common.pt`` content is not included.
    Read it with ``torch.load(path, weights_only=False)`` (BytesIO is not on the weights-only list)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(out_dir), str(path))


def _run(cmd: list[str], timeout: float) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MCORE_JOB_PORT": str(free_port()), "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            try:  # whatever the ranks left behind goes with the session
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        log.seek(0)
        text = log.read().decode(errors="replace")
    if code:
        raise RuntimeError(f"megatron-core job {cmd[2:]} failed ({code}):\n{text[-6000:]}")
    return time.monotonic() - start


# ---------------------------------------------------------------- inside the ranks


def _stub_cuda(torch) -> None:
    """Saving calls ``torch.cuda.synchronize()`` and allocates a failure flag on
    ``torch.cuda.current_device()``; ``"cpu"`` keeps such allocations on the CPU."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _stub_cuda_for_optimizer(torch) -> None:
    """The distributed optimizer checks ``param.type()`` against ``torch.cuda.*Tensor`` names and
    allocates a few scalars with ``device="cuda"``: report CPU parameters under the CUDA type names
    and send every ``device="cuda"`` factory call (and ``Tensor.cuda()``) to the CPU."""
    from torch.overrides import TorchFunctionMode

    cuda_names = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                  "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}
    original_type = torch.nn.Parameter.type

    def param_type(self, *args, **kwargs):
        result = original_type(self, *args, **kwargs)
        return cuda_names.get(result, result) if not args and not kwargs else result

    def is_cuda(device) -> bool:
        return (isinstance(device, str) and device.startswith("cuda")) or (
            isinstance(device, torch.device) and device.type == "cuda")

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if is_cuda(kwargs.get("device")):
                kwargs = {**kwargs, "device": "cpu"}
            return func(*args, **kwargs)

    torch.nn.Parameter.type = param_type
    torch.Tensor.cuda = lambda self, *a, **k: self
    CudaToCpu().__enter__()  # for the rest of this rank process


def _build_model(torch, tp: int, pp: int, layers: int, vocab: int):
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = SIZES
    config = TransformerConfig(
        num_layers=layers, hidden_size=s["hidden"], ffn_hidden_size=s["ffn"], num_attention_heads=s["heads"],
        num_query_groups=s["groups"], kv_channels=s["head_dim"], gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab, max_sequence_length=s["seq"],
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False, position_embedding_type="rope")
    return config, model


def _rank(rank: int, world: int, a: argparse.Namespace, port: int) -> None:
    import torch

    _stub_cuda(torch)
    if a.optimizer:
        _stub_cuda_for_optimizer(torch)
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp)
    torch.manual_seed(SEED)  # every rank draws the same full master weights (use_cpu_initialization)
    config, model = _build_model(torch, a.tp, a.pp, a.layers, a.padded_vocab or padded_vocab(a.tp))
    # What Megatron-LM's training loop passes (megatron/training/checkpointing.py, mcore >= 0.14).
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if a.optimizer:
        metadata["distrib_optim_sharding_type"] = a.optimizer
        state = _with_optimizer(torch, config, model, metadata)
    elif a.training_dict:
        state = {"model": model.sharded_state_dict(metadata=metadata), "iteration": ITERATION,
                 "checkpoint_version": CHECKPOINT_VERSION}
    else:
        state = model.sharded_state_dict()
    if a.local_dump:
        coords = {"tp": parallel_state.get_tensor_model_parallel_rank(),
                  "pp": parallel_state.get_pipeline_model_parallel_rank(),
                  "dp": parallel_state.get_data_parallel_rank()}
        tensors = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        torch.save({"coords": coords, "state_dict": tensors}, os.path.join(a.local_dump, f"rank{rank}.pt"))
    wrapped = a.optimizer or a.training_dict
    dist_checkpointing.save(state, a.out, content_metadata=metadata if wrapped else None)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's static destructors, which sometimes abort at interpreter exit


def _with_optimizer(torch, config, model, metadata: dict) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=False, overlap_param_gather=False)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # clip_grad=0: gradient clipping asserts grad.type() == 'torch.cuda.FloatTensor'.
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                                 use_distributed_optimizer=True, params_dtype=torch.float32, bf16=False,
                                 fp16=False, clip_grad=0.0)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    # Fake gradients, a deterministic function of each parameter's own (tp-local) values, identical on all
    # dp ranks; then the usual DP reduce-scatter (an average of equal values) and one Adam step.
    ddp.zero_grad_buffer()
    with torch.no_grad():
        for p in ddp.module.parameters():
            p.main_grad.copy_(torch.sin(p.detach() * 37.0) * 0.01 + 0.001)
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("optimizer step was skipped")
    model_sd = ddp.module.sharded_state_dict(metadata=metadata)
    optim_sd = optimizer.sharded_state_dict(model_sd, metadata=metadata)
    return {"model": model_sd, "optimizer": optim_sd, "iteration": ITERATION,
            "checkpoint_version": CHECKPOINT_VERSION}


def _main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("save")
    p.add_argument("out")
    p.add_argument("tp", type=int)
    p.add_argument("pp", type=int)
    p.add_argument("--world", type=int, default=0)
    p.add_argument("--layers", type=int, default=SIZES["layers"])
    p.add_argument("--optimizer", nargs="?", const="dp_reshardable", default="", choices=("",) + SHARDINGS)
    p.add_argument("--training-dict", action="store_true")
    p.add_argument("--padded-vocab", type=int, default=0)
    p.add_argument("--local-dump", default="")
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("file")
    a = parser.parse_args(argv)
    if a.action == "dump":
        dump_full(a.out, a.file)
        return
    if "MCORE_JOB_PORT" not in os.environ:  # run by hand: go through save() for the process handling
        seconds = save(a.out, a.tp, a.pp, world=a.world or None, optimizer=a.optimizer or False,
                       training_dict=a.training_dict, layers=a.layers, padded_vocab_size=a.padded_vocab or None,
                       local_dump=a.local_dump or None)
        print(f"saved {a.out} in {seconds:.1f}s")
        return
    import torch.multiprocessing as mp

    world = a.world or a.tp * a.pp
    os.makedirs(a.out, exist_ok=True)
    if a.local_dump:
        os.makedirs(a.local_dump, exist_ok=True)
    mp.spawn(_rank, args=(world, a, int(os.environ["MCORE_JOB_PORT"])), nprocs=world)


if __name__ == "__main__":
    _main(sys.argv[1:])
