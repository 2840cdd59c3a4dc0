"""Models reshard has no family for, made by the real frameworks, converted with no spec and no sizes.

- A transformers ``Qwen2ForCausalLM`` (tied and untied) with a tokenizer: Hugging Face -> DCP (FSDP2's
  layout) -> Hugging Face; ``from_pretrained`` gives bit-identical logits, every tensor is equal, and
  the config, generation config and tokenizer files arrive unchanged.
- A ``BertForMaskedLM`` and a custom ``nn.Module`` (bf16 and fp32 parameters, a tied weight, a
  persistent and a non-persistent buffer, a BatchNorm with its 0-d step counter) trained and saved by
  real FSDP2 jobs (``fsdp_any_jobs.py``): to Hugging Face, and resharded 2 -> 3 ranks for a real job
  that loads model and Adam state with ``set_state_dict``. The oracles are the jobs' own full tensors
  (``full_tensor()``) and DCP's own load-time resharding of the original checkpoint: the step taken
  after either load must agree bit for bit.
- A 0-d buffer through DCP, and tensors with no elements (an empty buffer too), carried in their dtypes.
"""

from __future__ import annotations

import json
import shutil

import fsdp_any_jobs as jobs
import pytest
import torch
from conftest import assert_same_logits, require
from reshard.cli.main import app
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from typer.testing import CliRunner

import reshard
from reshard.io.dcp_metadata import read_metadata

pytestmark = pytest.mark.interop

QWEN_VOCAB = 320


def same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert same(got[k], v), k


def model_part(flat: dict) -> dict:
    """The ``model.<fqn>`` entries of a flattened DCP state dict, by fqn."""
    return {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}


def hf_tensors(path) -> dict:
    """Every tensor of a Hugging Face directory, one file or sharded with an index."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    out = {}
    for f in files:
        out.update(load_file(path / f))
    return out


def chunk_rows(path, key: str) -> list[int]:
    return [c.sizes[0] for c in sorted(read_metadata(path).tensors[key].chunks, key=lambda c: c.offsets)]


# -- Qwen2: Hugging Face <-> DCP ---------------------------------------------------------------------------


def save_tokenizer(path) -> None:
    """A byte-level BPE tokenizer trained here (no network), saved as ``save_pretrained`` saves it."""
    transformers = require("transformers")
    tokenizers = require("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainer)
    assert tok.get_vocab_size() <= QWEN_VOCAB
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                         pad_token="<|endoftext|>").save_pretrained(path)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen(request, tmp_path_factory):
    """A tiny random Qwen2ForCausalLM saved by transformers (fp32 untied, bf16 tied) with a tokenizer."""
    transformers = require("transformers")
    tied = request.param
    path = tmp_path_factory.mktemp("qwen") / "hf"
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=QWEN_VOCAB,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    model = transformers.Qwen2ForCausalLM(config)
    model.to(torch.bfloat16 if tied else torch.float32).save_pretrained(path)
    save_tokenizer(path)
    return path, tied


def assert_same_hf_model(src, out) -> None:
    """``out`` is ``src``: every tensor, the logits, config and generation config, the tokenizer's files and
    its tokens."""
    from safetensors.torch import load_file

    transformers = require("transformers")
    assert_same_tensors(load_file(out / "model.safetensors"), load_file(src / "model.safetensors"))
    assert_same_logits(transformers.Qwen2ForCausalLM, src, out, QWEN_VOCAB)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((src / name).read_text()), name
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    text = "the lazy fox jumps over a quick dog!"
    want = transformers.AutoTokenizer.from_pretrained(src)(text)["input_ids"]
    got = transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"]
    assert got == want and len(want) > 3


def test_qwen2_to_fsdp2_dcp_at_3_and_back_is_the_same_model(qwen, tmp_path):
    from safetensors.torch import load_file

    src, tied = qwen
    reshard.convert(src, tmp_path / "dcp", format="dcp", to="dp=3")
    dcp = tmp_path / "dcp"
    assert chunk_rows(dcp, "model.model.embed_tokens.weight") == [107, 107, 106]  # torch.chunk of 320 rows
    dcp_to_torch_save(dcp, tmp_path / "dcp.pt")  # DCP's own reader is the oracle for what reshard wrote
    consolidated = torch.load(tmp_path / "dcp.pt", weights_only=True)
    files = load_file(src / "model.safetensors")
    if tied:  # FSDP2's state dict of a tied model holds its output projection beside the embedding
        files["lm_head.weight"] = files["model.embed_tokens.weight"]
    assert_same_tensors(consolidated["model"], files)
    reshard.convert(dcp, tmp_path / "back", format="hf")
    assert_same_hf_model(src, tmp_path / "back")


def test_qwen2_through_dcp_at_2_then_3_and_back_is_the_same_model(qwen, tmp_path):
    src, tied = qwen
    reshard.convert(src, tmp_path / "dp2", format="dcp", to="dp=2")
    reshard.convert(tmp_path / "dp2", tmp_path / "dp3", to="dp=3")
    assert chunk_rows(tmp_path / "dp2", "model.model.embed_tokens.weight") == [160, 160]
    assert chunk_rows(tmp_path / "dp3", "model.model.embed_tokens.weight") == [107, 107, 106]
    reshard.convert(tmp_path / "dp3", tmp_path / "back", format="hf")
    assert_same_hf_model(src, tmp_path / "back")
    result = reshard.verify(src, tmp_path / "dp3")
    assert result.identical and result.compared == 2 * 12 + 2 + (not tied), result  # layers, embedding, norm, head


# -- real FSDP2 jobs: a BERT encoder and a custom module ---------------------------------------------------


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """Two jobs. At 2 ranks: BERT and the custom module trained and saved. Then reshard rewrites both for 3
    ranks (BERT by the API, the custom module by the CLI), and a job at 3 ranks saves BERT anew and
    loads each 2-rank checkpoint twice: as reshard rewrote it, and as saved (DCP reshards on load).

    BERT's ``config.json`` sits in the checkpoints' parent directory, where Accelerate keeps it; the
    custom module has none.
    """
    require("transformers")
    root = tmp_path_factory.mktemp("fsdp")
    bert, custom = root / "bert", root / "custom"
    bert.mkdir()
    custom.mkdir()
    (bert / "config.json").write_text(json.dumps(jobs.BERT_CONFIG))
    jobs.run(2, jobs.save("bert", bert / "ws2", root / "bert2.pt"),
             jobs.save("custom", custom / "ws2", root / "custom2.pt"))
    reshard.convert(bert / "ws2", bert / "ws2-to-3", to="dp=3")
    result = CliRunner().invoke(app, ["convert", str(custom / "ws2"), str(custom / "ws2-to-3"), "--to", "dp=3"])
    assert result.exit_code == 0, result.output
    jobs.run(3, jobs.save("bert", bert / "ws3", root / "bert3.pt"),
             jobs.load("bert", root / "bert-loads.pt", [bert / "ws2-to-3", bert / "ws2"]),
             jobs.load("custom", root / "custom-loads.pt", [custom / "ws2-to-3", custom / "ws2"]))

    def dump(name):
        return torch.load(root / name, weights_only=True)

    return {"bert": bert, "custom": custom, "saved": {k: dump(f"{k}.pt") for k in ("bert2", "bert3", "custom2")},
            "loads": {k: dump(f"{k}-loads.pt") for k in ("bert", "custom")}}


@pytest.mark.parametrize("world,shard", [(2, None), (3, "20KB")])
def test_fsdp2_bert_to_hf_is_the_trained_model(fsdp, tmp_path, world, shard):
    transformers = require("transformers")
    src, saved = fsdp["bert"] / f"ws{world}", fsdp["saved"][f"bert{world}"]
    assert len(read_metadata(src).tensors["model.bert.embeddings.word_embeddings.weight"].chunks) == world
    reshard.convert(src, tmp_path / "hf", format="hf", max_shard_size=shard)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() is (shard is not None)
    weights = model_part(saved)
    assert_same_tensors(hf_tensors(tmp_path / "hf"), weights)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == jobs.BERT_CONFIG

    trained = transformers.BertForMaskedLM(transformers.BertConfig(**jobs.BERT_CONFIG)).eval()
    trained.load_state_dict(weights, strict=True)  # the state the job trained, gathered by full_tensor()
    loaded, info = transformers.BertForMaskedLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    ids = torch.arange(48).reshape(2, 24) % jobs.VOCAB["bert"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, trained(ids).logits)


@pytest.mark.parametrize("model", ["bert", "custom"])
def test_fsdp2_checkpoint_resharded_2_to_3_loads_in_a_real_job_as_saved(fsdp, model):
    saved = fsdp["saved"][f"{model}2"]
    loads = fsdp["loads"][model]
    resharded, original = loads[str(fsdp[model] / "ws2-to-3")], loads[str(fsdp[model] / "ws2")]
    key = {"bert": "model.bert.embeddings.word_embeddings.weight", "custom": "model.emb.weight"}[model]
    rows = {"bert": [32, 32, 32], "custom": [17, 17, 16]}[model]
    assert chunk_rows(fsdp[model] / "ws2-to-3", key) == rows
    assert chunk_rows(fsdp[model] / "ws2-to-3", "optim.state." + key[len("model."):] + ".exp_avg") == rows
    for world, path in ((2, fsdp[model] / "ws2"), (3, fsdp[model] / "ws2-to-3")):
        opened = reshard.open_checkpoint(path)  # what reshard reads from the metadata alone
        assert (opened.topology.dp, opened.progress.step) == (world, jobs.STEPS)
        assert {n: t.shape for n, t in opened.layout.tensors.items()} == {
            n: tuple(v.shape) for n, v in model_part(saved).items()}
    # model and Adam state (exp_avg, exp_avg_sq, step, param_groups) as the 2-rank job saved them
    assert_same_tensors(resharded["loaded"], saved)
    # the next step from reshard's checkpoint is the step from DCP's own load-time resharding, bit for bit
    assert_same_tensors(original["loaded"], saved)
    assert resharded["loss"] == original["loss"]
    assert_same_tensors(resharded["stepped"], original["stepped"])
    trained = ["model." + k[len("optim.state."):-len(".exp_avg")] for k in saved if k.endswith(".exp_avg")]
    assert trained and all(not torch.equal(resharded["stepped"][k], saved[k]) for k in trained)  # a real step
    result = reshard.verify(fsdp[model] / "ws2", fsdp[model] / "ws2-to-3")
    # parameters and buffers (a 0-d one too), and their optimizer states (Adam's 0-d steps are not tensors of it)
    tensors = sum(torch.is_tensor(v) and (v.dim() > 0 or k.startswith("model.")) for k, v in saved.items())
    assert result.identical and result.compared == tensors, result


def test_custom_module_to_hf_needs_a_config_then_writes_its_state_dict(fsdp, tmp_path):
    """The CLI with no spec and no sizes: refused while nothing says which model this is, then, with the
    user's config.json beside the source, every tensor of the module's state dict, in its dtype."""
    from safetensors.torch import load_file

    runner = CliRunner()
    src = tmp_path / "ws2"
    shutil.copytree(fsdp["custom"] / "ws2", src)
    refused = runner.invoke(app, ["convert", str(src), str(tmp_path / "hf"), "--format", "hf"])
    assert refused.exit_code == 2, refused.output
    assert "needs its config; put the model's config.json beside the source" in " ".join(refused.output.split())
    assert not (tmp_path / "hf").exists()

    config = {"model_type": "tiny-net", "architectures": ["Net"], "vocab_size": jobs.VOCAB["custom"]}
    (src / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "hf"), "--format", "hf"])
    assert result.exit_code == 0, result.output
    state = load_file(tmp_path / "hf" / "model.safetensors")
    saved = model_part(fsdp["saved"]["custom2"])
    net = jobs.custom_module()()
    assert state.keys() == net.state_dict().keys() == saved.keys()  # the tied head stored, the cache buffer not
    assert_same_tensors(state, saved)
    assert state["block.proj.weight"].dtype == torch.bfloat16 and state["emb.weight"].dtype == torch.float32
    assert state["bn.num_batches_tracked"].dtype == torch.int64 and state["bn.num_batches_tracked"].item() == jobs.STEPS
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == config

    net.load_state_dict(state, strict=True)
    trained = jobs.custom_module()()
    trained.load_state_dict(saved, strict=True)
    net.eval(), trained.eval()  # BatchNorm with its running statistics
    tokens = torch.arange(24).reshape(2, 12) % jobs.VOCAB["custom"]
    with torch.no_grad():
        assert torch.equal(net(tokens), trained(tokens))
    check = reshard.verify(src, tmp_path / "hf", states=("param",))
    assert check.identical and check.compared == len(saved), check


def test_0d_buffers_travel_hf_to_dcp_and_back(tmp_path):
    """A 0-d buffer (BatchNorm's int64 ``num_batches_tracked``, a bf16 scale) is a tensor of the model: DCP
    holds it as one 0-d chunk, as FSDP2's ``dcp.save`` does, and it comes back."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    tensors = {"emb.weight": torch.randn(10, 4), "bn.weight": torch.randn(6), "bn.running_mean": torch.randn(6),
               "bn.num_batches_tracked": torch.tensor(7), "scale": torch.tensor(0.5, dtype=torch.bfloat16)}
    (tmp_path / "hf").mkdir()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "tiny-cnn"}))
    reshard.convert(tmp_path / "hf", tmp_path / "dcp", format="dcp", to="dp=3")
    md = read_metadata(tmp_path / "dcp")
    assert [(c.offsets, c.sizes) for c in md.tensors["model.bn.num_batches_tracked"].chunks] == [((), ())]
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    assert_same_tensors(torch.load(tmp_path / "dcp.pt", weights_only=True)["model"], tensors)
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    assert_same_tensors(load_file(tmp_path / "back" / "model.safetensors"), tensors)


def test_empty_tensors_travel_hf_to_dcp_at_dp3_and_back_in_their_dtypes(tmp_path):
    """Tensors with no elements ((0,), (0, 8), an int64 and a bf16 one) have no bytes, but a shape and a dtype
    the model needs: DCP holds each as one chunk of none, as ``dcp.save`` records it, and the Hugging Face file
    that comes back is the original byte for byte."""
    from safetensors.torch import save_file

    tensors = {"emb.weight": torch.randn(10, 4, generator=torch.Generator().manual_seed(0)),
               "ids": torch.zeros(0, dtype=torch.int64), "cache": torch.zeros(0, 8, dtype=torch.bfloat16),
               "bias": torch.arange(5, dtype=torch.int32)}
    (tmp_path / "hf").mkdir()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "tiny-net"}))
    reshard.convert(tmp_path / "hf", tmp_path / "dcp", format="dcp", to="dp=3")
    md = read_metadata(tmp_path / "dcp")
    assert [(c.offsets, c.sizes) for c in md.tensors["model.cache"].chunks] == [((0, 0), (0, 8))]
    assert md.tensors["model.ids"].dtype == "int64" and md.tensors["model.cache"].dtype == "bfloat16"
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    assert_same_tensors(torch.load(tmp_path / "dcp.pt", weights_only=True)["model"], tensors)
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


def test_a_dcp_checkpoint_with_an_empty_buffer_loads_strictly_from_hugging_face(tmp_path):
    """A module whose state dict holds an empty buffer, saved by ``dcp.save``: converted to Hugging Face, the
    module loads it with ``strict=True`` and holds every tensor as before, the empty one in its dtype."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 3)
            self.register_buffer("history", torch.zeros(0, 4, dtype=torch.float16))
            self.register_buffer("steps", torch.tensor(3))

    torch.manual_seed(0)
    net = Net()
    dcp.save({"model": net.state_dict()}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    (tmp_path / "dcp" / "config.json").write_text(json.dumps({"model_type": "tiny-net"}))
    reshard.convert(tmp_path / "dcp", tmp_path / "hf", format="hf")
    fresh = Net()
    fresh.history = torch.zeros(0, 4)  # float32: assigning what the file holds must bring float16 back
    loaded = load_file(tmp_path / "hf" / "model.safetensors")
    fresh.load_state_dict(loaded, strict=True, assign=True)
    assert_same_tensors(fresh.state_dict(), net.state_dict())
