"""The ``reshard`` command: a thin shell over the library (``reshard.api``).

Each command declares its options, calls one library function and prints the
result. A ``ReshardError`` ends the command with its message on stderr and
exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Column, Table
from rich.text import Text

import reshard
from reshard.api.distributed import RankLost, launched_rank
from reshard.api.inspecting import inspect_spec
from reshard.core.layout import PARAM
from reshard.errors import ReshardError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Change a training checkpoint's parallel layout, bit-exactly.")
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

TopologyOpt = Annotated[str | None, typer.Option("--to", help="destination topology, e.g. tp=2,pp=2,dp=4,zero=1 (also ep=, cp=, vpp=, stages=)")]
FormatOpt = Annotated[str | None, typer.Option("--format", help="destination format: megatron, deepspeed, hf, dcp, mcore-dist, ucp (default: the source's)")]
SpecOpt = Annotated[str | None, typer.Option("--spec", help="destination layout: a generated name (megatron-llama-tied, hf-gpt2, ...) or a spec file by path")]
SizesOpt = Annotated[str | None, typer.Option("--sizes", help="model sizes the checkpoint does not tell (no config.json), e.g. heads=32,g=8")]
ShardOpt = Annotated[str | None, typer.Option("--max-shard-size", help="hf: largest safetensors shard, e.g. 5GB (default), 500MB")]
WorkersOpt = Annotated[str, typer.Option("--workers", help="processes writing byte-balanced shares of the destination "
                                          "side by side: a number, or auto (as many as help, up to one per core)")]
DistOptimOpt = Annotated[str | None, typer.Option("--dist-optim", help="mcore-dist with zero=1: the distributed optimizer's state as dp_reshardable or fully_reshardable; default: the source run's (dp_reshardable)")]
VocabPadOpt = Annotated[str | None, typer.Option("--vocab-pad", help="megatron: rows padding the vocab for the target tp: zero or last (copies of the last row); default: the spec's (zeros)")]


def _sizes(text: str | None) -> dict[str, int] | None:
    """``heads=32,g=8`` -> {"heads": 32, "g": 8}."""
    if not text:
        return None
    out_: dict[str, int] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip().isdigit():
            raise ReshardError(f"--sizes: '{part}' is not name=integer (e.g. heads=32,g=8)")
        out_[key.strip()] = int(value)
    return out_


def _workers(text: str) -> int | str:
    """``auto`` or a positive integer."""
    if text.strip().lower() == "auto":
        return "auto"
    if not text.strip().isdigit() or int(text) < 1:
        raise ReshardError(f"--workers: '{text}' is not auto or a number of at least 1")
    return int(text)


def _user_errors(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ReshardError as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(code=2) from None

    return run


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.command()
@_user_errors
def convert(
    src: Annotated[str, typer.Argument(help="source checkpoint directory, or an fsspec URL (s3://..., "
                                        "read with range requests)")],
    dst: Annotated[str, typer.Argument(help="destination directory (must not exist, or be empty), or an fsspec URL "
                                        "(s3://...: assembled in TMPDIR, then uploaded in parts, the manifest last)")],
    to: TopologyOpt = None,
    format: FormatOpt = None,
    spec: SpecOpt = None,
    workers: WorkersOpt = "auto",
    memory_budget: Annotated[str, typer.Option("--memory-budget", help="memory the conversion may hold, workers included, "
                                               "e.g. 512MiB, 4GiB; auto: three quarters of the memory available")] = "auto",
    sizes: SizesOpt = None,
    max_shard_size: ShardOpt = None,
    vocab_pad: VocabPadOpt = None,
    dist_optim: DistOptimOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the plan; read and write nothing")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="continue an interrupted conversion to DST, keeping the files it "
                                         "finished whose checksums verify")] = False,
    direct_io: Annotated[bool, typer.Option("--direct-io/--no-direct-io",
                                            help="write windows of 1 MiB or more directly to the disk (O_DIRECT, where "
                                                 "the file system allows it); --no-direct-io: through the page cache")] = True,
) -> None:
    """Rewrite SRC for another topology (and format) at DST, streaming.

    The output appears at DST only when complete. A conversion that is killed or
    interrupted leaves a hidden .DST.reshard-partial beside it; the same command
    with --resume continues it.

    Under torchrun (torchrun ... -m reshard convert ...), on one host or many, the
    ranks write byte-balanced shares of DST side by side; rank 0 reports."""
    if dry_run:
        _print_plan(reshard.plan(src, to=to, format=format, spec=spec, sizes=_sizes(sizes),
                                 max_shard_size=max_shard_size, vocab_pad=vocab_pad, dist_optim=dist_optim).to_json(workers=_workers(workers)))
        return
    follower = launched_rank() != 0  # a torchrun rank other than 0: rank 0 reports progress, the result and errors
    columns = (TextColumn("converting"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    # redrawn from the progress callback, not by a thread of rich's: a conversion in one thread forks its workers
    with Progress(*columns, console=err, transient=True, disable=follower or not err.is_terminal,
                  auto_refresh=False) as bar:
        task = bar.add_task("convert", total=None)
        drawn = [0.0]

        def show(done: int, total: int) -> None:  # redrawn at most 10 times a second
            due = time.monotonic() - drawn[0] >= 0.1
            bar.update(task, completed=done, total=total, refresh=due)
            if due:
                drawn[0] = time.monotonic()

        try:
            result = reshard.convert(src, dst, to=to, format=format, spec=spec, sizes=_sizes(sizes), workers=_workers(workers),
                                     memory_budget=memory_budget, max_shard_size=max_shard_size, vocab_pad=vocab_pad,
                                     dist_optim=dist_optim, progress=show, resume=resume, direct_io=direct_io)
        except KeyboardInterrupt:
            if not follower:
                err.print(f"interrupted: {dst} was not written; the same command with --resume continues where this "
                          "one stopped", highlight=False)
            raise typer.Exit(code=130) from None
        except ReshardError as e:
            if follower and not isinstance(e, RankLost):
                raise typer.Exit(code=2) from None  # rank 0 prints it
            raise
    r = result.report
    if r is None:  # a rank other than 0
        return
    out.print(f"wrote {result.path} ({r.target.format}, {r.target.topology}) from {r.source.path} "
              f"({r.source.format}, {r.source.topology}): {len(result.files)} files, {_bytes(result.bytes_written)} "
              f"in {result.seconds:.1f} s, {_bytes(result.bytes_read)} read"
              + (f" by {result.ranks} ranks" if result.ranks > 1 else "")
              + (f"; {result.reused} files kept from the interrupted conversion" if result.reused else ""),
              highlight=False)
    if r.dropped_states:
        out.print(f"not carried ({r.target.format} does not hold them): {', '.join(r.dropped_states)}", highlight=False)


@app.command("plan")
@_user_errors
def plan_cmd(
    src: Annotated[str, typer.Argument(help="source checkpoint directory, or an fsspec URL (s3://..., "
                                        "read with range requests)")],
    to: TopologyOpt = None,
    format: FormatOpt = None,
    spec: SpecOpt = None,
    sizes: SizesOpt = None,
    workers: WorkersOpt = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="print the plan report as JSON")] = False,
) -> None:
    """Show what moves where: per destination file the bytes, copies and source files; the work units; each
    worker's byte share."""
    report = reshard.plan(src, to=to, format=format, spec=spec, sizes=_sizes(sizes)).to_json(workers=_workers(workers))
    if as_json:
        out.print_json(json.dumps(report))
    else:
        _print_plan(report)


def _print_plan(report: dict) -> None:
    s, d = report["source"], report["destination"]
    out.print(f"{s['path']}: {s['format']} {s['topology']} ({s['spec']})  ->  {d['format']} {d['topology']} ({d['spec']})", highlight=False)
    table = Table("destination", "bytes", "copies", "from")
    for row in report["files"]:
        table.add_row(row["destination"], _bytes(row["bytes"]), str(row["copies"]), ", ".join(row["sources"]))
    out.print(table)
    summary = report["summary"]
    out.print(f"{summary['copies']} copies, {summary['elements_written']:,} elements; "
              f"{len(report['work_units'])} independent work units", highlight=False)
    for k, unit in enumerate(report["work_units"]):
        out.print(f"  unit {k}: {', '.join(unit['sources'])} -> {', '.join(unit['destinations'])}", highlight=False)
    shares = report.get("workers")
    if shares:
        out.print(f"{shares['workers']} worker{'s' if shares['workers'] != 1 else ''}, largest byte share "
                  f"{shares['largest_over_mean']:.2f} x the mean:", highlight=False)
        for k, row in enumerate(shares["shares"]):
            part = {p["file"]: f" ({_bytes(p['bytes'])} of it, {p['tensors']} tensors)" for p in row["parts"]}
            files = ", ".join(f + part.get(f, "") for f in row["files"])
            out.print(f"  worker {k}: {_bytes(row['bytes'])} in {len(row['files'])} file"
                      f"{'s' if len(row['files']) != 1 else ''}: {files}", highlight=False)
    if report["dropped_states"]:
        out.print(f"not carried: {', '.join(report['dropped_states'])}", highlight=False)


@app.command()
@_user_errors
def inspect(
    src: Annotated[Path, typer.Argument(help="checkpoint directory")],
    sizes: SizesOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print as JSON")] = False,
    as_spec: Annotated[bool, typer.Option("--spec", help="print the checkpoint's layout in the spec language, "
                                          "the start of a spec of your own")] = False,
) -> None:
    """Format, topology, model, progress, optimizer states, and every tensor with its dtypes and sizes."""
    if as_json and as_spec:
        raise ReshardError("--json and --spec each print the checkpoint whole: give one of them")
    if as_spec:
        typer.echo(inspect_spec(src, sizes=_sizes(sizes)), nl=False)
        return
    info = reshard.inspect(src, sizes=_sizes(sizes))
    if as_json:
        out.print_json(json.dumps(info))
        return
    for line in _summary(info):
        typer.echo(line)
    header = ("tensor", "shape", *info["states"])
    rows = [(name, "x".join(map(str, row["shape"])) or "scalar",
             *(f"{row['states'][s]['dtype']} {_bytes(row['states'][s]['bytes'])}" if s in row["states"] else "-"
               for s in info["states"]))
            for name, row in info["tensors"].items()]
    _print_table(header, rows)


def _summary(info: dict) -> list[str]:
    """The lines above ``inspect``'s table: what the checkpoint is, then what it holds."""
    model, progress = info["model"], info["progress"]
    identity = [f"family {model['family']}"] if model["family"] else []
    if model["model_type"] is not None:
        identity.append(f"model_type {model['model_type']}")
    archs = model["architectures"]
    if archs:
        identity.append(", ".join(map(str, archs)) if isinstance(archs, list) else str(archs))
    done = [f"{k} {progress[k]}" for k in ("iteration", "step", "lr") if progress[k] is not None]
    optim = info["optimizer_states"]
    return [
        f"{info['path']}: {info['format']} ({info['spec']}), {info['topology']}, {len(info['files'])} "
        f"file{'' if len(info['files']) == 1 else 's'}, {_bytes(info['bytes'])}",
        "model: " + ("; ".join(identity) if identity else "not recorded"),
        "progress: " + (", ".join(done) if done else "not recorded"),
        "sizes: " + (", ".join(f"{k}={v}" for k, v in sorted(info["sizes"].items())) or "none recorded"),
        f"tensors: {info['tensor_count']}, {sum(info['dtypes'].values())} tensor states: "
        + ", ".join(f"{n} {d}" for d, n in info["dtypes"].items()),
        "optimizer state: " + (", ".join(optim) if optim else "none (weights only)"),
    ]


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A table in a terminal (long tensor names folded, never cut short); plain aligned lines otherwise,
    one row a line, so a pipe or a file gets every name whole."""
    if out.is_terminal:
        table = Table(*(Column(Text(h), overflow="fold") for h in header))
        for row in rows:
            table.add_row(*map(Text, row))
        out.print(table)
        return
    widths = [max(len(r[k]) for r in (header, *rows)) for k in range(len(header))]
    for row in (header, *rows):
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@app.command()
@_user_errors
def verify(
    a: Annotated[Path, typer.Argument(help="first checkpoint")],
    b: Annotated[Path | None, typer.Argument(help="second checkpoint (any layout or format); "
                                                  "without it, check A against its reshard.json")] = None,
    states: Annotated[str | None, typer.Option("--states", help="compare only these states, comma-separated (e.g. param)")] = None,
    sizes: SizesOpt = None,
) -> None:
    """Compare two checkpoints' logical tensors bit for bit, or one against its manifest; exit 0 only if identical."""
    result = reshard.verify(a, b, states=tuple(states.split(",")) if states else None, sizes=_sizes(sizes))
    what = "logical tensors compared" if b is not None else "files checked against reshard.json"
    if result.by_checksum:
        what += f", {result.by_checksum} of them by the logical checksums in both manifests"
    if result:
        out.print(f"identical: {result.compared} {what}" if b is not None else f"intact: {result.compared} {what}",
                  highlight=False)
        return
    for line in result.differences:
        err.print(line, highlight=False, markup=False)
    err.print(f"{'checkpoints differ' if b is not None else 'checkpoint does not match its manifest'} "
              f"({result.compared} {what})", highlight=False)
    raise typer.Exit(code=1)


@app.command()
@_user_errors
def fixture(
    out_dir: Annotated[Path, typer.Argument(metavar="OUT", help="directory to write")],
    format: Annotated[str, typer.Option("--format", help="megatron, deepspeed, hf or dcp")] = "megatron",
    to: Annotated[str, typer.Option("--to", help="topology of the simulated ranks")] = "tp=1",
    model: Annotated[str, typer.Option("--model", help="tiny-llama, tiny-llama-tied, tiny-gpt2")] = "tiny-llama",
) -> None:
    """Write a checkpoint exactly as the simulated ranks of a topology would (deterministic values)."""
    from reshard.fixtures import make_fixture

    files = make_fixture(out_dir, format=format, to=to, model=model)
    out.print(f"wrote {out_dir}: {model}, {format}, {to}, {len(files)} files", highlight=False)


@app.command()
@_user_errors
def demo(
    workdir: Annotated[Path | None, typer.Option("--dir", help="where to write (default: a temporary directory)")] = None,
) -> None:
    """Make a Megatron fixture at tp=2,pp=2, reshard it, convert it to HF, verify both, print a summary."""
    from reshard.fixtures import make_fixture

    with tempfile.TemporaryDirectory(prefix="reshard-demo-") as tmp:
        base = workdir or Path(tmp)
        src, dst, hf = base / "megatron-tp2-pp2", base / "megatron-tp1-pp4-vpp", base / "hf"
        make_fixture(src, format="megatron", to="tp=2,pp=2", model="tiny-llama")
        table = Table("step", "from -> to", "files", "bytes", "s", "result")
        first = reshard.convert(src, dst, to="tp=1,pp=2,vpp=2")
        check = reshard.verify(src, dst)
        table.add_row("convert", f"{first.report.source.topology} -> {first.report.target.topology}", str(len(first.files)),
                      _bytes(first.bytes_written), f"{first.seconds:.2f}", "identical" if check else "DIFFERENT")
        second = reshard.convert(dst, hf, format="hf")
        check2 = reshard.verify(src, hf, states=(PARAM,))
        table.add_row("to hf", f"{second.report.source.topology} -> hf", str(len(second.files)),
                      _bytes(second.bytes_written), f"{second.seconds:.2f}", "identical" if check2 else "DIFFERENT")
        out.print(table)
        out.print(f"{check.compared} logical tensors (weights and optimizer state) compared bit for bit; "
                  f"files in {base if workdir else 'a temporary directory (use --dir to keep them)'}", highlight=False)
        if not (check and check2):
            for line in (*check.differences, *check2.differences):
                err.print(line, highlight=False, markup=False)
            raise typer.Exit(code=1)


def main() -> None:
    app(prog_name="reshard")


if __name__ == "__main__":
    sys.exit(main())
