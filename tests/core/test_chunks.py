"""chunk_fragments: a stored tensor's fragments restricted to one chunk of it (DCP chunks of Megatron torch_dist)."""

from __future__ import annotations

import itertools
from types import MappingProxyType

import numpy as np
import pytest

from reshard.fixtures import MODELS
from reshard.execution.arrays import gather, scatter
from reshard.formats.specs import layout_spec
from reshard.core.layout import Item, ItemInfo, Layout, chunk_fragments
from reshard.core.resolve import resolve
from reshard.core.topology import Topology

# Megatron-core torch_dist style: layers stacked on a leading dim, QKV group-interleaved,
# SwiGLU fc1 as [gate; up], padded vocab, a transposed-looking row-parallel weight.
STACKED = """include llama
logical lm_head.weight as head = vocab h
section model
embedding.word_embeddings.weight -> embed = (vocab~256) h
decoder.layers.self_attention.linear_qkv.weight = {i} (g [q: qpg hd | k: hd | v: hd]) h
decoder.layers.mlp.linear_fc1.weight = {i} [gate: f | up: f] h
decoder.layers.self_attention.linear_proj.weight -> o = {i} h (g qpg hd)
decoder.final_layernorm.weight -> norm = h
"""


def _cuts(n: int, parts: int) -> list[tuple[int, int]]:
    edges = sorted({0, n, *(n * k // parts + k % 2 for k in range(1, parts)), *([1100] if n == 1280 else [])})
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_any_grid_of_chunks_rebuilds_every_logical_tensor(tmp_path, parts):
    (tmp_path / "stacked.spec").write_text(STACKED)
    sizes = {k: v for k, v in MODELS["tiny-llama"].sizes.items() if k != "vocab_div"}
    whole = resolve(layout_spec(tmp_path / "stacked.spec"), Topology(), sizes)
    used = {f.tensor for f in whole.fragments}
    rng = np.random.default_rng(parts)
    values = {(n, "param"): rng.integers(0, 2**32, size=int(np.prod(t.shape)), dtype=np.uint32)
              for n, t in whole.tensors.items() if n in used}
    stored = scatter(whole, values)
    items, frags, data, where = {}, [], {}, {}
    for it, info in whole.items.items():
        arr = stored[it].reshape(info.shape)
        mine = [f for f in whole.fragments if f.item == it]
        for box in itertools.product(*(_cuts(n, parts) for n in info.shape)):
            offsets, lengths = tuple(a for a, _ in box), tuple(b - a for a, b in box)
            chunk = Item("chunks", (), 0, "param", f"{it.key}@{offsets}")
            items[chunk] = ItemInfo(shape=lengths, mapped=int(np.prod(lengths)))
            where[chunk] = offsets
            data[chunk] = np.ascontiguousarray(arr[tuple(slice(a, b) for a, b in box)]).reshape(-1)
            frags += chunk_fragments(mine, info.shape, offsets, lengths, chunk)
    chunked = Layout(topology=Topology(), tensors=MappingProxyType({n: whole.tensors[n] for n in used}),
                     items=MappingProxyType(items), fragments=tuple(frags))
    back = gather(chunked, data)
    assert back.keys() == values.keys()
    for key, v in values.items():
        np.testing.assert_array_equal(back[key].reshape(-1), v, err_msg=str(key))
    padded = [c for c in items if c.key.startswith("embedding") and where[c][0] >= sizes["vocab"]]
    assert padded and not any(f.item in padded for f in frags)  # chunks of pure vocab padding hold no logical data
