"""DCP's ``.metadata`` pickle, emitted by reshard's own code, byte for byte what ``pickle.dump`` writes.

``dcp.save`` writes ``.metadata`` as ``pickle.dump(Metadata(...))`` at the default protocol (4).
Building ~200,000 of torch's dataclasses and pickling them takes seconds, so ``encode_metadata``
writes the same opcodes directly: each entry from a template of constant bytes around its
strings and integers. The bytes are those CPython's C pickler produces for the objects
``write_metadata`` builds (``reshard.io.pickle_emit`` follows its memo, batch and frame rules).

Objects whose pickled form comes from torch (its classes, dtypes, ``torch.strided``,
``_MEM_FORMAT_ENCODING``) are saved once through a small generic pickler that asks torch for their
reductions, so a torch release that changes them changes the bytes here the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from reshard.io.pickle_emit import (
    _BINGET,
    _MEMOIZE,
    _NEWOBJ_STATE,
    _TUPLE_OPS,
    Pickler,
    _int,
    _pack_h,
    _pack_i,
    _pack_ui,
)

__all__ = ["encode_metadata"]


def _size_body(dims: tuple[int, ...]) -> tuple[bytes, int]:
    """A ``torch.Size(dims)`` after its class: ``REDUCE((tuple(dims),))``, and the memo entries that takes."""
    if not dims:
        return b")\x85\x94R\x94", 2
    ints = b"".join([_int(d) for d in dims])
    return (b"(" + ints + b"t" if len(dims) > 3 else ints + _TUPLE_OPS[len(dims)]) + b"\x94\x85\x94R\x94", 3


def encode_metadata(md: Any) -> list[bytes]:
    """The bytes of ``pickle.dump(Metadata(...))`` for the ``DcpMetadata`` ``md``, as ``write_metadata`` builds it.

    That is: each tensor a ``TensorStorageMetadata`` of strided, contiguous ``TensorProperties`` of
    its dtype, its size and chunks as ``torch.Size``; each bytes entry a ``BytesStorageMetadata``;
    ``storage_data`` keyed by ``MetadataIndex(fqn, offsets, 0)`` (``MetadataIndex(fqn)`` for bytes)
    with ``_StorageInfo`` values (transforms a list, or absent when there are none); ``planner_data``
    as given; ``version`` as given; ``storage_meta`` None (``dcp.load`` makes one when there is none).
    Returns the pieces to write in order.
    """
    p = _MetadataPickler()
    sdm: dict[str, Any] = dict(md.tensors)
    for key in md.byte_entries:
        sdm[key] = None
    p.save(p.cls.Metadata)
    p.buf += _NEWOBJ_STATE
    p.count += 2
    for name in p.f_meta:
        p.save_str(name)
        if name == "state_dict_metadata":
            p.dict_items(sdm, p.entries)
        elif name == "planner_data":
            p.dict_items(md.planner_data, p.planner_entries)
        elif name == "storage_data":
            p.dict_items(md.storage, p.storage_entries)
        elif name == "version" and md.version is not None:  # FileSystemWriter.finish sets CURRENT_DCP_VERSION
            p.save_str(md.version)
        else:
            p.buf += b"N"
        p.end_unit()
    p.buf += b"ub"
    return p.finish()


class _Classes:
    """torch's DCP metadata classes, imported when a ``.metadata`` is written."""

    def __init__(self) -> None:
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        self.torch, self.Size, self.StorageInfo = torch, torch.Size, _StorageInfo
        self.Bytes, self.Chunk, self.Metadata = BytesStorageMetadata, ChunkStorageMetadata, Metadata
        self.Index, self.Properties, self.Tensor = MetadataIndex, TensorProperties, TensorStorageMetadata


class _MetadataPickler(Pickler):
    """A ``Pickler`` with a template per kind of entry.

    An entry kind's first save goes the slow way (``save``), which memoizes its classes and field
    names; after it the kind's constant bytes (their BINGETs around fixed opcodes) are known, and each
    further entry is one concatenation with its strs, ints and sizes.
    """

    def __init__(self) -> None:
        super().__init__()
        c = self.cls = _Classes()
        size = c.Size(())
        # Field names as torch's instances hold them: the pickler memoizes these very str objects.
        meta = vars(c.Metadata(state_dict_metadata={}))
        self.f_meta = list(meta)
        self.f_tensor = list(vars(c.Tensor(c.Properties(), size, [])))
        self.f_chunk = list(vars(c.Chunk(size, size)))
        self.f_index = list(vars(c.Index("", (), 0)))
        self.f_info = list(c.StorageInfo("", 0, 0, [""]).__getstate__())
        fields = (self.f_meta[:3], self.f_tensor, self.f_chunk, self.f_index, self.f_info)
        if fields != (["state_dict_metadata", "planner_data", "storage_data"], ["properties", "size", "chunks"],
                      ["offsets", "sizes"], ["fqn", "index", "offset"],
                      ["relative_path", "offset", "length", "transform_descriptors"]) or any(
                          meta[k] is not None for k in self.f_meta[3:]):
            raise RuntimeError(f"torch's DCP metadata classes have fields {fields}, not those reshard writes")
        _, self.layout, _, self.mem_format, _ = c.Properties(dtype=c.torch.float32).__getstate__()
        self.sizes: dict[tuple[int, ...], tuple[bytes, int]] = {}
        self.dtypes: dict[str, bytes] = {}
        self.tpl: dict[str, tuple[bytes, ...]] = {}
        self.tails: dict[tuple, tuple[bytes, int]] = {}  # a tensor entry's bytes after its key, by kind

    # -- pieces ---------------------------------------------------------------------------------
    def g(self, *objs: Any) -> bytes:
        """The BINGETs of objects saved before."""
        return b"".join(self.get(o) for o in objs)  # type: ignore[misc]

    def detached(self, obj: Any) -> bytes:
        """``save(obj)``'s bytes, returned rather than left in the buffer (its memo entries stay made)."""
        start = len(self.buf)
        self.save(obj)
        got = bytes(self.buf[start:])
        del self.buf[start:]
        return got

    def text(self, s: str) -> bytes:
        """A str's opcodes: ``save_str``'s common case, returned for a template to join."""
        i = self.memo.get(id(s))
        if i is not None:
            return _BINGET[i] if i < 256 else b"j" + _pack_ui(i)
        if type(s) is not str:
            return self.detached(s)
        data = s.encode("utf-8", "surrogatepass")
        if len(data) >= 256:
            return self.detached(s)
        self.memo[id(s)] = self.count
        self.alive.append(s)
        self.count += 1
        return b"\x8c" + bytes((len(data),)) + data + _MEMOIZE

    def size_body(self, dims: tuple[int, ...]) -> tuple[bytes, int]:
        body = self.sizes.get(dims)
        if body is None:
            body = self.sizes[dims] = _size_body(tuple(int(d) for d in dims))
        return body

    def size(self, dims: tuple[int, ...]) -> None:
        self.save(self.cls.Size)
        body = self.size_body(dims)
        self.buf += body[0]
        self.count += body[1]

    def dtype(self, name: str) -> bytes:
        got = self.dtypes.get(name)
        if got is None:
            dtype = getattr(self.cls.torch, name)
            if self.get(dtype) is None:
                return self.detached(dtype)
            got = self.dtypes[name] = self.get(dtype)  # type: ignore[assignment]
        return got

    def dict_items(self, d: dict, save_batch: Callable[[Iterable], None]) -> None:
        self.buf += b"}\x94"
        self.count += 1
        self.batches(d.items(), save_batch, b"s", b"u")

    # -- state_dict_metadata --------------------------------------------------------------------
    def entries(self, items: Iterable) -> None:
        buf, memo, tails = self.buf, self.memo, self.tails
        for key, t in items:
            i = memo.get(id(key))
            buf += self.text(key) if i is None else _BINGET[i] if i < 256 else b"j" + _pack_ui(i)
            if t is None:
                self.save(self.cls.Bytes)
                buf += b")\x81\x94"
                self.count += 1
            else:
                # Its bytes after the key hold no memo index: the same for every tensor of its dtype, size and
                # chunks (a model's many layers, each tensor's chunks shared), so they are made once per kind.
                kind = (t.dtype, t.size, *map(id, t.chunks))
                tail = tails.get(kind)
                if tail is not None:
                    buf += tail[0]
                    self.count += tail[1]
                else:
                    # with its templates and dtype known, a tensor's save memoizes objects but refers to none new
                    pure = "tensor" in self.tpl and "chunk" in self.tpl and t.dtype in self.dtypes
                    start, count = len(buf), self.count
                    self.tensor(t)
                    if pure:
                        tails[kind] = (bytes(buf[start:]), self.count - count)
            self.end_unit()

    def tensor(self, t: Any) -> None:
        c = self.cls
        parts = self.tpl.get("tensor")
        if parts is not None:
            self.count += 3  # the tensor, its state dict, its properties: memoized before a new dtype's global
            head = parts[0] + self.dtype(t.dtype)
            body = self.size_body(t.size)
            self.buf += head + parts[1] + body[0] + parts[2]
            self.count += 2 + body[1]
        else:
            self.save(c.Tensor)
            self.buf += _NEWOBJ_STATE
            self.count += 2
            self.save_str(self.f_tensor[0])
            self.save(c.Properties)
            self.buf += b")\x81\x94("
            self.count += 1
            self.buf += self.dtype(t.dtype)
            self.save(self.layout)
            self.buf += b"\x89"
            self.save(self.mem_format)
            self.buf += b"\x89t\x94b"
            self.count += 1
            self.save_str(self.f_tensor[1])
            self.size(t.size)
            self.save_str(self.f_tensor[2])
            self.buf += b"]\x94"
            self.count += 1
            g = self.g
            self.tpl["tensor"] = (g(c.Tensor) + _NEWOBJ_STATE + g(self.f_tensor[0], c.Properties) + b")\x81\x94(",
                                  g(self.layout) + b"\x89" + g(self.mem_format) + b"\x89t\x94b" +
                                  g(self.f_tensor[1], c.Size), g(self.f_tensor[2]) + b"]\x94")
        self.batches(t.chunks, self.chunks, b"a", b"e")
        self.buf += b"ub"

    def chunks(self, items: Iterable) -> None:
        for chunk in items:
            t = self.tpl.get("chunk")
            if t is not None:
                off, n = self.size_body(chunk.offsets), self.size_body(chunk.sizes)
                self.buf += t[0] + off[0] + t[1] + n[0] + b"ub"
                self.count += 2 + off[1] + n[1]
            else:
                self.save(self.cls.Chunk)
                self.buf += _NEWOBJ_STATE
                self.count += 2
                self.save_str(self.f_chunk[0])
                self.size(chunk.offsets)
                self.save_str(self.f_chunk[1])
                self.size(chunk.sizes)
                self.buf += b"ub"
                self.tpl["chunk"] = (self.g(self.cls.Chunk) + _NEWOBJ_STATE + self.g(self.f_chunk[0], self.cls.Size),
                                     self.g(self.f_chunk[1], self.cls.Size))
            self.end_unit()

    # -- planner_data ---------------------------------------------------------------------------
    def planner_entries(self, items: Iterable) -> None:
        buf, memo, alive, heads = self.buf, self.memo, self.alive, {}
        for key, value in items:
            i = memo.get(id(key))
            if i is None:
                self.save(key)
            else:
                buf += _BINGET[i] if i < 256 else b"j" + _pack_ui(i)
            if (type(value) is tuple and len(value) == 2 and type(value[0]) is str and type(value[1]) is str and
                    id(value) not in memo and id(value[0]) not in memo and id(value[1]) not in memo and
                    value[0] is not value[1]):
                # the common case, ``(state dict, fqn)`` of strs new to the pickle: the state dict's name is one
                # of a few (its opcode made once), each fqn encoded as it comes
                head, fqn = value
                op = heads.get(head)
                if op is None:
                    data = head.encode("utf-8", "surrogatepass")
                    op = heads[head] = b"\x8c" + bytes((len(data),)) + data + _MEMOIZE if len(data) < 256 else b""
                data = fqn.encode("utf-8", "surrogatepass")
                if op and len(data) < 256:
                    buf += b"".join((op, b"\x8c", bytes((len(data),)), data, b"\x94\x86\x94"))
                    count = self.count
                    memo[id(head)], memo[id(fqn)], memo[id(value)] = count, count + 1, count + 2
                    alive.append(value)  # and so its strs
                    self.count = count + 3
                    self.end_unit()
                    continue
            if type(value) is tuple and 0 < len(value) <= 3 and id(value) not in memo and all(
                    type(v) is str for v in value):  # a path of keys: its strs joined at once
                buf += b"".join([self.text(v) for v in value]) + _TUPLE_OPS[len(value)] + _MEMOIZE
                memo[id(value)] = self.count
                alive.append(value)
                self.count += 1
            else:
                self.save(value)
            self.end_unit()

    # -- storage_data ---------------------------------------------------------------------------
    def storage_entries(self, items: Iterable) -> None:
        tpl, buf, memo, mids = self.tpl, self.buf, self.memo, {}
        for (fqn, offset), s in items:
            index, info = tpl.get("index" if offset is None else "index at"), tpl.get("info")
            if index is None or info is None or s.transforms:
                self.storage(fqn, offset, s)
                self.end_unit()
                continue
            self.count += 2  # the index and its state dict, memoized before its fqn
            i = memo.get(id(fqn))
            name = self.text(fqn) if i is None else _BINGET[i] if i < 256 else b"j" + _pack_ui(i)
            # from the fqn to the path: the index's offsets (a torch.Size, no memo refs) and the info's head
            mid = mids.get(offset)
            if mid is None:
                body = (b"", 0) if offset is None else self.size_body(offset)
                mid = mids[offset] = (index[1] + body[0] + (b"ub" if offset is not None else b"") + info[0],
                                      body[1] + 2)
            self.count += mid[1]
            i = memo.get(id(s.relative_path))
            path = self.text(s.relative_path) if i is None else _BINGET[i] if i < 256 else b"j" + _pack_ui(i)
            off, length = s.offset, s.length
            # an offset within 2 GiB (most of them) as BININT, inline; the rest as _int writes them
            buf += b"".join((index[0], name, mid[0], path, info[1],
                             b"J" + _pack_i(off) if 65536 <= off <= 0x7FFFFFFF else _int(off), info[2],
                             b"M" + _pack_h(length) if 256 <= length < 65536 else _int(length), b"ub"))
            self.end_unit()

    def storage(self, fqn: str, offset: tuple[int, ...] | None, s: Any) -> None:
        """One storage entry the slow way, leaving its templates behind."""
        c, g, f_index, f_info = self.cls, self.g, self.f_index, self.f_info
        self.save(c.Index)
        self.buf += _NEWOBJ_STATE
        self.count += 2
        self.save_str(f_index[0])
        self.save(fqn)
        self.save_str(f_index[1])
        if offset is None:
            self.buf += b"Nub"
            self.tpl["index"] = (g(c.Index) + _NEWOBJ_STATE + g(f_index[0]), g(f_index[1]) + b"Nub")
        else:
            self.buf += b"K\x00"
            self.save_str(f_index[2])
            self.size(offset)
            self.buf += b"ub"
            self.tpl["index at"] = (g(c.Index) + _NEWOBJ_STATE + g(f_index[0]),
                                    g(f_index[1]) + b"K\x00" + g(f_index[2], c.Size))
        self.save(c.StorageInfo)
        self.buf += _NEWOBJ_STATE
        self.count += 2
        self.save_str(f_info[0])
        self.save(s.relative_path)
        self.save_str(f_info[1])
        self.buf += _int(s.offset)
        self.save_str(f_info[2])
        self.buf += _int(s.length)
        self.tpl["info"] = (g(c.StorageInfo) + _NEWOBJ_STATE + g(f_info[0]), g(f_info[1]), g(f_info[2]))
        if s.transforms:
            self.save_str(f_info[3])
            self.save_list(list(s.transforms))
        self.buf += b"ub"
