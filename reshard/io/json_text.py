"""``json.dumps(obj, indent=n, sort_keys=...)``'s exact text, at the C encoder's speed for large flat maps.

Python's ``json`` uses its C encoder only without ``indent``; with it, every value goes through the pure-Python
encoder, about 7 microseconds a value. A manifest of 100,000 tensor digests or a safetensors index of 100,000
names took a second that way. Here a dict whose keys and values are all strings (the digests, the weight map) is
written one line per entry with the C string encoder; anything else recurses, and leaves go through ``json.dumps``.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _string  # type: ignore[attr-defined]
from typing import Any

__all__ = ["dumps"]


def dumps(obj: Any, *, indent: int, sort_keys: bool = False) -> str:
    """The text ``json.dumps(obj, indent=indent, sort_keys=sort_keys)`` gives (``ensure_ascii``, default
    separators), for the JSON values ``json`` takes: dicts, lists, tuples, strings, numbers, booleans, None."""
    out: list[str] = []
    _write(obj, out, " " * indent, 0, sort_keys)
    return "".join(out)


def _write(obj: Any, out: list[str], step: str, level: int, sort_keys: bool) -> None:
    if isinstance(obj, dict):
        if not obj:
            out.append("{}")
            return
        inner, outer = "\n" + step * (level + 1), "\n" + step * level
        pairs = [(_key(k), v) for k, v in (sorted(obj.items(), key=lambda kv: kv[0]) if sort_keys else obj.items())]
        if all(type(v) is str for _, v in pairs):
            out.append("{" + inner + ("," + inner).join(f"{_string(k)}: {_string(v)}" for k, v in pairs) + outer + "}")
            return
        out.append("{")
        for n, (k, v) in enumerate(pairs):
            out.append(("," if n else "") + inner + _string(k) + ": ")
            _write(v, out, step, level + 1, sort_keys)
        out.append(outer + "}")
    elif isinstance(obj, (list, tuple)):
        if not obj:
            out.append("[]")
            return
        inner, outer = "\n" + step * (level + 1), "\n" + step * level
        out.append("[")
        for n, v in enumerate(obj):
            out.append(("," if n else "") + inner)
            _write(v, out, step, level + 1, sort_keys)
        out.append(outer + "]")
    elif type(obj) is str:
        out.append(_string(obj))
    else:
        out.append(json.dumps(obj))


def _key(key: Any) -> str:
    """A dict key as ``json`` writes it: strings as they are, numbers, booleans and None as their JSON text."""
    if isinstance(key, str):
        return key
    if key is True or key is False or key is None or isinstance(key, (int, float)):
        return json.dumps(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")
