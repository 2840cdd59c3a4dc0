"""A derived layout's spec text, made with each shape's dims once, reads as one line per tensor made alone."""

from __future__ import annotations

import pytest

from reshard.errors import CheckpointFormatError
from reshard.formats.derived import Recorded, logical_lines, stored_line, whole_derived, whole_text

TENSORS = [Recorded("embed.weight", (16, 8)), Recorded("norm.weight", (8,)), Recorded("scale", ()),
           Recorded("layers.0.w", (16, 8)), Recorded("layers.0.b", (8, 16))]


def test_whole_text_is_the_let_logical_and_stored_lines_of_each_tensor():
    want = ["let d0_8 = 8", "let d1_8 = 8", "let d0_16 = 16", "let d1_16 = 16", "",
            "logical embed.weight = d0_16 d1_8", "logical norm.weight = d0_8", "logical scale = scalar",
            "logical layers.0.w = d0_16 d1_8", "logical layers.0.b = d0_8 d1_16"]
    assert logical_lines(TENSORS, "ckpt") == want
    assert whole_text(TENSORS, "ckpt") == "\n".join([*want, "section model", *map(stored_line, TENSORS)]) + "\n"


def test_whole_derived_layout_reads_every_tensor_whole_and_in_order():
    _, layout = whole_derived(TENSORS, "hf", "ckpt")
    assert list(layout.tensors) == [t.name for t in TENSORS]
    assert [(f.tensor, f.box.lengths, f.strides) for f in layout.fragments] == [
        ("embed.weight", (16, 8), (8, 1)), ("norm.weight", (8,), (1,)), ("scale", (), ()),
        ("layers.0.w", (16, 8), (8, 1)), ("layers.0.b", (8, 16), (16, 1))]
    info = layout.items[layout.fragments[4].item]
    assert (info.shape, info.mapped, info.fill, info.rule, info.tensor) == ((8, 16), 128, "zero", "layers.0.b", None)
    t = layout.tensors["layers.0.b"]
    assert (t.axes, t.view, t.blob, t.dim_axes) == (("d0_8", "d1_16"), (8, 16), False, (1, 1))


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("bad name", (2,), "ckpt: tensor name 'bad name' has whitespace"),
    ("a{b}", (2,), "ckpt: tensor name 'a{b}' has whitespace, a brace or '#'"),
    ("", (2,), "ckpt: tensor name '' has whitespace"),
    ("neg", (-1,), "ckpt: tensor 'neg' has a negative extent in shape [-1]"),
])
def test_a_name_or_shape_a_layout_cannot_spell_is_named_among_many(name, shape, message):
    tensors = [*TENSORS[:3], Recorded(name, shape), *TENSORS[3:]]
    with pytest.raises(CheckpointFormatError, match=message.replace("{", r"\{").replace("}", r"\}").replace("[", r"\[")
                       .replace("]", r"\]")):
        whole_text(tensors, "ckpt")


def test_whole_derived_of_names_and_shapes_is_whole_derived_and_resolve_alike():
    from reshard.core.resolve import resolve
    from reshard.core.topology import Topology
    from reshard.formats.derived import derived_spec, whole_derived_of
    spec, layout = whole_derived_of({t.name: t.shape for t in TENSORS}, "hf", "ckpt")
    spec2, layout2 = whole_derived(TENSORS, "hf", "ckpt")
    resolved = resolve(derived_spec(whole_text(TENSORS, "ckpt"), "hf", "ckpt"), Topology(), {})
    assert spec.lines == spec2.lines == derived_spec(whole_text(TENSORS, "ckpt"), "hf", "ckpt").lines
    assert layout == layout2 == resolved
    assert list(layout.items) == list(resolved.items) and dict(layout.order) == dict(resolved.order)


def test_a_tensor_recorded_twice_is_named():
    with pytest.raises(CheckpointFormatError, match="ckpt: tensor 'norm.weight' is recorded twice"):
        whole_derived([*TENSORS, Recorded("norm.weight", (8,)), Recorded("scale", ())], "hf", "ckpt")


def test_a_tensor_without_elements_is_laid_out_by_resolve():
    _, layout = whole_derived([*TENSORS, Recorded("empty", (0, 4))], "hf", "ckpt")
    assert "empty" in layout.tensors and len(layout.items) == len(TENSORS) + 1
