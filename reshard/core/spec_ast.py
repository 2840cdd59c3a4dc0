"""The layout spec language's syntax tree: the frozen dataclasses a parsed spec is made of.

``reshard.core.spec.parse_spec`` builds these from spec text (its docstring has the
grammar) and re-exports every name here, so ``from reshard.core.spec import X`` works
for each of them. ``Pos`` says where a node came from; ``Expr`` nodes are sizes,
``Term`` nodes a stored or logical tensor's dims, ``Pattern`` a tensor name with
captures, and ``Statement`` one line of a spec; ``Spec`` holds them in file order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from reshard.errors import SpecError

__all__ = [
    "Axis",
    "Blob",
    "Call",
    "Capture",
    "Computed",
    "Concat",
    "Expr",
    "Flat",
    "FlatOp",
    "Include",
    "Index",
    "IndexDecl",
    "Let",
    "Logical",
    "Num",
    "Op",
    "Part",
    "Pattern",
    "Pos",
    "Product",
    "Pad",
    "Section",
    "Spec",
    "Split",
    "Statement",
    "Stored",
    "Term",
    "Var",
]


@dataclass(frozen=True, slots=True)
class Pos:
    """Where a token sits: 1-based line and column, length in characters."""

    line: int
    col: int
    length: int = 1
    source: str = ""  # the file, when a spec includes others


# --- expressions (sizes) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Num:
    value: int
    pos: Pos


@dataclass(frozen=True, slots=True)
class Var:
    name: str
    pos: Pos


@dataclass(frozen=True, slots=True)
class Op:
    op: str  # one of + - * / //
    left: Expr
    right: Expr
    pos: Pos


@dataclass(frozen=True, slots=True)
class Call:
    fn: str  # cdiv, roundup, lcm, min, max
    args: tuple[Expr, ...]
    pos: Pos


Expr = Num | Var | Op | Call

# --- dims (terms) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Axis:
    """A named extent of a logical tensor; its size is the variable of the same name."""

    name: str
    pos: Pos


@dataclass(frozen=True, slots=True)
class Index:
    """``{i}`` as a dim: the values of capture ``i`` stacked (layers on a leading dim)."""

    name: str
    pos: Pos


@dataclass(frozen=True, slots=True)
class Product:
    """``(a b c)``: row-major composition of terms into one dim."""

    terms: tuple[Term, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a concatenation: ``ref: terms`` (a logical tensor's axes) or ``pad: n``."""

    ref: str | None  # None for a pad part
    terms: tuple[Term, ...]
    size: Expr | None  # pad parts only
    pos: Pos


@dataclass(frozen=True, slots=True)
class Concat:
    """``[q: ... | k: ... | pad: n]``: parts stacked along one dim."""

    parts: tuple[Part, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Split:
    """``term/axis``: the term's extent divided over a mesh axis.

    ``mode`` is ``even`` (must divide), ``chunk`` (torch.chunk) or ``widths``.
    """

    term: Term
    axis: str
    mode: str
    widths: tuple[Expr, ...]
    pos: Pos


@dataclass(frozen=True, slots=True)
class Pad:
    """``term~m``: extent rounded up to a multiple of ``m``; ``policy`` fills the rest."""

    term: Term
    multiple: Expr
    policy: str  # zero | last
    pos: Pos


Term = Axis | Index | Product | Concat | Split | Pad

# --- statements ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Capture:
    name: str
    axis: str | None  # {i/pp}: local index under a split over pp
    pos: Pos
    numbered: str = "local"
    """How the name numbers it: ``local`` ({i/pp}, the index within the split) or ``global`` ({i@pp})."""
    offset: "Expr | None" = None
    """Added to the number in the name: ``{i@pp+1}`` (DeepSpeed pipelines number an embedding layer 0)."""


@dataclass(frozen=True, slots=True)
class Computed:
    """A number in a name computed from sizes: ``{=layers+1}``."""

    expr: "Expr"
    pos: Pos


@dataclass(frozen=True, slots=True)
class Pattern:
    """A tensor name with captures: literal pieces and ``Capture``s, in order."""

    parts: tuple["str | Capture | Computed", ...]
    text: str
    pos: Pos

    @property
    def plain(self) -> bool:
        """Only literal text and ``{name}`` / ``{name/axis}`` captures: no offsets, global numbering or computed parts."""
        return all(isinstance(p, str) or (isinstance(p, Capture) and p.numbered == "local" and p.offset is None)
                   for p in self.parts)

    @property
    def captures(self) -> tuple[Capture, ...]:
        return tuple(p for p in self.parts if isinstance(p, Capture))

    def format(self, values: dict[str, object]) -> str:
        return "".join(p if isinstance(p, str) else str(values[p.name]) for p in self.parts)


@dataclass(frozen=True, slots=True)
class Let:
    name: str
    expr: Expr
    pos: Pos


@dataclass(frozen=True, slots=True)
class IndexDecl:
    name: str
    size: Expr | None
    """The range's end (exclusive); None: the parent's end."""
    pos: Pos
    parent: str | None = None
    """``index m in i ...``: a part of index ``i``'s range, placed over pipeline stages as ``i``'s layers are."""
    start: Expr | None = None
    """``from expr``: where a part of a parent's range starts (None: 0)."""


@dataclass(frozen=True, slots=True)
class Include:
    path: str
    pos: Pos


@dataclass(frozen=True, slots=True)
class Logical:
    pattern: Pattern
    alias: str | None
    dims: tuple[Term, ...] | None  # None: a 0-d scalar
    pos: Pos


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    axes: tuple[str, ...]
    states: tuple[str, ...]
    pos: Pos
    axes_pos: tuple[Pos, ...] = ()


@dataclass(frozen=True, slots=True)
class Stored:
    pattern: Pattern
    ref: str | None  # alias or logical name; None: the logical tensor of the same name
    place: str | None  # first | last | lastonly | stage (pipeline stage)
    dims: tuple[Term, ...] | None
    pos: Pos
    stage: Expr | None = None  # the stage number of '@stage(expr)'
    shape: tuple[Expr, ...] | None = None  # 'as (...)': the stored shape, a row-major reshape of dims


@dataclass(frozen=True, slots=True)
class Blob:
    pattern: Pattern
    regenerate: bool
    pos: Pos


@dataclass(frozen=True, slots=True)
class FlatOp:
    op: str  # one of reshard.core.spec.FLAT_OPS
    arg: Expr | str | None
    pos: Pos


@dataclass(frozen=True, slots=True)
class Flat:
    pattern: Pattern
    source: str  # the section whose items are flattened
    ops: tuple[FlatOp, ...]
    pos: Pos


Statement = Let | IndexDecl | Include | Logical | Section | Stored | Blob | Flat


@dataclass(frozen=True, slots=True)
class Spec:
    """A parsed spec: statements in file order, plus the text for error messages."""

    source: str
    statements: tuple[Statement, ...]
    lines: tuple[str, ...] = field(repr=False, compare=False)
    included: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), repr=False, compare=False)
    """Source name and lines of each included file, for messages."""

    def error(self, message: str, pos: Pos | None) -> SpecError:
        if pos is None:
            return SpecError(message, source=self.source)
        source, lines = self.source, self.lines
        if pos.source and pos.source != self.source:
            source, lines = pos.source, dict(self.included).get(pos.source, ())
        text = lines[pos.line - 1] if 0 < pos.line <= len(lines) else ""
        return SpecError(message, source=source, line=pos.line, col=pos.col, length=pos.length, text=text)


class LazySpec(Spec):
    """A ``Spec`` whose statements are made when first asked for (``make()``, e.g. a ``parse_spec`` of its text).

    A layout derived from a checkpoint's header is built directly from the header, yet carries its spec text for
    messages and later conversions: 200,000 statements for 100,000 tensors, which most conversions never read.
    Pickled (a worker's share holds its target), it travels as its text and is made again by ``remake(source,
    lines)`` (a module-level function), parsed only where asked for: its statements pickled were 41 MB and 5 s
    for 100,000 tensors, per worker.
    """

    __slots__ = ("_make", "_remake")

    def __init__(self, source: str, lines: tuple[str, ...], make: Callable[[], tuple[Statement, ...]],
                 remake: Callable[[str, tuple[str, ...]], LazySpec]) -> None:
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "lines", lines)
        object.__setattr__(self, "included", ())
        object.__setattr__(self, "_make", make)
        object.__setattr__(self, "_remake", remake)

    @property
    def statements(self) -> tuple[Statement, ...]:  # type: ignore[override]
        slot = Spec.__dict__["statements"]
        try:
            return slot.__get__(self, Spec)
        except AttributeError:  # not made yet
            made = self._make()
            slot.__set__(self, made)
            return made

    def __reduce__(self) -> tuple:
        return self._remake, (self.source, self.lines)
