"""Reading a DCP checkpoint: its storage files, the flattened key names of ``get_state_dict``, and the
bytes of each chunk located inside its ``torch.save`` archive."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from reshard.core.geometry import row_major_strides
from reshard.core.layout import PARAM, LogicalTensor, new_logical
from reshard.errors import CheckpointFormatError
from reshard.io.dcp_metadata import (
    METADATA_NAME,
    DcpChunk,
    DcpMetadata,
    DcpStorage,
    DcpTensor,
)
from reshard.io.location import pread
from reshard.io.safetensors_io import read_header
from reshard.io.torch_read import read_torch_file
from reshard.io.torch_types import SmallTensor, TensorRef, scalar_value

SECTION = "dcp"




_DATA_FILE = re.compile(r"__([0-9]{1,9})_([0-9]{1,9})\.distcp")

_MODEL_PREFIX = "model."
"""The parameters' key prefix ``get_state_dict`` gives a model saved as ``{"model": ...}`` (torchtitan has none)."""
_OPTIM_PREFIXES = ("optim.", "optimizer.")
"""The optimizer's key prefixes seen in checkpoints; the first is the one a new checkpoint gets."""

_ADAM_GROUP = {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": False}
"""torch.optim.Adam's param_groups entry with its defaults (torch 2.13)."""

@dataclass(frozen=True, slots=True)
class _Verbatim:
    """A whole entry copied as stored: a 0-d tensor chunk or a bytes entry (a torch.save archive)."""

    key: str
    tensor: DcpTensor | None
    """None for a bytes entry."""
    data: bytes

class ParamGroup(NamedTuple):
    """One param group of a torch optimizer as its ``state_dict`` gives it, its params by name: what a checkpoint
    of one framework tells a checkpoint of another about the optimizer (``optimizer_groups``)."""

    hyper: dict[str, Any]
    """The group's hyperparameters (``lr``, ``betas``, ``weight_decay``, ...), without ``params``."""
    params: tuple[str, ...]
    """The group's parameters by fqn, in the group's order (a flat buffer's order, for DeepSpeed)."""
    step: SmallTensor | None
    """Adam's ``step`` of the group's parameters (one value per group), None when it has none."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpRead:
    """What a DCP source carries to a DCP target besides its tensors (``Source.extra["dcp"]``)."""

    naming: _Naming
    """How the checkpoint spells its keys (``model.``/``optim.`` or torchtitan's bare names)."""
    verbatim: list[_Verbatim]
    """0-d tensors (Adam's per-parameter ``step``) and bytes entries (``param_groups``), copied as stored."""
    planner_data: dict[str, Any]
    """``.metadata``'s planner data (each key's path in the state dict)."""
    param_groups: tuple[ParamGroup, ...] = ()
    """The optimizer's param groups, when the checkpoint holds them in plain values (``_param_groups``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpWrite:
    """What a DCP (or torch_dist) target writes besides its items (``Target.extra["dcp"]``)."""

    chunks: dict[Any, Any]
    """Each item's chunk: its box of the global tensor and the rank that writes it."""
    verbatim: list[_Verbatim]
    planner_data: dict[str, Any]
    naming: _Naming


def _rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"

def _plain(name: str, shape: tuple[int, ...]) -> LogicalTensor:
    n = len(shape)
    return new_logical(name, shape, _PLAIN_AXES[n] if n < len(_PLAIN_AXES) else tuple(f"d{k}" for k in range(n)))


_PLAIN_AXES = tuple(tuple(f"d{k}" for k in range(n)) for n in range(9))
"""A plain tensor's axes by rank, made once: a target may have 100,000 tensors of few ranks."""

@dataclass(frozen=True, slots=True)
class _Naming:
    """How flat keys are spelled: the model prefix (``model.`` or none) and the optimizer's (``optim.``)."""

    model: str
    optim: str
    fqns: frozenset[str]

    def role(self, key: str) -> tuple[str, str] | None:
        """``(fqn, state)`` of a tensor key, None for a tensor that is not a parameter or its state."""
        state_prefix = f"{self.optim}state."
        if self.optim and key.startswith(state_prefix):
            fqn, _, state = key[len(state_prefix):].rpartition(".")
            return (fqn, state) if fqn in self.fqns else None
        if key.startswith(self.model) and key[len(self.model):] in self.fqns:
            return key[len(self.model):], PARAM
        return None

    def key(self, fqn: str, state: str) -> str:
        return f"{self.model}{fqn}" if state == PARAM else f"{self.optim}state.{fqn}.{state}"

    def path(self, key: str) -> tuple:
        """``planner_data``: where ``key`` sits in the nested state dict ``dcp.save`` was given."""
        for p in (f"{self.optim}state.", f"{self.optim}param_groups.") if key.startswith(self.optim) else ():
            if self.optim and key.startswith(p):
                rest = key[len(p):]
                if p.endswith("state."):
                    fqn, _, state = rest.rpartition(".")
                    return (self.optim[:-1], "state", fqn, state)
                group, _, name = rest.partition(".")
                return (self.optim[:-1], "param_groups", int(group) if re.fullmatch(r"[0-9]{1,9}", group) else group,
                        name)
        if self.model and key.startswith(self.model):
            return (self.model[:-1], key[len(self.model):])
        return (key,)

def _naming(md: DcpMetadata, path: Path) -> _Naming:
    optim = next((p for p in _OPTIM_PREFIXES if any(k.startswith(p) for k in [*md.tensors, *md.byte_entries])), "")
    model_keys = [k for k, t in md.tensors.items() if not (optim and k.startswith(optim)) and t.size != ()]
    prefix = _MODEL_PREFIX if model_keys and all(k.startswith(_MODEL_PREFIX) for k in model_keys) else ""
    for k in model_keys:
        if prefix == "" and k.startswith((_MODEL_PREFIX, optim or "\0")):
            raise CheckpointFormatError(f"{path}: key '{k}' mixes prefixed and bare parameter names")
    # A 0-d entry under the model's prefix is the model's (BatchNorm's num_batches_tracked); a bare one could
    # be anyone's (torchtitan's train_state.step), so it stays an entry carried verbatim.
    scalars = [k for k, t in md.tensors.items() if prefix and t.size == () and k.startswith(prefix)]
    return _Naming(prefix, optim, frozenset(k[len(prefix):] for k in [*model_keys, *scalars]))

def _storage(path: Path, md: DcpMetadata, key: str, offsets: tuple[int, ...] | None) -> DcpStorage:
    s = md.storage.get((key, offsets))
    if s is None:
        where = "" if offsets is None else f" at {list(offsets)}"
        raise CheckpointFormatError(f"{path}/{METADATA_NAME}: '{key}'{where} has no storage entry")
    if s.transforms:
        raise CheckpointFormatError(f"{path}/{s.relative_path}: '{key}' is stored with transforms {list(s.transforms)} "
                                    "(compression/extensions), which reshard does not read")
    return s

def _entry_bytes(path: Path, md: DcpMetadata, key: str, offsets: tuple[int, ...] | None) -> tuple[bytes, TensorRef | None]:
    s = _storage(path, md, key, offsets)
    file = path / s.relative_path
    if not file.is_file():  # never open a FIFO or a device: reading it could block or never end
        raise CheckpointFormatError(f"{file}: missing or not a regular file (the metadata puts '{key}' there)")
    try:
        with file.open("rb") as f:
            data = pread(f, s.length, s.offset)
    except OSError as e:
        raise CheckpointFormatError(f"{file}: cannot read '{key}': {e.strerror or e}") from e
    if len(data) != s.length:
        raise CheckpointFormatError(f"{file}: '{key}' needs bytes {s.offset}..{s.offset + s.length}, "
                                    f"the file ends at {s.offset + len(data)} (truncated?)")
    if offsets is not None:  # a 0-d tensor: check it is what the metadata says before carrying it
        ref = read_torch_file(file, offset=s.offset, length=s.length)
        if not isinstance(ref, TensorRef) or ref.shape != ():
            raise CheckpointFormatError(f"{file}: '{key}' should be a 0-d tensor, the archive holds {_what(ref)}")
        return data, ref
    return data, None

def _chunk_ref(path: Path, md: DcpMetadata, key: str, c: DcpChunk, t: DcpTensor, cache: dict,
               problems: list[str]) -> TensorRef | None:
    s = _storage(path, md, key, c.offsets)
    file = path / s.relative_path
    if not file.is_file():
        raise CheckpointFormatError(f"{file}: missing (the metadata puts '{key}' there)")
    with file.open("rb") as f:
        magic = pread(f, 4, s.offset)
    if magic == b"PK\x03\x04":
        ref = read_torch_file(file, offset=s.offset, length=s.length)
    else:
        ref = _safetensors_ref(file, s, key, cache)
    if not isinstance(ref, TensorRef):
        problems.append(f"{file}: '{key}' chunk at {list(c.offsets)} holds {_what(ref)}, not a tensor")
    elif ref.shape != c.sizes or ref.dtype != t.dtype:
        problems.append(f"{file}: '{key}' chunk at {list(c.offsets)} is {ref.dtype} {list(ref.shape)}, "
                        f"the metadata says {t.dtype} {list(c.sizes)}")
    elif not ref.is_contiguous:
        problems.append(f"{file}: '{key}' chunk at {list(c.offsets)} is stored non-contiguous (stride {list(ref.stride)})")
    else:
        return ref
    return None

def _safetensors_ref(file: Path, s: DcpStorage, key: str, cache: dict) -> TensorRef:
    """A chunk of DCP's safetensors serialization (``FileSystemWriter(serialization_format=SAFETENSORS)``).

    Each rank file then ends with one safetensors blob of all its tensors keyed
    by flat key, and every tensor's storage offset points at the blob's start
    (torch 2.13's own ``dcp.load`` cannot read these); the blob's header says
    where each tensor's bytes are.
    """
    header = cache.get((file, s.offset))
    if header is None:
        header = cache[(file, s.offset)] = read_header(file, offset=s.offset)
    info = header.tensors.get(key)
    if info is None:
        raise CheckpointFormatError(f"{file}: '{key}' is neither a torch.save archive at byte {s.offset} nor a "
                                    "tensor of a safetensors blob there")
    return TensorRef(dtype=info.dtype, shape=info.shape, stride=row_major_strides(info.shape), storage=key,
                     storage_offset=0, path=file, data_offset=info.data_offset, storage_nbytes=info.nbytes)

def _chunk_cover(key: str, t: DcpTensor) -> str | None:
    """What is wrong with a tensor's chunks, if anything: DCP saves each element once (replicas deduplicated),
    so the chunks' element counts add up to the tensor's exactly; more means two chunks overlap (whose bytes
    could disagree), fewer that part of the tensor is stored nowhere."""
    stored, numel = sum(math.prod(c.sizes) for c in t.chunks), math.prod(t.size)
    if stored == numel:
        return None
    return (f"'{key}' of size {list(t.size)} ({numel} elements) has chunks holding {stored} elements "
            f"({'overlapping chunks' if stored > numel else 'part of it is stored nowhere'})")

def _what(obj: object) -> str:
    return f"a tensor of shape {list(obj.shape)}" if isinstance(obj, TensorRef) else type(obj).__name__

def _step_value(data: bytes, ref: TensorRef, base: int) -> float | None:
    """The value of a 0-d tensor whose archive (``data``) was read from byte ``base`` of its file."""
    at = ref.data_offset - base
    return scalar_value(data[at:at + ref.itemsize], ref.dtype)

_PLAIN = (bool, int, float, str, type(None))


def _plain_value(value: object) -> bool:
    """A hyperparameter carried by value: a number, string, bool or None, or a tuple or list of them."""
    if isinstance(value, tuple | list):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def _param_groups(path: Path, md: DcpMetadata, naming: _Naming,
                  steps: dict[str, SmallTensor]) -> tuple[ParamGroup, ...]:
    """The optimizer's param groups as ``get_state_dict`` flattened them (``optim.param_groups.<g>.<key>``, each
    a ``torch.save`` of a plain value; ``params`` the group's fqns), each with its params' Adam ``step``
    (``steps``: per fqn). None (an empty tuple) when a group holds anything else (a tensor ``lr``) or an entry
    is unreadable, when a group lists no params, or when the params of one group have different steps: then
    nothing is carried to another format (a DCP target still copies the entries as stored)."""
    prefix = f"{naming.optim}param_groups."
    raw: dict[int, dict[str, Any]] = {}
    for key in md.byte_entries:
        if not (naming.optim and key.startswith(prefix)):
            continue
        group, _, name = key[len(prefix):].partition(".")
        if not re.fullmatch(r"[0-9]{1,9}", group) or not name:
            return ()
        s = _storage(path, md, key, None)
        try:
            value = read_torch_file(path / s.relative_path, offset=s.offset, length=s.length)
        except CheckpointFormatError:
            return ()
        if not _plain_value(value):
            return ()
        raw.setdefault(int(group), {})[name] = value
    out: list[ParamGroup] = []
    for g in range(len(raw)):
        entry = raw.get(g)
        params = entry.get("params") if entry else None
        if not isinstance(params, list) or not params or not all(isinstance(p, str) for p in params):
            return ()
        held = {steps[p] for p in params if p in steps}
        if len(held) > 1:
            return ()
        hyper = {k: v for k, v in entry.items() if k != "params"}
        out.append(ParamGroup(hyper, tuple(params), next(iter(held), None)))
    return tuple(out)
