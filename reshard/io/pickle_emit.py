"""The opcodes ``pickle.dump`` (protocol 4, the C pickler) writes, emitted without building the objects.

``dcp_pickle`` writes DCP's ``.metadata`` with this: a template per kind of entry around its strings
and integers. The rules followed here, as the C pickler's:

- every str, tuple, list, dict, class and reduced object is memoized (MEMOIZE) when first saved,
  and a later save of the *same object* (not an equal one) is a BINGET (LONG_BINGET from index 256);
  so strings are memoized by identity, as the pickler sees them;
- ints are BININT1 / BININT2 / BININT / LONG1 by size; strs SHORT_BINUNICODE below 256 bytes of
  UTF-8 (surrogates passed through), BINUNICODE / BINUNICODE8 above;
- a dict of one item is ``key value SETITEM``; larger ones go in MARK ... SETITEMS batches of 1000,
  with an empty batch after a last full one; a list of one item is APPEND, larger ones MARK ... APPENDS
  batches of 1000, without the empty batch;
- the body after ``PROTO 4`` is cut into FRAMEs: at the start of any object's save, once the open
  frame holds 65,536 bytes or more, it is closed; a frame of fewer than 4 bytes gets no FRAME
  opcode; a str of 65,536 bytes or more is written outside any frame.
"""

from __future__ import annotations

import copyreg
import pickle
import struct
from collections.abc import Callable, Collection, Iterable
from itertools import islice
from types import MappingProxyType
from typing import Any

__all__ = ["Pickler"]

_FRAME_TARGET = 64 * 1024
_BATCH = 1000
_MEMOIZE = b"\x94"
_NEWOBJ_STATE = b")\x81\x94}\x94("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK: an object and its state dict
_pack_i, _pack_h, _pack_ui, _pack_q, _pack_d = (struct.Struct(f).pack for f in ("<i", "<H", "<I", "<Q", ">d"))
_SMALL = tuple(b"K" + bytes((v,)) for v in range(256))
_TUPLE_OPS = MappingProxyType({1: b"\x85", 2: b"\x86", 3: b"\x87"})
_BINGET = tuple(b"h" + bytes((i,)) for i in range(256))


def _int(v: int) -> bytes:
    if 0 <= v < 256:
        return _SMALL[v]
    if 0 <= v < 65536:
        return b"M" + _pack_h(v)
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return b"J" + _pack_i(v)
    data = pickle.encode_long(v)
    return (b"\x8a" + bytes((len(data),)) if len(data) < 256 else b"\x8b" + _pack_i(len(data))) + data


class Pickler:
    """The C pickler's output for the objects ``encode_metadata`` describes: memo, batches and frames."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.count = 0  # memo entries so far
        self.memo: dict[int, int] = {}  # id(obj) -> memo index, for the objects a later save may meet again
        self.alive: list[Any] = []  # what the memo's ids name, kept alive so that no id is reused
        self.frame_start = 0  # body offset where the open frame begins
        self.spans: list[tuple[int, int, bool]] = []  # (start, end, framed) of the body, in order
        self.unit_start = 0  # body offset of the first opcode not yet looked at for frame cuts

    def memoize(self, obj: Any) -> None:
        self.buf += _MEMOIZE
        self.memo[id(obj)] = self.count
        self.alive.append(obj)
        self.count += 1

    def get(self, obj: Any) -> bytes | None:
        i = self.memo.get(id(obj))
        if i is None:
            return None
        return _BINGET[i] if i < 256 else b"j" + _pack_ui(i)

    def save(self, obj: Any) -> None:
        """``pickle.dump``'s opcodes for ``obj``: the atoms, containers and torch objects of DCP's metadata."""
        buf = self.buf
        t = type(obj)
        if obj is None:
            buf += b"N"
        elif t is bool:
            buf += b"\x88" if obj else b"\x89"
        elif t is int:
            buf += _int(obj)
        elif t is float:
            buf += b"G" + _pack_d(obj)
        elif t is str:
            self.save_str(obj)
        elif t is tuple:
            self.save_tuple(obj)
        elif (got := self.get(obj)) is not None:  # a list, dict or torch object saved before
            buf += got
        elif t is list:
            self.save_list(obj)
        elif t is dict:
            self.save_dict(obj)
        elif isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__")):
            self.save_global(obj, obj.__qualname__)
        elif t.__module__.split(".")[0] == "torch":
            self.save_reduced(obj)
        else:
            raise TypeError(f"DCP metadata holds a {t.__name__} ({obj!r:.60}), which reshard does not write")

    def save_str(self, s: str) -> None:
        got = self.get(s)
        if got is not None:
            self.buf += got
            return
        data = s.encode("utf-8", "surrogatepass")
        n = len(data)
        if n < 256:
            self.buf += b"\x8c" + bytes((n,)) + data
        else:
            self.buf += (b"X" + _pack_ui(n) if n <= 0xFFFFFFFF else b"\x8d" + _pack_q(n)) + data
        self.memoize(s)

    def save_tuple(self, t: tuple) -> None:
        got = self.get(t)
        if got is not None:
            self.buf += got
            return
        if not t:
            self.buf += b")"
            return
        if len(t) > 3:
            self.buf += b"("
        for item in t:
            self.save(item)
        self.buf += _TUPLE_OPS.get(len(t), b"t")
        self.memoize(t)

    def save_list(self, items: list) -> None:
        self.buf += b"]"
        self.memoize(items)
        self.batches(items, self._save_each, b"a", b"e")

    def save_dict(self, d: dict) -> None:
        self.buf += b"}"
        self.memoize(d)
        self.batches(d.items(), self._save_pairs, b"s", b"u")

    def _save_each(self, items: Iterable) -> None:
        for item in items:
            self.save(item)
            self.end_unit()

    def _save_pairs(self, items: Iterable) -> None:
        for k, v in items:
            self.save(k)
            self.save(v)
            self.end_unit()

    def batches(self, items: Collection, save_batch: Callable[[Iterable], None], one: bytes, many: bytes) -> None:
        """A list's (APPEND, APPENDS) or a dict's (SETITEM, SETITEMS) items, batched as ``pickle`` does.

        ``save_batch`` saves a run of items, calling ``end_unit`` after each.
        """
        n = len(items)
        if n == 1:
            save_batch(items)
            self.buf += one
            return
        # A dict (never a list) whose last batch is full gets one more, empty: MARK SETITEMS.
        stop = n + 1 if n and many == b"u" else n
        it = iter(items)
        for _ in range(0, stop, _BATCH):
            self.buf += b"("
            save_batch(islice(it, _BATCH))
            self.buf += many

    def save_global(self, obj: Any, name: str) -> None:
        self.save_str(pickle.whichmodule(obj, name))
        self.save_str(name)
        self.buf += b"\x93"
        self.memoize(obj)

    def save_reduced(self, obj: Any) -> None:
        reduce = copyreg.dispatch_table.get(type(obj))
        rv = reduce(obj) if reduce is not None else obj.__reduce_ex__(4)
        if isinstance(rv, str):
            self.save_global(obj, rv)
            return
        func, args, state = (*rv, None)[:3]
        if len(rv) > 3 and any(x is not None for x in rv[3:]):
            raise TypeError(f"{type(obj).__name__} reduces with list or dict items, which reshard does not write")
        if func is copyreg.__newobj__:
            self.save(args[0])
            self.save_tuple(args[1:])
            self.buf += b"\x81"
        else:
            self.save(func)
            self.save_tuple(args)
            self.buf += b"R"
        self.memoize(obj)
        if state is not None:
            self.save(state)
            self.buf += b"b"

    # -- frames ---------------------------------------------------------------------------------
    def end_unit(self) -> None:
        """Close the frames the opcodes since ``unit_start`` complete; cheap unless one is due.

        A save can only begin inside ``buf[unit_start:]``, so the open frame reaches 64 KiB at one (or
        holds a str of 64 KiB, which stands outside frames) only if the buffer runs past that.
        """
        end = len(self.buf)
        if end - self.frame_start > _FRAME_TARGET:
            self._cut(self.unit_start, end)
        self.unit_start = end

    def _cut(self, start: int, end: int) -> None:
        buf, fs = self.buf, self.frame_start
        for at, kind in _save_starts(buf, start, end):
            if at - fs >= _FRAME_TARGET:
                self.spans.append((fs, at, True))
                fs = at
            if kind:  # a str of 64 KiB or more: the open frame closes and the str stands outside frames
                self.spans.append((fs, at, True))
                fs = at + kind
                self.spans.append((at, fs, False))
        self.frame_start = fs

    def finish(self) -> list[bytes]:
        """PROTO 4 and the body, framed."""
        self.buf += b"."
        self.end_unit()
        self.spans.append((self.frame_start, len(self.buf), True))
        view = memoryview(self.buf)
        out = [b"\x80\x04"]
        for start, end, framed in self.spans:
            if framed and end - start >= 4:
                out.append(b"\x95" + _pack_q(end - start))
            if end > start:
                out.append(bytes(view[start:end]))
        return out


# Opcodes that begin an object's save (argument widths; -1, -4, -8: a counted run follows, its count that wide).
_PUSH = MappingProxyType({ord(k): w for k, w in {
    "h": 1, "j": 4, "N": 0, "\x88": 0, "\x89": 0, "K": 1, "M": 2, "J": 4, "G": 8, ")": 0, "}": 0, "]": 0, "\x8a": -1,
    "\x8b": -4, "\x8c": -1, "X": -4, "\x8d": -8}.items()})
_OTHER = frozenset(b"\x94\x93\x81Rb\x85\x86\x87use" + b"as")
_MARK, _TUPLE, _POP_MARK = ord("("), ord("t"), frozenset(b"ue")


def _save_starts(buf: bytearray, start: int, end: int) -> list[tuple[int, int]]:
    """Where a save begins in ``buf[start:end]``, in order, with the bytes of a str that must stand unframed.

    Every opcode that pushes an object begins a save; so does a MARK that a TUPLE closes. A MARK
    closed by SETITEMS / APPENDS (or not closed in the range) is a container's batch, not a save.
    """
    found: list[tuple[int, int]] = []
    marks: list[int] = []
    i = start
    while i < end:
        op = buf[i]
        width = _PUSH.get(op)
        if width is not None:
            if width >= 0:
                found.append((i, 0))
                i += 1 + width
            else:
                n = int.from_bytes(buf[i + 1:i + 1 - width], "little")
                size = 1 - width + n
                found.append((i, size if op in (0x58, 0x8D) and n >= _FRAME_TARGET else 0))
                i += size
        elif op == _MARK:
            marks.append(len(found))
            found.append((i, -1))
            i += 1
        elif op == _TUPLE or op in _POP_MARK:
            if marks:
                k = marks.pop()
                found[k] = (found[k][0], 0 if op == _TUPLE else -1)
            i += 1
        elif op in _OTHER:
            i += 1
        else:
            raise AssertionError(f"opcode {op:#04x} at {i} is not one encode_metadata writes")
    return [f for f in found if f[1] >= 0]
