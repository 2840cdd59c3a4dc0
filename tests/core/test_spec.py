"""The spec language: what parses, what resolves, and the exact errors for what does not."""

from __future__ import annotations

import pytest

from reshard.models.catalog import available_specs, load_spec
from reshard.errors import ReshardError, SpecError, TopologyError
from reshard.core.resolve import resolve
from reshard.core.spec import Concat, Flat, Logical, Pad, Product, Section, Split, Stored, parse_spec
from reshard.core.topology import parse_topology

VALID = [
    # (spec text, kinds of statements)
    ("logical w = f h", ["Logical"]),
    ("let qpg = heads / g\nindex i < layers", ["Let", "IndexDecl"]),
    ("section model per tp pp states param master", ["Section"]),
    ("w = (g/tp [q: qpg hd | k: hd | v: hd]) h  # comment", ["Stored"]),
    ("emb -> embed @first = (vocab~(128*tp):last)/tp h", ["Stored"]),
    ("out @lastonly -> embed = v h", ["Stored"]),
    ("3.weight @stage(pp - 2) -> w = h", ["Stored"]),
    ("w = (n)/dp:chunk h/tp:(3, 5)", ["Stored"]),
    ("step = scalar", ["Stored"]),
    ("blob args\nblob rng regenerate", ["Blob", "Blob"]),
    ("flat opt.{state}.{bucket} = model | reverse | align 64 | buckets cap | pad lcm(dp, 128) | split dp", ["Flat"]),
    ("flat opt = model | perparam | pad 2 * dp | split dp", ["Flat"]),
    ("include llama", ["Include"]),
    ("decoder.layers.{i/pp}.experts.{e/ep}.w = {j}/ep [pad: 3 | a: x] h", ["Stored"]),
    ("\n# only a comment\n   \n", []),
]


@pytest.mark.parametrize("text,kinds", VALID, ids=[t.split("\n")[0][:40] for t, _ in VALID])
def test_valid_specs_parse_to_the_expected_statements(text, kinds):
    spec = parse_spec(text)
    assert [type(s).__name__ for s in spec.statements] == kinds


def test_a_stored_rule_keeps_its_structure():
    spec = parse_spec("qkv = (g/tp [q: qpg hd | k: hd]) h~(8*tp):last")
    (rule,) = spec.statements
    assert isinstance(rule, Stored)
    prod, pad = rule.dims
    assert isinstance(prod, Product) and isinstance(prod.terms[0], Split) and prod.terms[0].axis == "tp"
    assert isinstance(prod.terms[1], Concat) and [p.ref for p in prod.terms[1].parts] == ["q", "k"]
    assert isinstance(pad, Pad) and pad.policy == "last"


def test_keywords_can_still_name_stored_tensors():
    spec = parse_spec("logical = n\nsection -> s = n")
    assert [type(s) for s in spec.statements] == [Stored, Stored]
    assert [s.pattern.text for s in spec.statements] == ["logical", "section"]


SYNTAX_ERRORS = [
    ("x = (g/tp", "bad.spec:1:10: expected ')' to close '(', found end of line\n    x = (g/tp\n             ^"),
    ("x = [q: a | ]", "bad.spec:1:13: expected a part name (a logical tensor alias) or 'pad', found ']'\n    x = [q: a | ]\n                ^"),
    ("logical a.{i = h", "bad.spec:1:11: unclosed '{' in name (expected '{name}' or '{name/axis}')\n    logical a.{i = h\n              ^"),
    ("x.{i/} = h", "bad.spec:1:3: bad capture '{i/}' (expected '{name}', '{name/axis}', '{name@axis}', an offset "
                   "'+expr' after any of them, or '{=expr}')\n    x.{i/} = h\n      ^^^^"),
    ("x -> y @mid = h", "bad.spec:1:9: unknown placement 'mid' (expected one of: first, last, lastonly, stage)\n    x -> y @mid = h\n            ^^^"),
    ("x @stage = h", "bad.spec:1:10: expected '(' after '@stage' (the stage number: '@stage(1)'), found '='\n    x @stage = h\n             ^"),
    ("x @stage(1 = h", "bad.spec:1:12: expected ')' to close '@stage(', found '='\n    x @stage(1 = h\n               ^"),
    ("x @stage(1) @first = h", "bad.spec:1:14: a second '@'\n    x @stage(1) @first = h\n                 ^^^^^"),
    ("x = h/tp:foo", "bad.spec:1:10: unknown split mode 'foo' (expected one of: chunk, even, (w1, w2, ...))\n    x = h/tp:foo\n             ^^^"),
    ("x = h~4:ones", "bad.spec:1:9: unknown pad policy 'ones' (expected one of: zero, last)\n    x = h~4:ones\n            ^^^^"),
    ("let a = b +", "bad.spec:1:12: expected a number, a name or '(', found end of line\n    let a = b +\n               ^"),
    ("let a = sqrt(b)", "bad.spec:1:9: unknown function 'sqrt' (expected one of: cdiv, roundup, lcm, min, max)\n    let a = sqrt(b)\n            ^^^^"),
    ("section s per tp states", "bad.spec:1:24: expected state names after 'states', found end of line\n    section s per tp states\n                           ^"),
    ("flat f = m | spin", "bad.spec:1:14: unknown flat operation 'spin' (expected one of: reverse, align, buckets, pad, split, perparam, coalesce, only, except, alone)\n    flat f = m | spin\n                 ^^^^"),
    ("x = h )", "bad.spec:1:7: expected an axis name, '(', '[' or '{', found ')'\n    x = h )\n          ^"),
    ("x h", "bad.spec:1:3: expected '=' after the stored tensor name, found 'h'\n    x h\n      ^"),
    ("x =", "bad.spec:1:4: expected dims (axis names, '(', '[', '{') or 'scalar', found end of line\n    x =\n       ^"),
    ("index i 4", "bad.spec:1:9: expected '<' between the index name and its range, found '4'\n    index i 4\n            ^"),
    ("x = a $ b", "bad.spec:1:7: expected an axis name, '(', '[' or '{', found '$'\n    x = a $ b\n          ^"),
]


@pytest.mark.parametrize("text,message", SYNTAX_ERRORS, ids=[t for t, _ in SYNTAX_ERRORS])
def test_syntax_errors_point_at_the_token(text, message):
    with pytest.raises(SpecError) as e:
        parse_spec(text, "bad.spec")
    assert str(e.value) == message


MEANING_ERRORS = [
    # (spec text, sizes, topology, exact message)
    ("logical w = f h\nsection model per tp\nw = f/tq h", {"f": 4, "h": 2}, "tp=2",
     "bad.spec:3:7: unknown mesh axis 'tq' (expected one of: tp, pp, dp, cp, ep, edp, etp)\n    w = f/tq h\n          ^^"),
    ("logical w = f h\nsection model per tp\nw = (gg/tp) h", {"f": 4, "h": 2}, "tp=2",
     "bad.spec:3:6: unknown axis 'gg' for w (its axes: f, h)\n    w = (gg/tp) h\n         ^^"),
    ("logical w = f h\nsection model per tp\nw = f/tp", {"f": 4, "h": 2}, "tp=2",
     "bad.spec:3:1: w axis 'h' is not stored by this rule\n    w = f/tp\n    ^"),
    ("logical w = f h\nsection model per tp\nw = f/tp h/tp", {"f": 4, "h": 2}, "tp=2",
     "bad.spec:3:7: w is sharded twice over 'tp'\n    w = f/tp h/tp\n          ^^"),
    ("logical w = f h\nsection model\nw = f/tp h", {"f": 4, "h": 2}, "tp=2",
     "bad.spec:3:7: split over 'tp' but section 'model' is stored per nothing (add 'tp' to its 'per' axes)\n    w = f/tp h\n          ^^"),
    ("logical w = f h\nsection model per tp\nv = f h", {"f": 6, "h": 2}, "tp=4",
     "bad.spec:3:1: no logical tensor named 'v' (map it with '-> name')\n    v = f h\n    ^"),
    ("logical w = f h\nw = f h", {"f": 6, "h": 2}, "",
     "bad.spec:2:1: a stored tensor, blob or flat buffer must come after a 'section' line\n    w = f h\n    ^"),
    ("logical w = f h f", {"f": 6, "h": 2}, "",
     "bad.spec:1:13: axis 'f' appears twice in logical tensor w\n    logical w = f h f\n                ^"),
    ("let q = a / b\nlogical w = q", {"a": 6, "b": 4}, "",
     "bad.spec:1:11: 6 / 4 is not a whole number (use // to round down or cdiv() to round up)\n    let q = a / b\n              ^"),
    ("let q = a / b", {"a": 8, "b": 4, "q": 3}, "",
     "bad.spec:1:5: 'q' is given as 3 but the spec computes 2\n    let q = a / b\n        ^"),
    ("logical w = n\nsection model per tp\nw = [w: n | w: n]", {"n": 6}, "",
     "bad.spec:3:13: part 'w' appears twice\n    w = [w: n | w: n]\n                ^"),
    ("logical w = n\nsection model per tp\nw = [u: n]", {"n": 6}, "",
     "bad.spec:3:6: unknown logical tensor 'u' (aliases: w)\n    w = [u: n]\n         ^"),
    ("logical layers.{i}.w = n", {"n": 6}, "",
     "bad.spec:1:16: unknown index 'i' (declared: none; add 'index i < N')\n    logical layers.{i}.w = n\n                   ^^^"),
    ("index i < L\nlogical layers.{i}.w = n\nsection model per tp\nblocks.{i/pp}.w -> layers.{i}.w = n", {"n": 6, "L": 4}, "pp=2",
     "bad.spec:4:8: '{i/pp}' needs 'pp' among the section's 'per' axes\n    blocks.{i/pp}.w -> layers.{i}.w = n\n           ^^^^^^"),
    ("logical w = n\nsection model per tp\nw = n~0", {"n": 6}, "",
     "bad.spec:3:6: pad multiple must be positive, got 0\n    w = n~0\n         ^"),
    ("logical w = f/tp h", {"f": 4, "h": 2}, "",
     "bad.spec:1:15: a logical tensor's dims are axis names and (products); splits, pads, concatenations and indices "
     "belong to stored tensors\n    logical w = f/tp h\n                  ^^"),
    ("index i < 3\nlogical layers.{i}.w = n\nsection model per pp\nw -> layers.{i}.w = n", {"n": 6}, "",
     "bad.spec:4:1: capture {i} of layers.{i}.w is not given by this rule's name or dims\n    w -> layers.{i}.w = n\n    ^"),
    ("logical w = n\nsection s per xp\nw = n", {"n": 6}, "",
     "bad.spec:2:15: unknown mesh axis 'xp' (expected one of: tp, pp, dp, cp, ep, edp)\n    section s per xp\n                  ^^"),
    ("logical w = n\nsection s per tp tp\nw = n", {"n": 6}, "",
     "bad.spec:2:18: mesh axis 'tp' is listed twice\n    section s per tp tp\n                     ^^"),
    ("logical w = n", {}, "",
     "bad.spec:1:13: unknown axis 'n' (sizes known: none)\n    logical w = n\n                ^"),
    ("logical w = n\nsection model\nw = n\nw = n", {"n": 2}, "",
     "bad.spec:4:1: two rules store model[] param:w (rules 'w' and 'w')\n    w = n\n    ^"),
    ("logical w = n\nsection m per dp\nw = n/dp:(1, 2)", {"n": 4}, "dp=2",
     "bad.spec:3:7: widths 1 + 2 must be 2 non-negative numbers summing to n(4)\n    w = n/dp:(1, 2)\n          ^^"),
    ("logical a = n\nlogical b = n\nsection m\nx = [a: n] [b: n]", {"n": 4}, "",
     "bad.spec:4:12: a stored tensor may have one concatenation\n    x = [a: n] [b: n]\n               ^"),
    ("logical w = n\nsection m\nw -> w = [w: n]", {"n": 4}, "",
     "bad.spec:3:1: '-> name' cannot be combined with a concatenation; the parts name their tensors\n    w -> w = [w: n]\n    ^"),
    ("logical w = n\nsection m per tp\nw = n\nsection o per tp states s\nflat f = nope | split tp", {"n": 4}, "",
     "bad.spec:5:6: unknown section 'nope' (declared: m, o)\n    flat f = nope | split tp\n         ^"),
    ("logical w = n\nlogical u = n\nsection m\nw = n\nu = n\nsection o per dp states s\nflat f = m | buckets 2 | split dp",
     {"n": 4}, "dp=2",
     "bad.spec:7:6: this flat buffer has several buckets: put '{bucket}' in its name or add '| coalesce'\n"
     "    flat f = m | buckets 2 | split dp\n         ^"),
]


@pytest.mark.parametrize("text,sizes,topology,message", MEANING_ERRORS, ids=[m.split(":", 3)[-1][:50] for *_, m in MEANING_ERRORS])
def test_meaning_errors_name_the_position_and_what_was_expected(text, sizes, topology, message):
    with pytest.raises(SpecError) as e:
        resolve(parse_spec(text, "bad.spec"), parse_topology(topology), sizes)
    assert str(e.value) == message


DIVISIBILITY_ERRORS = [
    ("logical w = f h\nsection model per tp\nw = f/tp h", {"f": 6, "h": 2}, "tp=4", "w: f(6) is not divisible by tp(4)"),
    ("let qpg = heads / g\nindex i < L\nlogical layers.{i}.k = (g hd) h\nsection m per tp pp\n"
     "layers.{i/pp}.k -> layers.{i}.k = (g/tp hd) h", {"heads": 8, "g": 8, "hd": 2, "h": 2, "L": 8}, "tp=3",
     "layers.0.k: g(8) is not divisible by tp(3)"),
    ("index e < E\nlogical x.{e} = n\nsection m per ep\nl.{e/ep} -> x.{e} = n", {"E": 8, "n": 1}, "ep=3,dp=3",
     "l.{e/ep}: e(8) is not divisible by ep(3)"),
    ("index i < L\nlogical l.{i} = n\nsection m per pp\nb.{i/pp} -> l.{i} = n", {"L": 10, "n": 1}, "pp=4",
     "b.{i/pp}: num_layers(10) is not divisible by pp(4) * vpp(1) = 4; give explicit stages, e.g. stages=3+3+2+2"),
]


@pytest.mark.parametrize("text,sizes,topology,message", DIVISIBILITY_ERRORS, ids=[m for *_, m in DIVISIBILITY_ERRORS])
def test_divisibility_errors_name_the_tensor_and_show_the_arithmetic(text, sizes, topology, message):
    with pytest.raises(TopologyError) as e:
        resolve(parse_spec(text, "bad.spec"), parse_topology(topology), sizes)
    assert str(e.value) == message


def test_errors_in_an_included_spec_point_into_that_file(tmp_path):
    (tmp_path / "model.spec").write_text("logical w = f h\nlogical u = f zz\n")
    (tmp_path / "top.spec").write_text("include model\nsection m\nw = f h\n")
    with pytest.raises(SpecError) as e:
        resolve(load_spec(tmp_path / "top.spec"), parse_topology(""), {"f": 2, "h": 2})
    assert str(e.value).endswith("model.spec:2:15: unknown axis 'zz' (sizes known: f, h)\n    logical u = f zz\n                  ^^")


def test_include_cycles_and_missing_specs_are_errors(tmp_path):
    (tmp_path / "a.spec").write_text("include b\n")
    (tmp_path / "b.spec").write_text("include a\n")
    with pytest.raises(SpecError, match="include cycle: a.spec -> b.spec -> a.spec"):
        load_spec(tmp_path / "a.spec")
    with pytest.raises(SpecError, match=rf"^no model family 'nonexistent' \(families: {', '.join(available_specs())}; "):
        load_spec("nonexistent")
    with pytest.raises(SpecError, match=r"^no spec file nowhere/x.spec \(families: .*named by its path; "):
        load_spec("nowhere/x.spec")


def test_a_bare_name_is_always_the_shipped_spec_and_a_path_is_the_users(tmp_path, monkeypatch):
    """A ``llama.spec`` in the current directory (or a ``specs/`` folder there) never shadows the shipped one."""
    (tmp_path / "specs").mkdir()
    for where in (tmp_path, tmp_path / "specs"):
        (where / "llama.spec").write_text("logical x as x = n\n")
    monkeypatch.chdir(tmp_path)
    shipped = load_spec("llama")
    assert any(isinstance(s, Logical) and "embed_tokens" in s.pattern.text for s in shipped.statements)
    mine = load_spec("./llama.spec")
    assert [s.pattern.text for s in mine.statements if isinstance(s, Logical)] == ["x"]


SHIPPED_SIZES = {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "layers": 4, "vocab_div": 8, "positions": 32,
                 "experts": 4, "vpad": 128}


@pytest.mark.parametrize("name", available_specs())
def test_every_shipped_spec_parses_and_resolves(name):
    spec = load_spec(name)
    assert any(isinstance(s, Logical) for s in spec.statements)
    if any(isinstance(s, (Stored, Flat)) for s in spec.statements):
        assert any(isinstance(s, Section) for s in spec.statements)
        try:
            layout = resolve(spec, parse_topology("tp=2,pp=2,dp=2"), SHIPPED_SIZES | {"bucket_size": 0})
        except ReshardError as e:  # a spec for another model family needs other sizes
            pytest.fail(f"{name}: {e}")
        assert layout.fragments


PIPELINE_NAMES = """
index i < layers
logical embed = v h
logical layers.{i}.w = h
logical norm = h
section model per pp
0.weight -> embed @first = v h
{i@pp+1}.w -> layers.{i}.w = h
{=layers+1}.weight -> norm @last = h
"""


def test_global_numbering_offsets_and_computed_numbers_in_stored_names():
    """A DeepSpeed PipelineModule numbers layers across stages: embedding 0, decoder layer i at i + 1."""
    layout = resolve(parse_spec(PIPELINE_NAMES), parse_topology("pp=2"), {"v": 5, "h": 2, "layers": 4})
    keys = {p: sorted((it.key for it in layout.items if dict(it.unit)["pp"] == p), key=lambda k: int(k.split(".")[0]))
            for p in (0, 1)}
    assert keys == {0: ["0.weight", "1.w", "2.w"], 1: ["3.w", "4.w", "5.weight"]}
    by_key = {it.key: f.tensor for f in layout.fragments for it in [f.item]}
    assert by_key["3.w"] == "layers.2.w" and by_key["5.weight"] == "norm"
    local = resolve(parse_spec(PIPELINE_NAMES.replace("{i@pp+1}", "{i/pp}")), parse_topology("pp=2"),
                    {"v": 5, "h": 2, "layers": 4})
    assert sorted(it.key for it in local.items if it.key.endswith(".w")) == ["0.w", "0.w", "1.w", "1.w"]


STAGED = """
logical a = h
logical b = h
logical c = h
section model per pp
a @stage(0) = h
b @stage(pp - 2) = h
c @stage(2) = h
section optim per pp dp states master
flat optim.{state} = model | pad 2*dp | split dp
"""


def test_stage_placement_puts_a_tensor_on_a_middle_stage_and_only_there():
    """``@stage(expr)``: a DeepSpeed pipeline's layer sits on the stage that holds it, a middle one too."""
    layout = resolve(parse_spec(STAGED), parse_topology("pp=3,dp=2"), {"h": 3})
    on = {p: sorted(it.key for it in layout.items if it.section == "model" and dict(it.unit)["pp"] == p)
          for p in range(3)}
    assert on == {0: ["a"], 1: ["b"], 2: ["c"]}
    flat = {dict(it.unit)["pp"]: it for it in layout.items if it.section == "optim" and dict(it.unit)["dp"] == 1}
    assert {p: {f.tensor for f in layout.fragments if f.item == it} for p, it in flat.items()} == {
        0: {"a"}, 1: {"b"}, 2: {"c"}}  # each stage's flat buffer holds its own params: 3 padded to 4, 2 per rank
    with pytest.raises(TopologyError) as e:
        resolve(parse_spec(STAGED), parse_topology("pp=2"), {"h": 3})
    assert str(e.value) == "c: @stage(2) is not a stage of pp(2) (stages 0 to 1)"


@pytest.mark.parametrize("text,message", [
    ("index i < 2\nlogical w.{i@pp} = h", "a logical name captures global indices only"),
    ("index i < 2\nlogical w.{i+1} = h", "a logical name captures global indices only"),
    ("section s\nflat f.{=1} = s", "a flat buffer's name takes plain captures only"),
])
def test_offsets_and_global_numbering_belong_to_stored_names_only(text, message):
    with pytest.raises(ReshardError, match=message):
        resolve(parse_spec(text), parse_topology("dp=1"), {"h": 2})


def test_an_offset_is_an_expression_and_its_errors_point_into_the_name():
    pattern = parse_spec("x.{i@pp+layers*2}.y = h").statements[0].pattern
    assert pattern.captures[0].numbered == "global" and pattern.captures[0].offset is not None
    with pytest.raises(SpecError, match=r"bad\.spec:1:\d+: unexpected"):
        parse_spec("x.{=1)}.y = h", "bad.spec")


ONLY_EXCEPT = """
index e < n
logical a = h
logical x.{e} = h
section model per ep
a = h
x.{e/ep} -> x.{e} = h
section dense per ep states master
flat dense.{state} = model | except x.* | align 4 | coalesce
section experts per ep states master
flat experts.{state} = model | only x.* | reverse | align 4 | coalesce
"""


def test_only_and_except_build_flat_buffers_from_part_of_a_section():
    """Megatron's dense and expert buffers: one section's params split by name into two flat buffers."""
    spec = parse_spec(ONLY_EXCEPT)
    layout = resolve(spec, parse_topology("dp=2,ep=2"), {"h": 3, "n": 4}, states={"model": ("param",)})
    by_key = {(it.key, dict(it.unit)["ep"]): info.shape for it, info in layout.items.items() if it.section != "model"}
    assert by_key == {("dense.master", 0): (3,), ("dense.master", 1): (3,),
                      ("experts.master", 0): (7,), ("experts.master", 1): (7,)}  # x.1 at 0, x.0 at 4 (aligned)
    frags = sorted((f.tensor, f.offset) for f in layout.fragments if f.item.key == "experts.master"
                   and dict(f.item.unit)["ep"] == 1)
    assert frags == [("x.2", 4), ("x.3", 0)]


PLAIN_LINES = [
    "let d0_4 = 4", "let d12_345 = 345", "logical a.w = d0_4 d1_3", "logical b = scalar", "c = d0_5",
    "logical = d0_4", "logical logical = d0_4", "let = d0_4", "section = scalar", "-x = d0_4",
    "a.b-c:d/e = d0_1 d1_2 d2_3", "lettuce = d0_2", "let x = 4", "logical a = d0_4  d1_3", "a = d0_4 ", " a = d0_4",
    "a -> b = d0_4", "w@x = d0_4", "a = d0_4/tp", "logical {i}.w = d0_4", "a = d0_4 # note",
]


def test_a_derived_layouts_lines_parse_alike_with_and_without_the_lexer(monkeypatch):
    """Lines a derived layout writes skip the lexer (100,000 tensors); each gives the very statement the
    general parser gives, positions included, and any other line still goes through the general parser."""
    import reshard.core.spec as spec_module

    text = "\n".join(PLAIN_LINES)
    direct = [spec_module._plain_statement(line, k, "<s>") for k, line in enumerate(PLAIN_LINES, start=1)]
    assert sum(d is not None for d in direct) == 11
    fast = parse_spec(text, "<s>")
    monkeypatch.setattr(spec_module, "_plain_statement", lambda *a: None)
    assert fast.statements == parse_spec(text, "<s>").statements


PARTS = """
index i < layers
index d in i < k
index m in i from k
logical l.{i}.attn as attn = h
logical l.{d}.mlp as mlp = h
logical l.{m}.moe as moe = h
section model per pp
dec.{d/pp}.attn -> attn = h
dec.{d/pp}.mlp -> mlp = h
dec.{m/pp}.attn -> attn = h
dec.{m/pp}.moe -> moe = h
"""


@pytest.mark.parametrize("topo, want", [
    ("pp=2", {0: ["dec.0.attn <- l.0.attn", "dec.0.mlp <- l.0.mlp", "dec.1.attn <- l.1.attn", "dec.1.moe <- l.1.moe"],
              1: ["dec.0.attn <- l.2.attn", "dec.0.moe <- l.2.moe", "dec.1.attn <- l.3.attn", "dec.1.moe <- l.3.moe"]}),
    ("pp=2,stages=3+1", {0: ["dec.0.attn <- l.0.attn", "dec.0.mlp <- l.0.mlp", "dec.1.attn <- l.1.attn",
                             "dec.1.moe <- l.1.moe", "dec.2.attn <- l.2.attn", "dec.2.moe <- l.2.moe"],
                         1: ["dec.0.attn <- l.3.attn", "dec.0.moe <- l.3.moe"]}),
])
def test_a_part_of_an_index_keeps_the_whole_ranges_stages_and_local_numbers(topo, want):
    """Dense layers then MoE layers (``index m in i from k``): each part is placed over the stages as the whole
    layer list is, so a layer keeps its stage and local number whichever part it is in, and a rule capturing a
    part gives its parent's capture (``l.{i}.attn``) too; per stage the layers stay in order."""
    layout = resolve(parse_spec(PARTS), parse_topology(topo), {"layers": 4, "k": 1, "h": 3})
    got: dict[int, list[str]] = {}
    for f in layout.fragments:
        got.setdefault(dict(f.item.unit)["pp"], []).append(f"{f.item.key} <- {f.tensor}")
    assert got == want


@pytest.mark.parametrize("change, message", [
    ("index d in i < k", "index d in j < k"),
    ("index m in i from k", "index m in i from 5"),
    ("index d in i < k", "index d in i"),
])
def test_a_part_of_an_index_names_a_declared_parent_and_lies_inside_it(change, message):
    bad = PARTS.replace(change, message)
    with pytest.raises(SpecError):
        resolve(parse_spec(bad), parse_topology("pp=2"), {"layers": 4, "k": 1, "h": 3})


def test_a_lazy_spec_parses_when_its_statements_are_first_asked_for_and_pickles_as_its_text():
    """A derived layout's spec (``LazySpec``) keeps its text and parses it once, on first use."""
    import pickle

    from reshard.core.spec_ast import LazySpec

    text = "logical w = f h\nsection model\nw = f/tp h\n"
    calls = []

    def make():
        calls.append(1)
        return parse_spec(text, "<lazy>").statements

    lazy = LazySpec("<lazy>", tuple(text.splitlines()), make, _remade)
    assert lazy.lines == tuple(text.splitlines()) and lazy.source == "<lazy>" and not calls
    assert lazy.statements == parse_spec(text, "<lazy>").statements and lazy.statements is lazy.statements
    assert calls == [1]
    again = pickle.loads(pickle.dumps(LazySpec("<lazy>", tuple(text.splitlines()), make, _remade)))  # as its text
    assert calls == [1] and type(again) is LazySpec and again.lines == lazy.lines and again.source == "<lazy>"
    assert again.statements == parse_spec(text, "<lazy>").statements


def _remade(source, lines):
    from reshard.core.spec_ast import LazySpec

    return LazySpec(source, lines, lambda: parse_spec("\n".join(lines), source).statements, _remade)
