"""``check_pickle``'s verdict on a large ``.metadata``, found in C-speed runs instead of one opcode at a time.

``pickle_scan.check_pickle`` walks every opcode in Python (about 0.15 s per million, and a
200,000-chunk ``.metadata`` holds some 7 million). Almost all of them are fixed-width opcodes
with nothing to check: BINGET, BININT, MEMOIZE, EMPTY_DICT, TUPLE2, SETITEMS ... A regular
expression steps over runs of those; this module's loop only stops at the opcodes
``check_pickle`` checks, and checks them the same way. For anything else (the opcodes with a
memo index: PUT, BINPUT, LONG_BINPUT; opcodes taking a line; a byte that is no opcode; an
argument past the end) it hands the whole pickle to ``check_pickle``, which accepts it or raises
its own error. So ``check_memoize_pickle`` raises exactly when ``check_pickle`` does, with the
same message.
"""

from __future__ import annotations

import pickle
import re
from types import MappingProxyType

from reshard.io.pickle_scan import check_pickle

__all__ = ["check_memoize_pickle"]

# Opcodes without an argument (STOP aside), and opcodes with a fixed-width argument that nothing
# needs to check (memo reads, ints, floats, extension codes).
_NO_ARG = b"()}]0N2Rabdelostu\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94\x97\x98"
_WIDTHS = MappingProxyType({1: b"hK\x82", 2: b"M\x83", 4: b"Jj\x84", 8: b"G"})


_RUN_OPS = frozenset(_NO_ARG + b"".join(_WIDTHS.values()))
"""Every opcode ``_RUN`` steps over."""

_RUN_LENGTH = 4096
"""The most opcodes one match of ``_RUN`` steps over. Unbounded, a greedy repeat keeps a backtracking point per
opcode it steps over (1.7 GiB for 15 million), and the possessive ``*+`` that keeps none is new in Python 3.11; so
runs are stepped over in matches of at most this many: 15 million opcodes in 0.25 s, against 0.22 s with ``*+``."""


def _run_pattern() -> re.Pattern[bytes]:
    def one_of(ops: bytes) -> bytes:
        return b"[" + b"".join(re.escape(bytes((op,))) for op in ops) + b"]"

    parts = [one_of(_NO_ARG)] + [one_of(ops) + b"." * width for width, ops in _WIDTHS.items()]
    return re.compile(b"(?:" + b"|".join(parts) + b"){0,%d}" % _RUN_LENGTH, re.DOTALL)


_RUN = _run_pattern()
# Opcodes this loop checks itself: a counted run of bytes (the count's width in bytes, signed?).
_COUNTED = MappingProxyType({
    0x8C: (1, False), 0x43: (1, False), 0x55: (1, False), 0x8A: (1, False),  # SHORT_BIN*, LONG1
    0x58: (4, False), 0x42: (4, False), 0x54: (4, True), 0x8B: (4, True),  # BIN{UNICODE,BYTES,STRING}, LONG4
    0x8D: (8, False), 0x8E: (8, False), 0x96: (8, False)})  # BINUNICODE8, BINBYTES8, BYTEARRAY8
_PROTO, _FRAME, _STOP = 0x80, 0x95, 0x2E


def check_memoize_pickle(data: bytes) -> None:
    """Raises what ``check_pickle(data)`` raises, if anything; fast for a pickle that memoizes with MEMOIZE."""
    end, i = len(data), 0
    match, counted = _RUN.match, _COUNTED
    while True:
        i = match(data, i).end()
        if i >= end:
            break
        op = data[i]
        if op in counted:
            size, signed = counted[op]
            if i + 1 + size > end:
                break
            count = int.from_bytes(data[i + 1:i + 1 + size], "little", signed=signed)
            i += 1 + size
            if not 0 <= count <= end - i:
                break
            i += count
        elif op == _FRAME:
            if i + 9 > end or int.from_bytes(data[i + 1:i + 9], "little") > end - i - 9:
                break
            i += 9
        elif op == _PROTO:
            if i + 1 >= end or data[i + 1] > pickle.HIGHEST_PROTOCOL:
                break
            i += 2
        elif op == _STOP:
            return
        elif op not in _RUN_OPS or match(data, i).end() == i:  # not a run cut at _RUN_LENGTH: an argument past the end
            break
    check_pickle(data)  # something this loop does not decide: the careful walk decides, and names it
