"""The layers are folders and imports only go down: a module imports nothing from a layer above its own.

Order, bottom to top: errors, core, io, models, execution, formats, api, torch (loading into a running job),
the fixtures (simulated ranks), the command line and ``python -m reshard`` (``reshard/__main__.py``, running the
command line). The core (spec language, resolution, planner) imports no torch and no format.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["reshard.errors", "reshard.core", "reshard.io", "reshard.models", "reshard.execution", "reshard.formats",
          "reshard.api", "reshard.torch", "reshard.fixtures", "reshard.cli",
          "reshard.__main__"]
FOLDERS = {"reshard": "reshard", "cli": "reshard.cli", "fixtures": "reshard.fixtures"}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[parts[0]], *parts[1:]]).replace("reshard.reshard", "reshard")


def _layer(module: str) -> int | None:
    hits = [k for k, prefix in enumerate(LAYERS) if module == prefix or module.startswith(prefix + ".")]
    return max(hits) if hits else None


def _modules() -> list[Path]:
    return sorted(p for top in FOLDERS for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_only_go_down(path):
    me = _module(path)
    mine = _layer(me)
    up = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            theirs = _layer(name)
            if mine is not None and theirs is not None and theirs > mine:
                up.append(f"line {node.lineno}: {name} ({LAYERS[theirs]} is above {LAYERS[mine]})")
    assert not up, f"{me} imports upward: " + "; ".join(up)


def test_the_core_imports_neither_torch_nor_a_format():
    code = ("import sys, reshard.core.spec, reshard.core.resolve, reshard.core.planner, reshard.models.catalog; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('reshard.formats', 'reshard.io'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
