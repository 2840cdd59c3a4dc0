"""Every layout fact L1-L19 (LAYOUTS.md Part A) as a spec, moved between two topologies.

Each test lays arange-valued logical tensors out under topology A, plans A -> B,
carries the plan out in memory and checks bit-exactness both ways
(``assert_round_trip``); most also check the stored bytes against an
independent numpy construction of how the framework lays the tensor out.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_round_trip, items_by_key, layouts, logical_values

from reshard.errors import SpecError, TopologyError
from reshard.execution.arrays import scatter


def test_l1_replicated_norm_is_in_every_tp_item():
    text = """
logical norm = h
section model per tp
norm = h
"""
    a, b = layouts(text, {"h": 8}, "tp=2", "tp=4")
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    for t in range(4):
        np.testing.assert_array_equal(items_by_key(b, out, tp=t)["norm"], values[("norm", "param")])


def test_l2_column_row_and_vocab_parallel_even_splits():
    text = """
logical col = f h
logical row = h f
logical emb = v h
section model per tp
col = f/tp h
row = h f/tp
emb = v/tp h
"""
    a, b = layouts(text, {"h": 4, "f": 12, "v": 8}, "tp=2", "tp=4")
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    col, row = values[("col", "param")], values[("row", "param")]
    for t in range(4):
        got = items_by_key(b, out, tp=t)
        np.testing.assert_array_equal(got["col"], col[3 * t : 3 * t + 3])
        np.testing.assert_array_equal(got["row"], row[:, 3 * t : 3 * t + 3])


def test_l3_uneven_split_follows_torch_chunk():
    text = """
logical w = r c
section model per dp
w = r/dp:chunk c
"""
    a, b = layouts(text, {"r": 128, "c": 2}, "dp=3", "dp=4")
    assert [a.items[it].shape[0] for it in sorted(a.items)] == [43, 43, 42]
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    w = values[("w", "param")]
    for d, chunk in enumerate(np.array_split(w, 4)):
        np.testing.assert_array_equal(items_by_key(b, out, dp=d)["w"], chunk)
    # torch.chunk leaves trailing ranks empty when the dim is short: 5 rows over 4 -> 2, 2, 1, 0.
    a5, _ = layouts(text, {"r": 5, "c": 1}, "dp=4", "dp=1")
    assert [a5.items[it].shape[0] for it in sorted(a5.items)] == [2, 2, 1, 0]


def test_l3_explicit_widths():
    text = """
logical w = r
section model per dp
w = r/dp:(3, 5)
"""
    even = """
logical w = r
section model per dp
w = r/dp
"""
    a, _ = layouts(text, {"r": 8}, "dp=2", "dp=2")
    _, b = layouts(even, {"r": 8}, "dp=2", "dp=4")
    assert [a.items[it].shape for it in sorted(a.items)] == [(3,), (5,)]
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    np.testing.assert_array_equal(items_by_key(b, out, dp=1)["w"], values[("w", "param")][2:4])


def test_l4_nested_split_is_fsdp_inside_each_tp_half():
    # FSDP x TP on one dim (_StridedShard(0, sf=2), Shard(0)), mesh (dp=2, tp=2), 64 rows:
    # DCP's chunks: rank (dp0,tp0) rows 0:16, (dp0,tp1) 32:48, (dp1,tp0) 16:32, (dp1,tp1) 48:64.
    text = """
logical w = r c
section model per dp tp
w = r/tp/dp:chunk c
"""
    a, b = layouts(text, {"r": 64, "c": 3}, "tp=2,dp=2", "tp=1,dp=3")
    assert sorted(b.items[it].shape[0] for it in b.items) == [20, 22, 22]
    values = logical_values(a)
    items = scatter(a, values)
    w = values[("w", "param")]
    for (d, t), start in {(0, 0): 0, (0, 1): 32, (1, 0): 16, (1, 1): 48}.items():
        np.testing.assert_array_equal(items_by_key(a, items, dp=d, tp=t)["w"], w[start : start + 16])
    assert_round_trip(a, b, values)


def test_l5_two_axes_on_two_dims_make_a_grid():
    text = """
logical w = r c
section model per dp tp
w = r/tp c/dp
"""
    a, b = layouts(text, {"r": 64, "c": 64}, "tp=2,dp=2", "tp=4,dp=1")
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    items = scatter(a, values)
    w = values[("w", "param")]
    np.testing.assert_array_equal(items_by_key(a, items, tp=1, dp=0)["w"], w[32:, :32])
    np.testing.assert_array_equal(items_by_key(b, out, tp=3)["w"], w[48:])


def test_l6_swiglu_fc1_holds_gate_then_up_of_each_tp_rank():
    text = """
logical gate = f h
logical up = f h
section model per tp
fc1 = [gate: f/tp | up: f/tp] h
"""
    a, b = layouts(text, {"f": 8, "h": 3}, "tp=2", "tp=4")
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    gate, up = values[("gate", "param")], values[("up", "param")]
    for t in range(4):
        want = np.concatenate([gate[2 * t : 2 * t + 2], up[2 * t : 2 * t + 2]])
        np.testing.assert_array_equal(items_by_key(b, out, tp=t)["fc1"], want)


def megatron_qkv(q, k, v, g, hd, tp, rank):
    """Megatron's linear_qkv rows on one tp rank, built independently with numpy."""
    h = q.shape[1]
    qg = q.reshape(g, -1, h)
    kg = k.reshape(g, hd, h)
    vg = v.reshape(g, hd, h)
    fused = np.concatenate([qg, kg, vg], axis=1)  # per group: q heads, then k, then v
    per = g // tp
    return fused[rank * per : (rank + 1) * per].reshape(-1, h)


def test_l7_gqa_qkv_is_group_interleaved_and_tp_splits_groups():
    text = """
let qpg = heads / g
logical q = (g qpg hd) h
logical k = (g hd) h
logical v = (g hd) h
section model per tp
qkv = (g/tp [q: qpg hd | k: hd | v: hd]) h
"""
    sizes = {"heads": 8, "g": 4, "hd": 2, "h": 5}
    a, b = layouts(text, sizes, "tp=4", "tp=2")
    values = logical_values(a)
    items = scatter(a, values)
    q, k, v = (values[(n, "param")] for n in "qkv")
    for t in range(4):
        np.testing.assert_array_equal(items_by_key(a, items, tp=t)["qkv"], megatron_qkv(q, k, v, 4, 2, 4, t))
    out = assert_round_trip(a, b, values)
    for t in range(2):
        np.testing.assert_array_equal(items_by_key(b, out, tp=t)["qkv"], megatron_qkv(q, k, v, 4, 2, 2, t))


def test_l8_contiguous_fused_qkv_holds_q_then_k_then_v_slices():
    text = """
logical q = a h
logical k = b h
logical v = b h
section model per tp
qkv = [q: a/tp | k: b/tp | v: b/tp] h
"""
    a, b = layouts(text, {"a": 8, "b": 4, "h": 2}, "tp=2", "tp=4")
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    q, k, v = (values[(n, "param")] for n in "qkv")
    want = np.concatenate([q[2:4], k[1:2], v[1:2]])
    np.testing.assert_array_equal(items_by_key(b, out, tp=1)["qkv"], want)


@pytest.mark.parametrize("policy", ["zero", "last"])
def test_l9_vocab_padding_changes_with_tp_and_follows_the_pad_policy(policy):
    text = f"""
logical emb = v h
section model per tp
emb = (v~(d*tp):{policy})/tp h
"""
    sizes = {"v": 50, "h": 3, "d": 4}
    a, b = layouts(text, sizes, "tp=2", "tp=4")
    # padded vocab = ceil(50 / (4 * tp)) * 4 * tp: 56 at tp=2, 64 at tp=4.
    assert sum(a.items[it].shape[0] for it in a.items) == 56
    assert sum(b.items[it].shape[0] for it in b.items) == 64
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    emb = values[("emb", "param")]
    whole = np.concatenate([items_by_key(b, out, tp=t)["emb"] for t in range(4)])
    np.testing.assert_array_equal(whole[:50], emb)
    pad = np.zeros((14, 3), emb.dtype) if policy == "zero" else np.repeat(emb[-1:], 14, axis=0)
    np.testing.assert_array_equal(whole[50:], pad)


def test_l10_pipeline_stages_uneven_and_virtual():
    text = """
index i < layers
logical layers.{i}.w = h
logical emb = h
section model per pp
emb @first = h
blocks.{i/pp}.w -> layers.{i}.w = h
"""
    sizes = {"layers": 8, "h": 2}
    a, b = layouts(text, sizes, "pp=2", "pp=2,vpp=2")
    c, _ = layouts(text, sizes, "pp=3,stages=2+3+3", "pp=1")
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    # vpp=2 over 2 stages: virtual stage v = chunk * pp + stage holds layers 2v, 2v+1, numbered 0, 1.
    where = {(it.unit, it.chunk, it.key) for it in b.items}
    assert (( ("pp", 1),), 1, "blocks.1.w") in where  # layer 7: virtual stage 3 = chunk 1 of stage 1
    item = next(it for it in b.items if it.unit == (("pp", 1),) and it.chunk == 1 and it.key == "blocks.1.w")
    np.testing.assert_array_equal(out[item], values[("layers.7.w", "param")])
    keys = {p: sorted(it.key for it in c.items if it.unit == (("pp", p),)) for p in range(3)}
    assert keys == {0: ["blocks.0.w", "blocks.1.w", "emb"], 1: ["blocks.0.w", "blocks.1.w", "blocks.2.w"],
                    2: ["blocks.0.w", "blocks.1.w", "blocks.2.w"]}
    assert_round_trip(c, a, values)


def test_l11_tied_embedding_is_stored_on_first_and_last_stage_and_read_once():
    text = """
logical emb = v h
section model per pp
word_embeddings @first -> emb = v h
output_layer @lastonly -> emb = v h
"""
    a, b = layouts(text, {"v": 6, "h": 2}, "pp=2", "pp=1")
    values = logical_values(a)
    items = scatter(a, values)
    assert {(it.unit, it.key) for it in a.items} == {((("pp", 0),), "word_embeddings"), ((("pp", 1),), "output_layer")}
    assert {it.key for it in b.items} == {"word_embeddings"}  # one stage: stored once
    out = assert_round_trip(b, a, values)
    for it in a.items:
        np.testing.assert_array_equal(out[it].reshape(6, 2), values[("emb", "param")])
    from reshard.core.planner import plan

    # Going to one stage reads one of the two copies, not both.
    assert len({c.src for c in plan(a, b).copies}) == 1
    del items


def test_l12_experts_by_local_index_and_stacked_grouped_gemm():
    text = """
index e < experts
logical experts.{e}.w = f h
section model per ep
local_experts.{e/ep}.w -> experts.{e}.w = f h
"""
    a, b = layouts(text, {"experts": 8, "f": 2, "h": 2}, "ep=4,dp=4", "ep=2,dp=2")
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    got = items_by_key(b, out, ep=1)
    for j in range(4):
        np.testing.assert_array_equal(got[f"local_experts.{j}.w"], values[(f"experts.{4 + j}.w", "param")])
    grouped = """
index e < experts
logical experts.{e}.w = f h
section model per ep
weight1 -> experts.{e}.w = {e}/ep f h
"""
    c, d = layouts(grouped, {"experts": 8, "f": 2, "h": 2}, "ep=4,dp=4", "ep=8,dp=8")
    out = assert_round_trip(c, d, values)
    stacked = items_by_key(c, scatter(c, values), ep=3)["weight1"]
    np.testing.assert_array_equal(stacked, np.stack([values[(f"experts.{e}.w", "param")] for e in (6, 7)]))
    assert_round_trip(a, c, values)


def test_l13_stacked_layers_on_a_leading_dim_split_over_pp():
    text = """
index i < layers
logical layers.{i}.qkv = r h
section model per pp tp
decoder.layers.qkv -> layers.{i}.qkv = {i}/pp r/tp h
"""
    a, b = layouts(text, {"layers": 4, "r": 8, "h": 2}, "pp=2,tp=2", "pp=1,tp=1")
    values = logical_values(a)
    items = scatter(a, values)
    got = items_by_key(a, items, pp=1, tp=1)["decoder.layers.qkv"]
    assert got.shape == (2, 4, 2)
    np.testing.assert_array_equal(got[0], values[("layers.2.qkv", "param")][4:])
    out = assert_round_trip(a, b, values)
    assert next(iter(out.values())).reshape(4, 8, 2)[3].tolist() == values[("layers.3.qkv", "param")].tolist()
    per_layer = """
index i < layers
logical layers.{i}.qkv = r h
section model per pp tp
decoder.layers.{i/pp}.qkv -> layers.{i}.qkv = r/tp h
"""
    c, _ = layouts(per_layer, {"layers": 4, "r": 8, "h": 2}, "pp=4,tp=1", "pp=1")
    assert_round_trip(a, c, values)


ZERO_TEXT = """
logical a = x y
logical b = z
logical c = w
section model per tp
a = x/tp y
b = z
c = w/tp
section optim per tp dp states master exp_avg exp_avg_sq
flat optimizer.{state} = model | pad 2*dp | split dp
"""


def zero_oracle(values, state, tp, rank, dp):
    """DeepSpeed ZeRO-1/2: local shards flattened, concatenated, padded to 2*dp, split."""
    a, b, c = (values[(n, state)] for n in "abc")
    xs, ws = a.shape[0] // tp, c.shape[0] // tp
    flat = np.concatenate([a[rank * xs : (rank + 1) * xs].ravel(), b.ravel(), c[rank * ws : (rank + 1) * ws]])
    padded = -(-flat.size // (2 * dp)) * 2 * dp
    flat = np.concatenate([flat, np.zeros(padded - flat.size, flat.dtype)])
    return np.split(flat, dp)


def test_l14_zero12_flat_partitions_with_a_param_straddling_ranks():
    sizes = {"x": 4, "y": 3, "z": 5, "w": 6}
    a, b = layouts(ZERO_TEXT, sizes, "tp=2,dp=2", "tp=1,dp=3")
    states = ("param", "master", "exp_avg", "exp_avg_sq")
    values = logical_values(a, states)
    items = scatter(a, values)
    for t in range(2):
        for d in range(2):
            got = items_by_key(a, {it: v for it, v in items.items() if it.state == "exp_avg"}, tp=t, dp=d)["optimizer.exp_avg"]
            np.testing.assert_array_equal(got, zero_oracle(values, "exp_avg", 2, t, 2)[d])
    # tp=2: 6 + 5 + 3 = 14 elements, padded to 16, split 8 / 8: b straddles ranks 0 and 1.
    assert a.items[next(it for it in a.items if it.section == "optim")].shape == (8,)
    out = assert_round_trip(a, b, values)
    for d in range(3):
        got = items_by_key(b, {it: v for it, v in out.items() if it.state == "master"}, dp=d)["optimizer.master"]
        np.testing.assert_array_equal(got, zero_oracle(values, "master", 1, 0, 3)[d])


def test_l15_zero3_pads_and_splits_every_param_on_its_own():
    text = """
logical a = x y
logical b = z
section model
a = x y
b = z
section optim per dp states fp32
flat fp32_flat_groups = model | perparam | split dp
"""
    a, b = layouts(text, {"x": 3, "y": 3, "z": 5}, "dp=2", "dp=4")
    values = logical_values(a, ("param", "fp32"))
    out = assert_round_trip(a, b, values)
    A, B = values[("a", "fp32")].ravel(), values[("b", "fp32")]

    def part(v, dp, r):
        share = -(-v.size // dp)
        padded = np.concatenate([v, np.zeros(share * dp - v.size, v.dtype)])
        return padded[r * share : (r + 1) * share]

    for r in range(4):
        want = np.concatenate([part(A, 4, r), part(B, 4, r)])
        np.testing.assert_array_equal(items_by_key(b, {k: v for k, v in out.items() if k.section == "optim"}, dp=r)["fp32_flat_groups"], want)


DISTOPT_TEXT = """
logical p0 = n0
logical p1 = n1
logical p2 = n2
section model
p0 = n0
p1 = n1
p2 = n2
section optim per dp states param exp_avg
flat bucket.{bucket}.{state} = model | reverse | align 64 | buckets size | pad lcm(dp, 128) | split dp
section legacy states param
flat distrib_optim.{state} = model | reverse | align 64 | buckets size | pad lcm(dp, 128) | coalesce
"""


def test_l16_megatron_distributed_optimizer_bucket_space_worked_example():
    # MEGATRON-DISTOPT.md section 3: p0 (10), p1 (7), p2 (5) registered in that order, dp=2.
    sizes = {"n0": 10, "n1": 7, "n2": 5, "size": 0}
    a, b = layouts(DISTOPT_TEXT, sizes, "dp=2", "dp=4")
    values = logical_values(a, ("param", "exp_avg"))
    items = scatter(a, values)
    p0, p1, p2 = (values[(n, "exp_avg")] for n in ("p0", "p1", "p2"))
    optim = {it: v for it, v in items.items() if it.section == "optim" and it.state == "exp_avg"}
    r0 = items_by_key(a, optim, dp=0)["bucket.0.exp_avg"]
    r1 = items_by_key(a, optim, dp=1)["bucket.0.exp_avg"]
    assert r0.shape == r1.shape == (128,)  # 138 unpadded -> 256 -> 128 per rank
    np.testing.assert_array_equal(r0[0:5], p2)
    np.testing.assert_array_equal(r0[64:71], p1)
    np.testing.assert_array_equal(r1[0:10], p0)
    assert not r0[5:64].any() and not r0[71:].any() and not r1[10:].any()
    legacy = next(v for it, v in items.items() if it.section == "legacy" and it.state == "param")
    assert legacy.shape == (138,)
    np.testing.assert_array_equal(legacy[128:138], values[("p0", "param")])
    assert_round_trip(a, b, values)


def test_l16_bucket_boundaries_follow_bucket_size():
    # bucket_size=12: bucket 0 = {p2, p1} [0, 128), bucket 1 = {p0} [128, 256);
    # coalesced length 71 + 10 = 81, p0 at [71, 81).
    sizes = {"n0": 10, "n1": 7, "n2": 5, "size": 12}
    a, b = layouts(DISTOPT_TEXT, sizes, "dp=2", "dp=1")
    values = logical_values(a, ("param", "exp_avg"))
    items = scatter(a, values)
    optim = {it: v for it, v in items.items() if it.section == "optim" and it.state == "param"}
    np.testing.assert_array_equal(items_by_key(a, optim, dp=1)["bucket.0.param"][0:7], values[("p1", "param")])
    np.testing.assert_array_equal(items_by_key(a, optim, dp=0)["bucket.1.param"][0:10], values[("p0", "param")])
    assert not items_by_key(a, optim, dp=1)["bucket.1.param"].any()  # rank 1 owns only padding
    legacy = next(v for it, v in items.items() if it.section == "legacy" and it.state == "param")
    assert legacy.shape == (81,)
    np.testing.assert_array_equal(legacy[71:81], values[("p0", "param")])
    assert_round_trip(a, b, values)


def test_l16_an_alone_param_has_a_bucket_of_its_own():
    # megatron-core's shared embedding at pp > 1: "alone p1" closes the open bucket {p2} at p1's aligned start 64
    # (unpadded 64, padded to 128), p1 takes [128, 135) and closes its bucket, p0 the last [256, 266); no bucket size.
    text = DISTOPT_TEXT.replace("| buckets size |", "| buckets size | alone p1 |")
    sizes = {"n0": 10, "n1": 7, "n2": 5, "size": 0}
    a, b = layouts(text, sizes, "dp=2", "dp=1")
    values = logical_values(a, ("param", "exp_avg"))
    items = scatter(a, values)
    optim = {it: v for it, v in items.items() if it.section == "optim" and it.state == "param"}
    buckets = items_by_key(a, optim, dp=0)  # each bucket's first 128 elements: dp rank 0's half
    assert sorted(buckets) == ["bucket.0.param", "bucket.1.param", "bucket.2.param"]
    np.testing.assert_array_equal(buckets["bucket.0.param"][0:5], values[("p2", "param")])
    np.testing.assert_array_equal(buckets["bucket.1.param"][0:7], values[("p1", "param")])
    np.testing.assert_array_equal(buckets["bucket.2.param"][0:10], values[("p0", "param")])
    legacy = next(v for it, v in items.items() if it.section == "legacy" and it.state == "param")
    assert legacy.shape == (64 + 7 + 10,)  # the first bucket's unpadded end is p1's aligned start
    np.testing.assert_array_equal(legacy[64:71], values[("p1", "param")])
    assert_round_trip(a, b, values)


def test_l16_split_param_straddles_dp_ranks():
    # Sizes 300, 70, 50: p0 at [192, 492), rank 0 holds p0[0:64], rank 1 p0[64:300].
    sizes = {"n0": 300, "n1": 70, "n2": 50, "size": 0}
    a, b = layouts(DISTOPT_TEXT, sizes, "dp=2", "dp=3")
    values = logical_values(a, ("param", "exp_avg"))
    items = scatter(a, values)
    optim = {it: v for it, v in items.items() if it.section == "optim" and it.state == "param"}
    p0 = values[("p0", "param")]
    np.testing.assert_array_equal(items_by_key(a, optim, dp=0)["bucket.0.param"][192:256], p0[:64])
    np.testing.assert_array_equal(items_by_key(a, optim, dp=1)["bucket.0.param"][0:236], p0[64:])
    assert_round_trip(a, b, values)


def test_l17_transposed_conv1d_storage():
    # GPT-2's HF Conv1D stores c_attn as [in, out]; the logical tensor is [out, in].
    text = """
logical attn = o i
section model per tp
c_attn -> attn = i o/tp
"""
    a, b = layouts(text, {"o": 6, "i": 4}, "tp=1", "tp=2")
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    np.testing.assert_array_equal(items_by_key(b, out, tp=1)["c_attn"], values[("attn", "param")][3:].T)


def test_l17_rotary_row_permutation_between_conventions():
    # Interleaved (Meta) rows (heads, r, two) vs half-rotated (HF) rows (heads, two, r).
    text = """
logical q = (heads r two) h
section model per tp
q_hf -> q = (heads/tp two r) h
"""
    a, b = layouts(text, {"heads": 2, "r": 3, "two": 2, "h": 2}, "tp=1", "tp=2")
    values = logical_values(a)
    out = assert_round_trip(a, b, values)
    q = values[("q", "param")].reshape(2, 3, 2, 2)
    want = q.transpose(0, 2, 1, 3).reshape(4 * 3, 2)
    np.testing.assert_array_equal(items_by_key(b, out, tp=0)["q_hf"], want[:6])


def test_l18_scalars_and_blobs_are_carried_and_regenerated_state_is_not_copied():
    text = """
logical step = scalar
logical w = n
section model per tp
w = n/tp
optimizer.step -> step = scalar
blob args
blob rng_state regenerate
"""
    a, b = layouts(text, {"n": 4}, "tp=2", "tp=4", blob_sizes={"args": 13})
    values = logical_values(a)
    values[("step", "param")] = np.array(42.0, dtype=np.float32)
    out = assert_round_trip(a, b, values)
    for t in range(4):
        got = items_by_key(b, out, tp=t)
        assert got["optimizer.step"].shape == () and float(got["optimizer.step"]) == 42.0
        np.testing.assert_array_equal(got["args"], values[("args", "param")])
    rng = [it for it in b.items if it.key == "rng_state"]
    assert len(rng) == 4 and all(b.items[it].fill == "regenerate" and b.items[it].mapped == 0 for it in rng)


def test_the_fragment_index_round_trips_through_json():
    import json

    from reshard.formats.specs import layout_spec
    from reshard.core.layout import Layout
    from reshard.core.resolve import resolve
    from reshard.core.topology import parse_topology

    sizes = {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "layers": 4, "vocab_div": 8, "bucket_size": 0}
    layout = resolve(layout_spec("megatron-llama-distopt"), parse_topology("tp=2,pp=2,dp=2,vpp=2"), sizes)
    back = Layout.from_json(json.loads(json.dumps(layout.to_json())))
    assert back.fragments == layout.fragments
    assert dict(back.items) == dict(layout.items)
    assert dict(back.tensors) == dict(layout.tensors)
    assert back.topology == layout.topology


def test_stacked_layers_with_virtual_pipeline_make_one_item_per_stage_and_chunk():
    text = """
index i < layers
logical layers.{i}.w = h
section model per pp
stack -> layers.{i}.w = {i}/pp h
"""
    a, b = layouts(text, {"layers": 8, "h": 2}, "pp=2,vpp=2", "pp=1")
    assert sorted((it.unit, it.chunk, a.items[it].shape) for it in a.items) == [
        ((("pp", 0),), 0, (2, 2)), ((("pp", 0),), 1, (2, 2)), ((("pp", 1),), 0, (2, 2)), ((("pp", 1),), 1, (2, 2))]
    values = logical_values(a)
    items = scatter(a, values)
    stage1_chunk1 = next(v for it, v in items.items() if it.unit == (("pp", 1),) and it.chunk == 1)
    np.testing.assert_array_equal(stage1_chunk1.reshape(2, 2)[1], values[("layers.7.w", "param")])
    assert_round_trip(a, b, values)


def test_l19_stored_shape_is_a_row_major_reshape_of_the_dims():
    # Megatron's legacy GroupedMLP: weight1 [h, E/ep * 2f/tp] holding [E/ep][h][gate f/tp | up f/tp] in that order.
    text = """
index e < experts
logical experts.{e}.gate as gate = f h
logical experts.{e}.up as up = f h
section model per ep tp
weight1 = {e}/ep h [gate: f/tp | up: f/tp] as (h, 2*experts*f/(ep*tp))
"""
    sizes = {"experts": 4, "f": 4, "h": 3}
    a, b = layouts(text, sizes, "ep=2,dp=2,tp=2", "ep=1,tp=1")
    values = logical_values(a)
    assert_round_trip(a, b, values)
    items = scatter(a, values)
    for r, t in ((0, 0), (1, 1), (1, 0)):
        got = items_by_key(a, items, ep=r, tp=t)["weight1"]
        rows = slice(2 * t, 2 * t + 2)
        want = np.stack([np.concatenate([values[(f"experts.{e}.{p}", "param")][rows].T for p in ("gate", "up")], 1)
                         for e in (2 * r, 2 * r + 1)])
        assert got.shape == (3, 8)
        np.testing.assert_array_equal(got, want.reshape(3, 8))


def test_l19_a_stored_shape_of_another_element_count_is_an_error():
    text = """
logical w = f h
section model per tp
w = f/tp h as (h, f)
"""
    with pytest.raises(SpecError, match=r"'as' shape \(3, 4\) holds 12 elements but its dims \(2, 3\) hold 6"):
        layouts(text, {"f": 4, "h": 3}, "tp=2", "tp=1")


def test_l20_a_split_over_etp_takes_the_tp_rank_mod_etp():
    # Megatron's torch format at tp=4, ep=2, etp=2: the rank file of tp rank t holds the experts' etp shard t % 2.
    text = """
index e < experts
logical dense = d h
logical experts.{e}.down as down = h f
section model per tp ep
dense = d/tp h
experts.{e/ep} -> down = h f/etp
"""
    sizes = {"experts": 2, "f": 4, "h": 2, "d": 4}
    a, b = layouts(text, sizes, "tp=4,ep=2,etp=2", "tp=1")
    values = logical_values(a)
    assert_round_trip(a, b, values)
    items = scatter(a, values)
    for t in range(4):
        for r in range(2):
            got = items_by_key(a, items, tp=t, ep=r)
            down = values[(f"experts.{r}.down", "param")]
            np.testing.assert_array_equal(got["experts.0"], down[:, 2 * (t % 2):2 * (t % 2) + 2])
            np.testing.assert_array_equal(got["dense"], values[("dense", "param")][t:t + 1])


def test_l20_a_split_over_etp_needs_a_section_per_tp_and_etp_dividing_tp():
    text = """
logical w = f h
section model per ep
w = f/etp h
"""
    with pytest.raises(SpecError, match=r"split over 'etp' but section 'model' is stored per ep \(add 'tp' to its"):
        layouts(text, {"f": 4, "h": 3}, "tp=2,dp=2,ep=2,etp=1", "tp=1")
    text = text.replace("per ep", "per tp")
    with pytest.raises(TopologyError, match=r"w: split over etp\(4\), which does not divide tp\(2\)"):
        layouts(text, {"f": 4, "h": 3}, "tp=2,dp=2,etp=4", "tp=1")
