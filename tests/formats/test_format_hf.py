"""Tests of the hf format adapter: reading, matching, writing Hugging Face Llama checkpoints.

Synthetic checkpoints (written with our own safetensors writer, arange-valued)
test matching and error messages without transformers; a real
``LlamaForCausalLM`` saved by transformers is the oracle for the round trip:
written back through the adapter, ``from_pretrained`` must give bit-identical
logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import require, save_tiny_mixtral

from reshard.formats.specs import layout_spec
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.formats.hf.files import _ordered_items
from reshard.formats.base import Source, Target, itemsize
from reshard.execution.session import WriteSession
from reshard.formats.base import ModelMeta
from reshard.formats.hf import FORMAT
from reshard.models.llama import config_from_sizes as llama_config
from reshard.models.llama import sizes_from_config
from reshard.core.resolve import resolve
from reshard.io.safetensors_io import INDEX_NAME, WEIGHTS_NAME, SafetensorsWriter, read_header
from reshard.core.topology import Topology
from reshard.models import FAMILIES

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "num_attention_heads": 2,
    "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 10, "num_hidden_layers": 2,
    "tie_word_embeddings": False,
}


def _tensors(config: dict) -> dict[str, np.ndarray]:
    """Every tensor of the hf-llama layout for ``config``, arange-valued and distinct per tensor."""
    layout = resolve(layout_spec("hf-llama"), Topology(), sizes_from_config(config))
    return {it.key: (np.arange(info.numel, dtype=np.float32) + 1000 * k).reshape(info.shape)
            for k, (it, info) in enumerate(sorted(layout.items.items()))}


def _save(path: Path, tensors: dict[str, np.ndarray]) -> None:
    with SafetensorsWriter(path, {n: (str(a.dtype), a.shape) for n, a in tensors.items()}, {"format": "pt"}) as w:
        for name in w.order:
            w.write(name, tensors[name].tobytes())


def _make_hf(root: Path, tensors: dict[str, np.ndarray], config: dict = TINY,
             shards: list[list[str]] | None = None) -> Path:
    """A checkpoint directory: config.json and one file, or the given shards with an index."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if shards is None:
        _save(root / WEIGHTS_NAME, tensors)
        return root
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(root / file, {n: tensors[n] for n in names})
        weight_map.update(dict.fromkeys(names, file))
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return root


def _span_fill(source: Source):
    """fill(item, lo, hi) reading the same-named tensor's bytes straight from the source files."""
    by_key = {it.key: loc for it, loc in source.where.items()}
    asked: list[int] = []

    def fill(item, lo: int, hi: int) -> bytes:
        loc = by_key[item.key]
        size = itemsize(loc.dtype)
        asked.append((hi - lo) * size)
        with loc.path.open("rb") as f:
            f.seek(loc.offset + lo * size)
            return f.read((hi - lo) * size)

    fill.asked = asked  # type: ignore[attr-defined]
    return fill


def _stored_bytes(source: Source) -> dict[str, bytes]:
    out = {}
    for it, loc in source.where.items():
        n = source.layout.items[it].numel * itemsize(loc.dtype)
        with loc.path.open("rb") as f:
            f.seek(loc.offset)
            out[it.key] = f.read(n)
    return out


@pytest.fixture
def tiny() -> dict[str, np.ndarray]:
    return _tensors(TINY)


# --- detect and open -------------------------------------------------------------------------

def test_detect_needs_config_and_weights(tmp_path: Path, tiny) -> None:
    assert FORMAT.detect(_make_hf(tmp_path / "single", tiny))
    assert FORMAT.detect(_make_hf(tmp_path / "sharded", tiny, shards=[list(tiny)]))
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text("{}")
    assert not FORMAT.detect(tmp_path / "config-only")
    (tmp_path / "single" / "config.json").unlink()
    assert not FORMAT.detect(tmp_path / "single")


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_open_locates_every_tensor_at_its_bytes(tmp_path: Path, tiny, sharded: bool) -> None:
    names = sorted(tiny)
    shards = [names[:7], names[7:8], names[8:]] if sharded else None
    root = _make_hf(tmp_path / "ckpt", tiny, shards=shards)
    source = FORMAT.open(root)
    assert (source.format, source.spec_name, source.topology) == ("hf", "hf-llama", Topology())
    assert source.sizes == {"h": 8, "heads": 2, "g": 1, "hd": 4, "f": 16, "vocab": 10, "layers": 2}
    assert source.model.config == TINY
    assert {it.key for it in source.where} == set(tiny)
    got = _stored_bytes(source)
    for name, arr in tiny.items():
        assert got[name] == arr.tobytes(), name
    assert all(loc.dtype == "float32" for loc in source.where.values())


@pytest.mark.parametrize("model_type", ["llama", "custom"], ids=["family", "derived"])
def test_open_locates_items_at_once_as_item_by_item(tmp_path: Path, tiny, monkeypatch, model_type: str) -> None:
    from reshard.formats.hf import format as hf_format
    root = _make_hf(tmp_path / "ckpt", tiny, shards=[sorted(tiny)[:5], sorted(tiny)[5:]])
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    fast = FORMAT.open(root)
    monkeypatch.setattr(hf_format, "_located", lambda *args: None)  # HFFormat.open's loop, item by item
    careful = FORMAT.open(root)
    assert list(fast.where.items()) == list(careful.where.items()) and len(fast.where) == len(tiny)


def test_a_tensor_the_family_does_not_name_is_carried_or_refused_by_name(tmp_path: Path, tiny) -> None:
    import reshard
    from reshard.errors import PlanError
    from reshard.io.safetensors_io import read_header

    extra = "model.layers.0.self_attn.q_proj.bias"
    root = _make_hf(tmp_path / "ckpt", {**tiny, extra: np.arange(8, dtype=np.float32)})
    source = FORMAT.open(root)
    assert source.spec_name == "hf-llama" and extra in source.layout.tensors
    reshard.convert(root, tmp_path / "dcp", format="dcp", to="dp=3")
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    header = read_header(tmp_path / "back" / WEIGHTS_NAME)
    data = (tmp_path / "back" / WEIGHTS_NAME).read_bytes()
    t = header.tensors[extra]
    assert data[t.data_offset:t.data_offset + 32] == np.arange(8, dtype=np.float32).tobytes()
    assert set(header.tensors) == {*tiny, extra}
    with pytest.raises(PlanError) as e:  # Megatron's layout of a Llama has no place for a q_proj bias
        reshard.convert(root, tmp_path / "meg", format="megatron", to="pp=2")
    assert f"'{extra}' [param] in {root / WEIGHTS_NAME}" in str(e.value) and "would be lost" in str(e.value)
    assert not (tmp_path / "meg").exists()


def test_missing_and_misshapen_tensors_are_all_listed(tmp_path: Path, tiny) -> None:
    tensors = {k: v for k, v in tiny.items() if k != "lm_head.weight"}
    tensors["model.norm.weight"] = np.zeros(9, np.float32)
    root = _make_hf(tmp_path / "ckpt", tensors)
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(root)
    assert str(e.value) == (
        f"{root}: the stored tensors do not match spec 'hf-llama':\n"
        f"  {root / WEIGHTS_NAME}: tensor 'model.norm.weight' has shape [9], the spec expects [8]\n"
        f"  tensor 'lm_head.weight' is missing (spec rule 'lm_head.weight')")


@pytest.mark.parametrize("model_type", ["smollm3", "granite", None])
def test_a_model_type_no_family_claims_is_never_read_as_llama(tmp_path: Path, tiny, model_type) -> None:
    """SmolLM3 and Granite store exactly Llama's tensor names; reading them as Llama would change them (SmolLM3's
    layers without RoPE, Granite's multipliers).

    Its tensors are read under their own names (a derived layout) and its config travels; a format that
    needs the family refuses it by model type."""
    import reshard

    config = {**TINY, "model_type": model_type, "sliding_window": 4096}
    root = _make_hf(tmp_path / "ckpt", tiny, config=config)
    source = FORMAT.open(root)
    assert source.spec_name == "hf-derived" and source.model.config == config
    assert set(source.layout.tensors) == set(tiny) and source.sizes == {}
    reshard.convert(root, tmp_path / "dcp", format="dcp", to="dp=2")
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config
    assert (tmp_path / "back" / WEIGHTS_NAME).read_bytes() == (root / WEIGHTS_NAME).read_bytes()
    with pytest.raises(CheckpointFormatError) as e:
        reshard.convert(root, tmp_path / "meg", format="megatron", to="pp=2")
    assert str(e.value) == (f"{root}: the model is model_type {model_type!r} (its config.json), which no model family "
                            f"reshard knows describes (known: {', '.join(FAMILIES)}); Megatron stores each family's "
                            "tensors its own way, and converting it as another family would change the model: give "
                            "a spec, or convert to a format that keeps every tensor by name (hf, dcp, deepspeed)")
    assert not (tmp_path / "meg").exists()


def test_tied_checkpoint_opens_with_the_tied_spec_and_has_no_lm_head(tmp_path: Path, tiny) -> None:
    tensors = {k: v for k, v in tiny.items() if k != "lm_head.weight"}
    root = _make_hf(tmp_path / "ckpt", tensors, config={**TINY, "tie_word_embeddings": True})
    source = FORMAT.open(root)
    assert source.spec_name == "hf-llama-tied"
    assert "lm_head.weight" not in source.layout.tensors
    with pytest.raises(CheckpointFormatError, match="lm_head.weight' matches no item of spec 'hf-llama-tied'"):
        FORMAT.open(_make_hf(tmp_path / "bad", tiny, config={**TINY, "tie_word_embeddings": True}))


def test_config_without_model_sizes_names_every_missing_key(tmp_path: Path, tiny) -> None:
    config = {k: v for k, v in TINY.items() if k not in ("hidden_size", "vocab_size")} | {"head_dim": 0}
    root = _make_hf(tmp_path / "ckpt", tiny, config=config)
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(root)
    assert str(e.value) == (f"{root / 'config.json'}: 'hidden_size' is missing; 'vocab_size' is missing; "
                            "'head_dim' must be a positive integer, got 0")


def test_sizes_default_like_llama_config() -> None:
    sizes = sizes_from_config({k: v for k, v in TINY.items() if k != "num_key_value_heads"})
    assert (sizes["g"], sizes["hd"]) == (2, 4)
    assert sizes_from_config({**TINY, "head_dim": 16})["hd"] == 16


def test_single_file_and_index_together_are_ambiguous(tmp_path: Path, tiny) -> None:
    root = _make_hf(tmp_path / "ckpt", tiny, shards=[list(tiny)])
    _save(root / WEIGHTS_NAME, tiny)
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(root)
    assert str(e.value) == (f"{root}: holds both {WEIGHTS_NAME} and {INDEX_NAME}; transformers would load "
                            f"{WEIGHTS_NAME} and ignore the index, so remove the one that is stale")


def test_index_and_shards_must_agree(tmp_path: Path, tiny) -> None:
    names = sorted(tiny)
    root = _make_hf(tmp_path / "ckpt", tiny, shards=[names[:10], names[10:]])
    index = json.loads((root / INDEX_NAME).read_text())
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    (root / INDEX_NAME).write_text(json.dumps(index))
    first = root / "model-00001-of-00002.safetensors"
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(root)
    assert str(e.value) == (
        f"{root}: the index and the shards disagree:\n"
        f"  {first}: holds tensor '{names[0]}' but {INDEX_NAME} maps it to model-00002-of-00002.safetensors\n"
        f"  {INDEX_NAME}: maps tensor '{names[0]}' to model-00002-of-00002.safetensors, which does not hold it")


def test_index_cannot_point_outside_the_checkpoint(tmp_path: Path, tiny) -> None:
    root = _make_hf(tmp_path / "ckpt", tiny, shards=[list(tiny)])
    index = json.loads((root / INDEX_NAME).read_text())
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    (root / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(root)
    assert str(e.value) == (f"{root / INDEX_NAME}: weight_map maps 'lm_head.weight' to \"../elsewhere.safetensors\", "
                            "not a file name in the checkpoint directory")


def test_malformed_shard_header_names_the_file(tmp_path: Path, tiny) -> None:
    root = _make_hf(tmp_path / "ckpt", tiny)
    file = root / WEIGHTS_NAME
    header = read_header(file)
    last, t = list(header.tensors.items())[-1]
    file.write_bytes(file.read_bytes()[:-1])
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.open(root)
    begin, end = t.data_offset - header.data_start, t.data_offset - header.data_start + t.nbytes
    reason = f"data_offsets [{begin}, {end}] end past the byte buffer ({end - 1} bytes)"
    assert str(e.value) == f"{file}: tensor '{last}': {reason}"


# --- target and write ----------------------------------------------------------------------

def test_target_refuses_a_sharded_topology(tmp_path: Path, tiny) -> None:
    source = FORMAT.open(_make_hf(tmp_path / "ckpt", tiny))
    with pytest.raises(TopologyError) as e:
        FORMAT.target(source, Topology(tp=2, pp=2))
    assert str(e.value) == "hf checkpoints are unsharded: cannot write tp(2), pp(2) (use tp=1,pp=1,dp=1)"


def test_target_of_an_hf_source_keeps_its_config_and_dtypes(tmp_path: Path, tiny) -> None:
    source = FORMAT.open(_make_hf(tmp_path / "ckpt", tiny))
    target = FORMAT.target(source, Topology())
    assert target.model.config == TINY and target.model.config is not source.model.config
    assert set(target.dtypes.values()) == {"float32"} and set(target.dtypes) == set(target.layout.items)


def test_target_of_another_format_synthesizes_a_llama_config(tmp_path: Path, tiny) -> None:
    source = dataclasses.replace(FORMAT.open(_make_hf(tmp_path / "ckpt", tiny)), format="megatron", model=ModelMeta())
    target = FORMAT.target(source, Topology())
    assert target.spec_name == "hf-llama"
    assert target.model.config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "num_hidden_layers": 2, "vocab_size": 10,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "float32",
    }


@pytest.mark.parametrize("max_shard_size", [None, 600], ids=["one-file", "sharded"])
def test_write_streams_every_tensor_in_bounded_windows(tmp_path: Path, tiny, monkeypatch, max_shard_size) -> None:
    source = FORMAT.open(_make_hf(tmp_path / "ckpt", tiny))
    target = FORMAT.target(source, Topology())
    if max_shard_size:
        target.max_shard_size = max_shard_size
    out = tmp_path / "out"
    out.mkdir()
    fill = _span_fill(source)
    files = FORMAT.write(target, out, fill, WriteSession(window_bytes=24))
    total = sum(a.nbytes for a in tiny.values())
    assert sum(fill.asked) == total and max(fill.asked) <= 24  # every byte asked for once, in windows
    if max_shard_size:
        shard_files = [f for f in files if f.suffix == ".safetensors"]
        assert len(shard_files) > 2 and files[-2:] == [Path(INDEX_NAME), Path("config.json")]
        assert shard_files[0] == Path(f"model-00001-of-{len(shard_files):05d}.safetensors")
        index = json.loads((out / INDEX_NAME).read_text())
        assert index["metadata"] == {"total_parameters": total // 4, "total_size": total}
        assert set(index["weight_map"]) == set(tiny)
        for f in shard_files:
            assert read_header(out / f).file_size <= max_shard_size + 8 + 2048  # header slack
    else:
        assert files == [Path(WEIGHTS_NAME), Path("config.json")]
    assert json.loads((out / "config.json").read_text()) == TINY
    again = FORMAT.open(out)
    got = _stored_bytes(again)
    for name, arr in tiny.items():
        assert got[name] == arr.tobytes(), name


def test_write_keeps_each_layer_together_in_state_dict_order(tmp_path: Path, tiny) -> None:
    source = FORMAT.open(_make_hf(tmp_path / "ckpt", tiny))
    order = [it.key for it in _ordered_items(FORMAT.target(source, Topology()).layout)]
    assert order[0] == "model.embed_tokens.weight" and order[-2:] == ["model.norm.weight", "lm_head.weight"]
    layers = [int(k.split(".")[2]) for k in order[1:-2]]
    assert layers == sorted(layers) and len(layers) == 18


def test_write_refuses_optimizer_states(tmp_path: Path, tiny) -> None:
    source = FORMAT.open(_make_hf(tmp_path / "ckpt", tiny))
    layout = resolve(source.spec, Topology(), source.sizes, states={"model": ("param", "exp_avg", "exp_avg_sq")})
    target = Target(format="hf", spec_name="hf-llama", spec=source.spec, topology=Topology(), sizes=source.sizes,
                    layout=layout, dtypes=dict.fromkeys(layout.items, "float32"))
    with pytest.raises(CheckpointFormatError) as e:
        FORMAT.write(target, tmp_path, _span_fill(source))
    assert str(e.value) == ("hf checkpoints hold model weights only; "
                            "the target layout also has states exp_avg, exp_avg_sq")


def test_a_short_fill_is_an_error_and_leaves_no_partial_shard(tmp_path: Path, tiny) -> None:
    source = FORMAT.open(_make_hf(tmp_path / "ckpt", tiny))
    target = FORMAT.target(source, Topology())
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointFormatError, match=r"^fill returned 3 bytes for elements \[0, \d+\) of model\[\] "):
        FORMAT.write(target, out, lambda item, lo, hi: b"abc")
    assert list(out.iterdir()) == []


# --- against transformers ------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    """A tiny LlamaForCausalLM saved sharded by transformers: (model, directory)."""
    transformers = require("transformers")
    import torch
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=100,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path, max_shard_size="50KB")
    return model, path


def _logits(path: Path):
    import torch
    import transformers

    model, info = transformers.LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    with torch.no_grad():
        return model.eval()(torch.arange(24).reshape(2, 12) % 100).logits


@pytest.mark.interop
def test_real_sharded_checkpoint_spans_hold_the_tensor_bytes(llama) -> None:
    import torch

    model, path = llama
    assert (path / INDEX_NAME).is_file() and not (path / WEIGHTS_NAME).exists()
    source = FORMAT.open(path)
    state = model.state_dict()
    assert {it.key for it in source.where} == set(state)
    assert len({loc.path for loc in source.where.values()}) > 1
    got = _stored_bytes(source)
    for name, t in state.items():
        assert got[name] == t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), name


@pytest.mark.interop
@pytest.mark.parametrize("max_shard_size", ["30KB", None], ids=["sharded", "one-file"])
def test_round_trip_through_the_adapter_gives_bit_identical_logits(llama, tmp_path: Path, max_shard_size) -> None:
    import torch

    _, path = llama
    source = FORMAT.open(path)
    target = FORMAT.target(source, Topology())
    if max_shard_size:
        target.max_shard_size = max_shard_size
    files = FORMAT.write(target, tmp_path, _span_fill(source))
    assert (Path(INDEX_NAME) in files) == bool(max_shard_size)
    assert (tmp_path / "config.json").read_text() == (path / "config.json").read_text()
    assert torch.equal(_logits(tmp_path), _logits(path))


@pytest.mark.interop
def test_written_shards_are_exactly_what_save_file_writes(llama, tmp_path: Path) -> None:
    from safetensors.torch import save_file
    model, path = llama
    source = FORMAT.open(path)
    target = FORMAT.target(source, Topology())
    target.max_shard_size = "30KB"
    (tmp_path / "out").mkdir()
    files = FORMAT.write(target, tmp_path / "out", _span_fill(source))
    state = model.state_dict()
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) > 1
    for f in shards:
        names = list(read_header(tmp_path / "out" / f).tensors)
        ref = tmp_path / "ref.safetensors"
        save_file({n: state[n].contiguous() for n in names}, str(ref), metadata={"format": "pt"})
        assert (tmp_path / "out" / f).read_bytes() == ref.read_bytes(), f


@pytest.mark.interop
def test_synthesized_config_loads_in_transformers(llama, tmp_path: Path) -> None:
    import torch
    import transformers

    model, path = llama
    source = dataclasses.replace(FORMAT.open(path), format="megatron", model=ModelMeta())
    target = FORMAT.target(source, Topology())
    FORMAT.write(target, tmp_path, _span_fill(source))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "vocab_size", "tie_word_embeddings"):
        assert getattr(loaded.config, key) == getattr(model.config, key), key
    state = loaded.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(state[name], t), name


def test_llama_config_picks_the_most_common_dtype() -> None:
    sizes = {"h": 8, "heads": 2, "g": 1, "hd": 4, "f": 16, "vocab": 10, "layers": 2}
    assert llama_config(sizes, ["bfloat16", "float32", "bfloat16"])["dtype"] == "bfloat16"
    assert "dtype" not in llama_config(sizes)
    with pytest.raises(CheckpointFormatError) as e:
        llama_config({"h": 8})
    assert str(e.value) == "cannot build a Llama config.json: model sizes f, heads, g, hd, layers, vocab are unknown"


@pytest.mark.interop
def test_a_mixtral_resharded_as_fsdp2_and_back_gives_identical_logits(tmp_path: Path) -> None:
    """MixtralForCausalLM (experts saved per expert, as transformers saves them) through DCP at dp=3."""
    transformers = require("transformers")
    import reshard

    save_tiny_mixtral(tmp_path / "hf", layers=2)
    src = reshard.open_checkpoint(tmp_path / "hf")
    assert src.spec_name == "hf-mixtral" and src.sizes["experts"] == 4
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in src.layout.tensors
    reshard.convert(tmp_path / "hf", tmp_path / "dcp", format="dcp", to="dp=3")
    reshard.convert(tmp_path / "dcp", tmp_path / "back", format="hf")
    from conftest import assert_same_logits

    assert_same_logits(transformers.MixtralForCausalLM, tmp_path / "hf", tmp_path / "back", 100)
    (tmp_path / "dcp" / "config.json").unlink()  # the model (and its routing, experts per token) is in no tensor
    with pytest.raises(CheckpointFormatError, match="which model this is is recorded nowhere"):
        reshard.convert(tmp_path / "dcp", tmp_path / "x", format="hf",
                        sizes={"h": 32, "heads": 4, "g": 2, "hd": 8, "f": 48, "vocab": 100, "layers": 2, "experts": 4})


def test_a_whole_tensor_layout_built_directly_equals_its_spec_resolved() -> None:
    """A derived layout of whole tensors is built without the resolver (100,000 tensors): it must be exactly the
    layout its own spec text resolves to, order, views and rules included; duplicates are refused."""
    from reshard.formats.derived import Recorded, derived_spec, whole_derived, whole_text

    tensors = [Recorded("a.w", (4, 3)), Recorded("b", ()), Recorded("c", (5,)), Recorded("d.x", (2, 3, 4)),
               Recorded("e", (4, 3)), Recorded("f", (1,))]
    spec, layout = whole_derived(tensors, "hf", "ckpt")
    resolved = resolve(derived_spec(whole_text(tensors, "ckpt"), "hf", "ckpt"), Topology(), {})
    assert spec.statements == derived_spec(whole_text(tensors, "ckpt"), "hf", "ckpt").statements
    assert dict(layout.tensors) == dict(resolved.tensors)
    assert list(layout.items.items()) == list(resolved.items.items())
    assert layout.fragments == resolved.fragments
    assert dict(layout.order) == dict(resolved.order)
    with pytest.raises(CheckpointFormatError, match="'c' is recorded twice"):
        whole_derived([*tensors, Recorded("c", (5,))], "hf", "ckpt")


def test_shard_plan_is_made_once_per_target_and_again_when_the_target_changes(tmp_path: Path, tiny,
                                                                            monkeypatch) -> None:
    from reshard.formats.hf import files as hf_files
    source = FORMAT.open(_make_hf(tmp_path / "ckpt", tiny))
    target = FORMAT.target(source, Topology())
    made = []
    real = hf_files._make_plan
    monkeypatch.setattr(hf_files, "_make_plan", lambda t: made.append(t) or real(t))
    files = FORMAT.files_of(target)
    assert FORMAT.files_of(target) == files and len(made) == 1
    assert set(files.values()) == {Path(WEIGHTS_NAME)}
    target.max_shard_size = 200
    assert len(set(FORMAT.files_of(target).values())) > 1 and len(made) == 2
    item = next(iter(target.dtypes))
    target.dtypes[item] = "bfloat16"  # changed in place: the plan is made again
    FORMAT.files_of(target)
    assert len(made) == 3 and hf_files._shard_plan(target).tensors[item.key][0] == "bfloat16"
    target.dtypes = dict(target.dtypes)
    FORMAT.files_of(target)
    assert len(made) == 4
