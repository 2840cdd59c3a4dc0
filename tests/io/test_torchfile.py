"""reshard.io.torchfile against real torch.save / torch.load: reading, writing and refusing hostile files."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import io
import os
import pickle
import random
import re
import sys
import types
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from reshard.errors import CheckpointFormatError
from reshard.core.dtypes import SUPPORTED
from reshard.io.torchfile import (
    Opaque,
    TensorRef,
    TensorSpec,
    TorchDtype,
    TorchFileWriter,
    TorchSize,
    map_tensors,
    read_torch_file,
    write_torch_file,
)

import torch


def sample(dtype: str, shape=(4, 6)) -> torch.Tensor:
    """Distinct, position-dependent values in ``dtype``."""
    x = torch.arange(-12, -12 + int(np.prod(shape)), dtype=torch.float32).reshape(shape) / 4
    if dtype == "bool":
        return x.remainder(1.5) == 0
    if dtype == "complex64":
        return torch.complex(x, -x - 0.5)
    return x.to(getattr(torch, dtype))


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, row-major."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def ref_bytes(ref: TensorRef) -> bytes:
    """A TensorRef's bytes, row-major, read through its offsets and strides."""
    start = ref.data_offset - ref.storage_offset * ref.itemsize
    with ref.path.open("rb") as fh:
        fh.seek(start)
        storage = np.frombuffer(fh.read(ref.storage_nbytes), np.uint8).reshape(-1, ref.itemsize)
    index = ref.storage_offset + sum(np.indices(ref.shape, dtype=np.int64)[d] * s for d, s in enumerate(ref.stride))
    return storage[np.asarray(index).reshape(-1)].tobytes()


def specs_for(tree):
    """The write tree for a read tree: every TensorRef becomes a TensorSpec keyed by the ref itself."""
    return map_tensors(tree, lambda r: TensorSpec(r.dtype, r.shape, key=r, requires_grad=r.requires_grad,
                                                  parameter=r.parameter))


def rewrite(src_tree, dst: Path) -> None:
    """Writes a tree read by read_torch_file to ``dst``, tensor bytes taken from the source file."""
    with TorchFileWriter(dst, specs_for(src_tree)) as out:
        for ref in out.entries:
            out.write(ref, ref_bytes(ref))


def without_location(tree):
    return map_tensors(tree, lambda r: dataclasses.replace(r, path=Path(), data_offset=0))


def zip_records(path: Path, records: dict[str, bytes], *, prefix="archive", compress=()) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in records.items():
            method = zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED
            zf.writestr(f"{prefix}/{name}" if prefix else name, data, compress_type=method)
    return path


def records_of(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {name.split("/", 1)[1]: zf.read(name) for name in zf.namelist()}


# -------------------------------------------------------------------------------------------- reading


@pytest.mark.parametrize("dtype", sorted(SUPPORTED))
def test_torch_save_tensor_of_every_dtype_reads_back_bit_exact(tmp_path, dtype):
    t = sample(dtype)
    view = t[1:3, ::2]
    torch.save({"t": t, "view": view}, tmp_path / "x.pt")

    tree = read_torch_file(tmp_path / "x.pt")

    ref = tree["t"]
    assert (ref.dtype, ref.shape, ref.stride, ref.storage_offset) == (dtype, (4, 6), (6, 1), 0)
    assert ref.itemsize == SUPPORTED[dtype] and ref.nbytes == 24 * SUPPORTED[dtype] == ref.storage_nbytes
    assert ref.is_contiguous and ref.data_offset % 64 == 0
    with (tmp_path / "x.pt").open("rb") as fh:  # a contiguous tensor is one span at data_offset
        fh.seek(ref.data_offset)
        assert fh.read(ref.nbytes) == raw(t)
    v = tree["view"]
    assert (v.storage, v.shape, v.stride, v.storage_offset) == (ref.storage, (2, 3), (6, 2), 6)
    assert not v.is_contiguous and v.data_offset == ref.data_offset + 6 * ref.itemsize
    assert ref_bytes(v) == raw(view)


def test_views_and_shared_storages_report_torch_offsets_and_strides(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensors = {
        "base": base, "rows": base[2:5], "column": base[:, 3], "transposed": base.t(), "narrow": base[1:4, 2:9],
        "expanded": base[0, :4].unsqueeze(0).expand(3, 4), "again": base, "element": base[5, 9], "empty": base[6:],
    }
    torch.save(tensors, tmp_path / "views.pt")

    tree = read_torch_file(tmp_path / "views.pt")

    assert {ref.storage for ref in tree.values()} == {"0"}
    for name, t in tensors.items():
        ref = tree[name]
        assert (ref.shape, ref.stride, ref.storage_offset) == (tuple(t.shape), t.stride(), t.storage_offset()), name
        assert ref.is_contiguous == t.is_contiguous(), name
        assert ref_bytes(ref) == raw(t), name
    assert tree["again"] is tree["base"]  # one pickled object, one TensorRef


def test_training_state_reads_back_as_plain_values(tmp_path):
    np.random.seed(7)
    random.seed(7)
    torch.manual_seed(7)
    args = argparse.Namespace(tensor_model_parallel_size=2, params_dtype=torch.bfloat16, seq=[1, 2], name="gpt")
    state = {
        "args": args,
        "iteration": 1200,
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                       "torch_rng_state": torch.get_rng_state()}],
        "shapes": collections.OrderedDict(w=torch.Size([4, 8])),
        "dtype": torch.float8_e4m3fn,
        "misc": (None, True, 2**70, -5, 1.5, 1 + 2j, b"\x00\xffblob", b"", {3, 1}, frozenset({2}), "text"),
        "np_scalars": [np.float64(0.25), np.int64(-3), np.float32(1.5)],
        "big_endian": np.arange(5, dtype=">i4"),
        "groups": collections.defaultdict(list, {"a": [1]}),
        "device": torch.device("cpu"),
    }
    torch.save(state, tmp_path / "state.pt")

    got = read_torch_file(tmp_path / "state.pt")

    assert got["args"] == argparse.Namespace(tensor_model_parallel_size=2, params_dtype=TorchDtype("bfloat16"),
                                             seq=[1, 2], name="gpt")
    assert got["iteration"] == 1200
    rng = got["rng_state"][0]
    assert rng["random_rng_state"] == random.getstate()
    random.setstate(rng["random_rng_state"])  # usable as is
    name, keys, pos, has_gauss, gauss = rng["np_rng_state"]
    want = np.random.get_state()
    assert (name, pos, has_gauss, gauss) == (want[0], want[2], want[3], want[4])
    assert keys.dtype == np.uint32 and np.array_equal(keys, want[1])
    torch_rng = rng["torch_rng_state"]
    assert (torch_rng.dtype, torch_rng.shape) == ("uint8", tuple(torch.get_rng_state().shape))
    assert ref_bytes(torch_rng) == raw(torch.get_rng_state())
    assert got["shapes"] == collections.OrderedDict(w=(4, 8)) and type(got["shapes"]["w"]) is TorchSize
    assert got["dtype"] == TorchDtype("float8_e4m3fn")
    assert got["misc"] == state["misc"]
    assert got["np_scalars"] == state["np_scalars"] and type(got["np_scalars"][0]) is np.float64
    assert got["big_endian"].dtype == np.dtype(">i4") and got["big_endian"].tolist() == [0, 1, 2, 3, 4]
    assert got["groups"] == {"a": [1]} and got["groups"].default_factory is list
    assert got["device"] == Opaque("torch", "device", ("cpu",))


def test_state_dict_metadata_survives_read_and_rewrite(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    torch.save(model.state_dict(), tmp_path / "sd.pt")

    tree = read_torch_file(tmp_path / "sd.pt")
    rewrite(tree, tmp_path / "out.pt")

    assert tree._metadata == model.state_dict()._metadata
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded._metadata == model.state_dict()._metadata
    for name, t in model.state_dict().items():
        assert raw(loaded[name]) == raw(t), name


# -------------------------------------------------------------------------------------------- writing


ALL_DTYPES = sorted(SUPPORTED)


def writer_tree():
    """A tree of specs plus the tensors torch should load from it."""
    tensors = {f"w_{d}": sample(d, (3, 5)) for d in ALL_DTYPES}
    tensors |= {
        "big": torch.arange(3 * 2**18, dtype=torch.float32).reshape(768, 1024),  # 3 MiB, streamed in pieces
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "param": torch.nn.Parameter(sample("float16", (2, 2))),
        "frozen": torch.nn.Parameter(sample("float32", (2,)), requires_grad=False),
        "grad": sample("float32", (3,)).requires_grad_(),
    }

    def spec(name):
        t = tensors[name]
        return TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape), key=name,
                          requires_grad=t.requires_grad, parameter=isinstance(t, torch.nn.Parameter))

    tree = {
        "model": collections.OrderedDict((name, spec(name)) for name in tensors if name.startswith("w_")),
        "opt": {"state": {0: {"step": spec("scalar"), "exp_avg": spec("big")}}, "param_groups": [{"lr": 0.1}]},
        "misc": [spec("empty"), (spec("param"), spec("frozen")), spec("grad")],
        "tied": spec("w_float32"),
        "shape": TorchSize((3, 5)),
        "dtype": TorchDtype("bfloat16"),
        "plain": (None, True, 3, -(2**40), 0.5, "s", {1, 2}, 1j),
    }
    return tree, tensors


def test_writer_output_loads_in_torch_bit_exact(tmp_path):
    tree, tensors = writer_tree()
    path = tmp_path / "out.pt"
    with TorchFileWriter(path, tree) as out:
        assert set(out.entries) == set(tensors)
        pending = {key: raw(t) for key, t in tensors.items()}
        while pending:  # interleave tensors, pieces of uneven size
            for key in list(pending):
                piece, pending[key] = pending[key][:1_000_003], pending[key][1_000_003:]
                out.write(key, piece)
                if not pending[key]:
                    del pending[key]
        for key, (offset, nbytes) in out.entries.items():
            assert nbytes == len(raw(tensors[key])) and offset % 64 == 0

    for weights_only in (True, False):
        got = torch.load(path, weights_only=weights_only)
        for name, t in tensors.items():
            where = got["model"].get(name) if name.startswith("w_") else None
            if where is not None:
                assert where.dtype == t.dtype and raw(where) == raw(t), name
        opt = got["opt"]["state"][0]
        assert raw(opt["step"]) == raw(tensors["scalar"]) and opt["step"].shape == ()
        assert raw(opt["exp_avg"]) == raw(tensors["big"])
        empty, (param, frozen), grad = got["misc"]
        assert empty.shape == (0, 4) and empty.dtype == torch.bfloat16
        assert type(param) is torch.nn.Parameter and param.requires_grad and raw(param) == raw(tensors["param"])
        assert type(frozen) is torch.nn.Parameter and not frozen.requires_grad
        assert type(grad) is torch.Tensor and grad.requires_grad and raw(grad.detach()) == raw(tensors["grad"])
        assert got["tied"].data_ptr() == got["model"]["w_float32"].data_ptr()  # one key, one storage
        assert type(got["shape"]) is torch.Size and got["shape"] == (3, 5)
        assert got["dtype"] is torch.bfloat16
        assert got["plain"] == tree["plain"] and got["opt"]["param_groups"] == [{"lr": 0.1}]


def test_writer_layout_is_what_torch_save_writes(tmp_path, monkeypatch):
    tree, tensors = writer_tree()
    write_torch_file(tmp_path / "mine.pt", tree, {k: raw(t) for k, t in tensors.items()})
    torch.save(_torch_tree(tree, tensors), tmp_path / "theirs.pt")

    with zipfile.ZipFile(tmp_path / "mine.pt") as mine, zipfile.ZipFile(tmp_path / "theirs.pt") as theirs:
        assert [i.filename.replace("mine/", "") for i in mine.infolist()] == \
               [i.filename.replace("theirs/", "") for i in theirs.infolist()]
        assert mine.read("mine/version") == theirs.read("theirs/version") == b"3\n"
        assert mine.testzip() is None  # every CRC-32 is right
    assert without_location(read_torch_file(tmp_path / "mine.pt")) == \
        without_location(read_torch_file(tmp_path / "theirs.pt"))
    # torch can compute storage offsets itself; this relies on miniz's exact layout, and the debug flag
    # makes torch check every computed offset against the local headers.
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    from torch.utils.serialization import config

    # torch's own patch(): monkeypatch's undo deletes the attribute, hiding the option for later loads.
    with config.patch({"load.calculate_storage_offsets": True}):
        got = torch.load(tmp_path / "mine.pt", mmap=True, weights_only=True)
        assert raw(got["opt"]["state"][0]["exp_avg"]) == raw(tensors["big"])
        meta = torch.load(tmp_path / "mine.pt", map_location="meta", weights_only=True)
    assert meta["opt"]["state"][0]["exp_avg"].shape == (768, 1024)


def test_empty_tuples_are_never_memoized_as_torch_save_writes_them(tmp_path):
    """A 0-d tensor's size and stride (Adam's ``step``) and any empty tuple: one EMPTY_TUPLE each and no memo entry,
    as pickle writes them, so that the bytes do not depend on which empty tuple object the tree holds."""
    import pickletools

    step = torch.tensor(3.0)
    write_torch_file(tmp_path / "mine.pt", {"step": TensorSpec("float32", (), key="s"), "x": (), "y": (1, ())},
                     {"s": raw(step)})
    torch.save({"step": step, "x": (), "y": (1, ())}, tmp_path / "theirs.pt")
    for name in ("mine", "theirs"):
        data = zipfile.ZipFile(tmp_path / f"{name}.pt").read(f"{name}/data.pkl")
        ops = [op.name for op, _, _ in pickletools.genops(data)]
        empty = [k for k, op in enumerate(ops) if op == "EMPTY_TUPLE"]
        assert len(empty) == 5, name  # size, stride, OrderedDict's arguments, x, y's second
        assert not [k for k in empty if ops[k + 1] in ("BINPUT", "LONG_BINPUT", "MEMOIZE")], name
    assert torch.equal(torch.load(tmp_path / "mine.pt", weights_only=True)["step"], step)


def _torch_tree(tree, tensors):
    """The tree of real tensors torch.save gets for ``tree``: specs swapped for tensors, our types for torch's."""
    if isinstance(tree, TensorSpec):
        return tensors[tree.key]
    if isinstance(tree, TorchSize):
        return torch.Size(tree)
    if isinstance(tree, TorchDtype):
        return getattr(torch, tree.name)
    if isinstance(tree, dict):
        return type(tree)((k, _torch_tree(v, tensors)) for k, v in tree.items())
    if type(tree) in (list, tuple):
        return type(tree)(_torch_tree(v, tensors) for v in tree)
    return tree


def test_writer_carries_numpy_and_python_state_that_torch_loads_unchanged(tmp_path):
    np.random.seed(3)
    random.seed(3)
    state = {
        "np_rng_state": np.random.get_state(), "random_rng_state": random.getstate(),
        "args": argparse.Namespace(hidden_size=64, params_dtype=TorchDtype("float16"), layers=[1, 2]),
        "blob": b"\x00\x01\xfe\xff" * 300, "empty_blob": b"", "scalar": np.float32(0.5), "fortran": np.asfortranarray(
            np.arange(6, dtype=np.int16).reshape(2, 3)), "groups": collections.defaultdict(int, {"x": 2}),
        "nested": collections.OrderedDict(a=[{"b": (1, 2.5, None)}], c=frozenset({"d"})),
    }
    write_torch_file(tmp_path / "state.pt", state, {})

    got = torch.load(tmp_path / "state.pt", weights_only=False)

    assert got["np_rng_state"][0] == "MT19937" and np.array_equal(got["np_rng_state"][1], state["np_rng_state"][1])
    assert got["np_rng_state"][2:] == state["np_rng_state"][2:]
    assert got["random_rng_state"] == state["random_rng_state"]
    assert got["args"] == argparse.Namespace(hidden_size=64, params_dtype=torch.float16, layers=[1, 2])
    assert got["blob"] == state["blob"] and got["empty_blob"] == b""
    assert type(got["scalar"]) is np.float32 and got["scalar"] == 0.5
    assert np.array_equal(got["fortran"], state["fortran"]) and got["fortran"].dtype == np.int16
    assert got["groups"] == {"x": 2} and got["groups"].default_factory is int
    assert got["nested"] == state["nested"]
    again = read_torch_file(tmp_path / "state.pt")
    assert again["args"] == state["args"] and again["blob"] == state["blob"]
    assert np.array_equal(again["fortran"], state["fortran"])


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """A stand-in ``deepspeed`` package with two real DeepSpeed class shapes: a dataclass and an int enum."""
    frag = types.ModuleType("deepspeed.utils.tensor_fragment")
    config = types.ModuleType("deepspeed.runtime.zero.config")

    @dataclasses.dataclass
    class fragment_address:  # noqa: N801 - DeepSpeed's own name
        numel: int
        start: int

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2

    for cls, mod in ((fragment_address, frag), (ZeroStageEnum, config)):
        cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
        setattr(mod, cls.__name__, cls)
    modules = {name: types.ModuleType(name) for name in
               ("deepspeed", "deepspeed.utils", "deepspeed.runtime", "deepspeed.runtime.zero")}
    modules |= {frag.__name__: frag, config.__name__: config}

    def install():
        for name, mod in modules.items():
            monkeypatch.setitem(sys.modules, name, mod)

    def uninstall():
        for name in modules:
            monkeypatch.delitem(sys.modules, name, raising=False)

    return types.SimpleNamespace(fragment_address=fragment_address, ZeroStageEnum=ZeroStageEnum,
                                 install=install, uninstall=uninstall)


def test_deepspeed_classes_survive_read_write_read_as_opaque_records(tmp_path, fake_deepspeed):
    ds = fake_deepspeed
    ds.install()
    optim = {
        "optimizer_state_dict": {
            "zero_stage": ds.ZeroStageEnum.gradients,
            "param_slice_mappings": [collections.OrderedDict(w=ds.fragment_address(numel=12, start=0),
                                                             b=ds.fragment_address(numel=4, start=12))],
            "single_partition_of_fp32_groups": [torch.arange(16, dtype=torch.float32)],
        },
        "ds_version": "0.16.0",
    }
    torch.save(optim, tmp_path / "optim.pt")
    ds.uninstall()

    first = read_torch_file(tmp_path / "optim.pt")
    rewrite(first, tmp_path / "again.pt")
    second = read_torch_file(tmp_path / "again.pt")

    assert "deepspeed" not in sys.modules  # nothing was imported
    state = first["optimizer_state_dict"]
    assert state["zero_stage"] == Opaque("deepspeed.runtime.zero.config", "ZeroStageEnum", (2,))
    assert state["param_slice_mappings"][0]["w"] == Opaque(
        "deepspeed.utils.tensor_fragment", "fragment_address", (), {"numel": 12, "start": 0}, newobj=True)
    assert without_location(second) == without_location(first)
    ds.install()
    loaded = torch.load(tmp_path / "again.pt", weights_only=False)
    assert loaded["optimizer_state_dict"]["zero_stage"] is ds.ZeroStageEnum.gradients
    mappings = optim["optimizer_state_dict"]["param_slice_mappings"]
    assert loaded["optimizer_state_dict"]["param_slice_mappings"] == mappings
    assert torch.equal(loaded["optimizer_state_dict"]["single_partition_of_fp32_groups"][0], torch.arange(16.0))


def test_hand_assembled_pickle_of_an_allowlisted_class_becomes_opaque(tmp_path):
    # GLOBAL megatron.core.enums ModelType; (1,) REDUCE; then the class itself as a bare value
    data = b"\x80\x02(cmegatron.core.enums\nModelType\nK\x01\x85Rcapex.optimizers\nFusedAdam\nl."
    path = zip_records(tmp_path / "m.pt", {"data.pkl": data})

    assert read_torch_file(path) == [Opaque("megatron.core.enums", "ModelType", (1,)),
                                     Opaque("apex.optimizers", "FusedAdam", None)]


def test_shared_subtrees_stay_shared_through_read_map_and_write(tmp_path):
    # 64 levels of t[i] = (t[i-1], t[i-1]): 2**64 leaves if anything along the way copied instead of sharing
    levels = b"".join(b"h%ch%c\x86q%c" % (i - 1, i - 1, i) for i in range(1, 65))
    path = zip_records(tmp_path / "dag.pt", {"data.pkl": b"\x80\x02)q\x00" + levels + b"."})

    tree = read_torch_file(path)
    write_torch_file(tmp_path / "out.pt", map_tensors(tree, lambda r: r), {})
    shared = [[1, 2]]
    write_torch_file(tmp_path / "lists.pt", {"a": shared, "b": shared}, {})

    assert len(records_of(tmp_path / "out.pt")["data.pkl"]) < 1000
    node = read_torch_file(tmp_path / "out.pt")
    for _ in range(64):
        assert node[0] is node[1]
        node = node[0]
    assert node == ()
    lists = torch.load(tmp_path / "lists.pt", weights_only=True)
    assert lists["a"] is lists["b"] and lists["a"] == [[1, 2]]


# -------------------------------------------------------------------------------------------- refusing


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_that_would_run_os_system_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "x": Payload(marker)}, tmp_path / "evil.pt")

    with pytest.raises(CheckpointFormatError, match=r"evil\.pt: pickle references (posix|nt)\.system, which reshard "
                                                    r"will not load \(allowed: torch tensors"):
        read_torch_file(tmp_path / "evil.pt")

    assert not marker.exists()
    torch.load(tmp_path / "evil.pt", weights_only=False)  # the payload is real: unrestricted loading runs it
    assert marker.exists()


def call(module: str, name: str, arg: str) -> bytes:
    """A protocol-2 pickle calling ``module.name(arg)``."""
    encoded = arg.encode()
    size = len(encoded).to_bytes(4, "little")
    return b"\x80\x02c%s\n%s\nX%s%s\x85R." % (module.encode(), name.encode(), size, encoded)


@pytest.mark.parametrize("data, shown", [
    (call("builtins", "eval", "1+1"), "builtins.eval"),
    (call("__builtin__", "exec", "x=1"), "builtins.exec"),
    (call("builtins", "getattr", "x"), "builtins.getattr"),
    (call("subprocess", "Popen", "true"), "subprocess.Popen"),
    (call("posix", "system", "true"), "posix.system"),
    (call("torch", "load", "x.pt"), "torch.load"),
    (call("numpy", "load", "x.npy"), "numpy.load"),
    (call("copyreg", "_reconstructor", "x"), "copyreg._reconstructor"),
    # protocol 4 names globals with STACK_GLOBAL: 'os' 'system' STACK_GLOBAL ('true',) REDUCE
    (b"\x80\x04\x8c\x02os\x8c\x06system\x93X\x04\x00\x00\x00true\x85R.", "os.system"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_any_other_global_is_refused_by_name(tmp_path, data, shown):
    path = zip_records(tmp_path / "x.pt", {"data.pkl": data})

    with pytest.raises(CheckpointFormatError, match=rf"x\.pt: pickle references {shown}, which reshard will not load"):
        read_torch_file(path)


def test_pickle_cannot_set_attributes_on_classes_it_is_allowed_to_name(tmp_path):
    # BUILD on the argparse.Namespace class itself, with slot state {'__repr__': 'x'}
    data = b"\x80\x02cargparse\nNamespace\nN}X\x08\x00\x00\x00__repr__X\x01\x00\x00\x00xs\x86b."
    path = zip_records(tmp_path / "x.pt", {"data.pkl": data})
    before = argparse.Namespace.__repr__

    with pytest.raises(CheckpointFormatError, match=r"x\.pt: data\.pkl is not a pickle reshard can read"):
        read_torch_file(path)

    assert argparse.Namespace.__repr__ is before


class _Storage:
    """Pickled by ``persistent_id`` below, as torch pickles storages."""


class _OutOfBounds:
    def __reduce__(self):  # 10 floats from element 2 of a 4-float storage
        return torch._utils._rebuild_tensor_v2, (STORAGE, 2, (10,), (1,), False, collections.OrderedDict())


STORAGE = _Storage()


class TorchLikePickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", torch.FloatStorage, "0", "cpu", 4) if obj is STORAGE else None


def torch_like_pickle(obj) -> bytes:
    buf = io.BytesIO()
    TorchLikePickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def damaged(tmp_path: Path, how: str) -> Path:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(10, dtype=torch.float32)}, good)
    records, path = records_of(good), tmp_path / "bad.pt"
    if how == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif how == "missing storage":
        del records["data/0"]
        zip_records(path, records)
    elif how == "short storage record":
        zip_records(path, records | {"data/0": records["data/0"][:8]})
    elif how == "tensor past storage end":
        zip_records(path, {"data.pkl": torch_like_pickle({"w": _OutOfBounds()}), "data/0": bytes(16)})
    elif how == "compressed storage":
        zip_records(path, records, compress={"data/0"})
    elif how == "legacy format":
        torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    elif how == "not a torch zip":
        zip_records(path, {"readme.txt": b"hello"}, prefix="")
    elif how == "no data.pkl":
        zip_records(path, {"data/0": records["data/0"]})
    elif how == "not a zip":
        path.write_text("just text\n")
    elif how == "corrupt data.pkl":
        data = bytearray(good.read_bytes())
        at = data.index(b"_rebuild_tensor_v2")
        data[at: at + 2] = b"_X"
        path.write_bytes(bytes(data))
    elif how == "garbage pickle":
        zip_records(path, {"data.pkl": b"\x80\x02}q\x00(X"})
    return path


@pytest.mark.parametrize("how, message", [
    ("truncated", r"not a readable zip archive \(truncated\?\)"),
    ("missing storage", r"missing storage record archive/data/0"),
    ("short storage record", r"storage record archive/data/0 holds 8 bytes but the pickle declares 40"),
    ("tensor past storage end", r"a float32 tensor of shape \[10\], stride \[1\] at storage offset 2 needs 48 bytes "
                                r"of storage 0, which holds 16"),
    ("compressed storage", r"storage record archive/data/0 is compressed \(zip method 8\)"),
    ("legacy format", r"written in the legacy torch.save format"),
    ("not a torch zip", r"zip archive is not a torch.save file: its records are not under one directory"),
    ("no data.pkl", r"no archive/data\.pkl record, so not a torch.save file"),
    ("not a zip", r"not a zip archive"),
    ("corrupt data.pkl", r"record good/data\.pkl fails its CRC-32 check"),
    ("garbage pickle", r"data\.pkl is not a pickle reshard can read \((EOF|Unpickling)"),
])
def test_damaged_files_are_refused_naming_file_and_reason(tmp_path, how, message):
    path = damaged(tmp_path, how)

    with pytest.raises(CheckpointFormatError, match=rf"^{re.escape(str(path))}: {message}"):
        read_torch_file(path)


# -------------------------------------------------------------------------------------------- writer errors


def test_incomplete_tensor_fails_close_and_removes_the_file(tmp_path):
    path = tmp_path / "x.pt"
    out = TorchFileWriter(path, {"w": TensorSpec("float32", (4,), key="w"), "v": TensorSpec("int8", (2,), key="v")})
    out.write("w", np.zeros(1, np.float32))
    out.write("v", b"\x01\x02")

    with pytest.raises(CheckpointFormatError, match=r"x\.pt: tensors not fully written: 'w' \(4 of 16 bytes\)$"):
        out.close()
    assert not path.exists()


def test_overflowing_a_tensor_is_refused(tmp_path):
    with TorchFileWriter(tmp_path / "x.pt", [TensorSpec("int16", (2,), key=0)]) as out:
        out.write(0, b"ab")
        with pytest.raises(CheckpointFormatError, match=r"tensor 0 takes 4 bytes; 4 more after 2 would overflow it"):
            out.write(0, b"cdef")
        out.write(0, b"cd")
    assert torch.load(tmp_path / "x.pt")[0].numpy().tobytes() == b"abcd"


def test_exception_inside_the_writer_removes_the_partial_file(tmp_path):
    path = tmp_path / "x.pt"
    tree = {"w": TensorSpec("uint8", (8,), key="w")}
    with pytest.raises(RuntimeError, match="source went away"), TorchFileWriter(path, tree):
        assert path.exists()
        raise RuntimeError("source went away")
    assert not path.exists()


@pytest.mark.parametrize("obj, error, message", [
    ({"w": TensorRef("float32", (1,), (1,), "0", 0, Path("a.pt"), 64, 4)}, CheckpointFormatError, "replace it with a TensorSpec"),
    ({"f": print}, CheckpointFormatError, "cannot write a builtins.builtin_function_or_method"),
    ({"o": Opaque("builtins", "eval", ("1",))}, CheckpointFormatError, "Opaque builtins.eval is outside the allowlist"),
    ([TensorSpec("float32", (2,), key="k"), TensorSpec("float16", (2,), key="k")], CheckpointFormatError, "names two different"),
])
def test_trees_reshard_cannot_write_are_refused_before_creating_a_file(tmp_path, obj, error, message):
    with pytest.raises(error, match=message):
        TorchFileWriter(tmp_path / "x.pt", obj)
    assert not (tmp_path / "x.pt").exists()


def test_unsupported_dtype_spec_is_refused():
    with pytest.raises(CheckpointFormatError, match="unsupported dtype 'float128'"):
        TensorSpec("float128", (2,), key="x")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("RESHARD_BIG_TESTS"), reason="writes a 4 GiB file; set RESHARD_BIG_TESTS=1")
def test_file_past_4_gib_uses_zip64_that_torch_and_zipfile_read(tmp_path):
    big = TensorSpec("uint8", (2**32 + 4096,), key="big")
    tail = TensorSpec("int32", (4,), key="tail")  # its header starts past 4 GiB
    path = tmp_path / "big.pt"
    chunk = np.full(2**26, 7, np.uint8)
    with TorchFileWriter(path, {"big": big, "tail": tail}) as out:
        left = big.nbytes
        while left:
            n = min(left, chunk.size)
            out.write("big", chunk[:n])
            left -= n
        out.write("tail", np.arange(4, dtype=np.int32))

    tree = read_torch_file(path)
    assert tree["tail"].data_offset > 2**32 and tree["tail"].data_offset % 64 == 0
    assert ref_bytes(tree["tail"]) == np.arange(4, dtype=np.int32).tobytes()
    got = torch.load(path, mmap=True, weights_only=True)
    assert got["big"].shape == (2**32 + 4096,) and int(got["big"][-1]) == 7
    assert got["tail"].tolist() == [0, 1, 2, 3]


def test_plain_tensor_attributes_round_trip_as_deepspeed_zero3_writes_them(tmp_path):
    """ZeRO-3 tags its flat groups with ds_id: _rebuild_from_type_v2(..., torch.Tensor, args, {"ds_id": ...})."""
    import torch
    path = tmp_path / "attrs.pt"
    data = np.arange(5, dtype=np.float32)
    write_torch_file(path, {"g": [TensorSpec("float32", (5,), key=1, attrs=(("ds_id", "0_20"),))]}, {1: data.tobytes()})
    loaded = torch.load(path, weights_only=True)["g"][0]
    assert loaded.ds_id == "0_20" and torch.equal(loaded, torch.from_numpy(data))
    ref = read_torch_file(path)["g"][0]
    assert ref.attrs == (("ds_id", "0_20"),) and ref.shape == (5,)
    t = torch.zeros(2)
    t.hook = [1, 2]  # anything but plain values is still refused
    torch.save(t, tmp_path / "bad.pt")
    with pytest.raises(CheckpointFormatError, match="a tensor with Python attributes"):
        read_torch_file(tmp_path / "bad.pt")


def test_archives_of_one_tensor_spec_share_a_layout_but_never_their_bytes(tmp_path):
    """A lone TensorSpec is laid out once (DCP writes one archive per chunk, many alike); each archive still gets
    its own CRCs and serialization id, and torch.load reads each one's own tensor."""
    from reshard.io.torch_write import _lay_out_alone

    spec = TensorSpec("float32", (3, 5), key=0)
    datas = [np.arange(15, dtype=np.float32) * k for k in (1, 2, 3)]
    for k, data in enumerate(datas):
        with TorchFileWriter(tmp_path / f"a{k}.pt", spec, archive_name="archive") as w:
            w.write(0, data)
    for k, data in enumerate(datas):
        got = torch.load(tmp_path / f"a{k}.pt", weights_only=True)
        assert torch.equal(got, torch.from_numpy(data.reshape(3, 5)))
        with zipfile.ZipFile(tmp_path / f"a{k}.pt") as z:
            assert z.testzip() is None
    template = _lay_out_alone(spec, "archive")
    assert all(r.crc == 0 and r.written == 0 for r in template.tensors.values())
    assert template.ident.payload == b"0" * 40
    ids = {zipfile.ZipFile(tmp_path / f"a{k}.pt").read("archive/.data/serialization_id") for k in range(3)}
    assert len(ids) == 3


@pytest.mark.parametrize("dtype,shape", [("float32", (3, 5)), ("bfloat16", (7,)), ("float32", (0, 4)),
                                         ("int64", ()), ("float16", (64, 64))])
def test_a_lone_archive_framed_in_memory_is_the_archive_the_writer_streams(tmp_path, dtype, shape):
    """DCP writes runs of small chunk archives framed in memory, one write a run: the bytes, CRCs and
    serialization id included, are those TorchFileWriter writes, and torch.load reads the tensor."""
    from reshard.io.torch_write import lone_archive

    spec = TensorSpec(dtype, shape, key=0)
    rng = np.random.default_rng(len(shape))
    for k in range(3):
        data = rng.integers(0, 256, spec.nbytes, dtype=np.uint8).tobytes()
        with TorchFileWriter(tmp_path / "streamed.pt", spec, archive_name="archive") as w:
            w.write(0, data)
        archive = lone_archive(spec, "archive")
        buf = bytearray(b"\xcd" * archive.size)  # whatever was in the buffer before
        buf[archive.data_offset:archive.data_offset + spec.nbytes] = data
        archive.frame(memoryview(buf))
        assert bytes(buf) == (tmp_path / "streamed.pt").read_bytes()
    (tmp_path / "framed.pt").write_bytes(bytes(buf))
    with zipfile.ZipFile(tmp_path / "framed.pt") as z:
        assert z.testzip() is None
    got = torch.load(tmp_path / "framed.pt", weights_only=True)
    assert got.shape == shape and bytes(got.reshape(-1).view(torch.uint8).numpy()) == data


@pytest.mark.parametrize("dtype,shape", [("float32", (3, 5)), ("bfloat16", (7,)), ("float32", (0, 4)), ("int64", ())])
def test_a_run_of_lone_archives_framed_at_once_is_each_archive_the_writer_streams(tmp_path, dtype, shape):
    """``frame_many`` frames a run of archives of one spec with array writes for them all: each archive, its
    CRCs and serialization id included, is the one TorchFileWriter writes for its tensor."""
    from reshard.io.torch_write import lone_archive

    spec = TensorSpec(dtype, shape, key=0)
    archive = lone_archive(spec, "archive")
    rng = np.random.default_rng(7)
    datas = [rng.integers(0, 256, spec.nbytes, dtype=np.uint8).tobytes() for _ in range(4)]
    buf = np.full(archive.size * len(datas), 0xCD, dtype=np.uint8)  # whatever was in the buffer before
    for k, data in enumerate(datas):
        at = k * archive.size + archive.data_offset
        buf[at:at + spec.nbytes] = np.frombuffer(data, dtype=np.uint8)
    crcs = archive.frame_many(memoryview(buf), len(datas))
    for k, data in enumerate(datas):
        with TorchFileWriter(tmp_path / "streamed.pt", spec, archive_name="archive") as w:
            w.write(0, data)
        assert bytes(buf[k * archive.size:(k + 1) * archive.size]) == (tmp_path / "streamed.pt").read_bytes()
        assert crcs[k] == zlib.crc32(data)
