"""The wheel installs everything under the ``reshard`` namespace, and an installed copy finds its shipped specs.

The repository keeps ``cli/``, ``specs/`` and ``fixtures/`` at its top level; pyproject.toml maps them to
``reshard.cli``, ``reshard.specs`` and ``reshard.fixtures``. A generic top-level ``cli`` or ``specs`` in a
user's site-packages would collide with their own packages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources: an in-tree build writes ``build/`` and ``*.egg-info`` into the
    repository and ships whatever stale modules an earlier build left in ``build/``, and it can trip over the
    bytecode that other test processes write into the tree meanwhile."""
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("wheel")
    shutil.copy2(ROOT / "pyproject.toml", tree)
    for folder in ("reshard", "cli", "specs", "fixtures"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", str(tree), "--no-deps", "--no-build-isolation",
                            "-w", str(out)], cwd=out, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    (found,) = out.glob("reshard-*.whl")
    return found


def test_the_wheel_has_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"reshard", wheel.name.split("-py3")[0] + ".dist-info"}
    shipped = {Path(n).name for n in names if n.startswith("reshard/specs/")}
    assert {p.name for p in (ROOT / "specs").glob("*.spec")} <= shipped
    assert "reshard/cli/main.py" in names and "reshard/fixtures/__init__.py" in names


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {v: k for k, v in config["package-dir"].items()}
    folders = set()
    for init in ROOT.glob("**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in ("reshard", *mapped) and not any(p.startswith(".") for p in rel.parts):
            top = mapped.get(rel.parts[0], rel.parts[0])
            folders.add(".".join((top, *rel.parts[1:])))
    assert folders == set(config["packages"])


def test_an_installed_copy_runs_the_demo_from_anywhere(wheel, tmp_path):
    """Installed (not editable), run from a directory with a ``specs/`` folder of its own: the shipped
    specs come from the package, and the demo's conversions verify."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    assert not {"cli", "specs", "fixtures"} & {p.name for p in site.iterdir()}
    work = tmp_path / "work"
    (work / "specs").mkdir(parents=True)
    (work / "specs" / "llama.spec").write_text("this is not a spec\n")
    (work / "llama.spec").write_text("nor is this\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    run = subprocess.run([sys.executable, "-c", "import reshard.cli.main as m, sys; sys.argv = ['reshard', 'demo']; "
                          "print(m.__file__); m.main()"], cwd=work, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith(str(site))
    assert "compared bit for bit" in run.stdout and "DIFFERENT" not in run.stdout
