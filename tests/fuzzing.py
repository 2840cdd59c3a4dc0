"""Mutation fuzzing of every reader of untrusted files, shared by the tests and by ``bench/fuzz.py``.

A **target** writes a real file or checkpoint once (the seed), and reads it back through a
public entry point. The fuzzer mutates one file of the seed at a time (truncations, byte
flips, integers overwritten with boundary values, digit runs replaced, splices) and reads
again. Whatever the bytes, the only exception allowed out of a reader is reshard's own
``ReshardError``; anything else is a **crash**.

Everything here is driven by a ``random.Random``: the deterministic test suite draws its
generators from hypothesis under the derandomized ``ci`` profile, and the long runs of
``bench/fuzz.py`` seed them from the clock. A crash found by a long run is saved under
``tests/fuzz_regressions/<target>/`` (the mutated file's bytes and which file of the seed
they replace) and replayed by ``tests/properties/test_fuzz.py`` from then on.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from reshard.errors import ReshardError

REGRESSIONS = Path(__file__).parent / "fuzz_regressions"

# Integers that break unchecked offset arithmetic: zero, one, sign bits, all ones, the
# largest values of each width.
_BOUNDARY = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF,
             0x7FFF_FFFF_FFFF_FFFF, 0x8000_0000_0000_0000, 0xFFFF_FFFF_FFFF_FFFF)
_DECIMALS = ("0", "1", "-1", "-9999999999", "4294967296", "9223372036854775807", "18446744073709551616",
             "1e308", "99999999999999999999999999", "1.5", "NaN")


@dataclass(frozen=True)
class Target:
    """One reader of untrusted input, fed mutations of a real file it reads cleanly."""

    name: str
    """Short name, used on the command line and as the regression folder's name."""
    doc: str
    """What the seed is and which entry point reads it, for the report."""
    build: Callable[[Path], None]
    """Writes the seed (one file or a whole checkpoint) into an empty directory."""
    check: Callable[[Path, Path], None]
    """Reads the seed directory through the entry point; the second path is an empty scratch directory."""
    mutable: Callable[[Path], list[Path]] = field(default=lambda root: _files(root))
    """The seed's files a mutation may replace (default: all of them)."""


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@dataclass(frozen=True)
class Crash:
    """An exception other than ``ReshardError`` escaping a reader."""

    target: str
    file: str
    """The seed file the mutation replaced, relative to the seed's root."""
    data: bytes
    error: str
    """``Type: message`` of the exception."""
    where: str
    """The innermost frame inside reshard (``file:line``): two crashes there are one bug."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.error.split(":", 1)[0], self.where)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to three random mutations of ``data``, each of a kind that breaks unchecked readers."""
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        out = _MUTATIONS[rng.randrange(len(_MUTATIONS))](out, rng)
    return bytes(out)


def _truncate(b: bytearray, rng: random.Random) -> bytearray:
    return b[: rng.randrange(len(b) + 1)]


def _flip(b: bytearray, rng: random.Random) -> bytearray:
    for _ in range(rng.randint(1, 8)):
        if b:
            b[rng.randrange(len(b))] = rng.randrange(256)
    return b


def _integer(b: bytearray, rng: random.Random) -> bytearray:
    """Overwrite 1, 2, 4 or 8 bytes with a boundary value (or the file's length), either byte order."""
    width = rng.choice((1, 2, 4, 8))
    if len(b) < width:
        return b
    at = rng.randrange(len(b) - width + 1)
    value = rng.choice(_BOUNDARY + (len(b), len(b) + 1, len(b) - at, rng.getrandbits(64)))
    value += rng.choice((0, 0, 1, -1))
    raw = (value % (1 << (8 * width))).to_bytes(width, rng.choice(("little", "little", "big")))
    b[at:at + width] = raw
    return b


def _digits(b: bytearray, rng: random.Random) -> bytearray:
    """Replace one run of ASCII digits (a JSON offset, a shape, a count) with an extreme number."""
    runs = [i for i in range(len(b)) if 48 <= b[i] <= 57 and (i == 0 or not 48 <= b[i - 1] <= 57)]
    if not runs:
        return _flip(b, rng)
    start = rng.choice(runs)
    end = start
    while end < len(b) and 48 <= b[end] <= 57:
        end += 1
    b[start:end] = rng.choice(_DECIMALS + (str(rng.getrandbits(rng.choice((8, 32, 70)))),)).encode()
    return b


def _splice(b: bytearray, rng: random.Random) -> bytearray:
    """Insert random bytes, delete a range, or repeat a range of the file."""
    at = rng.randrange(len(b) + 1)
    kind = rng.randrange(3)
    if kind == 0:
        b[at:at] = rng.randbytes(rng.randint(1, 64))
    elif kind == 1:
        del b[at:at + rng.randint(1, 64)]
    else:
        b[at:at] = b[at:at + rng.randint(1, 256)]
    return b


_MUTATIONS = (_truncate, _flip, _flip, _integer, _integer, _integer, _digits, _splice)


class Seed:
    """A target's seed, built once in ``workdir``, that mutations are tried against one at a time.

    Each try writes the mutated bytes over one file, reads, and puts the original back, so
    a long run costs one build.
    """

    def __init__(self, target: Target, workdir: Path) -> None:
        self.target = target
        self.root = workdir / "seed"
        self.scratch = workdir / "scratch"
        self.root.mkdir(parents=True)
        target.build(self.root)
        # A reader that cannot read its own clean seed is a broken target, not a finding.
        self._check()
        self.files = [p.relative_to(self.root).as_posix() for p in target.mutable(self.root)]
        if not self.files:
            raise RuntimeError(f"fuzz target {target.name}: the seed has no file to mutate")
        self.originals = {rel: (self.root / rel).read_bytes() for rel in self.files}

    def _check(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir()
        try:
            self.target.check(self.root, self.scratch)
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def draw(self, rng: random.Random) -> tuple[str, bytes]:
        """A file of the seed and a mutation of its bytes."""
        rel = rng.choice(self.files)
        return rel, mutate(self.originals[rel], rng)

    def run(self, rel: str, data: bytes) -> Crash | None:
        """Read the seed with ``rel`` replaced by ``data``; the crash, if anything but a ``ReshardError`` escapes."""
        path = self.root / rel
        path.write_bytes(data)
        try:
            self._check()
        except ReshardError:
            return None
        except RecursionError as e:  # too deep to format a traceback safely
            return Crash(self.target.name, rel, data, f"RecursionError: {e}", "(recursion)")
        except Exception as e:  # noqa: BLE001 - every other exception is the finding
            return Crash(self.target.name, rel, data, f"{type(e).__name__}: {e}"[:500], crash_site(e))
        finally:
            path.write_bytes(self.originals[rel])
        return None


def crash_site(e: BaseException) -> str:
    """The innermost traceback frame inside the reshard package, else the innermost one."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/reshard/" in f.filename.replace("\\", "/")]
    f = (ours or frames or [None])[-1]
    if f is None:
        return "?"
    return f"{Path(f.filename).name}:{f.lineno} ({f.name})"


def save_crash(crash: Crash, folder: Path = REGRESSIONS) -> Path:
    """Keep a crash as a regression file: ``<target>/<sha>.bin`` and its ``.json`` sidecar."""
    digest = hashlib.sha256(crash.file.encode() + b"\0" + crash.data).hexdigest()[:16]
    out = folder / crash.target
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{digest}.bin").write_bytes(crash.data)
    (out / f"{digest}.json").write_text(json.dumps({"file": crash.file, "error": crash.error, "where": crash.where},
                                                   indent=1) + "\n")
    return out / f"{digest}.bin"


def regressions(target: str, folder: Path = REGRESSIONS) -> Iterator[tuple[str, str, bytes]]:
    """Saved crashes of ``target``: (regression id, seed file it replaces, the bytes)."""
    for side in sorted((folder / target).glob("*.json")):
        meta = json.loads(side.read_text())
        yield side.stem, meta["file"], side.with_suffix(".bin").read_bytes()


def all_targets() -> dict[str, Target]:
    """Every fuzz target by name: the file readers, then whole checkpoints of each format."""
    import fuzz_formats
    import fuzz_readers

    targets = {t.name: t for t in (*fuzz_readers.TARGETS, *fuzz_formats.TARGETS)}
    if len(targets) != len(fuzz_readers.TARGETS) + len(fuzz_formats.TARGETS):
        raise RuntimeError("two fuzz targets share a name")
    return targets
