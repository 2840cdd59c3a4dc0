from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import reshard
import reshard.formats.base
from reshard.execution.arrays import apply, gather, scatter
from reshard.core.layout import Layout
from reshard.core.resolve import resolve
from reshard.core.planner import plan
from reshard.core.spec import parse_spec
from reshard.core.topology import parse_topology

# Hypothesis profiles. ``ci``, the default, is deterministic: derandomized and with no example
# database, so the same commit gives the same result on every run and machine. ``fuzz`` is for
# long random runs outside the test command (``pytest tests/properties
# --hypothesis-profile=fuzz``; ``python bench/fuzz.py`` runs the file readers for minutes each).
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
settings.register_profile("fuzz", derandomize=False, database=None, deadline=None, max_examples=20_000,
                          print_blob=True, suppress_health_check=_QUIET)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The real frameworks the ``interop`` tests run. They are part of the test command's install
# (``.[test,interop]``), so a missing one fails its tests instead of skipping them.
INTEROP = {"deepspeed": "deepspeed", "transformers": "transformers", "megatron.core": "megatron-core"}


def require(module: str):
    """Import a real framework for an interop test; a missing package fails the test, never skips it."""
    if module == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is the same finding
        package = INTEROP.get(module, module)
        pytest.fail(f"{module} is not importable ({type(e).__name__}: {e}); the interop tests need {package}: "
                    "pip install -c constraints.txt -e '.[test,interop]'", pytrace=False)


@pytest.fixture
def mcore_legacy():
    """The older megatron-core the legacy-format tests run (``mcore_legacy_jobs``), installed beside the test
    environment's by ``.ci/run``; a missing install fails the test, naming the step that makes it."""
    import mcore_legacy_jobs

    if problem := mcore_legacy_jobs.missing():
        pytest.fail(problem, pytrace=False)
    return mcore_legacy_jobs.install_dir()


@pytest.fixture
def mcore(request, monkeypatch) -> str:
    """The megatron-core release a test's jobs run: the test environment's own, or, where the test is
    parametrized with ``RELEASES`` (``indirect``), another of ``mcore_releases``, whose folder then goes first on
    ``PYTHONPATH`` for every job the test starts; a missing install fails the test, naming the step that makes
    it. Its value is the release's version."""
    import mcore_releases

    version = getattr(request, "param", None)
    if version is None:
        from importlib.metadata import version as installed

        return installed("megatron-core")
    if problem := mcore_releases.missing(version):
        pytest.fail(problem, pytrace=False)
    monkeypatch.setenv("PYTHONPATH", mcore_releases.python_path(version))
    return version


def releases(*others: str):
    """Parametrize a test over the installed megatron-core and ``others`` (``mcore_releases``' versions), through
    the ``mcore`` fixture."""
    return pytest.mark.parametrize("mcore", [None, *others], indirect=True,
                                   ids=["mcore-installed", *(f"mcore-{v}" for v in others)])


@pytest.fixture
def wide(tmp_path, monkeypatch):
    """A Megatron checkpoint with tensors of several MiB, so that windows go directly."""
    import fixtures

    src = tmp_path / "wide"
    sizes = {"h": 256, "heads": 4, "g": 2, "hd": 64, "f": 512, "vocab": 4096, "layers": 4, "vocab_div": 128}
    monkeypatch.setitem(fixtures.MODELS, "wide-llama", fixtures.Model("hf-llama", sizes))
    fixtures.make_fixture(src, format="megatron", to="tp=2,pp=2,dp=1,zero=1", model="wide-llama")
    return src


def logical_values(layout: Layout, states: tuple[str, ...] = ("param",), dtype=np.float32) -> dict:
    """Distinct, position-dependent values for every logical tensor and state.

    Tensor k, state s holds ``arange + 100000 * (k + 1) + 7777 * s``, so any
    element moved to a wrong place, tensor or state shows up.
    """
    out = {}
    for s_index, state in enumerate(states):
        for k, (name, t) in enumerate(sorted(layout.tensors.items())):
            n = int(np.prod(t.shape))
            if t.blob:
                out[(name, state)] = (np.arange(n) * 7 + k + s_index).astype(np.uint8)
            else:
                base = np.arange(n, dtype=np.float64) + 100000 * (k + 1) + 7777 * s_index
                out[(name, state)] = base.astype(dtype).reshape(t.shape)
    return out


def layouts(text: str, sizes: dict, a: str, b: str, **kw) -> tuple[Layout, Layout]:
    spec = parse_spec(text, "fact.spec")
    return resolve(spec, parse_topology(a), sizes, **kw), resolve(spec, parse_topology(b), sizes, **kw)


def convert(src: Layout, dst: Layout, items: dict) -> dict:
    """Plan src -> dst, prove the plan, and carry it out in memory."""
    p = plan(src, dst)
    p.validate()
    return apply(p, items)


def assert_round_trip(src: Layout, dst: Layout, values: dict) -> dict:
    """Move ``values`` laid out as ``src`` to ``dst`` and back, bit-exactly.

    Returns the destination items. Checks: the destination items equal a direct
    lay-out of the logical values (padding included), the logical tensors
    gathered from them equal the originals, and the way back restores the
    source items byte for byte.
    """
    src_items = scatter(src, values)
    dst_items = convert(src, dst, src_items)
    expected = scatter(dst, values)
    assert dst_items.keys() == expected.keys()
    for item, arr in expected.items():
        np.testing.assert_array_equal(dst_items[item].view(np.uint8), arr.view(np.uint8), err_msg=str(item))
    gathered = gather(dst, dst_items)
    for key, arr in gathered.items():
        np.testing.assert_array_equal(arr, values[key], err_msg=str(key))
    back = convert(dst, src, dst_items)
    for item, arr in src_items.items():
        np.testing.assert_array_equal(back[item].view(np.uint8), arr.view(np.uint8), err_msg=str(item))
    return dst_items


def items_by_key(layout: Layout, items: dict, **unit) -> dict[str, np.ndarray]:
    """The items of one unit, by key, reshaped to their stored shapes."""
    want = tuple(sorted(unit.items()))
    return {
        it.key: items[it].reshape(layout.items[it].shape)
        for it in items
        if tuple(sorted((a, c) for a, c in it.unit if a in unit)) == want
    }


def save_tiny_mixtral(path, layers: int) -> None:
    """A small MixtralForCausalLM (GQA, 4 experts, top-2) saved by transformers as sharded bf16 safetensors."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=layers, vocab_size=100,
                                        num_local_experts=4, num_experts_per_tok=2)
    transformers.MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(path, max_shard_size="50KB")


def stored_bytes(path: Path) -> dict:
    """Every stored item of a checkpoint by (section, unit, chunk, state, key), as raw bytes."""
    src = reshard.open_checkpoint(path)
    out = {}
    for item, loc in src.where.items():
        n = src.layout.items[item].numel * np.dtype(f"u{reshard.formats.base.itemsize(loc.dtype)}").itemsize
        with loc.path.open("rb") as f:
            f.seek(loc.offset)
            out[(item.section, item.unit, item.chunk, item.state, item.key)] = f.read(n)
    return out


def assert_same_logits(model_class, before, after, vocab: int) -> None:
    """``from_pretrained`` of both directories, loaded alike, gives bit-identical logits."""
    import torch

    ids = torch.arange(48).reshape(2, 24) % vocab
    with torch.no_grad():
        want = model_class.from_pretrained(before).eval()(ids).logits
        got = model_class.from_pretrained(after).eval()(ids).logits
    assert torch.equal(got, want)
