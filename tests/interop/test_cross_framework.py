"""DeepSpeed ZeRO <-> DCP/FSDP2 with Adam's state, real frameworks both ways, no spec and no config.

One module (``ds_jobs.custom_module``: an embedding tied to the output head, Linear layers with biases, a
LayerNorm, a frozen Linear, a persistent float buffer and a persistent int64 buffer) is trained in fp32 by
real DeepSpeed ZeRO-2 jobs (``ds_jobs.py``) and real FSDP2 jobs (``fsdp_any_jobs.py``, model ``ds2``) alike:
the same initial weights, the same batch at every rank, ``torch.optim.AdamW`` (lr 1e-2) in two param groups
(weight decay 0.1 on weights, none on biases and norms), no gradient clipping, two ranks.

The two frameworks' runs are the same arithmetic, bit for bit (the first test proves it on the
uninterrupted runs): DeepSpeed on CPU steps the client's ``torch.optim.AdamW`` itself on its flat fp32
partitions (its own CPU Adam comes only with optimizer offload), and FSDP2 steps the same optimizer on its
``Shard(0)`` parameters; both run torch's single-tensor Adam (no foreach on CPU), elementwise, so how the
values are partitioned changes no bit. Every rank computes the same gradient, and both frameworks average
two of them exactly (a halving and a sum of equal halves, in either order). So a checkpoint carried from one
framework to the other must resume exactly as the other framework's own run continues: the step that follows
is compared bit for bit against the uninterrupted run of either framework.

- DeepSpeed -> FSDP2: reshard writes DCP at dp=2 (and dp=3); the FSDP2 job loads model and optimizer with
  ``dcp.load`` + ``set_state_dict`` and steps. At dp=3 the loaded state is still exact, but the step is not
  DeepSpeed's at dp=2: the average of three equal gradients is not always the gradient in floating point
  (a third of it, or three of it, rounds); its oracle is FSDP2 itself, resumed at 3 ranks from its own dp=2
  checkpoint (which holds the same values, DCP resharding it at load).
- FSDP2 -> DeepSpeed: reshard writes ZeRO-2 at dp=2; ``deepspeed.initialize`` + ``load_checkpoint`` (not a
  universal checkpoint) loads it and steps.

ZeRO-3 is not a target here: a DCP checkpoint does not say which of the entries without optimizer state are
buffers and which are frozen params or tied copies, and ZeRO-3 stores the two differently (buffers whole in
the module, params partitioned), so DeepSpeed cannot load a ZeRO-3 checkpoint made from one of this module.
"""

from __future__ import annotations

import ds_jobs
import fsdp_any_jobs as jobs
import numpy as np
import pytest
import torch
from conftest import require

import reshard
from reshard.io.dcp_metadata import read_metadata
from reshard.io.torch_read import read_torch_file
from reshard.io.torch_types import TensorRef

pytestmark = [pytest.mark.interop, pytest.mark.slow]

MODEL = "ds2"  # fsdp_any_jobs' name for this module with two param groups
DS = {"stage": 2, "dtype": "fp32", "groups": 2, "frozen": True, "buffers": True, "clip": 0.0}
TRAINED = ["embed.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias", "out.weight", "out.bias"]
GROUPS = [["embed.weight", "proj.weight", "out.weight"], ["proj.bias", "norm.weight", "norm.bias", "out.bias"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job once. DeepSpeed at dp=2 trains two steps, saves, takes a third; reshard writes its checkpoint
    as DCP at dp=2 and dp=3. A 2-rank FSDP2 job trains the same way uninterrupted (saving after two steps) and
    loads the dp=2 DCP; a 3-rank one loads the dp=3 DCP and FSDP2's own checkpoint. reshard writes FSDP2's
    checkpoint as DeepSpeed ZeRO-2 at dp=2, which a DeepSpeed job loads and steps."""
    require("deepspeed")
    root = tmp_path_factory.mktemp("cross-framework")
    ds_jobs.run(root, 2, "save", root / "ds", root / "ds.npz", **DS)
    for dp in (2, 3):
        result = reshard.convert(root / "ds", root / f"ds-to-dcp{dp}", format="dcp", to=f"dp={dp}")
        assert result.report.source.spec_name == "deepspeed-derived"
    jobs.run(2, jobs.train(MODEL, root / "fsdp", root / "fsdp.pt"),
             jobs.load(MODEL, root / "loads2.pt", [root / "ds-to-dcp2"]))
    jobs.run(3, jobs.load(MODEL, root / "loads3.pt", [root / "ds-to-dcp3", root / "fsdp"]))
    reshard.convert(root / "fsdp", root / "fsdp-to-ds", format="deepspeed", to="dp=2,zero=2")
    ds_jobs.run(root, 2, "load", root / "fsdp-to-ds", root / "ds-load.npz", **DS)

    def dump(name):
        return torch.load(root / name, weights_only=True)

    return {"root": root, "ds": dict(np.load(root / "ds.npz")), "ds_load": dict(np.load(root / "ds-load.npz")),
            "fsdp": dump("fsdp.pt"), "loads2": dump("loads2.pt"), "loads3": dump("loads3.pt")}


def as_dcp(dump: dict, prefix: str) -> dict[str, np.ndarray]:
    """A DeepSpeed job's dump under ``prefix`` in DCP's flat keys: a trained param's fp32 master (its fp32
    weights hold the same bits, checked here) and a frozen param's or buffer's weights as ``model.<fqn>``, the
    tied head as the embedding (DeepSpeed's ``shared_params``), Adam's moments as
    ``optim.state.<fqn>.<state>``."""
    out = {}
    for key, value in dump.items():
        if not key.startswith(prefix + ":"):
            continue
        _, name, kind = key.split(":")
        if kind == "param" and f"{prefix}:{name}:master" in dump:
            master = dump[f"{prefix}:{name}:master"]
            assert value.dtype == master.dtype and value.tobytes() == master.tobytes(), key
            continue
        out[f"model.{name}" if kind in ("param", "master") else f"optim.state.{name}.{kind}"] = value
    out["model.head.weight"] = out["model.embed.weight"]
    return out


def saved_groups(tag) -> list[tuple[dict, float]]:
    """Each param group a ZeRO-1/2 checkpoint's optimizer files hold (hyperparameters, ``params`` its index)
    and its Adam step, as every dp rank's file has them."""
    out = None
    for path in sorted(tag.glob("*zero_pp_rank_*_optim_states.pt")):
        base = read_torch_file(path)["optimizer_state_dict"]["base_optimizer_state"]
        steps = []
        for g in range(len(base["param_groups"])):
            step = base["state"][g]["step"]
            assert isinstance(step, TensorRef) and step.dtype == "float32" and step.shape == ()
            steps.append(float(np.fromfile(step.path, np.float32, count=1, offset=step.data_offset)[0]))
        groups = list(zip(base["param_groups"], steps, strict=True))
        assert out is None or groups == out, path
        out = groups
    assert out is not None
    return out


def assert_holds(flat: dict, want: dict[str, np.ndarray]) -> None:
    """The tensors of an FSDP2 job's flat state (Adam's 0-d steps aside) are ``want``'s, bit for bit."""
    tensors = {k: v for k, v in flat.items() if torch.is_tensor(v) and not k.endswith(".step")}
    assert sorted(tensors) == sorted(want)
    for key, value in want.items():
        got = tensors[key].numpy()
        assert (got.dtype, got.shape) == (value.dtype, value.shape), key
        assert got.tobytes() == value.tobytes(), key


def assert_same_state(got: dict, want: dict) -> None:
    """Two FSDP2 jobs' flat states are equal: every tensor (dtype, shape, bits) and every other entry."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        if torch.is_tensor(value):
            assert torch.is_tensor(got[key]) and got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_deepspeed_and_fsdp2_train_this_module_to_the_same_bits(runs):
    """The oracle the other tests rely on: uninterrupted, the DeepSpeed run and the FSDP2 run hold the same
    fp32 weights, masters and Adam moments after two steps, the same loss on the third, and the same state
    after it (26 tensors each: 7 trained params with 2 moments, 2 frozen params, 2 buffers, the tied head)."""
    ds, fsdp = runs["ds"], runs["fsdp"]
    saved = as_dcp(ds, "state")
    assert len(saved) == 3 * len(TRAINED) + 2 + 2 + 1
    assert_holds(fsdp["saved"], saved)
    assert float(ds["loss"]) == fsdp["loss"]
    assert_holds(fsdp["stepped"], as_dcp(ds, "after"))
    for name in TRAINED:  # a real step
        assert not np.array_equal(ds[f"after:{name}:master"], ds[f"state:{name}:master"]), name
    assert [fsdp["saved"][f"optim.param_groups.{g}.params"] for g in (0, 1)] == GROUPS
    assert [fsdp["saved"][f"optim.param_groups.{g}.weight_decay"] for g in (0, 1)] == [0.1, 0.0]


def test_deepspeed_zero2_to_fsdp2_at_dp2_resumes_bit_exactly(runs):
    """DeepSpeed's checkpoint as DCP at dp=2: laid out as FSDP2 lays out its own (the same chunks, the
    int64 and float buffers whole, the tied head under both names, the frozen params), loaded by
    ``set_state_dict`` as DeepSpeed held it (weights, moments, each group's hyperparameters and step), and the
    step after it is DeepSpeed's uninterrupted step and FSDP2's, bit for bit."""
    root, ds, fsdp = runs["root"], runs["ds"], runs["fsdp"]
    ours, theirs = read_metadata(root / "ds-to-dcp2"), read_metadata(root / "fsdp")

    def chunks(md):
        return {k: (t.dtype, t.size, sorted((c.offsets, c.sizes) for c in t.chunks)) for k, t in md.tensors.items()}

    assert chunks(ours) == chunks(theirs)
    assert ours.byte_entries == theirs.byte_entries and ours.planner_data == theirs.planner_data
    assert chunks(ours)["model.embed.weight"][2] == [((0, 0), (20, 8)), ((20, 0), (20, 8))]
    assert chunks(ours)["model.seen"] == ("int64", (3,), [((0,), (3,))])

    resumed = runs["loads2"][str(root / "ds-to-dcp2")]
    loaded = resumed["loaded"]
    assert_holds(loaded, as_dcp(ds, "state"))
    for g, (group, step) in enumerate(saved_groups(root / "ds" / "global_step2")):  # as DeepSpeed saved them
        assert {k: loaded[f"optim.param_groups.{g}.{k}"] for k in group if k != "params"} == {
            k: v for k, v in group.items() if k != "params"}
        assert loaded[f"optim.param_groups.{g}.params"] == GROUPS[g]
        assert all(loaded[f"optim.state.{name}.step"].item() == step == 2.0 for name in GROUPS[g])
    assert_same_state(loaded, fsdp["saved"])  # and as FSDP2's own run holds them
    assert resumed["loss"] == float(ds["loss"]) == fsdp["loss"]
    assert_holds(resumed["stepped"], as_dcp(ds, "after"))  # DeepSpeed's step ...
    assert_same_state(resumed["stepped"], fsdp["stepped"])  # ... and FSDP2's


def test_deepspeed_zero2_to_fsdp2_at_dp3_loads_exactly_and_steps_as_fsdp2_own_checkpoint(runs):
    """At dp=3 (rows 14, 14, 12) the state loads as DeepSpeed held it, and the forward pass gives its loss;
    the step is FSDP2's own at 3 ranks (from its dp=2 checkpoint, resharded by DCP at load), not DeepSpeed's
    at 2: the 3-rank average of the gradients rounds."""
    root, ds, fsdp = runs["root"], runs["ds"], runs["fsdp"]
    rows = [c.sizes[0] for c in sorted(read_metadata(root / "ds-to-dcp3").tensors["model.embed.weight"].chunks,
                                       key=lambda c: c.offsets)]
    assert rows == [14, 14, 12]
    loads = runs["loads3"]
    ours, own = loads[str(root / "ds-to-dcp3")], loads[str(root / "fsdp")]
    assert_holds(ours["loaded"], as_dcp(ds, "state"))
    assert_same_state(ours["loaded"], fsdp["saved"])
    assert_same_state(own["loaded"], fsdp["saved"])
    assert ours["loss"] == own["loss"] == float(ds["loss"])
    assert_same_state(ours["stepped"], own["stepped"])


def test_fsdp2_to_deepspeed_zero2_resumes_bit_exactly(runs):
    """FSDP2's checkpoint as DeepSpeed ZeRO-2 at dp=2: the param groups FSDP2's optimizer had (their params
    in order, hyperparameters, step) and no ``clip_grad``, so the resuming engine clips as its config says
    (not at all) although the next gradient's norm is above DeepSpeed's default clip of 1.0. DeepSpeed loads
    FSDP2's weights and moments, and its next step is FSDP2's uninterrupted step, bit for bit."""
    root, fsdp, resumed = runs["root"], runs["fsdp"], runs["ds_load"]
    saved = fsdp["saved"]
    tag = root / "fsdp-to-ds" / "global_step2"
    model = read_torch_file(tag / "mp_rank_00_model_states.pt")
    assert [list(g) for g in model["param_shapes"]] == GROUPS
    for rank in range(2):
        assert "clip_grad" not in read_torch_file(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")[
            "optimizer_state_dict"]
    groups = saved_groups(tag)
    assert len(groups) == 2
    for g, (group, step) in enumerate(groups):
        want = {k[len(f"optim.param_groups.{g}."):]: v for k, v in saved.items()
                if k.startswith(f"optim.param_groups.{g}.")}
        assert {**group, "params": want["params"]} == want and group["params"] == [g]
        assert all(saved[f"optim.state.{name}.step"].item() == step == 2.0 for name in GROUPS[g])

    net = ds_jobs.custom_module()()  # the gradient of the step DeepSpeed takes next
    net.load_state_dict({k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}, strict=True)
    ds_jobs.loss_of(net(ds_jobs.batch(3))).backward()
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for n, p in net.named_parameters() if n in TRAINED]))
    assert norm > 1.0

    assert_holds(saved, as_dcp(resumed, "state"))
    assert float(resumed["loss"]) == fsdp["loss"]
    assert_holds(fsdp["stepped"], as_dcp(resumed, "after"))
