"""A pass over a pickle's opcodes, before unpickling, that refuses the integers the C unpickler trusts.

CPython's ``_pickle`` allocates from two kinds of integers in the data before checking them:

- a memo index (PUT, LONG_BINPUT): storing at index ``i`` grows the memo table to ``2 * i`` entries,
  zero-filled, so 8 bytes of pickle can make it write gigabytes;
- a byte count (BINBYTES, BINBYTES8, BYTEARRAY8, ...): the buffer is allocated at that size before
  the bytes are read, so 12 bytes of pickle can ask for exabytes. (FRAME's count is checked too.)

A pickler numbers its memo entries in order, so an index is never more than the number of entries
stored before it; a byte count never runs past the end of the pickle. ``check_pickle`` checks both,
with every other opcode's argument skipped by its width, in one pass of a few hundred nanoseconds per
opcode. Whatever else is wrong with the pickle is left to the unpickler (and the reader's allowlist).
"""

from __future__ import annotations

import pickle
import pickletools

__all__ = ["check_pickle"]

# Kinds of argument, by opcode: a width >= 0 is that many bytes; the negative kinds below need a look.
_PUT1, _MEMOIZE, _PUT4, _PROTO, _LINE, _TWO_LINES, _STOP, _INVALID, _FRAME = -1, -2, -3, -4, -5, -6, -7, -8, -13
# Counted arguments: (bytes of the count, signed).
_COUNTED = {-9: (1, False), -10: (4, True), -11: (4, False), -12: (8, False)}
_BY_ARG_N = {pickletools.TAKEN_FROM_ARGUMENT1: -9, pickletools.TAKEN_FROM_ARGUMENT4: -10,
             pickletools.TAKEN_FROM_ARGUMENT4U: -11, pickletools.TAKEN_FROM_ARGUMENT8U: -12}
_SPECIAL = {"BINPUT": _PUT1, "MEMOIZE": _MEMOIZE, "LONG_BINPUT": _PUT4, "PROTO": _PROTO, "STOP": _STOP,
            "FRAME": _FRAME}


def _kinds() -> tuple[list[int], list[str]]:
    kinds, names = [_INVALID] * 256, ["?"] * 256
    for op in pickletools.opcodes:
        code = ord(op.code)
        names[code] = op.name
        arg = op.arg
        if op.name in _SPECIAL:
            kinds[code] = _SPECIAL[op.name]
        elif arg is None:
            kinds[code] = 0
        elif arg.n >= 0:
            kinds[code] = arg.n
        elif arg.n == pickletools.UP_TO_NEWLINE:
            kinds[code] = _TWO_LINES if arg.name == "stringnl_noescape_pair" else _LINE
        else:
            kinds[code] = _BY_ARG_N[arg.n]
    return kinds, names


_KINDS, _NAMES = _kinds()
_PUT = ord("p")


def check_pickle(data: bytes) -> None:
    """Raises ``pickle.UnpicklingError`` naming the opcode, its byte and the limit it breaks, if any.

    Checks, up to the first STOP: every opcode is one pickle defines; every argument, line or counted
    run of bytes ends inside ``data``; every memo index is at most the number of memo entries stored
    before it; the protocol is at most ``pickle.HIGHEST_PROTOCOL``.
    """
    end, i, stored = len(data), 0, 0
    kinds = _KINDS
    while i < end:
        op = data[i]
        kind = kinds[op]
        i += 1
        if kind >= 0:
            i += kind
        elif kind == _PUT1:
            i += 1
            stored += 1
        elif kind == _MEMOIZE:
            stored += 1
        elif kind == _PUT4:
            if i + 4 <= end:
                _memo_index(i - 1, int.from_bytes(data[i:i + 4], "little"), stored)
            i += 4
            stored += 1
        elif kind in (_LINE, _TWO_LINES):
            j = data.find(b"\n", i)
            if kind == _TWO_LINES and j >= 0:
                j = data.find(b"\n", j + 1)
            if j < 0:
                break
            if op == _PUT:
                _memo_index(i - 1, _decimal(i - 1, data[i:j]), stored)
                stored += 1
            i = j + 1
        elif kind == _STOP:
            return
        elif kind == _PROTO:
            if i < end and data[i] > pickle.HIGHEST_PROTOCOL:
                raise pickle.UnpicklingError(f"PROTO at byte {i - 1} asks for protocol {data[i]}, "
                                             f"past the highest there is ({pickle.HIGHEST_PROTOCOL})")
            i += 1
        elif kind == _FRAME:  # the opcodes that follow, counted: they must be there
            if i + 8 <= end and int.from_bytes(data[i:i + 8], "little") > end - i - 8:
                raise pickle.UnpicklingError(f"FRAME at byte {i - 1} counts {int.from_bytes(data[i:i + 8], 'little')} "
                                             f"bytes, but only {end - i - 8} remain in the pickle")
            i += 8
        elif kind == _INVALID:
            raise pickle.UnpicklingError(f"byte {i - 1} is {op:#04x}, not a pickle opcode")
        else:
            size, signed = _COUNTED[kind]
            if i + size > end:
                break
            count = int.from_bytes(data[i:i + size], "little", signed=signed)
            i += size
            if not 0 <= count <= end - i:
                raise pickle.UnpicklingError(f"{_NAMES[op]} at byte {i - 1 - size} counts {count} bytes, but only "
                                             f"{end - i} remain in the pickle")
            i += count
    raise pickle.UnpicklingError(f"pickle data was truncated: it ends at byte {end} without a STOP opcode")


def _memo_index(at: int, index: int, stored: int) -> None:
    if index > stored:
        raise pickle.UnpicklingError(f"memo index {index} at byte {at} is past the {stored} memo entries stored "
                                     "before it (a pickler numbers them in order)")


def _decimal(at: int, line: bytes) -> int:
    text = line.strip()
    if not text.isdigit() or len(text) > 19:
        raise pickle.UnpicklingError(f"PUT at byte {at} has memo index {text[:40]!r}, not a decimal of up to 19 digits")
    return int(text)
