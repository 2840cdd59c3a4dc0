"""Megatron-core torch_dist checkpoints as a source: stacked, fused, padded global tensors in DCP chunks.

The reference is always an independent de-interleaving in torch of what
``dcp_to_torch_save`` reads: q/k/v from the group-interleaved QKV, gate/up
from the two halves of fc1, the vocabulary without its padding. Real
checkpoints come from megatron-core itself (``mcore_jobs.py``) where it is
installed; a one-process ``dcp.save`` of the same layout runs everywhere.
"""

from __future__ import annotations

import json
import shutil

import mcore_jobs
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import require
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import reshard
from reshard.errors import CheckpointFormatError
from reshard.models import FAMILIES

S = mcore_jobs.SIZES


def expected_hf(ref: dict) -> dict:
    """HF Llama tensors from a torch_dist state dict, de-interleaved here by hand."""
    L, g, qpg, hd, h, f, v = S["layers"], S["g"], S["heads"] // S["g"], S["hd"], S["h"], S["f"], S["vocab"]
    qkv = ref["decoder.layers.self_attention.linear_qkv.weight"].view(L, g, qpg + 2, hd, h)
    fc1 = ref["decoder.layers.mlp.linear_fc1.weight"]
    out = {"model.embed_tokens.weight": ref["embedding.word_embeddings.weight"][:v],
           "lm_head.weight": ref["output_layer.weight"][:v], "model.norm.weight": ref["decoder.final_layernorm.weight"]}
    for i in range(L):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": qkv[i, :, :qpg].reshape(-1, h),
                p + "self_attn.k_proj.weight": qkv[i, :, qpg].reshape(-1, h),
                p + "self_attn.v_proj.weight": qkv[i, :, qpg + 1].reshape(-1, h),
                p + "self_attn.o_proj.weight": ref["decoder.layers.self_attention.linear_proj.weight"][i],
                p + "mlp.gate_proj.weight": fc1[i, :f], p + "mlp.up_proj.weight": fc1[i, f:],
                p + "mlp.down_proj.weight": ref["decoder.layers.mlp.linear_fc2.weight"][i],
                p + "input_layernorm.weight": ref["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
                p + "post_attention_layernorm.weight": ref["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i]}
    return out


def check_hf(hf_dir, ref: dict) -> None:
    got = load_file(hf_dir / "model.safetensors")
    want = expected_hf(ref)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def synthetic(path, tp: int = 2, dtype=torch.bfloat16) -> dict:
    """torch_dist's layout written by dcp.save in one process, with common.pt and metadata.json as Megatron writes them."""
    L, h, f = S["layers"], S["h"], S["f"]
    rows = S["g"] * (S["heads"] // S["g"] + 2) * S["hd"]
    vpad = mcore_jobs.padded_vocab(tp)
    gen = torch.Generator().manual_seed(tp)
    shapes = {"embedding.word_embeddings.weight": (vpad, h), "output_layer.weight": (vpad, h),
              "decoder.final_layernorm.weight": (h,),
              "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, h),
              "decoder.layers.self_attention.linear_qkv.weight": (L, rows, h),
              "decoder.layers.self_attention.linear_proj.weight": (L, h, S["heads"] * S["hd"]),
              "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, h),
              "decoder.layers.mlp.linear_fc1.weight": (L, 2 * f, h), "decoder.layers.mlp.linear_fc2.weight": (L, h, f)}
    state = {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}
    dcp.save(dict(state), checkpoint_id=path)
    torch.save({"args": mcore_jobs._args(tp, 1), "iteration": 10}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    return state


def test_a_torch_dist_layout_converts_to_hf_de_interleaved(tmp_path):
    ref = synthetic(tmp_path / "src")
    src = reshard.open_checkpoint(tmp_path / "src")
    assert src.format == "mcore-dist" and src.sizes["vpad"] == 512 and src.topology.tp == 2
    reshard.convert(tmp_path / "src", tmp_path / "hf", format="hf")
    check_hf(tmp_path / "hf", ref)


def test_torch_dist_to_megatron_torch_format_and_on_to_hf(tmp_path):
    ref = synthetic(tmp_path / "src")
    reshard.convert(tmp_path / "src", tmp_path / "meg", format="megatron", to="tp=2,pp=2")
    assert reshard.verify(tmp_path / "src", tmp_path / "meg")
    reshard.convert(tmp_path / "meg", tmp_path / "hf", format="hf")
    check_hf(tmp_path / "hf", ref)


def test_torch_dist_through_deepspeed_dcp_and_back_keeps_every_weight(tmp_path):
    ref = synthetic(tmp_path / "src", dtype=torch.float32)  # fp32 weights serve as DeepSpeed's master copy
    reshard.convert(tmp_path / "src", tmp_path / "ds", format="deepspeed", to="dp=3")
    reshard.convert(tmp_path / "ds", tmp_path / "dcp", format="dcp", to="dp=2")
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="mcore-dist", to="tp=2")
    for other in ("ds", "dcp", "back"):  # verify compares logical tensors across layouts that view them differently
        check = reshard.verify(tmp_path / "src", tmp_path / other, states=("param",))
        assert check.identical and check.compared == 9 * S["layers"] + 3, (other, check.differences)
    dcp_to_torch_save(tmp_path / "back", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    for k, v in ref.items():
        if k.startswith(("embedding", "output_layer")):
            v = v[: S["vocab"]]  # padding rows are not logical data
            assert torch.equal(back[k][: S["vocab"]], v) and not back[k][S["vocab"]:].any(), k
        else:
            assert torch.equal(back[k], v), k


def test_a_stored_key_the_spec_does_not_know_is_an_error(tmp_path):
    synthetic(tmp_path / "src")
    extra = tmp_path / "extra"
    dcp.save({"decoder.layers.mlp.router.weight": torch.zeros(4, 8)}, checkpoint_id=extra)
    md = dcp.FileSystemReader(extra).read_metadata()
    import pickle
    ours = pickle.loads((tmp_path / "src" / ".metadata").read_bytes())
    ours.state_dict_metadata.update(md.state_dict_metadata)
    (tmp_path / "src" / ".metadata").write_bytes(pickle.dumps(ours))
    with pytest.raises(CheckpointFormatError, match=r"'decoder.layers.mlp.router.weight' \(float32 \[4, 8\]\) matches no "
                                                    r"tensor of spec 'mcore-dist-llama'"):
        reshard.open_checkpoint(tmp_path / "src")


@pytest.mark.parametrize("to", ["tp=2", "tp=1,pp=2", "tp=2,pp=2,vpp=2", "tp=2,pp=2,dp=3"])
def test_written_torch_dist_has_megatron_cores_chunks_and_reads_back(tmp_path, to):
    from reshard.fixtures import make_fixture
    from reshard.io.dcp_metadata import read_metadata

    make_fixture(tmp_path / "src", format="megatron", to="tp=2,pp=2")
    result = reshard.convert(tmp_path / "src", tmp_path / "dist", format="mcore-dist", to=to)
    assert result.report.dropped_states == ("exp_avg", "exp_avg_sq", "master")  # weights only, said so
    assert json.loads((tmp_path / "dist" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    md = read_metadata(tmp_path / "dist")
    tp = int(to.split(",")[0].split("=")[1])
    layers, rows = S["layers"], S["g"] * (S["heads"] // S["g"] + 2) * S["hd"]
    fc1 = sorted(c.offsets for c in md.tensors["decoder.layers.mlp.linear_fc1.weight"].chunks)
    f = 160  # the fixture's ffn
    assert fc1 == sorted((i, half * f + t * f // tp, 0) for i in range(layers) for half in (0, 1) for t in range(tp))
    qkv = md.tensors["decoder.layers.self_attention.linear_qkv.weight"]
    assert {c.sizes for c in qkv.chunks} == {(1, rows // tp, S["h"])} and len(qkv.chunks) == layers * tp
    norms = md.tensors["decoder.layers.self_attention.linear_qkv.layer_norm_weight"]
    assert len(norms.chunks) == layers  # replicated over tp: written once
    assert len(md.byte_entries) == 4 * layers  # the linear layers' _extra_state
    check = reshard.verify(tmp_path / "src", tmp_path / "dist", states=("param",))
    assert check.identical and check.compared == 9 * layers + 3, check.differences


def test_bucket_space_optimizer_state_without_its_bucket_sizes_is_refused_by_name(tmp_path):
    """dp_reshardable tensors are read (test_mcore_dist_optim.py) against per_bucket_numel_unpadded; a group without
    it is refused by name; dp_zero_gather_scatter state (objects only, test_mcore_dist_zero.py) must have one
    object per model-parallel rank."""
    synthetic(tmp_path / "src")
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg"
    dcp.save({key: torch.zeros(64), "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1": [{"buckets_coalesced": True}]},
             checkpoint_id=tmp_path / "o", planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    import pickle
    ours = pickle.loads((tmp_path / "src" / ".metadata").read_bytes())
    theirs = dcp.FileSystemReader(tmp_path / "o").read_metadata().state_dict_metadata
    ours.state_dict_metadata.update({key: theirs[key]})
    (tmp_path / "src" / ".metadata").write_bytes(pickle.dumps(ours))
    with pytest.raises(CheckpointFormatError, match=r"dp_group_idx_0 \(tp=0, pp=0\) has bucket tensors but no "
                                                    "per_bucket_numel_unpadded"):
        reshard.open_checkpoint(tmp_path / "src")
    gather = "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1"
    del ours.state_dict_metadata[key]
    ours.state_dict_metadata[gather] = theirs[gather]
    (tmp_path / "src" / ".metadata").write_bytes(pickle.dumps(ours))
    with pytest.raises(CheckpointFormatError, match=r"\.metadata: no 'optimizer\.distributed\.dp_group_idx_1\."
                                                    r"param_state' \(dp_zero_gather_scatter: one per model-parallel "
                                                    r"rank, 2 at tp 2, pp 1\)"):
        reshard.open_checkpoint(tmp_path / "src")


def test_fully_reshardable_optimizer_state_is_read_with_the_weights(tmp_path):
    """optimizer.state.<state>.<model key>: the same global tensors and chunks as the weights; param is the master."""
    ref = synthetic(tmp_path / "src", dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    optim = {f"optimizer.state.{state}.{k}": (v.clone() if state == "param" else torch.randn(v.shape, generator=gen))
             for k, v in ref.items() for state in ("param", "exp_avg", "exp_avg_sq")}
    shutil.rmtree(tmp_path / "src")
    dcp.save({**ref, **optim}, checkpoint_id=tmp_path / "src")
    torch.save({"args": mcore_jobs._args(2, 1), "iteration": 10,
                "optimizer": {"optimizer": {"param_groups": [{"lr": 1e-3, "step": 10.0}]},
                              "param_state_sharding_type": "fully_reshardable"}}, tmp_path / "src" / "common.pt")
    (tmp_path / "src" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    src = reshard.open_checkpoint(tmp_path / "src")
    assert src.layout.states == ("exp_avg", "exp_avg_sq", "master", "param") and src.progress.step == 10
    reshard.convert(tmp_path / "src", tmp_path / "ds", format="deepspeed", to="dp=3,zero=2")
    check = reshard.verify(tmp_path / "src", tmp_path / "ds")
    assert check.identical and check.compared == 4 * (9 * S["layers"] + 3), check.differences
    reshard.convert(tmp_path / "src", tmp_path / "dcp", format="dcp", to="dp=2")
    back = dcp_jobs_flat(tmp_path / "dcp", tmp_path)
    f = S["f"]
    fc1 = optim["optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight"]
    assert torch.equal(back["optim.state.model.layers.1.mlp.up_proj.weight.exp_avg_sq"], fc1[1, f:])
    assert back["optim.state.model.layers.1.mlp.up_proj.weight.step"].item() == 10.0


def dcp_jobs_flat(path, tmp_path) -> dict:
    dcp_to_torch_save(path, tmp_path / "flat.pt")
    tree = torch.load(tmp_path / "flat.pt", weights_only=True)
    out = {f"model.{k}": v for k, v in tree["model"].items()}
    for name, states in tree["optim"]["state"].items():
        out.update({f"optim.state.{name}.{s}": v for s, v in states.items()})
    return out


@pytest.mark.interop
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_real_megatron_core_torch_dist_checkpoint_converts_to_hf(tmp_path, tp, pp):
    require("megatron.core")
    src = tmp_path / "src"
    mcore_jobs.save(src, tp, pp)
    assert json.loads((src / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    dcp_to_torch_save(src, tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    assert ref["decoder.layers.self_attention.linear_qkv.weight"].shape == (S["layers"], 128, S["h"])  # stacked (L13)
    reshard.convert(src, tmp_path / "hf", format="hf")
    check_hf(tmp_path / "hf", ref)
    reshard.convert(src, tmp_path / "meg", format="megatron", to="tp=2,pp=2")
    reshard.convert(tmp_path / "meg", tmp_path / "hf2", format="hf")
    check_hf(tmp_path / "hf2", ref)


@pytest.mark.interop
def test_reshard_written_torch_dist_loads_in_megatron_core_at_a_new_layout(tmp_path):
    """A real tp=2 checkpoint -> torch_dist chunk for chunk as megatron-core saved it, and at pp=2, which
    megatron-core loads with every weight equal to the torch format's; then the same checkpoint with args that
    name no family (derived by name) -> tp=2, dp=2, which megatron-core loads the same way."""
    require("megatron.core")
    import glob

    from reshard.io.dcp_metadata import read_metadata

    mcore_jobs.save(tmp_path / "src", 2, 1)
    reshard.convert(tmp_path / "src", tmp_path / "same", format="mcore-dist", to="tp=2,pp=1")
    real, ours = read_metadata(tmp_path / "src"), read_metadata(tmp_path / "same")  # chunk for chunk
    assert ours.tensors.keys() == real.tensors.keys() and sorted(ours.byte_entries) == sorted(real.byte_entries)
    for key, t in real.tensors.items():
        assert sorted((c.offsets, c.sizes) for c in ours.tensors[key].chunks) == sorted((c.offsets, c.sizes) for c in t.chunks)
    reshard.convert(tmp_path / "src", tmp_path / "dist", format="mcore-dist", to="tp=1,pp=2")
    reshard.convert(tmp_path / "src", tmp_path / "torch", format="megatron", to="tp=1,pp=2")
    mcore_jobs.load(tmp_path / "dist", 1, 2, tmp_path / "dump")
    names = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    for pp in range(2):
        got = torch.load(tmp_path / "dump" / f"rank{pp}.pt", weights_only=True)
        got = {next((k.replace(a, b) for a, b in names.items() if k.endswith(a)), k): v for k, v in got.items()}
        rank_file = glob.glob(str(tmp_path / "torch" / "iter_*" / f"mp_rank_00_{pp:03d}" / "model_optim_rng.pt"))[0]
        want = {k: v for k, v in torch.load(rank_file, weights_only=False)["model"].items() if torch.is_tensor(v)}
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), (pp, k)
    derived_checkpoint_loads_in_megatron_core_at_another_dp(tmp_path)


# --- a model no family describes: laid out from .metadata alone -------------------------------------------------


def no_family_args(tp: int = 2):
    args = mcore_jobs._args(tp, 1)
    args.swiglu = False  # no SwiGLU, RMSNorm, rotary: no family reshard knows
    return args


def no_family_checkpoint(path) -> dict:
    """The synthetic layout with fully_reshardable optimizer state, a bytes entry and a 0-d tensor, whose args
    describe no family: everything dcp.save was given, by key."""
    ref = synthetic(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    saved = {**ref, **{f"optimizer.state.{state}.{k}": torch.randn(v.shape, generator=gen) for k, v in ref.items()
                       for state in ("param", "exp_avg", "exp_avg_sq")},
             "rng_state/shard_0.0_1.1": [{"random_rng_state": (3, (1, 2, 3), None), "seed": 1234}],
             "grad_scale": torch.tensor(2.0**16)}
    shutil.rmtree(path)
    dcp.save(dict(saved), checkpoint_id=path)
    torch.save({"args": no_family_args(), "iteration": 10, "checkpoint_version": 3.0,
                "optimizer": {"optimizer": {"param_groups": [{"lr": 1e-3, "step": 10.0, "wd_mult": 1.0}]},
                              "param_state_sharding_type": "fully_reshardable"}}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return saved


def flat(path, tmp_path, name: str) -> dict:
    dcp_to_torch_save(path, tmp_path / f"{name}.pt")
    return torch.load(tmp_path / f"{name}.pt", weights_only=False)


def test_a_torch_dist_model_of_no_known_family_converts_by_name_to_torch_dist_and_dcp(tmp_path):
    saved = no_family_checkpoint(tmp_path / "src")
    src = reshard.open_checkpoint(tmp_path / "src")
    weights = {k: v for k, v in saved.items() if torch.is_tensor(v) and v.dim() and not k.startswith("optimizer.")}
    assert src.spec_name == "mcore-dist-derived" and (src.topology.tp, src.topology.pp) == (2, 1)
    assert {n: t.shape for n, t in src.layout.tensors.items()} == {k: tuple(v.shape) for k, v in weights.items()}
    assert src.layout.states == ("exp_avg", "exp_avg_sq", "master", "param") and src.progress.step == 10

    reshard.convert(tmp_path / "src", tmp_path / "dist", format="mcore-dist", to="tp=2,dp=3")  # same names, new dp
    back = flat(tmp_path / "dist", tmp_path, "dist")
    assert back.keys() == saved.keys()
    for k, v in saved.items():
        assert (torch.equal(back[k], v) and back[k].dtype == v.dtype) if torch.is_tensor(v) else back[k] == v, k
    common = torch.load(tmp_path / "dist" / "common.pt", weights_only=False)
    assert vars(common["args"]) == vars(no_family_args()) and common["iteration"] == 10
    assert common["optimizer"]["optimizer"]["param_groups"] == [{"lr": 1e-3, "step": 10.0, "wd_mult": 1.0}]
    assert reshard.open_checkpoint(tmp_path / "dist").spec_name == "mcore-dist-derived"
    check = reshard.verify(tmp_path / "src", tmp_path / "dist")
    assert check.identical and check.compared == 4 * len(weights), check.differences

    reshard.convert(tmp_path / "src", tmp_path / "dcp", format="dcp", to="dp=2")  # names kept, under DCP's prefixes
    got = dcp_jobs_flat(tmp_path / "dcp", tmp_path)
    for k in weights:
        assert torch.equal(got[f"model.{k}"], saved[f"optimizer.state.param.{k}"]), k  # FSDP2 keeps fp32 masters
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"optim.state.{k}.{state}"], saved[f"optimizer.state.{state}.{k}"]), (k, state)


def test_a_torch_dist_model_of_no_known_family_keeps_its_recorded_chunks_and_refuses_what_needs_the_family(tmp_path):
    from reshard.fixtures import make_fixture
    from reshard.io.dcp_metadata import read_metadata

    src = tmp_path / "src"
    make_fixture(src, format="mcore-dist", to="tp=2")  # megatron-core's chunks: per layer and tp rank
    common = torch.load(src / "common.pt", weights_only=False)
    common["args"].swiglu = False
    torch.save(common, src / "common.pt")
    source = reshard.open_checkpoint(src)
    md = read_metadata(src)
    assert source.spec_name == "mcore-dist-derived" and len(source.where) == sum(len(t.chunks) for t in md.tensors.values())
    reshard.convert(src, tmp_path / "dist", format="mcore-dist", to="tp=2,dp=2")
    out = read_metadata(tmp_path / "dist")
    assert out.tensors.keys() == md.tensors.keys() and sorted(out.byte_entries) == sorted(md.byte_entries)
    for key, t in md.tensors.items():
        assert sorted((c.offsets, c.sizes) for c in out.tensors[key].chunks) == sorted((c.offsets, c.sizes) for c in t.chunks)
        assert {out.storage[(key, c.offsets)].relative_path for c in t.chunks} == \
            {md.storage[(key, c.offsets)].relative_path for c in t.chunks}, key  # each by the rank that wrote it
    want, got = flat(src, tmp_path, "src"), flat(tmp_path / "dist", tmp_path, "out")
    assert want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items() if torch.is_tensor(v))

    with pytest.raises(CheckpointFormatError) as e:
        reshard.convert(src, tmp_path / "meg", format="megatron")
    assert str(e.value) == (f"{src}: which model this is is recorded nowhere (no config.json beside it, no model "
                            "family in its layout); Megatron stores each family's tensors its own way: put the model's "
                            "config.json beside the source, or give a spec")
    with pytest.raises(CheckpointFormatError, match=r"which model this is is recorded nowhere .* mcore-dist stores "
                                                    r"them under its own fused names"):
        reshard.convert(src, tmp_path / "hf", format="hf")
    (src / "config.json").write_text('{"model_type": "granite"}')  # a model no family describes: still refused
    with pytest.raises(CheckpointFormatError, match=r"the model is model_type 'granite' .* no model family"):
        reshard.convert(src, tmp_path / "hf", format="hf")
    assert not (tmp_path / "hf").exists()
    (src / "config.json").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        reshard.convert(src, tmp_path / "tp1", format="mcore-dist", to="tp=1")
    assert str(e.value) == (f"{src}: its layout is derived from the checkpoint alone (no model family), which keeps "
                            "the chunks as stored, those of tp=2, pp=1; writing tp=1, pp=1 needs to know how the model "
                            "splits each tensor: put the model's config.json of a known family beside the source, or "
                            "give a spec")
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "hidden_size": S["h"]}))
    with pytest.raises(CheckpointFormatError) as e:
        reshard.convert(src, tmp_path / "meg", format="megatron")
    assert str(e.value) == (
        f"{src}: the model is model_type 'qwen3_next' (its config.json), which no model family reshard knows "
        f"describes (known: {', '.join(FAMILIES)}); Megatron stores each family's tensors its own way, and converting "
        "it as another family would change the model: give a spec, or convert to a format that keeps every tensor by "
        "name (hf, dcp, deepspeed)")


def derived_checkpoint_loads_in_megatron_core_at_another_dp(tmp_path):
    """The real tp=2 checkpoint at ``tmp_path / "src"`` with args that name no family: reshard keeps its chunks,
    megatron-core loads what it wrote."""
    for done in ("torch", "dist", "dump"):  # the first half's outputs
        shutil.rmtree(tmp_path / done, ignore_errors=True)
    reshard.convert(tmp_path / "src", tmp_path / "torch", format="megatron", to="tp=2")  # the reference: per rank
    common = torch.load(tmp_path / "src" / "common.pt", weights_only=False)
    common["args"].swiglu = False
    torch.save(common, tmp_path / "src" / "common.pt")
    assert reshard.open_checkpoint(tmp_path / "src").spec_name == "mcore-dist-derived"
    reshard.convert(tmp_path / "src", tmp_path / "dist", format="mcore-dist", to="tp=2,dp=2")
    mcore_jobs.load(tmp_path / "dist", 2, 1, tmp_path / "dump")
    stored = flat(tmp_path / "src", tmp_path, "src")
    names = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    rows = mcore_jobs.padded_vocab(2) // 2
    for tp in range(2):
        got = torch.load(tmp_path / "dump" / f"rank{tp}.pt", weights_only=True)
        got = {next((k.replace(a, b) for a, b in names.items() if k.endswith(a)), k): v for k, v in got.items()}
        rank_file = next((tmp_path / "torch").glob(f"iter_*/mp_rank_{tp:02d}/model_optim_rng.pt"))
        want = {k: v for k, v in torch.load(rank_file, weights_only=False)["model"].items() if torch.is_tensor(v)}
        for k in ("embedding.word_embeddings.weight", "output_layer.weight"):  # the padding rows too, as stored
            want[k] = stored[k][tp * rows:(tp + 1) * rows]
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), (tp, k)


def test_a_tp_rank_holding_only_vocabulary_padding_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Vocab 50 padded to 256 rows at tp=2: rank 1's embedding rows are all padding. megatron-core writes that
    chunk; reshard cannot place it, so it refuses instead of writing a checkpoint without it."""
    import fixtures

    tiny = fixtures.MODELS["tiny-llama"]
    monkeypatch.setitem(fixtures.MODELS, "tiny-vocab", fixtures.Model(tiny.spec, {**tiny.sizes, "vocab": 50}))
    fixtures.make_fixture(tmp_path / "hf", format="hf", model="tiny-vocab", states=("param",))
    with pytest.raises(CheckpointFormatError, match=r"embedding\.word_embeddings\.weight.*holds only padding at this "
                                                    r"tp \(2\)"):
        reshard.convert(tmp_path / "hf", tmp_path / "dist", format="mcore-dist", to="tp=2")
    assert not (tmp_path / "dist").exists()
    reshard.convert(tmp_path / "hf", tmp_path / "dist1", format="mcore-dist", to="tp=1")  # one rank holds it all
