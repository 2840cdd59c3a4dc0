"""Checks on the integers a reader takes from an untrusted file, one helper per rule.

Every reader of checkpoint files (``torch_read``, ``zipdir``, ``safetensors_io``,
``dcp_metadata``) checks each integer it reads before using it: as an offset
or length against the real size of the file, as a tensor dim or stride against
torch's int64, as a product (``numel * itemsize``) against the bytes there are.
A failed check raises ``FieldError`` with a message naming the field, its value
and the limit it broke; the reader adds the file's name and raises
``CheckpointFormatError``, so that message reads, for example::

    x.pt: zip local header offset of record 'x/data/3' is 18446744073709551615, past the end of the file (4096 bytes)
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["INT64_MAX", "FieldError", "brief", "check_count", "check_offset", "check_range", "check_shape", "show"]

INT64_MAX = (1 << 63) - 1
"""The largest dim, stride, offset or byte count torch (and ``os.pread``) can take."""


class FieldError(Exception):
    """A field of a file that breaks a rule of its format; the reader prefixes the file's name."""


def show(value: object) -> str:
    """``value`` for a message; an integer too long to print (Python refuses past 4300 digits) by its size."""
    if type(value) is int and value.bit_length() > 256:
        return f"a {value.bit_length()}-bit integer"
    return repr(value) if not isinstance(value, int) else str(value)


def brief(value: object, limit: int = 80, depth: int = 3) -> str:
    """A repr of ``value`` for a message, at most ``limit`` characters, built without a full ``repr``.

    A pickle can share one sub-tree many times over, so a full ``repr`` of what it built can run
    to terabytes: containers show their first 8 items to ``depth`` levels, other objects their type.
    """
    t = type(value)
    if value is None or t in (bool, int, float, complex):
        text = show(value)
    elif t in (str, bytes, bytearray):
        text = repr(value[:limit])
    elif isinstance(value, (tuple, list, set, frozenset, dict)) and depth > 0:
        items = value.items() if isinstance(value, dict) else value
        shown = []
        for k, item in enumerate(items):
            if k == 8:
                shown.append("...")
                break
            shown.append(f"{brief(item[0], limit, depth - 1)}: {brief(item[1], limit, depth - 1)}"
                         if isinstance(value, dict) else brief(item, limit, depth - 1))
        ends = "[]" if isinstance(value, list) else "()" if isinstance(value, tuple) else "{}"
        text = ends[0] + ", ".join(shown) + ("," if ends == "()" and len(shown) == 1 else "") + ends[1]
    else:
        text = f"<{t.__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_count(field: str, value: object, limit: int = INT64_MAX, *, what: str = "torch's int64 limit") -> int:
    """``value`` must be an int in ``[0, limit]``; ``what`` says what the limit is."""
    if type(value) is not int:
        raise FieldError(f"{field} is {show(value)[:60]}, not an integer")
    if value < 0:
        raise FieldError(f"{field} is {show(value)}, negative")
    if value > limit:
        raise FieldError(f"{field} is {show(value)}, past {what} ({limit})")
    return value


def check_offset(field: str, offset: int, limit: int, *, end: str = "the file") -> int:
    """A byte offset ``field`` must lie in ``[0, limit]``, ``limit`` being the size of ``end``."""
    if offset < 0:
        raise FieldError(f"{field} is {show(offset)}, negative")
    if offset > limit:
        raise FieldError(f"{field} is {show(offset)}, past the end of {end} ({limit} bytes)")
    return offset


def check_range(field: str, offset: int, length: int, limit: int, *, end: str = "the file") -> int:
    """Bytes ``[offset, offset + length)`` must lie in ``[0, limit)``; ``field`` names ``offset``. Returns the end."""
    check_offset(field, offset, limit, end=end)
    if length < 0:
        raise FieldError(f"{field} is {offset} with a length of {show(length)}, negative")
    if offset + length > limit:
        raise FieldError(f"{field} is {offset}, and its {show(length)} bytes run past the end of {end} ({limit} bytes)")
    return offset + length


def check_shape(field: str, shape: Iterable[int], itemsize: int) -> int:
    """A tensor shape of int dims whose row-major strides, in bytes, fit int64; returns its numel.

    Dims of size 0 count as 1 here, as they do in torch's contiguous strides, so an empty tensor
    cannot carry a dim that would overflow a stride computed from its shape.
    """
    span = itemsize
    numel = 1
    for k, n in enumerate(shape):
        check_count(f"{field} dim {k}", n)
        span *= max(n, 1)
        numel *= n
        if span > INT64_MAX:
            raise FieldError(f"{field} {_dims(shape)} spans more than {INT64_MAX} bytes at {itemsize} bytes an "
                             "element, past torch's int64 limit")
    return numel


def _dims(shape: Iterable[int]) -> str:
    text = "[" + ", ".join(show(n) for n in shape) + "]"
    return text if len(text) <= 80 else text[:76] + " ...]"
