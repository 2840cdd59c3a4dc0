"""The CUDA paths, on a machine with a GPU: a rank's ``reshard.load(device="cuda")`` and ``load_into`` of a module
(plain, and under FSDP2) that lives on the GPU, each bit for bit what the same load gives on the CPU.

Skipped where CUDA is absent, as on CI. The logic these paths share with the CPU (staging buffers, a buffer
filled again only once its copy is done, copies cast to the module's dtype, failures surfacing) is tested on
the CPU in ``test_rank_load.py`` and ``test_load_into.py``, with a thread standing in for the CUDA stream; here
the real stream, pinned buffers and the caching allocator do the copies."""

from __future__ import annotations

import pytest
import torch
from test_load_into import _hf, _net, _save_trained, _step

import reshard
import reshard.api.loading
import reshard.torch.loading
from fixtures import make_fixture
from reshard.torch import load_into

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SOURCES = {"hf": "tp=1", "megatron": "tp=2,pp=2,dp=1,zero=1", "deepspeed": "dp=2,zero=2"}


def raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    for fmt, topo in SOURCES.items():
        make_fixture(root / fmt, format=fmt, to=topo, model="tiny-llama")
    return root


@pytest.mark.parametrize("window", [16 << 20, 4096], ids=["default windows", "4 KiB windows"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("fmt", list(SOURCES))
def test_a_ranks_load_onto_the_gpu_is_the_hosts_bit_for_bit(sources, monkeypatch, fmt, threads, window):
    """Small windows cut every tensor into many, so each staging buffer is filled again while copies are in
    flight on the stream."""
    monkeypatch.setattr(reshard.api.loading, "_WINDOW", window)
    host = reshard.load(sources / fmt, to="tp=2,pp=2", rank=3, format="megatron")
    gpu = reshard.load(sources / fmt, to="tp=2,pp=2", rank=3, format="megatron", device="cuda", threads=threads)
    assert list(gpu.tensors) == list(host.tensors) and len(host.tensors) > 10
    for item, tensor in gpu.tensors.items():
        assert tensor.device.type == "cuda" and tensor.dtype == host.tensors[item].dtype, item
        assert raw(tensor) == raw(host.tensors[item]), item
    assert gpu.bytes_read == host.bytes_read


def test_a_load_onto_the_gpu_waits_for_work_queued_before_it(sources, monkeypatch):
    """Memory the caching allocator hands the load may still be written by kernels queued on the current stream;
    the load's copies are ordered after them, so nothing queued earlier lands over the loaded bytes."""
    monkeypatch.setattr(reshard.api.loading, "_WINDOW", 4096)
    host = reshard.load(sources / "hf", to="tp=2,pp=2", rank=3, format="megatron")
    for _ in range(3):
        busy = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        big = torch.randn(8192, 8192, device="cuda")
        for _ in range(4):  # keeps the current stream busy for a while
            big = big @ big
        busy.fill_(0xAB)
        del busy  # its memory goes back to the allocator while fill_ may still be queued
        gpu = reshard.load(sources / "hf", to="tp=2,pp=2", rank=3, format="megatron", device="cuda")
        torch.cuda.synchronize()
        for item, tensor in gpu.tensors.items():
            assert raw(tensor) == raw(host.tensors[item]), item


@pytest.mark.parametrize("window", [16 << 20, 8], ids=["default windows", "8-byte windows"])
def test_a_module_on_the_gpu_loads_safetensors_cast_as_on_the_host(tmp_path, monkeypatch, window):
    """bf16 in the file, float32 in the module: the staging buffer holds the stored bits, the copy casts."""
    monkeypatch.setattr(reshard.torch.loading, "_WINDOW", window)
    saved = {k: v.to(torch.bfloat16).contiguous() for k, v in _net(0).state_dict().items()}
    _hf(tmp_path / "hf", saved)
    host, gpu = _net(1), _net(1).cuda()
    load_into(host, None, tmp_path / "hf")
    report = load_into(gpu, None, tmp_path / "hf", threads=3)
    for (k, a), b in zip(gpu.state_dict().items(), host.state_dict().values()):
        assert a.device.type == "cuda" and a.dtype == torch.float32, k
        assert raw(a) == raw(b) == raw(saved[k].float()), k
    assert report.bytes_read == report.share == sum(v.numel() * 2 for v in saved.values())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_module_and_adam_on_the_gpu_load_a_dcp_checkpoint_as_on_the_host(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    monkeypatch.setattr(reshard.torch.loading, "_WINDOW", 64)
    _save_trained(tmp_path / "dcp", 3, lr=1e-2)
    loaded = {}
    for device in ("cpu", "cuda"):
        mine = _net(1).to(device)
        my_opt = torch.optim.Adam(mine.parameters(), lr=1e-2)
        load_into(mine, my_opt, tmp_path / "dcp", threads=2)
        msd, osd = get_state_dict(mine, my_opt)  # the live tensors: kept as they are now, before the step
        state = {fqn: {s: (v.device.type, raw(v)) for s, v in states.items()} for fqn, states in osd["state"].items()}
        loaded[device] = ({k: (v.device.type, raw(v)) for k, v in msd.items()}, state)
        _step(mine, my_opt)  # one more step trains the same on both
        loaded[device + " stepped"] = [p.detach().cpu() for p in mine.parameters()]
    (h_msd, h_osd), (g_msd, g_osd) = loaded["cpu"], loaded["cuda"]
    assert g_msd.keys() == h_msd.keys() and g_osd.keys() == h_osd.keys() and len(h_osd) == 6
    for k, (where, value) in g_msd.items():
        assert where == "cuda" and value == h_msd[k][1], k
    for fqn, states in h_osd.items():
        assert states.keys() == g_osd[fqn].keys() == {"step", "exp_avg", "exp_avg_sq"}, fqn
        for s, (_, value) in states.items():
            assert s == "step" or g_osd[fqn][s][0] == "cuda", (fqn, s)  # where step lives is Adam's choice
            assert g_osd[fqn][s][1] == value, (fqn, s)
    # one more step trains alike (up to the kernels' rounding: the GPU's are not the CPU's)
    assert all(torch.allclose(a, b) for a, b in zip(loaded["cuda stepped"], loaded["cpu stepped"]))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_fsdp2_module_on_the_gpu_loads_its_shards(sources, tmp_path, monkeypatch):
    """A one-rank NCCL job: FSDP2 puts each parameter in a DTensor on the GPU, which the load fills through the
    staging buffers; its values are the checkpoint's, as a plain module on the host gets them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    monkeypatch.setattr(reshard.torch.loading, "_WINDOW", 4096)
    saved = {k: v.contiguous() for k, v in _net(0).state_dict().items()}
    _hf(tmp_path / "hf", saved)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gpu = _net(1).cuda()
        for layer in gpu:
            fully_shard(layer)
        fully_shard(gpu)
        report = load_into(gpu, None, tmp_path / "hf")
        for k, v in gpu.state_dict().items():
            assert type(v).__name__ == "DTensor" and v.device.type == "cuda", k
            assert raw(v.full_tensor()) == raw(saved[k]), k
        assert report.bytes_read == report.share
    finally:
        dist.destroy_process_group()
