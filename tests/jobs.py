"""Running the multi-process jobs the interop tests use (torch DCP, megatron-core) robustly."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def run_job(cmd: list[str], env: dict[str, str], timeout: float = 600) -> tuple[int, str]:
    """Run a multi-process job in its own session; whatever it leaves behind (helper processes that
    outlive their rank) is killed with it, and output goes to a file so no leftover can hold a pipe.

    A job whose rank died of a signal (gloo on CPU has crashed in teardown, rarely) runs once more, and so
    does one whose rendezvous port another process took between its choice and its use (EADDRINUSE), on
    fresh ports (every ``*_PORT`` of ``env``); the retry is reported in the output. Any other failure is
    returned as it is.
    """
    code, output = _run_once(cmd, env, timeout)
    if code and re.search(r"terminated with signal (SIGSEGV|SIGABRT|SIGBUS)|Signal (6|11) \(SIG", output):
        again, more = _run_once(cmd, env, timeout)
        return again, f"{output}\n--- a rank died of a signal; ran the job again ---\n{more}"
    if code and "EADDRINUSE" in output:
        env = {**env, **{k: str(free_port()) for k in env if k.endswith("_PORT")}}
        again, more = _run_once(cmd, env, timeout)
        return again, f"{output}\n--- its port was taken; ran the job again on another ---\n{more}"
    return code, output


def free_port() -> int:
    """A port on 127.0.0.1 that no one listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_once(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    import signal
    import tempfile

    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        return code, out.read().decode(errors="replace")


def run_ranks(script: str, args: list[str], what: str) -> None:
    """Run ``python script *args`` (a job that spawns its ranks) with a free port in ``RESHARD_MCORE_PORT``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESHARD_MCORE_PORT": str(port)}
    code, err = run_job([sys.executable, script, *args], env)
    if code:
        raise RuntimeError(f"{what} job {args} failed ({code}):\n{err[-4000:]}")


MEGATRON = ("megatron.core.parallel_state", "megatron.core.distributed", "megatron.core.models.gpt",
            "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.optimizer", "megatron.core.dist_checkpointing",
            "megatron.core.transformer.transformer_config")
"""What a megatron-core job's ranks import: ``spawn`` imports it once, before the ranks fork."""


def spawn(fn, args: tuple, nprocs: int, preload: tuple[str, ...] = MEGATRON) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from this one after it imported ``preload``, so that no
    rank imports them again (megatron-core takes some 4 s a rank to import; a spawned rank starts a fresh
    interpreter). Nothing here has started a thread pool or a process group before the fork: the jobs run with
    ``OMP_NUM_THREADS=1`` and each rank initializes its own group."""
    import importlib
    import warnings

    import torch.multiprocessing as mp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ranks' own imports would say it again
        for module in preload:
            importlib.import_module(module)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="fork")


def exit_now() -> None:
    """End a rank that finished its work without running C++ static destructors (gloo's threads sometimes
    abort at interpreter exit, failing a job that succeeded), stopping its helper processes first."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
