"""Megatron-core torch_dist of mixtures of experts with grouped-GEMM experts (``--moe-grouped-gemm``).

megatron-core 0.16's legacy ``GroupedMLP`` saves its ``weight1``/``weight2`` under SequentialMLP's keys and global
shapes, one chunk per ep rank's block of experts (``reshard.formats.megatron.dist_moe``); its grad buffers hold
``weight1`` and ``weight2``, so the distributed optimizer's ``dp_reshardable`` buckets are the ``-grouped`` Megatron
layout's. ``TEGroupedMLP`` keys its experts as SequentialMLP does; its buckets are refused. The references are
independent: megatron-core's own ranks (``mcore_moe_jobs`` with ``grouped``), which dump every weight, fp32 main
param and Adam moment they hold and resume what reshard writes, and a Megatron torch-format fixture's
``distrib_optim.pt``.
"""

from __future__ import annotations

import re

import mcore_moe_jobs as jobs
import pytest
import torch
from conftest import require
from test_mcore_dist_moe import assert_same_values, hf_of
from test_mcore_dist_moe_optim import assert_same_but_padding
from test_megatron_moe import collect

import reshard
from reshard.errors import CheckpointFormatError, SpecError
from reshard.formats.specs import spec_text
from reshard.io.dcp_metadata import read_metadata

S = jobs.SIZES
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def sequential_values(dump, scratch, ep: int) -> dict:
    """``collect`` of a GroupedMLP run's dump with each layer's ``weight1``/``weight2`` (value and optimizer states)
    cut into SequentialMLP's ``local_experts.{e}.linear_fc1/2.weight`` under global expert numbers, by hand:
    ``weight1`` ``[h, E/ep * 2f]`` is a view of ``[E/ep, h, 2f]`` (expert e's fc1 transposed), ``weight2``
    ``[E/ep * f, h]`` of ``[E/ep, f, h]`` (expert e's fc2 transposed), as the grouped GEMM reads them."""
    scratch.mkdir()
    for f in sorted(dump.glob("rank*.pt")):
        d = torch.load(f, weights_only=False)
        r = d["coords"]["ep"]

        def mark(name: str, r=r) -> str:  # each ep rank's block apart, so that collect keeps both
            return re.sub(r"(\.mlp\.experts\.weight[12])$", rf"\1@{r}", name)
        d["params"] = {mark(n): v for n, v in d["params"].items()}
        d["states"] = {mark(n): v for n, v in d["states"].items()}
        torch.save(d, scratch / f.name)
    local, h, f = S["experts"] // ep, S["h"], S["f"]
    out = {}
    for (name, state), t in collect(scratch, 1, ep, S).items():
        m = re.fullmatch(r"(.*\.mlp\.experts\.)weight([12])@(\d+)", name)
        if m is None:
            out[(name, state)] = t
            continue
        at, n, r = m.group(1), m.group(2), int(m.group(3))
        for j in range(local):
            part = t if state == "step" else (t.view(local, h, 2 * f)[j] if n == "1" else
                                              t.view(local, f, h)[j]).T.flatten()
            out[(f"{at}local_experts.{r * local + j}.linear_fc{n}.weight", state)] = part
    return out


@pytest.mark.interop
def test_real_grouped_mlp_dp_reshardable_at_ep2_converts_bit_exactly_and_resumes_in_megatron_core(tmp_path):
    """megatron-core trains a Mixtral-style model with GroupedMLP experts one step at ep 2, dp 2 (bf16, fp32 main
    params, buckets of 4000 elements) and saves torch_dist dp_reshardable: the experts under SequentialMLP's keys
    and shapes, one chunk per ep rank -> reshard opens it as ``-grouped`` -> Hugging Face: every weight bit-exact;
    -> the torch format ``-grouped`` at ep 2: each rank's weight1/weight2 the run's; -> reshard's own torch_dist
    rewrite at the same layout: the optimizer's keys, chunks and bytes entries as megatron-core wrote them, which
    megatron-core built with GroupedMLP resumes with every weight, main param, Adam moment and step equal, and the
    next step equal; -> torch_dist with SequentialMLP's buckets at ep 1: the same values."""
    require("megatron.core")
    from safetensors.torch import load_file

    from reshard.formats.megatron.dist_optim import _object

    run = {"bf16": True, "next": True, "bucket_size": 4000, "grouped": True}
    jobs.save(tmp_path / "src", tmp_path / "dump", tp=1, pp=1, ep=2, dp=2, distopt=True, torch_dist=True, **run)
    ckpt = tmp_path / "src" / f"iter_{jobs.ITERATION:07d}"
    real = read_metadata(ckpt)
    # GroupedMLP: SequentialMLP's key and global shape, one chunk per (layer, ep rank, half)
    assert list(real.tensors[FC1].size) == [S["layers"], S["experts"], 2 * S["f"], S["h"]]
    assert sorted(c.offsets for c in real.tensors[FC1].chunks) == sorted(
        (i, r * 2, half * S["f"], 0) for i in range(S["layers"]) for r in range(2) for half in range(2))
    want = {now: sequential_values(tmp_path / now, tmp_path / f"seq-{now.replace('/', '-')}", 2)
            for now in ("dump", "dump/next")}
    source = reshard.open_checkpoint(ckpt)
    assert source.spec_name == "mcore-dist-mixtral-local-grouped" and source.progress.step == 1
    reshard.convert(ckpt, tmp_path / "hf", format="hf")
    assert_same_values(load_file(tmp_path / "hf" / "model.safetensors"), hf_of(want["dump"], "mixtral"), "hf")

    reshard.convert(ckpt, tmp_path / "meg", format="megatron", to="tp=1,pp=1,dp=2,ep=2",
                    spec="megatron-mixtral-local-grouped")
    for f in sorted((tmp_path / "dump").glob("rank*.pt")):
        d = torch.load(f, weights_only=False)
        model = torch.load(next((tmp_path / "meg").glob(f"iter_*/mp_rank_00_{d['coords']['ep']:03d}/"
                                                        "model_optim_rng.pt")), weights_only=False)["model"]
        for name, value in d["params"].items():
            if ".mlp.experts.weight" in name:
                assert torch.equal(model[name], value), (f.name, name)

    reshard.convert(ckpt, tmp_path / "same", to="tp=1,dp=2,ep=2,zero=1")
    ours = read_metadata(tmp_path / "same")
    assert reshard.open_checkpoint(tmp_path / "same").spec_name == "mcore-dist-mixtral-local-grouped"
    assert ours.tensors.keys() == real.tensors.keys() and sorted(ours.byte_entries) == sorted(real.byte_entries)
    for key, t in real.tensors.items():
        if key.startswith("chained_"):
            assert sorted((c.offsets, c.sizes) for c in ours.tensors[key].chunks) == \
                sorted((c.offsets, c.sizes) for c in t.chunks), key
    for key in real.byte_entries:
        if key.startswith("chained_"):
            assert _object(tmp_path / "same", ours, key) == _object(ckpt, real, key), key
    jobs.load(tmp_path / "same", tmp_path / "dump-same", tp=1, pp=1, ep=2, dp=2, distopt=True, torch_dist=True, **run)
    for now, then in (("dump", "dump-same"), ("dump/next", "dump-same/next")):
        got = sequential_values(tmp_path / then, tmp_path / f"seq-{then.replace('/', '-')}", 2)
        assert_same_but_padding(got, want[now], then)

    reshard.convert(ckpt, tmp_path / "seq", format="mcore-dist", to="tp=1,dp=1,ep=1,zero=1",
                    spec="mcore-dist-mixtral-local")
    seq = reshard.open_checkpoint(tmp_path / "seq")
    assert seq.spec_name == "mcore-dist-mixtral-local" and not torch.load(
        tmp_path / "seq" / "common.pt", weights_only=False)["args"].moe_grouped_gemm
    check = reshard.verify(ckpt, tmp_path / "seq")
    assert check.identical and check.compared == 4 * 79, check.differences  # weights, main params, two moments


def test_grouped_torch_dist_buckets_are_the_grouped_megatron_layouts_and_te_grouped_ones_are_refused(tmp_path):
    """A Mixtral fixture with the distributed optimizer at ep 2, dp 2 -> torch_dist ``-grouped`` (GroupedMLP's
    buckets: weight1/weight2 per layer) -> the torch format ``-grouped``: every distrib_optim.pt buffer equal to
    the fixture's converted there directly; the same checkpoint with TEGroupedMLP's args is refused naming the
    file, the key and why; GPT-OSS (expert biases) has no grouped torch_dist layout."""
    from reshard.fixtures import make_fixture
    from reshard.formats.megatron.torch_dist import COMMON

    assert spec_text("mcore-dist-mixtral-local-grouped") == spec_text("mcore-dist-mixtral-local")
    with pytest.raises(SpecError, match=r"^mcore-dist-gpt_oss-grouped: no torch_dist layout for gpt_oss with "
                                        r"grouped experts \(GroupedMLP holds no biases\)"):
        spec_text("mcore-dist-gpt_oss-grouped")
    make_fixture(tmp_path / "meg", format="megatron", to="tp=1,pp=1,dp=2,ep=2,zero=1", model="tiny-mixtral")
    topo, torch_spec = "tp=1,pp=1,dp=2,ep=2,zero=1", "megatron-mixtral-grouped-ep-distopt-torch"
    reshard.convert(tmp_path / "meg", tmp_path / "dist", format="mcore-dist", to="tp=1,dp=2,ep=2,zero=1",
                    spec="mcore-dist-mixtral-grouped")
    common = torch.load(tmp_path / "dist" / COMMON, weights_only=False)
    assert common["args"].moe_grouped_gemm and common["args"].moe_use_legacy_grouped_gemm
    assert reshard.open_checkpoint(tmp_path / "dist").spec_name == "mcore-dist-mixtral-grouped"
    reshard.convert(tmp_path / "dist", tmp_path / "back", format="megatron", to=topo, spec=torch_spec)
    reshard.convert(tmp_path / "meg", tmp_path / "direct", format="megatron", to=topo, spec=torch_spec)
    files = sorted(p.relative_to(tmp_path / "direct") for p in (tmp_path / "direct").rglob("distrib_optim.pt"))
    assert len(files) == 2
    for rel in files:
        want, got = (torch.load(tmp_path / d / rel, weights_only=True) for d in ("direct", "back"))
        assert len(want) == len(got) == 2  # the dense optimizer's, the expert optimizer's
        for a, b in zip(want, got):
            assert (a is None) == (b is None), rel
            if a is not None:
                (x,), (y,) = a[0].values(), b[0].values()
                assert all(torch.equal(x[s], y[s]) for s in ("param", "exp_avg", "exp_avg_sq")), rel
    common["args"].moe_use_legacy_grouped_gemm, common["args"].transformer_impl = False, "transformer_engine"
    torch.save(common, tmp_path / "dist" / COMMON)
    with pytest.raises(CheckpointFormatError, match=r"/dist/\.metadata: 'chained_[01]\.optimizer\.distributed\..*': "
                                                    r"the distributed optimizer's buckets of TEGroupedMLP experts"):
        reshard.open_checkpoint(tmp_path / "dist")
