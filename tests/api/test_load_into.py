"""``reshard.torch.load_into`` in one process: plain (unsharded) modules, from safetensors and from a DCP
checkpoint torch itself saved, against ``dcp.load``; names mapped, tied weights, and every refusal.
The sharded jobs (FSDP2, tensor parallelism, other world sizes) are in ``tests/interop/test_load_into_real.py``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import reshard.torch.loading
from reshard.errors import ReshardError
from reshard.torch import load_into


def _net(seed: int, tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 4), torch.nn.LayerNorm(4),
                              torch.nn.Linear(4, 11, bias=False))
    if tied:
        net[3] = torch.nn.Linear(6, 11, bias=False)
        net[3].weight = net[0].weight
    return net


def _hf(path, tensors: dict) -> None:
    path.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"model_type": "tiny-net"}))


def _step(net, opt) -> None:
    x = (torch.arange(6).reshape(2, 3) % 11).to(next(net.parameters()).device)
    net(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _save_trained(path, steps: int, **adam) -> torch.nn.Module:
    """``_net(0)`` after ``steps`` steps of Adam (``adam``: its options), saved with its optimizer by ``dcp.save`` at
    ``path``; returns the net."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net = _net(0)
    opt = torch.optim.Adam(net.parameters(), **adam)
    for _ in range(steps):
        _step(net, opt)
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return net


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("staged", [False, True], ids=["in place", "staged"])
def test_a_plain_module_loads_from_safetensors_reading_only_its_bytes(tmp_path, monkeypatch, staged, threads):
    """Windows of 8 bytes filled on 1 or 3 threads; also (``staged``) through the path of a module on a device:
    staging buffers copied (and cast to float32) on a thread of their own, as CUDA's stream copies them."""
    monkeypatch.setattr(reshard.torch.loading, "_WINDOW", 8)
    if staged:
        monkeypatch.setattr(reshard.torch.loading, "_on_host", lambda local: False)
    saved = {k: v.to(torch.bfloat16) for k, v in _net(0).state_dict().items()}
    _hf(tmp_path / "hf", saved)
    net = _net(1)
    report = load_into(net, None, tmp_path / "hf", threads=threads)
    for k, v in net.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, saved[k].float()), k
    assert report.bytes_read == report.share == sum(v.numel() * 2 for v in saved.values())
    assert report.states == ("param",) and report.tensors == len(saved)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_adam_state_and_step_load_as_dcp_load_gives_them(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    net = _save_trained(tmp_path / "dcp", 3, lr=1e-2)
    mine = _net(1)
    my_opt = torch.optim.Adam(mine.parameters(), lr=1e-2)
    report = load_into(mine, my_opt, tmp_path / "dcp")
    ref = _net(2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    msd, osd = get_state_dict(ref, ref_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "dcp")
    set_state_dict(ref, ref_opt, model_state_dict=msd, optim_state_dict=osd)
    for (a_msd, a_osd), (b_msd, b_osd) in [(get_state_dict(mine, my_opt), get_state_dict(ref, ref_opt))]:
        assert all(torch.equal(a_msd[k], b_msd[k]) for k in b_msd)
        for fqn, states in b_osd["state"].items():
            assert states["step"].item() == 3
            assert all(torch.equal(a_osd["state"][fqn][s], v) for s, v in states.items()), fqn
    assert report.states == ("param", "exp_avg", "exp_avg_sq")
    assert report.bytes_read == report.share == 3 * 4 * sum(p.numel() for p in net.parameters())
    _step(mine, my_opt)
    _step(ref, ref_opt)
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), ref.parameters()))


def test_names_maps_the_models_keys_to_the_checkpoints(tmp_path):
    saved = _net(0).state_dict()
    _hf(tmp_path / "hf", {f"backbone.{k}": v for k, v in saved.items()})
    net = _net(1)
    load_into(net, None, tmp_path / "hf", names=lambda key: f"backbone.{key}")
    assert all(torch.equal(v, saved[k]) for k, v in net.state_dict().items())
    net = _net(2)
    load_into(net, None, tmp_path / "hf", names={k: f"backbone.{k}" for k in saved})
    assert all(torch.equal(v, saved[k]) for k, v in net.state_dict().items())


def test_a_tied_weight_is_filled_once_from_the_name_the_checkpoint_holds(tmp_path):
    saved = {k: v for k, v in _net(0, tied=True).state_dict().items() if k != "3.weight"}
    _hf(tmp_path / "hf", saved)
    net = _net(1, tied=True)
    report = load_into(net, None, tmp_path / "hf")
    assert net[3].weight is net[0].weight and torch.equal(net[0].weight, saved["0.weight"])
    assert report.tensors == len(saved) and report.bytes_read == report.share


def test_every_mismatch_is_named_at_once(tmp_path):
    saved = _net(0).state_dict()
    _hf(tmp_path / "hf", {**saved, "extra.weight": torch.zeros(3)})
    net = _net(1)
    net[1] = torch.nn.Linear(6, 5)
    net.append(torch.nn.Linear(5, 2))
    with pytest.raises(ReshardError) as e:
        load_into(net, None, tmp_path / "hf")
    assert str(e.value) == (
        f"{tmp_path / 'hf'}: cannot load this hf checkpoint into the model:\n"
        "  '1.weight' [param]: the model's shape is [5, 6], the checkpoint's '1.weight' is [4, 6]\n"
        "  '1.bias' [param]: the model's shape is [5], the checkpoint's '1.bias' is [4]\n"
        "  model key '4.weight' is not in the checkpoint\n"
        "  model key '4.bias' is not in the checkpoint\n"
        "  checkpoint tensor 'extra.weight' has no key in the model")


def test_not_strict_leaves_what_the_checkpoint_lacks_and_says_so(tmp_path):
    saved = _net(0).state_dict()
    _hf(tmp_path / "hf", {k: v for k, v in saved.items() if k != "2.bias"})
    net = _net(1)
    before = net[2].bias.detach().clone()
    report = load_into(net, None, tmp_path / "hf", strict=False)
    assert report.missing == ("2.bias",) and torch.equal(net[2].bias, before)
    assert torch.equal(net[2].weight, saved["2.weight"])


def test_threads_must_be_a_count(tmp_path):
    _hf(tmp_path / "hf", _net(0).state_dict())
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ReshardError, match=rf"threads must be an integer of at least 1, got {bad!r}"):
            load_into(_net(1), None, tmp_path / "hf", threads=bad)


def test_an_optimizer_is_refused_when_the_checkpoint_has_only_weights(tmp_path):
    _hf(tmp_path / "hf", _net(0).state_dict())
    net = _net(1)
    opt = torch.optim.Adam(net.parameters())
    with pytest.raises(ReshardError, match=r"holds no optimizer state .*pass optimizer=None"):
        load_into(net, opt, tmp_path / "hf")
    assert not opt.state  # refused before anything was touched


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_model_that_does_not_match_is_refused_before_the_optimizer_is_touched(tmp_path):
    """DCP's state dict of an optimizer makes its state (a step of zeros): a model that cannot take the
    checkpoint is refused before that, so the job's optimizer still has no state and its params their values."""
    _save_trained(tmp_path / "dcp", 1)
    mine = _net(1)
    mine[1] = torch.nn.Linear(6, 5)
    mine[2] = torch.nn.LayerNorm(5)
    mine[3] = torch.nn.Linear(5, 11, bias=False)
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    my_opt = torch.optim.Adam(mine.parameters())
    with pytest.raises(ReshardError, match=r"'1\.weight' \[param\]: the model's shape is \[5, 6\]"):
        load_into(mine, my_opt, tmp_path / "dcp")
    assert not my_opt.state
    assert all(torch.equal(v, before[k]) for k, v in mine.state_dict().items())
