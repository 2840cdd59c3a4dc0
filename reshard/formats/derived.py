"""Layouts derived from what a checkpoint records: every tensor's name and shape, in order.

Most checkpoints are of models reshard has no family for, and most formats need none: a
safetensors header, DeepSpeed's ``param_shapes``, DCP's and torch_dist's metadata and UCP's
folders record each tensor's name and global shape. Each recorded tensor is then its own
logical tensor, and the format's rules place it (whole, flattened into a ZeRO partition,
chunked over dp). The layout is written in the spec language, as a family's is, so
resolving, planning, executing, ``verify`` and ``plan --explain`` see no difference, and
``inspect --spec`` prints it as the start of a user's own spec.

Axes are named by position and extent (``d0_896 d1_4864``), each declared once with ``let``,
so the text stands alone and two tensors of one shape share their axes.
"""

from __future__ import annotations

import math
import re
from itertools import repeat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from reshard.core.geometry import Box, row_major_strides
from reshard.core.layout import (
    PARAM,
    Layout,
    held_tensors,
    new_fragment,
    new_item,
    new_item_info,
    new_logical,
)
from reshard.core.resolve import resolve
from reshard.core.topology import Topology
from reshard.core.spec import Spec, parse_spec
from reshard.core.spec_ast import LazySpec
from reshard.errors import CheckpointFormatError

__all__ = ["DERIVED", "Recorded", "derived_spec", "derived_spec_name", "is_derived", "logical_lines",
           "recorded_of", "stored_line", "whole_derived", "whole_derived_of", "whole_text"]

DERIVED = "derived"
"""The family part of a derived layout's name (``hf-derived``): no model family, the checkpoint's own tensors."""

_SAFE = re.compile(r"[^\s{}#]+")
_SAFE_LINES = re.compile(r"[^\s{}#]+(?:\n[^\s{}#]+)*")


@dataclass(frozen=True, slots=True)
class Recorded:
    """One tensor as a checkpoint records it: its name and its global (unsharded) shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def axes(self) -> tuple[str, ...]:
        """Its axis names in a derived spec: ``d<dim>_<extent>``."""
        return tuple(f"d{k}_{n}" for k, n in enumerate(self.shape))

    @property
    def dims(self) -> str:
        """Its dims in the spec language (``scalar`` for a 0-d tensor)."""
        return " ".join(self.axes) or "scalar"


def derived_spec_name(format_name: str) -> str:
    """The name a derived layout goes by: ``<format>-derived``. It names no family and cannot be generated
    by name: the ``Spec`` lives on the ``Source`` or ``Target`` it was derived for."""
    return f"{format_name}-{DERIVED}"


def is_derived(spec_name: str) -> bool:
    """Whether ``spec_name`` is a layout derived from a checkpoint (not a family's, not a user's file)."""
    return spec_name.endswith(f"-{DERIVED}")


def check_names(tensors: Iterable[Recorded], where: Path | str) -> None:
    """Fail closed on a tensor name the spec language cannot spell (whitespace, braces, ``#``)."""
    tensors = list(tensors)
    _check_names([t.name for t in tensors], [t.shape for t in tensors], where)


def _check_names(names: Sequence[str], shapes: Sequence[tuple[int, ...]], where: Path | str) -> None:
    """``check_names`` of the tensors ``names[k]`` of shape ``shapes[k]``."""
    # One match over all names (a newline is whitespace, so no valid name holds one), each shape's extents once;
    # tensor by tensor after.
    if _SAFE_LINES.fullmatch("\n".join(names)) and not any(n < 0 for shape in set(shapes) for n in shape):
        return
    for name, shape in zip(names, shapes, strict=True):
        if not _SAFE.fullmatch(name):
            raise CheckpointFormatError(f"{where}: tensor name {name!r} has whitespace, a brace or '#', which a "
                                        "layout cannot name; reshard cannot convert this checkpoint")
        if any(n < 0 for n in shape):
            raise CheckpointFormatError(f"{where}: tensor '{name}' has a negative extent in shape {list(shape)}")


def logical_lines(tensors: Sequence[Recorded], where: Path | str) -> list[str]:
    """``let`` lines for every axis the tensors use, then one ``logical`` line per tensor."""
    names, shapes = [t.name for t in tensors], [t.shape for t in tensors]
    _check_names(names, shapes, where)
    return _logical_lines(names, shapes, _dims_by_shape(shapes))


def _logical_lines(names: Sequence[str], shapes: Sequence[tuple[int, ...]],
                   dims: dict[tuple[int, ...], str]) -> list[str]:
    """``logical_lines`` of checked names, with each shape's ``Recorded.dims``."""
    sizes: dict[str, int] = {}
    for shape in dims:
        for axis, n in zip(Recorded("", shape).axes, shape, strict=True):
            sizes.setdefault(axis, n)
    lines = [f"let {axis} = {n}" for axis, n in sorted(sizes.items(), key=lambda kv: (kv[1], kv[0]))]
    lines.append("")
    lines += [f"logical {name} = {dims[shape]}" for name, shape in zip(names, shapes)]
    return lines


def _dims_by_shape(shapes: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], str]:
    """Each shape's ``Recorded.dims``, once per shape: a checkpoint of 100,000 tensors has a few dozen shapes."""
    return {shape: Recorded("", shape).dims for shape in dict.fromkeys(shapes)}


def stored_line(t: Recorded, key: str | None = None) -> str:
    """A stored rule holding ``t`` whole, under its own name or under ``key``."""
    return f"{t.name} = {t.dims}" if key is None or key == t.name else f"{key} -> {t.name} = {t.dims}"


def whole_text(tensors: Sequence[Recorded], where: Path | str, section: str = "model") -> str:
    """A derived layout of ``tensors``, each stored whole under its own name in one ``section``."""
    return "\n".join(_whole_lines([t.name for t in tensors], [t.shape for t in tensors], where, section)) + "\n"


def _whole_lines(names: Sequence[str], shapes: Sequence[tuple[int, ...]], where: Path | str,
                 section: str) -> list[str]:
    """The lines of ``whole_text`` of the tensors ``names[k]`` of shape ``shapes[k]``."""
    _check_names(names, shapes, where)
    dims = _dims_by_shape(shapes)
    lines = _logical_lines(names, shapes, dims)
    lines.append(f"section {section}")
    lines += [f"{name} = {dims[shape]}" for name, shape in zip(names, shapes)]  # stored_line, dims made per shape
    return lines


def derived_spec(text: str, format_name: str, where: Path | str) -> Spec:
    """The derived layout, parsed when its statements are first asked for (a conversion that builds the layout
    from the checkpoint directly never asks), its errors pointing at the checkpoint it was derived from."""
    return _lazy(f"<{derived_spec_name(format_name)}: {where}>", tuple(text.splitlines()))


def _lazy(source: str, lines: tuple[str, ...]) -> LazySpec:
    """The ``LazySpec`` of spec text ``lines``; how one is made again where it is unpickled."""
    return LazySpec(source, lines, lambda: parse_spec("\n".join(lines), source=source).statements, _lazy)


def recorded_of(layout: Layout) -> list[Recorded]:
    """The tensors of an opened checkpoint's layout, in its order, as a derived layout of another format
    records them (blobs left out: they are the format's own state; tensors without elements kept)."""
    held = held_tensors(layout)
    return [Recorded(n, t.shape) for n, t in layout.tensors.items() if not t.blob and n in held]


def whole_derived(tensors: Sequence[Recorded], format_name: str, where: Path | str,
                  section: str = "model") -> tuple[Spec, Layout]:
    """A derived layout of ``tensors``, each whole under its own name in one ``section``: its spec
    (``whole_text``, parsed) and that spec's layout at the trivial topology. The layout is built directly,
    exactly as ``resolve`` builds it, because a checkpoint may record 100,000 tensors; ``resolve`` itself
    lays out a tensor without elements."""
    return _whole([t.name for t in tensors], [t.shape for t in tensors], format_name, where, section)


def whole_derived_of(shapes: Mapping[str, tuple[int, ...]], format_name: str, where: Path | str,
                     section: str = "model") -> tuple[Spec, Layout]:
    """``whole_derived`` of the tensors of ``shapes`` (name -> shape, in order), as a header lists them: no
    ``Recorded`` made per tensor."""
    return _whole(list(shapes), list(shapes.values()), format_name, where, section)


def _whole(names: list[str], shapes: list[tuple[int, ...]], format_name: str, where: Path | str,
           section: str) -> tuple[Spec, Layout]:
    """``whole_derived`` of the tensors ``names[k]`` of shape ``shapes[k]``."""
    lines = _whole_lines(names, shapes, where, section)
    spec = _lazy(f"<{derived_spec_name(format_name)}: {where}>", tuple(lines))  # derived_spec of the lines' text
    distinct = dict.fromkeys(shapes)
    if any(0 in shape for shape in distinct):
        return spec, resolve(spec, Topology(), {})
    shaped = {shape: (Recorded("", shape).axes, Box((0,) * len(shape), shape), row_major_strides(shape),
                      math.prod(shape)) for shape in distinct}
    # Objects made by the field-by-field constructors, called from C (``map``), not through the frozen
    # dataclasses' keyword __init__: 400,000 of them for 100,000 tensors, where the generated __init__ costs
    # more than the object and a Python loop's own steps as much again.
    known = [shaped[shape] for shape in shapes]
    logical = dict(zip(names, map(new_logical, names, shapes, [k[0] for k in known]), strict=True))
    if len(logical) != len(names):
        seen: set[str] = set()
        for twice in names:
            if twice in seen:
                break
            seen.add(twice)
        raise CheckpointFormatError(f"{where}: tensor '{twice}' is recorded twice")
    items = list(map(new_item, repeat(section), repeat(()), repeat(0), repeat(PARAM), names))
    infos = map(new_item_info, shapes, [k[3] for k in known], names)
    fragments = tuple(map(new_fragment, names, repeat(PARAM), [k[1] for k in known], items, repeat(0),
                          [k[2] for k in known]))
    return spec, Layout(topology=Topology(), tensors=MappingProxyType(logical),
                        items=MappingProxyType(dict(zip(items, infos))), fragments=fragments,
                        order=MappingProxyType({f"{section}//0": tuple(items)}))
