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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from reshard.core.geometry import Box, row_major_strides
from reshard.core.layout import (
    PARAM,
    Fragment,
    Item,
    ItemInfo,
    Layout,
    LogicalTensor,
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
           "recorded_of", "stored_line", "whole_derived", "whole_text"]

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
    # One match over all names (a newline is whitespace, so no valid name holds one); tensor by tensor after.
    if _SAFE_LINES.fullmatch("\n".join(t.name for t in tensors)) and not any(
            n < 0 for t in tensors for n in t.shape):
        return
    for t in tensors:
        if not _SAFE.fullmatch(t.name):
            raise CheckpointFormatError(f"{where}: tensor name {t.name!r} has whitespace, a brace or '#', which a "
                                        "layout cannot name; reshard cannot convert this checkpoint")
        if any(n < 0 for n in t.shape):
            raise CheckpointFormatError(f"{where}: tensor '{t.name}' has a negative extent in shape {list(t.shape)}")


def logical_lines(tensors: Sequence[Recorded], where: Path | str) -> list[str]:
    """``let`` lines for every axis the tensors use, then one ``logical`` line per tensor."""
    check_names(tensors, where)
    sizes: dict[str, int] = {}
    dims = _dims_by_shape(tensors)
    for shape in dims:
        for axis, n in zip(Recorded("", shape).axes, shape, strict=True):
            sizes.setdefault(axis, n)
    lines = [f"let {axis} = {n}" for axis, n in sorted(sizes.items(), key=lambda kv: (kv[1], kv[0]))]
    lines.append("")
    lines += [f"logical {t.name} = {dims[t.shape]}" for t in tensors]
    return lines


def _dims_by_shape(tensors: Iterable[Recorded]) -> dict[tuple[int, ...], str]:
    """Each shape's ``Recorded.dims``, once per shape: a checkpoint of 100,000 tensors has a few dozen shapes."""
    out: dict[tuple[int, ...], str] = {}
    for t in tensors:
        if t.shape not in out:
            out[t.shape] = t.dims
    return out


def stored_line(t: Recorded, key: str | None = None) -> str:
    """A stored rule holding ``t`` whole, under its own name or under ``key``."""
    return f"{t.name} = {t.dims}" if key is None or key == t.name else f"{key} -> {t.name} = {t.dims}"


def whole_text(tensors: Sequence[Recorded], where: Path | str, section: str = "model") -> str:
    """A derived layout of ``tensors``, each stored whole under its own name in one ``section``."""
    dims = _dims_by_shape(tensors)
    stored = [f"{t.name} = {dims[t.shape]}" for t in tensors]  # stored_line(t), its dims made once per shape
    return "\n".join([*logical_lines(tensors, where), f"section {section}", *stored]) + "\n"


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
    spec = derived_spec(whole_text(tensors, where, section), format_name, where)
    if any(0 in t.shape for t in tensors):
        return spec, resolve(spec, Topology(), {})
    names: dict[str, LogicalTensor] = {}
    items: dict[Item, ItemInfo] = {}
    fragments: list[Fragment] = []
    # Objects made field by field, not through the frozen dataclasses' keyword __init__: 400,000 of them for
    # 100,000 tensors, where the generated __init__ costs more than the object.
    shaped: dict[tuple[int, ...], tuple[tuple[str, ...], Box, tuple[int, ...], int]] = {}
    for t in tensors:
        if t.name in names:
            raise CheckpointFormatError(f"{where}: tensor '{t.name}' is recorded twice")
        known = shaped.get(t.shape)
        if known is None:
            known = shaped[t.shape] = (t.axes, Box((0,) * len(t.shape), t.shape), row_major_strides(t.shape),
                                       math.prod(t.shape))
        axes, box, strides, numel = known
        names[t.name] = new_logical(t.name, t.shape, axes)
        item = new_item(section, (), 0, PARAM, t.name)
        items[item] = new_item_info(t.shape, numel, t.name)
        fragments.append(new_fragment(t.name, PARAM, box, item, 0, strides))
    return spec, Layout(topology=Topology(), tensors=MappingProxyType(names), items=MappingProxyType(items),
                        fragments=tuple(fragments), order=MappingProxyType({f"{section}//0": tuple(items)}))
