"""specs/README.md says what the code does: its examples parse, resolve and convert.

Conventions the README's fenced blocks follow (this test reads them):

- ```spec blocks are spec text. Every one must parse. A block with a ``section`` line is
  complete and must carry an annotation comment line (the first line, by convention)::

      # sizes: h=4 f=8; blobs: args=13; topology: tp=2 -> tp=4

  ``sizes`` are the model sizes passed to ``resolve``, ``blobs`` the blob byte sizes
  (optional), ``topology`` one topology string, or two joined by ``->``. The block is
  resolved at each topology; with two, arange-valued logical tensors are moved from the
  first to the second and back bit-exactly (``conftest.assert_round_trip``). A block with
  an ``include`` is written to a temporary file and loaded with ``load_spec``, so the
  include is found among the shipped specs.
- ```spec-bad blocks are read as ``bad.spec`` and must fail; the ```text block right
  after one is the exact ``str()`` of the error. Their ``# sizes:`` line comes last so
  the line numbers in the message match the block.
- The ```ebnf block is the grammar, identical to the one in ``reshard/core/spec.py``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from conftest import assert_round_trip, logical_values

import reshard.core.spec
from reshard.execution.arrays import gather, scatter
from reshard.formats.specs import spec_names
from reshard.models.catalog import load_spec
from reshard.errors import ReshardError
from reshard.core.layout import Layout
from reshard.core.resolve import resolve
from reshard.core.spec import parse_spec
from reshard.core.topology import parse_topology

README = Path(__file__).resolve().parents[2] / "specs" / "README.md"
FACTS_TESTS = Path(__file__).with_name("test_layout_facts.py")
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer(text)]


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section, up to the next ``## ``."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def _annotation(body: str) -> dict[str, object] | None:
    """Parse the ``# sizes: ...; blobs: ...; topology: A -> B`` line of a block, if any."""
    line = next((ln for ln in body.splitlines() if ln.startswith("# sizes:")), None)
    if line is None:
        return None
    out: dict[str, object] = {"sizes": {}, "blobs": {}, "topologies": [""]}
    for field in line[1:].split(";"):
        key, _, value = field.partition(":")
        key = key.strip()
        if key in ("sizes", "blobs"):
            out[key] = {k: int(v) for k, _, v in (kv.partition("=") for kv in value.split())}
        elif key == "topology":
            out["topologies"] = [t.strip() for t in value.split("->")]
        else:
            raise AssertionError(f"unknown annotation key '{key}' in: {line}")
    return out


TEXT = README.read_text(encoding="utf-8")
BLOCKS = _blocks(TEXT)
SPEC_BLOCKS = [body for lang, body in BLOCKS if lang == "spec"]
BAD_PAIRS = [
    (body, BLOCKS[k + 1][1] if k + 1 < len(BLOCKS) and BLOCKS[k + 1][0] == "text" else None)
    for k, (lang, body) in enumerate(BLOCKS)
    if lang == "spec-bad"
]


def _id(body: str) -> str:
    first = next((ln for ln in body.splitlines() if ln.strip() and not ln.startswith("#")), "")
    return first[:40]


def _load(body: str, tmp_path: Path):
    if re.search(r"^\s*include\s", body, re.M):
        path = tmp_path / "example.spec"
        path.write_text(body, encoding="utf-8")
        return load_spec(path)
    return parse_spec(body, "example.spec")


def _assert_every_tensor_is_stored(layout: Layout) -> None:
    # gather() only rebuilds tensors that have fragments; a logical tensor stored
    # nowhere would pass a round trip silently, so check it here.
    stored = {f.tensor for f in layout.fragments if not f.fill}
    missing = sorted(n for n, t in layout.tensors.items() if n not in stored and not (t.blob and t.view == (0,)))
    assert not missing, f"logical tensors stored nowhere: {missing}"


def test_readme_has_spec_examples_and_error_examples():
    assert len(SPEC_BLOCKS) >= 18 and BAD_PAIRS


def test_the_grammar_is_the_one_in_the_parser_docstring():
    doc = reshard.core.spec.__doc__
    start = doc.index("::\n\n") + 4
    grammar = textwrap.dedent(doc[start : doc.index("\n\n", start)]) + "\n"
    ebnf = [body for lang, body in BLOCKS if lang == "ebnf"]
    assert ebnf == [grammar]


@pytest.mark.parametrize("body", SPEC_BLOCKS, ids=[_id(b) for b in SPEC_BLOCKS])
def test_every_spec_example_parses_and_every_complete_one_resolves(body, tmp_path):
    spec = _load(body, tmp_path)
    if not re.search(r"^section\s", body, re.M):
        return
    note = _annotation(body)
    assert note is not None, "a complete example needs a '# sizes: ...; topology: ...' line"
    layouts = [
        resolve(spec, parse_topology(t), note["sizes"], blob_sizes=note["blobs"])
        for t in note["topologies"]
    ]
    for layout in layouts:
        _assert_every_tensor_is_stored(layout)
    a = layouts[0]
    values = logical_values(a, tuple(a.states))
    if len(layouts) == 2:
        assert_round_trip(a, layouts[1], values)
    else:
        gathered = gather(a, scatter(a, values))
        for key, arr in gathered.items():
            assert arr.tobytes() == values[key].tobytes(), key


@pytest.mark.parametrize("body,message", BAD_PAIRS, ids=[_id(b) for b, _ in BAD_PAIRS])
def test_every_error_example_prints_exactly_as_shown(body, message):
    assert message is not None, "a spec-bad block must be followed by a text block with the message"
    note = _annotation(body) or {"sizes": {}, "blobs": {}, "topologies": [""]}
    with pytest.raises(ReshardError) as e:
        spec = parse_spec(body, "bad.spec")
        resolve(spec, parse_topology(note["topologies"][0]), note["sizes"], blob_sizes=note["blobs"])
    assert str(e.value) == message.rstrip("\n")


def test_every_format_rule_and_family_has_a_line_in_the_readme():
    listed = set(re.findall(r"^- `([\w.-]+)`", _section(TEXT, "Formats and families"), re.M))
    prefixes = {name.rsplit("-", 1)[0] for name in spec_names()}
    from reshard.models import FAMILIES

    assert listed == prefixes | set(FAMILIES)


def test_every_layout_fact_has_an_example_naming_a_real_test():
    facts = _section(TEXT, "The layout facts")
    tests = set(re.findall(r"^def (test_\w+)", FACTS_TESTS.read_text(encoding="utf-8"), re.M))
    for k in range(1, 19):
        m = re.search(rf"^\*\*L{k}\*\* (.*?)(?=^\*\*L{k + 1}\*\* |\Z)", facts, re.S | re.M)
        assert m, f"no example for L{k}"
        named = set(re.findall(r"`(test_\w+)`", m.group(1)))
        assert named and named <= tests, f"L{k} names {sorted(named)}; tests are {sorted(tests)}"
        assert "```spec\n" in m.group(1), f"L{k} has no spec block"
