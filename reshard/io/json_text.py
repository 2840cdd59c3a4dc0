"""``json.dumps(obj, indent=n, sort_keys=...)``'s exact text, at the C encoder's speed for large maps.

Python's ``json`` uses its C encoder only without ``indent``; with it, every value goes through the pure-Python
encoder, about 7 microseconds a value. A manifest of 100,000 tensor digests or a safetensors index of 100,000
names took a second that way. Here the C encoder writes, with separators that carry the newline and indentation,
every map or list of plain values (a weight map, a file's tensor digests) and every map of such maps (the logical
checksums: tensor -> dtype and digest); anything else recurses.
"""

from __future__ import annotations

import json
from itertools import chain, repeat
from json.encoder import encode_basestring_ascii as _string  # type: ignore[attr-defined]
from operator import add
from typing import Any

__all__ = ["dumps"]

_PLAIN = frozenset({str, int, float, bool, type(None)})
"""The types of values ``json`` writes the same with ``indent`` as without (``float.__repr__``, ``true``, ...)."""


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
        if _plain(obj.values()):
            out.append(_flat(obj, inner, outer, sort_keys))
            return
        if _maps_of_plain(obj):
            out.append(_maps(obj, inner, "\n" + step * (level + 2), outer, sort_keys))
            return
        out.append("{")
        items = sorted(obj.items(), key=lambda kv: kv[0]) if sort_keys else obj.items()
        for n, (k, v) in enumerate(items):
            out.append(("," if n else "") + inner + _string(_key(k)) + ": ")
            _write(v, out, step, level + 1, sort_keys)
        out.append(outer + "}")
    elif isinstance(obj, (list, tuple)):
        if not obj:
            out.append("[]")
            return
        inner, outer = "\n" + step * (level + 1), "\n" + step * level
        if _plain(obj):
            out.append(_flat(obj, inner, outer, sort_keys))
            return
        out.append("[")
        for n, v in enumerate(obj):
            out.append(("," if n else "") + inner)
            _write(v, out, step, level + 1, sort_keys)
        out.append(outer + "]")
    elif type(obj) is str:
        out.append(_string(obj))
    else:
        out.append(json.dumps(obj))


def _plain(values: Any) -> bool:
    return set(map(type, values)) <= _PLAIN


def _maps_of_plain(obj: dict) -> bool:
    """``obj`` has string keys, and maps each to a non-empty dict of plain values."""
    values = obj.values()
    return (set(map(type, obj)) == {str} and set(map(type, values)) == {dict} and all(values)
            and _plain(chain.from_iterable(map(dict.values, values))))


def _flat(obj: dict | list | tuple, inner: str, outer: str, sort_keys: bool) -> str:
    """A non-empty map or list of plain values: the C encoder's text with the item separator ``json`` writes
    with ``indent`` (a comma, then the newline and indentation), and the first and last line breaks added."""
    text = json.dumps(obj, separators=("," + inner, ": "), sort_keys=sort_keys)
    return text[0] + inner + text[1:-1] + outer + text[-1]


def _maps(obj: dict, inner: str, inner2: str, outer: str, sort_keys: bool) -> str:
    """A map of ``_maps_of_plain``: the inner maps written by the C encoder in one list, with the item separator
    of their own level (``inner2``), and cut apart again. Encoded strings hold no raw newline and a plain value
    never ends in ``}``, so ``"}," + inner2 + "{"`` stands exactly where one inner map ends and the next begins."""
    keys, maps = (list(obj), list(obj.values())) if not sort_keys else zip(*sorted(obj.items()))
    text = json.dumps(list(maps), separators=("," + inner2, ": "), sort_keys=sort_keys)
    bodies = text[2:-2].split("}," + inner2 + "{")
    heads = map(add, map(_string, keys), repeat(": {" + inner2))
    return "{" + inner + (inner + "}," + inner).join(map(add, heads, bodies)) + inner + "}" + outer + "}"


def _key(key: Any) -> str:
    """A dict key as ``json`` writes it: strings as they are, numbers, booleans and None as their JSON text."""
    if isinstance(key, str):
        return key
    if key is True or key is False or key is None or isinstance(key, (int, float)):
        return json.dumps(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")
