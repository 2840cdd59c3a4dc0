"""Long fuzzing runs of every reader of untrusted input, outside the test command.

Each target runs in a child process for a fixed time, drawing mutations of a real seed file (see
``tests/fuzzing.py``) or, for ``spec``, whole specs generated from the grammar and carried through
resolver, planner and a bit-exact round trip (see ``tests/spec_gen.py``). Anything but reshard's own
error is a crash: the first of each kind (exception type and the innermost reshard frame) is saved
under ``tests/fuzz_regressions/<target>/``, where ``tests/properties/test_fuzz.py`` replays it on every test run.
Children run with a memory limit and a per-example alarm, so a size field that drives a huge
allocation or a loop that never ends is a crash too, not a dead machine.

    python bench/fuzz.py --minutes 30                   # every target, 30 minutes each
    python bench/fuzz.py --minutes 30 --jobs 2          # two targets at a time
    python bench/fuzz.py --targets torch-zip,spec --minutes 1 --no-save

Prints a markdown table: examples tried, examples per second, crashes found (distinct kinds) and
how many of those replay cleanly at the end of the run (fixed); ``--json`` writes the figures too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ROOT / "tests"
SPEC = "spec"
MEMORY_LIMIT = 8 << 30  # bytes of address space per child
ALARM_S = 60  # one example taking longer than this is a hang


def _target_names() -> list[str]:
    from fuzzing import all_targets

    return [*all_targets(), SPEC]


class _Hang(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Hang(f"one example ran past {ALARM_S} s")


def _spec_loop(deadline: float, rng: random.Random, save: bool) -> dict:
    from spec_gen import check_case, random_case

    from fuzzing import REGRESSIONS, crash_site
    from reshard.errors import ReshardError

    found: dict[tuple[str, str], str] = {}
    outcomes: dict[str, int] = {}
    n = 0
    while time.monotonic() < deadline:
        case = random_case(rng)
        n += 1
        signal.alarm(ALARM_S)
        try:
            outcome = check_case(case)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        except ReshardError:  # check_case returns for reshard's errors; one escaping is still clean
            outcomes["rejected"] = outcomes.get("rejected", 0) + 1
        except Exception as e:  # noqa: BLE001 - the finding
            key = (type(e).__name__, crash_site(e))
            if key not in found:
                found[key] = f"{type(e).__name__}: {e}"[:300]
                if save:
                    blob = json.dumps({"case": asdict(case), "error": found[key], "where": key[1]}, indent=1)
                    out = REGRESSIONS / SPEC
                    out.mkdir(parents=True, exist_ok=True)
                    (out / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json").write_text(blob + "\n")
        finally:
            signal.alarm(0)
    return {"examples": n, "crashes": [{"kind": k[0], "where": k[1], "error": v} for k, v in found.items()],
            "outcomes": outcomes}


def _file_loop(name: str, deadline: float, rng: random.Random, save: bool) -> dict:
    from fuzzing import Seed, all_targets, save_crash

    seed = Seed(all_targets()[name], Path(tempfile.mkdtemp(prefix=f"reshard-fuzz-{name}-")))
    found: dict[tuple[str, str], object] = {}
    n = 0
    while time.monotonic() < deadline:
        rel, data = seed.draw(rng)
        n += 1
        signal.alarm(ALARM_S)
        try:
            crash = seed.run(rel, data)
        except _Hang as e:
            from fuzzing import Crash

            crash = Crash(name, rel, data, f"hang: {e}", "(hang)")
        finally:
            signal.alarm(0)
        if crash is not None and crash.key not in found:
            found[crash.key] = crash
            if save:
                save_crash(crash)
    fixed = sum(seed.run(c.file, c.data) is None for c in found.values())
    return {"examples": n, "fixed_at_end": fixed,
            "crashes": [{"kind": c.key[0], "where": c.key[1], "file": c.file, "error": c.error} for c in found.values()]}


def child(name: str, seconds: float, seed: int | None, save: bool) -> dict:
    """One target's run, in this process (started by ``main`` with ``--child``)."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    signal.signal(signal.SIGALRM, _on_alarm)
    rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
    started = time.monotonic()
    if name == SPEC:
        result = _spec_loop(started + seconds, rng, save)
    else:
        result = _file_loop(name, started + seconds, rng, save)
    result.update(target=name, seconds=round(time.monotonic() - started, 1))
    return result


def _run_child(name: str, seconds: float, seed: int | None, save: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--seconds", str(seconds),
               "--out", out.name, *([] if save else ["--no-save"]), *([] if seed is None else ["--seed", str(seed)])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        text = Path(out.name).read_text()
    if proc.returncode != 0 or not text:
        return {"target": name, "seconds": seconds, "examples": 0, "crashes": [
            {"kind": f"exit {proc.returncode}", "where": "(driver)", "error": proc.stderr.strip()[-400:]}]}
    return json.loads(text)


def _table(results: list[dict]) -> str:
    lines = ["| target | minutes | examples | examples/s | crashes found | fixed at the end |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        found = len(r["crashes"])
        fixed = r.get("fixed_at_end", "")
        lines.append(f"| {r['target']} | {r['seconds'] / 60:.1f} | {r['examples']:,} | "
                     f"{r['examples'] / max(r['seconds'], 1e-9):,.0f} | {found} | {fixed} |")
    for r in results:
        for c in r["crashes"]:
            lines.append(f"\n- {r['target']}: {c['kind']} at {c['where']}: {c['error'][:200]}")
        if "outcomes" in r:
            total = sum(r["outcomes"].values()) or 1
            share = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(r["outcomes"].items()))
            lines.append(f"\n- {r['target']}: {share}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="per target (default 30)")
    ap.add_argument("--targets", default="", help="comma-separated names (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="targets run at a time")
    ap.add_argument("--seed", type=int, default=None, help="a fixed random seed (default: from the OS)")
    ap.add_argument("--no-save", action="store_true", help="do not write crashes to tests/fuzz_regressions/")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path[:0] = [str(TESTS), str(ROOT)]
        args.out.write_text(json.dumps(child(args.child, args.seconds, args.seed, not args.no_save)))
        return
    sys.path[:0] = [str(TESTS), str(ROOT)]
    names = [t for t in args.targets.split(",") if t] or _target_names()
    unknown = sorted(set(names) - set(_target_names()))
    if unknown:
        ap.error(f"unknown targets {unknown} (known: {', '.join(_target_names())})")
    print(f"fuzzing {len(names)} targets, {args.minutes:g} min each, {args.jobs} at a time", flush=True)

    def one(name: str) -> dict:
        r = _run_child(name, args.minutes * 60, args.seed, not args.no_save)
        print(f"  {name}: {r['examples']:,} examples, {len(r['crashes'])} crash kinds", flush=True)
        return r

    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one, names))
    print(_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    sys.exit(1 if any(len(r["crashes"]) > r.get("fixed_at_end", 0) for r in results) else 0)


if __name__ == "__main__":
    main()
