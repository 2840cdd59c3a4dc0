"""Families whose output projection is always tied (Gemma, Gemma 2, Gemma 3 text, GPT-2), from Hugging Face to
DeepSpeed by the family's layout and back, without a framework: the files hold the model as a DeepSpeed run
of the transformers model saves it (the embedding once in the flat buffer, in registration order; the module's
state dict with both keys; ``shared_params`` naming the tie), and come back to the original safetensors bit
for bit. ``tests/interop/test_deepspeed_families.py`` loads such a checkpoint into DeepSpeed itself.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import reshard
from reshard.core.resolve import resolve
from reshard.core.topology import parse_topology
from reshard.execution.arrays import gather
from reshard.formats.specs import layout_spec, tied_head
from reshard.models import get_family

SIZES = {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "layers": 2, "positions": 32}
TIED = ["gemma", "gemma2", "gemma3_text", "gpt2", "llama"]
"""The families that always tie, and a Llama tied by its config (Llama 3.2)."""


def save_hf(name: str, path) -> dict[str, np.ndarray]:
    """A Hugging Face checkpoint of the family (every tensor distinct, arange-valued) and its config.json."""
    family = get_family(name)
    sizes = {k: SIZES[k] for k in family.sizes}
    layout = resolve(layout_spec(f"hf-{name}{'-tied' * family.can_tie}"), parse_topology("tp=1"), sizes)
    tensors, start = {}, 0
    for it, info in layout.items.items():
        tensors[it.key] = (np.arange(info.numel, dtype=np.float32) + start).reshape(info.shape) / 7
        start += info.numel
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = family.config_from_sizes(sizes, ["float32"]) | {"tie_word_embeddings": True}
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def registered(name: str) -> list[str]:
    """The names ``named_parameters()`` lists, in its order (a tied head once, as the embedding)."""
    family = get_family(name)
    per_layer = [t.name for t in family.by_registration(tied=True) if "{i}" in t.name]
    out = []
    for t in family.by_registration(tied=True):
        if "{i}" not in t.name:
            out.append(t.name)
        elif t.name == per_layer[0]:
            out += [n.format(i=i) for i in range(SIZES["layers"]) for n in per_layer]
    return out


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("name", TIED)
def test_a_tied_family_goes_to_deepspeed_as_deepspeed_saves_it_and_back_bit_exactly(tmp_path, name, zero):
    hf = save_hf(name, tmp_path / "hf")
    head, embed = tied_head(get_family(name), True)
    result = reshard.convert(tmp_path / "hf", tmp_path / "ds", format="deepspeed", to=f"dp=2,zero={zero}")
    tied = "-tied" if get_family(name).can_tie else ""
    assert result.report.target.spec_name == f"deepspeed-{name}{tied}" + ("-zero3" if zero == 3 else "")
    tag = (tmp_path / "ds" / "latest").read_text().strip()
    first = "mp_rank_00_model_states.pt" if zero == 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    tree = torch.load(tmp_path / "ds" / tag / first, weights_only=False)
    assert tree["shared_params"] == {head: embed.name}
    assert list(tree["param_shapes"][0]) == registered(name)
    assert [tuple(s) for s in tree["param_shapes"][0].values()] == [hf[k].shape for k in registered(name)]
    assert list(tree["module"]) == [*registered(name), head]
    if zero == 2:  # the tied copy is the embedding, in the training dtype
        assert torch.equal(tree["module"][head], torch.from_numpy(hf[embed.name]))
    else:  # a placeholder, as every param's
        assert tree["module"][head].shape == (0,)

    reshard.convert(tmp_path / "ds", tmp_path / "back", format="hf")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key


def test_a_tied_family_s_deepspeed_checkpoint_reads_back_by_its_family_s_spec(tmp_path):
    """Given the family's spec, the module's tied copy and the flat buffers' masters are the embedding's."""
    hf = save_hf("gemma2", tmp_path / "hf")
    reshard.convert(tmp_path / "hf", tmp_path / "ds", format="deepspeed", to="dp=2")
    src = reshard.open_checkpoint(tmp_path / "ds", spec="deepspeed-gemma2")
    assert src.spec_name == "deepspeed-gemma2" and set(src.layout.tensors) == set(hf)
    items = {it: np.fromfile(loc.path, dtype=np.float32, count=src.layout.items[it].numel, offset=loc.offset)
             for it, loc in src.where.items()}
    logical = gather(src.layout, items)
    for name, value in hf.items():
        for state in ("param", "master"):
            assert np.array_equal(logical[(name, state)].reshape(value.shape), value), (name, state)
    head = next(it for it in src.layout.items if it.key == "lm_head.weight")
    assert np.array_equal(items[head].reshape(hf["model.embed_tokens.weight"].shape), hf["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", ["gemma", "llama"])
def test_a_tied_family_s_pipeline_is_refused_naming_tied_modules(tmp_path, name):
    save_hf(name, tmp_path / "hf")
    with pytest.raises(reshard.errors.CheckpointFormatError, match=rf"a {name} model( tied)?; DeepSpeed's pipeline "
                                                                   r"engine .*tied_modules"):
        reshard.convert(tmp_path / "hf", tmp_path / "ds", format="deepspeed", to="pp=2")
