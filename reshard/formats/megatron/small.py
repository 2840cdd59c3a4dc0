"""Small non-model tensors of a Megatron checkpoint, carried as bytes.

``SmallTensor`` (``reshard.io.torch_types``, shared with DeepSpeed's step scalars) holds an rng state, a per-parameter ``step``, a loss scale or a TE
``_extra_state`` tensor; ``open`` reads such tensors from a rank file (at most
``SMALL_TENSOR_LIMIT`` bytes each, never model or optimizer tensors), and the helpers here
walk the object trees that hold them.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from reshard.errors import CheckpointFormatError
from reshard.formats.base import itemsize
from reshard.io.bounds import brief
from reshard.io.location import read_at
from reshard.io.torch_types import SmallTensor
from reshard.io.torchfile import Opaque, TensorRef, TorchDtype, map_tensors

SMALL_TENSOR_LIMIT = 1 << 20
"""Largest non-model tensor (rng state, step, TE extra state) ``open`` reads, in bytes."""


def _is_tensor(obj: Any) -> bool:
    return type(obj) is TensorRef


def _dtype_name(dtype: Any) -> str:
    """'bfloat16' from a TensorRef's dtype or a pickled ``torch.bfloat16`` (a TorchDtype)."""
    return dtype.name if isinstance(dtype, TorchDtype) else dtype if isinstance(dtype, str) else brief(dtype, 40)


def _small(ref: Any, where: str) -> SmallTensor:
    """Read a small non-model tensor's bytes."""
    dtype = _dtype_name(ref.dtype)
    shape = tuple(int(n) for n in ref.shape)
    n = math.prod(shape)
    nbytes = n * itemsize(dtype)
    if nbytes > SMALL_TENSOR_LIMIT:
        raise CheckpointFormatError(f"{where}: a {nbytes}-byte tensor where small state was expected")
    offset = _contiguous_offset(ref, where)
    data = read_at(ref.path, offset, nbytes)
    if len(data) != nbytes:
        raise CheckpointFormatError(f"{where}: file ends before the tensor's {nbytes} bytes")
    return SmallTensor(dtype, shape, data)


def _contiguous_offset(ref: Any, where: str) -> int:
    """Byte offset in the file of a row-major contiguous tensor's first element."""
    if not ref.is_contiguous:
        raise CheckpointFormatError(
            f"{where}: tensor is not contiguous (shape {tuple(ref.shape)}, stride {tuple(ref.stride)})")
    return int(ref.data_offset)


def _capture(obj: Any, where: str) -> Any:
    """A copy of a small object tree with every tensor read into a SmallTensor."""
    return map_tensors(obj, lambda ref: _small(ref, where))


def _map_small(obj: Any, fn: Callable[[SmallTensor], Any]) -> Any:
    """A copy of ``obj`` with every SmallTensor leaf replaced by ``fn(leaf)`` (containers keep their types)."""
    if isinstance(obj, SmallTensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict/defaultdict and instance attributes
        for k, v in obj.items():
            out[k] = _map_small(v, fn)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_map_small(v, fn) for v in obj)
    if type(obj) is argparse.Namespace:
        return argparse.Namespace(**{k: _map_small(v, fn) for k, v in vars(obj).items()})
    if type(obj) is Opaque:
        return replace(obj, args=_map_small(obj.args, fn), state=_map_small(obj.state, fn),
                       listitems=_map_small(obj.listitems, fn), dictitems=_map_small(obj.dictitems, fn))
    return obj
