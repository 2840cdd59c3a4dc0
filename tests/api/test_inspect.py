"""``inspect`` of a checkpoint of every format: what it reports, the table a pipe gets, ``--spec``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import reshard
from reshard.api.inspecting import inspect_spec
from reshard.cli.main import app
from reshard.core.spec import Logical, parse_spec
from reshard.fixtures import make_fixture
from reshard.io.safetensors_io import WEIGHTS_NAME, SafetensorsWriter

runner = CliRunner()

LAYER = {"input_layernorm": (64,), "self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64),
         "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64), "post_attention_layernorm": (64,),
         "mlp.gate_proj": (160, 64), "mlp.up_proj": (160, 64), "mlp.down_proj": (64, 160)}
TINY_LLAMA = {"model.embed_tokens.weight": (1100, 64), "model.norm.weight": (64,), "lm_head.weight": (1100, 64),
              **{f"model.layers.{i}.{m}.weight": s for i in range(4) for m, s in LAYER.items()}}
"""tiny-llama's tensors (the fixtures' model) under their Hugging Face names: 39 tensors."""
PARAMS = sum(int(np.prod(s)) for s in TINY_LLAMA.values())
OPTIM = ["master", "exp_avg", "exp_avg_sq"]
LLAMA_HF = {"family": "llama", "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
LONG = "model.layers.0.a_module_name_long_enough_that_no_console_of_80_columns_could_show_it.weight"
QWEN = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 8, "vocab_size": 10}

# format -> (topology, states, dtypes, progress, model); progress ... is not checked (the reader is changing)
EXPECTED = {
    "megatron": ("tp=2,pp=2,dp=1", ["param", *OPTIM], {"bfloat16": 39, "float32": 117},
                 {"step": None, "iteration": 0, "lr": None}, {"family": "llama", "model_type": None,
                                                              "architectures": None}),
    "deepspeed": ("tp=1,pp=1,dp=2,zero=1", ["param", *OPTIM], {"bfloat16": 39, "float32": 117}, ..., LLAMA_HF),
    "hf": ("tp=1,pp=1,dp=1", ["param"], {"bfloat16": 39}, {"step": None, "iteration": None, "lr": None}, LLAMA_HF),
    "mcore-dist": ("tp=2,pp=1,dp=1", ["param"], {"bfloat16": 39}, {"step": None, "iteration": 0, "lr": None},
                   {"family": "llama", "model_type": None, "architectures": None}),
    "dcp": ("tp=1,pp=1,dp=2", ["param", "exp_avg", "exp_avg_sq"], {"float32": 117},
            {"step": 0, "iteration": None, "lr": None}, LLAMA_HF),
    "ucp": ("tp=1,pp=1,dp=1", ["param", *OPTIM], {"bfloat16": 39, "float32": 117},
            {"step": 1, "iteration": None, "lr": 0.001}, LLAMA_HF),
}
TOPOLOGY = {"megatron": "tp=2,pp=2", "deepspeed": "tp=1,dp=2,zero=1", "hf": "tp=1", "mcore-dist": "tp=2",
            "dcp": "dp=2"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inspect")
    made = {}
    for fmt, to in TOPOLOGY.items():
        make_fixture(root / fmt, format=fmt, to=to, model="tiny-llama")
        made[fmt] = root / fmt
    reshard.convert(made["deepspeed"], root / "ucp", format="ucp")  # UCP has no fixture of its own
    made["ucp"] = root / "ucp"
    return made


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    """An hf checkpoint of a model no family knows, one tensor name longer than a console line."""
    root = tmp_path_factory.mktemp("qwen") / "ckpt"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(QWEN))
    tensors = {"model.embed_tokens.weight": np.zeros((10, 8), np.float32), LONG: np.zeros((3, 8), np.float16),
               "model.norm.weight": np.zeros((8,), np.float32)}
    with SafetensorsWriter(root / WEIGHTS_NAME, {n: (str(a.dtype), a.shape) for n, a in tensors.items()},
                           {"format": "pt"}) as w:
        for name in w.order:
            w.write(name, tensors[name].tobytes())
    return root


@pytest.mark.parametrize("fmt", list(EXPECTED))
def test_inspect_reports_every_format_without_sizes(ckpts, fmt):
    topology, states, dtypes, progress, model = EXPECTED[fmt]
    info = reshard.inspect(ckpts[fmt])
    assert (info["format"], info["topology"], info["states"]) == (fmt, topology, states)
    assert info["optimizer_states"] == [s for s in states if s != "param"]
    assert info["tensor_count"] == len(info["tensors"]) == 39 and info["dtypes"] == dtypes
    assert {n: tuple(t["shape"]) for n, t in info["tensors"].items()} == TINY_LLAMA
    width = {"bfloat16": 2, "float32": 4}
    assert info["bytes"] == PARAMS * sum(width[d] * n for d, n in dtypes.items()) // 39
    for name, row in info["tensors"].items():
        assert list(row["states"]) == states, name
        for st in row["states"].values():
            assert st["bytes"] == int(np.prod(TINY_LLAMA[name])) * width[st["dtype"]]
    if progress is not ...:
        assert info["progress"] == progress
    assert info["model"] == model


def test_json_is_the_api_dict(ckpts):
    result = runner.invoke(app, ["inspect", str(ckpts["dcp"]), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == reshard.inspect(ckpts["dcp"])


def test_text_gives_identity_progress_states_and_full_names_to_a_pipe(qwen):
    result = runner.invoke(app, ["inspect", str(qwen)])  # CliRunner's stdout is not a terminal
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:6] == [
        f"{qwen}: hf (hf-derived), tp=1,pp=1,dp=1, 1 file, {10 * 8 * 4 + 3 * 8 * 2 + 8 * 4} B",
        "model: model_type qwen3_next; Qwen3NextForCausalLM",
        "progress: not recorded",
        "sizes: none recorded",
        "tensors: 3, 3 tensor states: 1 float16, 2 float32",
        "optimizer state: none (weights only)",
    ]
    assert lines[6].split() == ["tensor", "shape", "param"]
    assert [line.split() for line in lines[7:]] == [
        ["model.embed_tokens.weight", "10x8", "float32", "320", "B"],
        [LONG, "3x8", "float16", "48", "B"],
        ["model.norm.weight", "8", "float32", "32", "B"],
    ]
    assert len(LONG) > 80 and "…" not in result.stdout


def test_text_names_family_progress_and_optimizer_states(ckpts):
    result = runner.invoke(app, ["inspect", str(ckpts["megatron"])])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"{ckpts['megatron']}: megatron (megatron-llama), tp=2,pp=2,dp=1, 4 files, 4.2 MiB"
    assert lines[1:3] == ["model: family llama", "progress: iteration 0"]
    assert lines[4:6] == ["tensors: 39, 156 tensor states: 39 bfloat16, 117 float32",
                          "optimizer state: master, exp_avg, exp_avg_sq"]
    assert lines[7].split() == ["lm_head.weight", "1100x64", "bfloat16", "137.5", "KiB",
                                *["float32", "275.0", "KiB"] * 3]
    assert len(lines) == 6 + 1 + 39


def _declared(text: str) -> list[str]:
    """The names (patterns) of the logical tensors the spec text declares, as the parser reads them."""
    return [s.pattern.text for s in parse_spec(text).statements if isinstance(s, Logical)]


@pytest.mark.parametrize("fmt", ["dcp", "ucp"])
def test_spec_of_a_format_without_one_declares_every_tensor(ckpts, fmt):
    result = runner.invoke(app, ["inspect", str(ckpts[fmt]), "--spec"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text == inspect_spec(ckpts[fmt])
    topology = EXPECTED[fmt][0]
    assert text.splitlines()[0].endswith(f"as its {fmt} checkpoint at {topology} records them")
    assert sorted(_declared(text)) == sorted(TINY_LLAMA)
    assert "logical model.layers.3.mlp.down_proj.weight = d0_64 d1_160" in text.splitlines()
    assert "let d0_1100 = 1100" in text.splitlines()


def test_spec_of_a_family_checkpoint_is_the_spec_it_was_read_with(ckpts):
    from reshard.api.planning import open_checkpoint

    result = runner.invoke(app, ["inspect", str(ckpts["megatron"]), "--spec"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"# layout of {ckpts['megatron']}: megatron at tp=2,pp=2,dp=1, read with spec megatron-llama"
    assert lines[1].startswith("# model sizes: bucket_size=0, f=160, g=4, h=64,")
    spec_lines = list(open_checkpoint(ckpts["megatron"]).spec.lines)
    assert len(spec_lines) > 20 and lines[2:] == "\n".join(spec_lines).rstrip("\n").splitlines()
    assert "model.layers.{i}.self_attn.q_proj.weight" in _declared(result.stdout)


def test_spec_of_an_unknown_model_derives_its_tensors(qwen):
    result = runner.invoke(app, ["inspect", str(qwen), "--spec"])
    assert result.exit_code == 0, result.output
    assert sorted(_declared(result.stdout)) == sorted(["model.embed_tokens.weight", LONG, "model.norm.weight"])
    assert f"logical {LONG} = d0_3 d1_8" in result.stdout.splitlines()
    assert "logical model.norm.weight = d0_8" in result.stdout.splitlines()


def test_spec_and_json_together_are_refused(ckpts):
    result = runner.invoke(app, ["inspect", str(ckpts["hf"]), "--spec", "--json"])
    assert result.exit_code == 2 and "--json and --spec" in result.stderr and result.stdout == ""


def test_a_pipeline_of_a_model_no_family_describes_shows_each_tensor_under_its_recorded_name(tmp_path):
    """A DeepSpeed pipeline-engine checkpoint without a config.json: its layout derived from the files, each
    tensor ``@stage`` of the stage holding it."""
    from reshard.formats.deepspeed import FORMAT, DsModel
    from reshard.formats.derived import Recorded

    tensors = (Recorded("0.weight", (10, 4)), Recorded("1.weight", (4, 4)), Recorded("1.bias", (4,)),
               Recorded("2.weight", (10, 4)))
    names = tuple(t.name for t in tensors)
    model = DsModel(tensors=tensors, groups=(names,), module=tuple(zip(names, names)),
                    stages=tuple((n, int(n.startswith("2."))) for n in names))
    target = FORMAT.new_target("pp=2,dp=1", {}, model=model, dtype="float32", zero_stage=1)
    FORMAT.write(target, tmp_path, lambda item, lo, hi: bytes(4 * (hi - lo)))  # float32 zeros
    info = reshard.inspect(tmp_path)
    assert (info["spec"], info["topology"]) == ("deepspeed-pipe-derived", "tp=1,pp=2,dp=1,zero=1")
    assert {n: t["shape"] for n, t in info["tensors"].items()} == {t.name: list(t.shape) for t in tensors}
    assert info["states"] == ["param", *OPTIM] and info["model"]["family"] is None
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].startswith(f"{tmp_path}: deepspeed (deepspeed-pipe-derived), tp=1,pp=2,dp=1")
    result = runner.invoke(app, ["inspect", str(tmp_path), "--spec"])
    assert result.exit_code == 0, result.output
    assert {"1.bias @stage(0) = d0_4", "2.weight @stage(1) = d0_10 d1_4"} <= set(result.stdout.splitlines())
    assert sorted(_declared(result.stdout)) == sorted(t.name for t in tensors)
