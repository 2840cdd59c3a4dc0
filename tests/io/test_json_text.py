"""``reshard.io.json_text.dumps`` writes exactly what ``json.dumps`` with ``indent`` writes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reshard.io.json_text import dumps

_leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_keys = st.text(max_size=6)
_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
                       max_leaves=30)


@given(_values, st.sampled_from([1, 2]), st.booleans())
def test_the_text_is_json_dumps_own(value, indent, sort_keys):
    assert dumps(value, indent=indent, sort_keys=sort_keys) == json.dumps(value, indent=indent, sort_keys=sort_keys)


@given(st.dictionaries(_keys, st.text(), max_size=50), st.booleans())
def test_a_flat_map_of_strings_is_json_dumps_own(value, sort_keys):
    wrapped = {"files": {"a": {"bytes": 3, "tensors": value}}, "list": [value, []], "empty": {}}
    assert dumps(wrapped, indent=1, sort_keys=sort_keys) == json.dumps(wrapped, indent=1, sort_keys=sort_keys)


# Text that looks like the separators and brackets the fast paths write and cut at.
_tricky = st.text(alphabet='{}[],: "\n\\aé', max_size=8)


@given(st.dictionaries(_tricky, st.dictionaries(_tricky, _leaves | _tricky, min_size=1, max_size=4), max_size=20),
       st.sampled_from([1, 2]), st.booleans())
def test_a_map_of_maps_of_plain_values_is_json_dumps_own(value, indent, sort_keys):
    wrapped = {"logical": {"param": value, "exp_avg": {"t": {}}}, "list": [value, [1, "a", None]]}
    assert dumps(wrapped, indent=indent, sort_keys=sort_keys) == json.dumps(wrapped, indent=indent, sort_keys=sort_keys)


def test_keys_that_are_not_strings_are_written_and_sorted_as_json_does():
    value = {10: "a", 2: "b", 1.5: ["c", ("d", None)], True: {"é": "\u2603"}}
    assert dumps({"m": {2: 1, 10: 2}}, indent=2, sort_keys=True) == json.dumps({"m": {2: 1, 10: 2}}, indent=2,
                                                                                sort_keys=True)
    assert dumps(value, indent=2) == json.dumps(value, indent=2)
    nested = {"m": {"b": {2: "x"}, "a": {None: 1.5}}, "n": {3: {"a": 1}}}
    assert dumps(nested, indent=1, sort_keys=True) == json.dumps(nested, indent=1, sort_keys=True)
    with pytest.raises(TypeError, match="keys must be str, int, float, bool or None, not tuple"):
        dumps({(1, 2): 3}, indent=1)
