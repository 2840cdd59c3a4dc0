"""The protocol-2 pickle ``torch.save`` writes for a tree, its tensors as persistent ids of their storages.

Names torch's globals without importing torch; ``reshard.io.torch_write`` lays the pickle out in the archive.
"""

from __future__ import annotations

import argparse
import collections
import io
import struct

import numpy as np

from reshard.errors import CheckpointFormatError
from reshard.io.torch_read import _is_builtin_type
from reshard.io.torch_types import (
    _STORAGE_OF,
    ALLOWED_PREFIXES,
    Opaque,
    TensorRef,
    TensorSpec,
    TorchDtype,
    TorchSize,
    _allowlisted,
    _contiguous_stride,
)

__all__ = ["TorchPickler"]


class TorchPickler:
    """Writes the protocol-2 pickle torch.save writes for a tree, naming globals without importing them.

    Like pickle, it memoizes globals and containers (BINPUT, then BINGET on the next visit), so shared
    objects stay shared and a tree that shares sub-trees is written once.
    """

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.memo: dict[object, int] = {}  # global name or id(object) -> memo index
        self.alive: list[object] = []  # memoized objects, kept alive so their ids stay unique
        self.storages: dict[object, tuple[str, TensorSpec]] = {}  # spec key -> (storage key, spec), in pickling order

    def dump(self, obj: object) -> bytes:
        self.out.write(b"\x80\x02")
        self.save(obj)
        self.out.write(b".")
        return self.out.getvalue()

    def get(self, index: int) -> None:
        self.out.write(b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index))

    def put(self, key: object, obj: object = None) -> None:
        index = self.memo[key] = len(self.memo)
        self.alive.append(obj)
        self.out.write(b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index))

    def save(self, obj: object) -> None:
        w, t = self.out.write, type(obj)
        if id(obj) in self.memo:
            self.get(self.memo[id(obj)])
        elif obj is None or t in (bool, int, float, str, bytes):
            self.save_atom(obj)
        elif t is tuple and not obj:  # never memoized, as pickle writes it (a 0-d tensor's size and stride: two
            w(b")")  # EMPTY_TUPLEs): the bytes do not hang on which empty tuple object the tree holds
        elif t is tuple or t is TorchSize:
            if t is TorchSize:
                self.save_global(("torch", "Size"))
            self.save_tuple(tuple(obj))
            if t is TorchSize:
                w(b"\x85R")
            self.put(id(obj), obj)
        elif t is list or t is dict:
            w(b"]" if t is list else b"}")
            self.put(id(obj), obj)
            self.save_batches(obj if t is list else obj.items(), pairs=t is dict)
        elif t is collections.OrderedDict or t is collections.defaultdict:
            args = () if t is collections.OrderedDict else (obj.default_factory,)
            self.save_reduce(("collections", t.__name__), args)
            self.put(id(obj), obj)
            self.save_batches(obj.items(), pairs=True)
            self.save_state(getattr(obj, "__dict__", None))  # a state dict's _metadata
        elif t in (set, frozenset, complex, bytearray):
            args = (list(obj),) if t in (set, frozenset) else (obj.real, obj.imag) if t is complex else (bytes(obj),)
            self.save_reduce(("__builtin__", t.__name__), args)
            self.put(id(obj), obj)
        elif t is argparse.Namespace:
            self.save_global(("argparse", "Namespace"))
            w(b")\x81")
            self.put(id(obj), obj)
            self.save_state(vars(obj))
        elif t is TorchDtype:
            self.save_global(("torch", obj.name))
        elif t is TensorSpec:
            self.save_tensor(obj)
            self.put(id(obj), obj)
        elif t is Opaque:
            self.save_opaque(obj)
            self.put(id(obj), obj)
        elif isinstance(obj, (np.ndarray, np.generic, np.dtype)):
            func, args, *rest = obj.__reduce_ex__(2)  # numpy's own reduction, as torch.save's pickler uses
            self.save_reduce(_numpy_global(func), args)
            self.save_state(rest[0] if rest else None)
        elif _is_builtin_type(obj):  # a defaultdict's factory
            self.save_global(("__builtin__", obj.__name__))
        elif isinstance(obj, type) and obj.__module__.split(".")[0] == "numpy":
            self.save_global(_numpy_global(obj))
        elif t is TensorRef:
            raise CheckpointFormatError(f"cannot write TensorRef {obj.storage}: replace it with a TensorSpec (see map_tensors)")
        else:
            raise CheckpointFormatError(f"reshard cannot write a {t.__module__}.{t.__qualname__} into a torch file")

    def save_atom(self, obj: None | bool | int | float | str | bytes) -> None:
        w, t = self.out.write, type(obj)
        if obj is None or t is bool:
            w(b"N" if obj is None else b"\x88" if obj else b"\x89")
        elif t is float:
            w(b"G" + struct.pack(">d", obj))
        elif t is str:
            data = obj.encode("utf-8", "surrogatepass")
            w(b"X" + struct.pack("<I", len(data)) + data)
        elif t is bytes:  # protocol 2 has no bytes opcode
            args = (obj.decode("latin1"), "latin1") if obj else ()
            self.save_reduce(("_codecs", "encode") if obj else ("__builtin__", "bytes"), args)
        elif 0 <= obj < 65536:
            w(b"K" + bytes([obj]) if obj < 256 else b"M" + struct.pack("<H", obj))
        elif -(2**31) <= obj < 2**31:
            w(b"J" + struct.pack("<i", obj))
        else:  # LONG1/LONG4: little-endian two's complement, shortest form
            data = obj.to_bytes(obj.bit_length() // 8 + 1, "little", signed=True)
            if obj < 0 and len(data) > 1 and data[-1] == 0xFF and data[-2] & 0x80:
                data = data[:-1]
            w((b"\x8a" + bytes([len(data)]) if len(data) < 256 else b"\x8b" + struct.pack("<i", len(data))) + data)

    def save_tuple(self, items: tuple) -> None:
        if len(items) > 3:
            self.out.write(b"(")
        for item in items:
            self.save(item)
        self.out.write(b")\x85\x86\x87"[len(items): len(items) + 1] if len(items) <= 3 else b"t")

    def save_batches(self, items, *, pairs: bool) -> None:
        """APPENDS or SETITEMS (``pairs``) in batches of 1000, as pickle does."""
        items = list(items)
        for i in range(0, len(items), 1000):
            batch = items[i: i + 1000]
            if len(batch) > 1:
                self.out.write(b"(")
            for item in batch:
                for part in item if pairs else (item,):
                    self.save(part)
            self.out.write((b"u" if len(batch) > 1 else b"s") if pairs else (b"e" if len(batch) > 1 else b"a"))

    def save_state(self, state: object) -> None:
        if state:
            self.save(state)
            self.out.write(b"b")

    def save_global(self, name: tuple[str, str]) -> None:
        if name in self.memo:
            self.get(self.memo[name])
        else:
            self.out.write(f"c{name[0]}\n{name[1]}\n".encode())
            self.put(name)

    def save_reduce(self, name: tuple[str, str], args: tuple) -> None:
        self.save_global(name)
        self.save_tuple(args)
        self.out.write(b"R")

    def save_tensor(self, spec: TensorSpec) -> None:
        known = self.storages.setdefault(spec.key, (str(len(self.storages)), spec))
        if (known[1].dtype, known[1].shape) != (spec.dtype, spec.shape):
            raise CheckpointFormatError(f"tensor key {spec.key!r} names two different tensors")
        wrapped = bool(spec.attrs)  # plain attributes: _rebuild_from_type_v2(func, Tensor, args, attrs)
        if spec.parameter:
            self.save_global(("torch._utils", "_rebuild_parameter"))
        if wrapped:
            self.save_global(("torch._tensor", "_rebuild_from_type_v2"))
            self.out.write(b"(")
        legacy = spec.dtype in _STORAGE_OF
        self.save_global(("torch._utils", "_rebuild_tensor_v2" if legacy else "_rebuild_tensor_v3"))
        if wrapped:
            self.save_global(("torch", "Tensor"))
        self.out.write(b"((")  # the arguments, then the persistent id
        self.save("storage")
        self.save_global(("torch", _STORAGE_OF[spec.dtype]) if legacy else ("torch.storage", "UntypedStorage"))
        for part in (known[0], "cpu", spec.numel if legacy else spec.nbytes):
            self.save(part)
        self.out.write(b"tQ")  # BINPERSID
        for part in (0, spec.shape, _contiguous_stride(spec.shape), spec.requires_grad and not spec.parameter):
            self.save(part)
        self.save_reduce(("collections", "OrderedDict"), ())  # backward hooks, always empty
        if not legacy:
            self.save_global(("torch", spec.dtype))
        self.out.write(b"t" if wrapped else b"tR")
        if wrapped:
            self.save(dict(spec.attrs))
            self.out.write(b"tR")
        if spec.parameter:
            self.save(spec.requires_grad)
            self.save_reduce(("collections", "OrderedDict"), ())
            self.out.write(b"\x87R")

    def save_opaque(self, o: Opaque) -> None:
        if not (_allowlisted(o.module) or (o.module, o.name) == ("torch", "device")):
            raise CheckpointFormatError(f"Opaque {o.module}.{o.name} is outside the allowlist ({', '.join(ALLOWED_PREFIXES)})")
        self.save_global((o.module, o.name))
        if o.args is None:
            return
        self.save_tuple(tuple(o.args))
        self.out.write(b"\x81" if o.newobj else b"R")
        if o.listitems:
            self.save_batches(o.listitems, pairs=False)
        if o.dictitems:
            self.save_batches(o.dictitems, pairs=True)
        if o.state is not None:
            self.save(o.state)
            self.out.write(b"b")


def _numpy_global(obj) -> tuple[str, str]:
    module, name = obj.__module__, obj.__qualname__
    if module.split(".")[0] != "numpy":
        raise CheckpointFormatError(f"numpy reduced to {module}.{name}, which reshard does not write")
    return module, name
