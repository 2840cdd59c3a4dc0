"""The dcp format: reading and writing PyTorch DCP directories, checked against torch's own DCP.

torch (a dependency) is the oracle here: ``dcp_to_torch_save`` consolidates
what reshard writes, and ``dcp.save`` in one process writes checkpoints
reshard reads. Multi-rank FSDP2 / tensor-parallel checkpoints made by real
gloo jobs are tested in ``test_dcp_real.py``.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from typer.testing import CliRunner

import reshard
from reshard.cli.main import app
from reshard.fixtures import MODELS, make_fixture, model_values
from reshard.formats.specs import layout_spec
from reshard.io.dcp_metadata import parse_metadata, read_metadata
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.formats.dcp.layouts import _torch_chunks
from reshard.core.resolve import resolve
from reshard.core.topology import Topology

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

runner = CliRunner()


def consolidated(path, tmp_path) -> dict:
    """torch's own reading of a DCP directory, as one nested state dict."""
    out = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=True)


def logical(model: str = "tiny-llama") -> dict:
    layout = resolve(layout_spec(MODELS[model].spec), Topology(), MODELS[model].sizes,
                     states={"model": ("param", "master", "exp_avg", "exp_avg_sq")})
    values = model_values(layout)
    return {k: (v, layout.tensors[k[0]].shape) for k, v in values.items()}


def test_torch_chunk_sizes_match_fsdp2():
    assert _torch_chunks(64, 3) == [(0, 22), (22, 22), (44, 20)]  # seen in real FSDP2 checkpoints
    assert _torch_chunks(128, 3) == [(0, 43), (43, 43), (86, 42)]
    assert _torch_chunks(3, 4) == [(0, 1), (1, 1), (2, 1), (3, 0)]
    assert _torch_chunks(5, 4) == [(0, 2), (2, 2), (4, 1), (5, 0)]  # torch.chunk: 2, 2, 1 and an empty rank


@pytest.mark.parametrize("dp", [1, 3, 8])
def test_torch_reads_a_dcp_fixture_with_the_fixture_values(tmp_path, dp):
    src = tmp_path / "dcp"
    make_fixture(src, format="dcp", to=f"dp={dp}")
    md = read_metadata(src)
    q = md.tensors["model.model.layers.0.self_attn.q_proj.weight"]
    rows = MODELS["tiny-llama"].sizes["h"]
    assert [c.sizes[0] for c in q.chunks] == [n for _, n in _torch_chunks(rows, dp) if n]
    state = consolidated(src, tmp_path)
    values = logical()
    for (name, st), (v, shape) in values.items():
        if st == "param":
            continue  # model.<fqn> holds the fp32 master weights; the bf16 copy is derived from them
        got = state["model"][name] if st == "master" else state["optim"]["state"][name][st]
        assert got.dtype == torch.float32, name
        np.testing.assert_array_equal(got.numpy(), v.reshape(shape), err_msg=f"{name} {st}")
    steps = {s["step"].item() for s in state["optim"]["state"].values()}
    assert steps == {0.0}
    group = state["optim"]["param_groups"][0]
    assert sorted(group["params"]) == sorted(state["model"]) and group["betas"] == (0.9, 0.999)


def test_a_dcp_written_by_torch_converts_to_hf_and_back_bit_exactly(tmp_path):
    """One-process dcp.save of a plain state dict: reshard reads torch's chunk archives in place."""
    gen = torch.Generator().manual_seed(0)
    sizes = MODELS["tiny-llama"].sizes
    layout = resolve(layout_spec("hf-llama"), Topology(), sizes)
    weights = {it.key: torch.randn(info.shape, generator=gen).to(torch.bfloat16) for it, info in layout.items.items()}
    src = tmp_path / "src"
    dcp.save({"model": weights}, checkpoint_id=src)
    (src / "config.json").write_text(__import__("json").dumps(
        {"model_type": "llama", "hidden_size": sizes["h"], "num_attention_heads": sizes["heads"],
         "num_key_value_heads": sizes["g"], "head_dim": sizes["hd"], "intermediate_size": sizes["f"],
         "vocab_size": sizes["vocab"], "num_hidden_layers": sizes["layers"], "tie_word_embeddings": False}))
    reshard.convert(src, tmp_path / "hf", format="hf")
    from safetensors.torch import load_file
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert hf.keys() == weights.keys()
    for k, v in weights.items():
        assert torch.equal(hf[k], v), k
    reshard.convert(tmp_path / "hf", tmp_path / "meg", format="megatron", to="tp=2,pp=2")
    reshard.convert(tmp_path / "meg", tmp_path / "back", format="dcp", to="dp=3")
    back = consolidated(tmp_path / "back", tmp_path)["model"]
    assert back.keys() == weights.keys()
    for k, v in weights.items():
        assert back[k].dtype == torch.bfloat16 and torch.equal(back[k], v), k


def test_dcp_through_megatron_and_deepspeed_and_back_is_byte_identical(tmp_path):
    from conftest import stored_bytes

    src = tmp_path / "src"
    make_fixture(src, format="dcp", to="dp=3", states=("master", "exp_avg", "exp_avg_sq"))
    reshard.convert(src, tmp_path / "meg", format="megatron", to="tp=2,pp=2")
    reshard.convert(tmp_path / "meg", tmp_path / "dcp4", format="dcp", to="dp=4")
    reshard.convert(tmp_path / "dcp4", tmp_path / "back", to="dp=3")
    assert stored_bytes(tmp_path / "back") == stored_bytes(src)
    a, b = consolidated(src, tmp_path), consolidated(tmp_path / "back", tmp_path)
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for name, st in a["optim"]["state"].items():
        for k, t in st.items():
            assert torch.equal(t, b["optim"]["state"][name][k]), (name, k)


def test_loading_one_rank_of_eight_reads_only_its_share_of_large_chunks(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="dcp", to="dp=1", states=("master", "exp_avg", "exp_avg_sq"))
    total = sum(os.path.getsize(p) for p in src.glob("*.distcp"))
    mine = reshard.load(src, to="dp=8", rank=3)
    share = sum(t.numel() * t.element_size() for t in mine.tensors.values())
    assert 0 < mine.bytes_read <= 1.1 * share
    assert share < total / 6
    full = consolidated(src, tmp_path)["model"]
    got = mine.state_dict("param")
    q = "model.model.layers.1.mlp.down_proj.weight"
    rows = full[q[len("model."):]].shape[0]
    lo, n = _torch_chunks(rows, 8)[3]
    assert torch.equal(got[q], full[q[len("model."):]][lo:lo + n])


def test_the_dcp_target_refuses_pipeline_layouts(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="megatron", to="tp=2")
    with pytest.raises(TopologyError, match=r"dp \(FSDP2\) and tp \(DTensor\) only; cannot write pp\(2\)"):
        reshard.convert(src, tmp_path / "dst", format="dcp", to="pp=2,dp=2")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("topology", ["tp=2", "tp=2,dp=2", "tp=4,dp=3"])
def test_tensor_parallel_and_2d_dcp_layouts_hold_dtensor_boxes(tmp_path, topology):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_fixture(src, format="megatron", to="tp=2,pp=2")
    reshard.convert(src, dst, format="dcp", to=topology)
    md = read_metadata(dst)
    tp = int(topology.split(",")[0].split("=")[1])
    dp = int(topology.split("dp=")[1]) if "dp=" in topology else 1
    q = md.tensors["model.model.layers.0.self_attn.q_proj.weight"]
    rows = q.size[0] // tp  # colwise: tp splits rows, then FSDP2 chunks each tp block (_StridedShard)
    want = sorted((t * rows + lo, n) for t in range(tp) for lo, n in _torch_chunks(rows, dp) if n)
    assert sorted((c.offsets[0], c.sizes[0]) for c in q.chunks) == want
    o = md.tensors["model.model.layers.0.self_attn.o_proj.weight"]  # rowwise: a dp x tp grid
    cols = o.size[1] // tp
    want = sorted((lo, t * cols) for t in range(tp) for lo, n in _torch_chunks(o.size[0], dp) if n)
    assert sorted(c.offsets for c in o.chunks) == want
    norm = md.tensors["model.model.norm.weight"]  # replicated over tp: each chunk stored once
    assert len(norm.chunks) == len([n for _, n in _torch_chunks(norm.size[0], dp) if n])
    state, values = consolidated(dst, tmp_path), logical()
    for (name, st), (v, shape) in values.items():
        if st in ("master", "exp_avg"):
            got = state["model"][name] if st == "master" else state["optim"]["state"][name][st]
            np.testing.assert_array_equal(got.numpy(), v.view(np.float32).reshape(shape), err_msg=f"{name} {st}")


# -- hostile and broken -------------------------------------------------------------------------------


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_metadata_pickle_payload_is_refused_and_never_runs(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="dcp", to="dp=2")
    marker = tmp_path / "pwned"
    md = pickle.loads((src / ".metadata").read_bytes())
    md.planner_data["model.model.norm.weight"] = Payload(marker)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "dst"), "--to", "dp=1"])
    assert result.exit_code == 2, result.output
    assert ".metadata" in result.stderr and "posix.system" in result.stderr and "will not load" in result.stderr
    assert not marker.exists() and not (tmp_path / "dst").exists()


def test_a_truncated_distcp_is_named(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="dcp", to="dp=2")
    victim = src / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "dst"), "--to", "dp=1"])
    assert result.exit_code == 2, result.output
    assert "__1_0.distcp" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "dst").exists()


def test_a_missing_distcp_is_named(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="dcp", to="dp=2")
    (src / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointFormatError, match=r"__1_0\.distcp: missing"):
        reshard.open_checkpoint(src)


def test_metadata_that_is_not_dcp_is_refused():
    with pytest.raises(CheckpointFormatError, match="the pickled object is a dict, expected Metadata"):
        parse_metadata(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointFormatError, match="not a pickle reshard can read"):
        parse_metadata(b"\x80\x04garbage")


def test_a_chunk_outside_its_tensor_is_refused(tmp_path):
    src = tmp_path / "src"
    make_fixture(src, format="dcp", to="dp=2")
    md = pickle.loads((src / ".metadata").read_bytes())
    chunk = md.state_dict_metadata["model.model.norm.weight"].chunks[1]
    chunk.offsets = torch.Size([60])
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointFormatError, match=r"'model.model.norm.weight' has a chunk at \[60\] of size \[32\] outside"):
        reshard.open_checkpoint(src)


def test_safetensors_serialized_dcp_is_read_at_the_offsets_its_header_gives(tmp_path):
    """FileSystemWriter(serialization_format=SAFETENSORS) points every tensor at its file's safetensors
    blob (torch 2.13's own dcp.load then fails); reshard reads each tensor where the blob's header says."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    gen = torch.Generator().manual_seed(3)
    model = {"a": torch.randn(6, 4, generator=gen), "b": torch.randn(5, generator=gen).to(torch.bfloat16)}
    dcp.save({"model": model, "x": 3}, storage_writer=FileSystemWriter(tmp_path / "src",
                                                                        serialization_format=SerializationFormat.SAFETENSORS))
    md = read_metadata(tmp_path / "src")
    assert len({s.offset for (k, o), s in md.storage.items() if o is not None}) == 1  # all at the blob's start
    reshard.convert(tmp_path / "src", tmp_path / "dst", to="dp=2")
    back = consolidated(tmp_path / "dst", tmp_path)
    assert back["x"] == 3
    for k, v in model.items():
        assert back["model"][k].dtype == v.dtype and torch.equal(back["model"][k], v), k


def test_torchtitan_naming_bare_parameters_and_an_optimizer_key(tmp_path):
    """torchtitan saves model parameters at the top level and the optimizer under 'optimizer'."""
    gen = torch.Generator().manual_seed(5)
    model = {"tok_embeddings.weight": torch.randn(10, 4, generator=gen), "norm.weight": torch.randn(4, generator=gen)}
    optim = {"state": {k: {"exp_avg": torch.randn(v.shape, generator=gen), "step": torch.tensor(7.0)}
                       for k, v in model.items()},
             "param_groups": [{"lr": 0.5, "params": list(model)}]}
    dcp.save({**model, "optimizer": optim, "train_state": {"step": 7}}, checkpoint_id=tmp_path / "src")
    src = reshard.open_checkpoint(tmp_path / "src")
    assert sorted(src.layout.tensors) == sorted(model) and src.layout.states == ("exp_avg", "param")
    reshard.convert(tmp_path / "src", tmp_path / "dst", to="dp=3")
    back = consolidated(tmp_path / "dst", tmp_path)
    assert back["train_state"] == {"step": 7} and back["optimizer"]["param_groups"][0]["lr"] == 0.5
    for k, v in model.items():
        assert torch.equal(back[k], v), k
        assert torch.equal(back["optimizer"]["state"][k]["exp_avg"], optim["state"][k]["exp_avg"]), k
        assert back["optimizer"]["state"][k]["step"].item() == 7.0
    md = read_metadata(tmp_path / "dst")
    assert [c.sizes for c in md.tensors["tok_embeddings.weight"].chunks] == [(4, 4), (4, 4), (2, 4)]
