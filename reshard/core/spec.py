"""The layout spec language: syntax only.

A spec file says, for one framework and model family, how every stored tensor
maps onto logical tensors. This module turns its text into a tree (``Spec``)
and checks nothing but syntax; meaning (axes exist, degrees divide, every
logical axis is covered once) is checked by ``reshard.core.resolve.resolve``.
The tree's node classes live in ``reshard.core.spec_ast`` and are re-exported here.

Grammar (one statement per line; ``#`` starts a comment)::

    statement := 'let' NAME '=' expr                      size variable
               | 'index' NAME '<' expr                    range of a name capture
               | 'index' NAME 'in' NAME ['from' expr] ['<' expr]
                                                          part of another index's range
               | 'include' PATH                           logical declarations of a model
               | 'logical' PATTERN ['as' NAME] '=' dims   a full, unpadded, unfused tensor
               | 'section' NAME ['per' NAME*] ['states' NAME*]
               | 'blob' PATTERN ['regenerate']            non-tensor state, as bytes
               | 'flat' PATTERN '=' NAME ('|' flatop)*    a flat buffer built from a section
               | PATTERN ['->' REF] ['@' place] '=' dims ['as' '(' expr (',' expr)* ')']
                                                          a stored tensor (-> and @ in any order)
    place     := 'first' | 'last' | 'lastonly'              pipeline stage (lastonly: last, if not also first)
               | 'stage' '(' expr ')'                     the stage of that number (0 .. pp-1)
    dims      := 'scalar' | term+
    term      := atom (split | pad)*
    atom      := NAME | '{' NAME '}' | '(' term* ')' | '[' part ('|' part)* ']'
    part      := NAME ':' term+ | 'pad' ':' expr
    split     := '/' NAME [':' ('chunk' | '(' expr (',' expr)* ')')]
    pad       := '~' eatom [':' ('zero' | 'last')]
    flatop    := 'reverse' | 'align' expr | 'buckets' expr | 'pad' expr | 'split' NAME
               | 'perparam' | 'coalesce' | 'only' GLOB | 'except' GLOB | 'alone' GLOB
    expr      := sum; sum := prod (('+'|'-') prod)*; prod := eatom (('*'|'/'|'//') eatom)*
    eatom     := INT | NAME | NAME '(' expr (',' expr)* ')' | '(' expr ')'
    PATTERN   := a name such as ``decoder.layers.{i/pp}.mlp.linear_fc1.weight``;
                 ``{x}`` captures index x, ``{x/axis}`` its local index under a split,
                 ``{x@axis}`` the same placement numbered globally; ``+expr`` after any of
                 them adds to the number; ``{=expr}`` is a number computed from sizes
    GLOB      := a whitespace-free ``fnmatch`` pattern over stored names (``*.mlp.experts.*``)

The published, normative version of this grammar is ``specs/README.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from reshard.core.layout import PARAM
from reshard.core.spec_ast import (
    Axis,
    Blob,
    Call,
    Capture,
    Computed,
    Concat,
    Expr,
    Flat,
    FlatOp,
    Include,
    Index,
    IndexDecl,
    Let,
    Logical,
    Num,
    Op,
    Pad,
    Part,
    Pattern,
    Pos,
    Product,
    Section,
    Spec,
    Split,
    Statement,
    Stored,
    Term,
    Var,
)
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
    "Stored",
    "Term",
    "Var",
    "parse_spec",
]


# --- the parser ----------------------------------------------------------------------

KEYWORDS = ("let", "index", "include", "logical", "section", "blob", "flat")
FLAT_OPS = ("reverse", "align", "buckets", "pad", "split", "perparam", "coalesce", "only", "except", "alone")
PLACES = ("first", "last", "lastonly", "stage")
FUNCTIONS = ("cdiv", "roundup", "lcm", "min", "max")

_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<int>[0-9]+)|(?P<punct>->|//|[()\[\]{}|:/~=,*+\-@<])|(?P<bad>\S))")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPACE = re.compile(r"\s*")
_WORD = re.compile(r"\S*")


@dataclass(slots=True)
class _Tok:
    kind: str  # name | int | punct | word | end
    text: str
    col: int  # 1-based


class _Line:
    """Tokens of one line, read as the parser asks for them, with a cursor; errors point into the line.

    Lexing is lazy: a tensor name is read as one whitespace-free word (``word``), so
    the characters of a long name are never split into tokens first.
    """

    def __init__(self, spec_source: str, lineno: int, text: str) -> None:
        self.source = spec_source
        self.lineno = lineno
        self.text = text
        self.toks: list[_Tok] = []
        self.i = 0
        self._scan = 0
        self._done = False
        self.end = len(text)
        """Where lexing stops (an expression inside a name's braces ends before the line does)."""

    def fail(self, message: str, tok: _Tok | None = None) -> SpecError:
        tok = tok or self.peek()
        return SpecError(message, source=self.source, line=self.lineno, col=tok.col, length=len(tok.text) or 1, text=self.text)

    def pos(self, tok: _Tok) -> Pos:
        return Pos(self.lineno, tok.col, max(1, len(tok.text)), self.source)

    def peek(self, ahead: int = 0) -> _Tok:
        j = self.i + ahead
        if j < len(self.toks):
            return self.toks[j]
        while len(self.toks) <= j and not self._done:
            self.toks.append(self._lex())
        return self.toks[min(j, len(self.toks) - 1)]

    def next(self) -> _Tok:
        tok = self.peek()
        self.peek(1)
        self.i = min(self.i + 1, len(self.toks) - 1)
        return tok

    def at(self, text: str) -> bool:
        tok = self.peek()
        return tok.kind in ("punct", "name") and tok.text == text

    def expect(self, text: str, what: str | None = None) -> _Tok:
        tok = self.peek()
        if tok.text != text or tok.kind not in ("punct", "name"):
            raise self.fail(f"expected '{text}'{' ' + what if what else ''}, found {_describe(tok)}")
        return self.next()

    def name(self, what: str) -> _Tok:
        tok = self.peek()
        if tok.kind != "name":
            raise self.fail(f"expected {what}, found {_describe(tok)}")
        return self.next()

    def word(self, what: str) -> _Tok:
        """The next whitespace-delimited run of characters (a tensor name or path)."""
        tok = self.peek()
        if tok.kind == "end":
            raise self.fail(f"expected {what}, found end of line")
        start = tok.col - 1
        end = _WORD.match(self.text, start).end()
        self._tokenize(end)  # lex again after the word
        return _Tok("word", self.text[start:end], start + 1)

    def _tokenize(self, start: int) -> None:
        """Forget the tokens read so far and lex from column ``start`` (0-based) on."""
        self.toks, self.i, self._scan, self._done = [], 0, start, False

    def _lex(self) -> _Tok:
        text, end = self.text, self.end
        pos = _SPACE.match(text, self._scan, end).end()
        if pos >= end or text[pos] == "#":
            self._done = True
            return _Tok("end", "", len(text[:end].split("#", 1)[0].rstrip()) + 1)
        m = _TOKEN.match(text, pos, end)  # always matches: 'bad' takes any other character
        kind = m.lastgroup or "bad"
        self._scan = m.end()
        return _Tok(kind, m.group(kind), m.start(kind) + 1)


def _describe(tok: _Tok) -> str:
    return "end of line" if tok.kind == "end" else f"'{tok.text}'"


def parse_spec(text: str, source: str = "<spec>") -> Spec:
    """Parse spec text into a ``Spec``; syntax only.

    Args:
      text: the spec file's contents.
      source: a name for messages, usually the file path.

    Raises:
      SpecError: with ``source:line:col``, the line, and a caret under the token.

    >>> spec = parse_spec("logical w = f h\\nsection model\\nw = f/tp h")
    >>> [type(s).__name__ for s in spec.statements]
    ['Logical', 'Section', 'Stored']
    """
    lines = tuple(text.splitlines())
    statements: list[Statement] = []
    for lineno, raw in enumerate(lines, start=1):
        plain = _plain_statement(raw, lineno, source)
        if plain is not None:
            statements.append(plain)
            continue
        line = _Line(source, lineno, raw)
        line._tokenize(0)
        if line.peek().kind == "end":
            continue
        statements.append(_statement(line))
        if line.peek().kind != "end":
            raise line.fail(f"unexpected {_describe(line.peek())} after the end of the statement")
    return Spec(source=source, statements=tuple(statements), lines=lines)


_PLAIN_LET = re.compile(r"let (d[0-9]+_[0-9]+) = ([0-9]+)")
_PLAIN_RULE = re.compile(r"(logical )?([^\s{}#=@>]+) = (scalar|d[0-9]+_[0-9]+(?: d[0-9]+_[0-9]+)*)")


def _plain_statement(raw: str, lineno: int, source: str) -> Statement | None:
    """The statement of a line as a derived layout writes them (``let d0_4 = 4``, ``logical NAME = d0_4 d1_3``,
    ``NAME = scalar``), made without the lexer: exactly what ``_statement`` gives for it, at a fraction of the
    cost (a checkpoint may record 100,000 tensors). None for any other line."""
    if raw.startswith("let "):
        m = _PLAIN_LET.fullmatch(raw)
        if m is None:
            return None
        num = m.group(2)
        return Let(m.group(1), Num(int(num), Pos(lineno, m.start(2) + 1, len(num), source)),
                   Pos(lineno, 5, len(m.group(1)), source))
    m = _PLAIN_RULE.fullmatch(raw)
    if m is None:
        return None
    name = m.group(2)
    at = m.start(2) + 1
    pattern = Pattern((name,), name, Pos(lineno, at, len(name), source))
    dims: tuple[Term, ...] | None = None
    if m.group(3) != "scalar":
        col = m.start(3) + 1
        axes = []
        for axis in m.group(3).split(" "):
            axes.append(Axis(axis, Pos(lineno, col, len(axis), source)))
            col += len(axis) + 1
        dims = tuple(axes)
    if m.group(1):
        return Logical(pattern, None, dims, pattern.pos)
    return Stored(pattern, None, None, dims, pattern.pos)


def _statement(ln: _Line) -> Statement:
    first = ln.peek()
    kw = first.text if first.kind == "name" and first.text in KEYWORDS and _keyword_follows(ln) else None
    if kw == "let":
        ln.next()
        name = ln.name("a variable name")
        ln.expect("=")
        return Let(name.text, _expr(ln), ln.pos(name))
    if kw == "index":
        ln.next()
        name = ln.name("an index name")
        if not ln.at("in"):
            ln.expect("<", "between the index name and its range")
            return IndexDecl(name.text, _expr(ln), ln.pos(name))
        ln.next()
        parent = ln.name("the index this one is a part of, after 'in'").text
        start = end = None
        if ln.at("from"):
            ln.next()
            start = _expr(ln)
        if ln.at("<"):
            ln.next()
            end = _expr(ln)
        if start is None and end is None:
            raise ln.fail(f"expected 'from N' or '< N' after 'in {parent}', found {_describe(ln.peek())}")
        return IndexDecl(name.text, end, ln.pos(name), parent, start)
    if kw == "include":
        ln.next()
        path = ln.word("a spec path")
        return Include(path.text, ln.pos(path))
    if kw == "logical":
        ln.next()
        pattern = _pattern(ln, ln.word("a logical tensor name"))
        alias = None
        if ln.at("as"):
            ln.next()
            alias = ln.name("an alias after 'as'").text
        ln.expect("=")
        return Logical(pattern, alias, _dims(ln), pattern.pos)
    if kw == "section":
        ln.next()
        name = ln.name("a section name")
        axes: list[str] = []
        axes_pos: list[Pos] = []
        states: list[str] = []
        if ln.at("per"):
            ln.next()
            while ln.peek().kind == "name" and ln.peek().text != "states":
                axes_pos.append(ln.pos(ln.peek()))
                axes.append(ln.next().text)
        if ln.at("states"):
            ln.next()
            while ln.peek().kind == "name":
                states.append(ln.next().text)
            if not states:
                raise ln.fail(f"expected state names after 'states', found {_describe(ln.peek())}")
        return Section(name.text, tuple(axes), tuple(states) or (PARAM,), ln.pos(name), tuple(axes_pos))
    if kw == "blob":
        ln.next()
        pattern = _pattern(ln, ln.word("a blob name"))
        regen = False
        if ln.at("regenerate"):
            ln.next()
            regen = True
        return Blob(pattern, regen, pattern.pos)
    if kw == "flat":
        ln.next()
        pattern = _pattern(ln, ln.word("a flat buffer name"))
        ln.expect("=")
        source = ln.name("the name of the section to flatten")
        ops: list[FlatOp] = []
        while ln.at("|"):
            ln.next()
            ops.append(_flatop(ln))
        return Flat(pattern, source.text, tuple(ops), pattern.pos)
    # A stored tensor rule.
    pattern = _pattern(ln, ln.word("a stored tensor name or a keyword (" + ", ".join(KEYWORDS) + ")"))
    ref = None
    place = None
    stage = None
    while ln.at("->") or ln.at("@"):  # in either order
        if ln.next().text == "->":
            if ref is not None:
                raise ln.fail("a second '->'")
            ref = ln.word("a logical tensor name or alias after '->'").text
            continue
        tok = ln.name("'first', 'last', 'lastonly' or 'stage(expr)' after '@'")
        if tok.text not in PLACES or place is not None:
            raise ln.fail(f"unknown placement '{tok.text}' (expected one of: {', '.join(PLACES)})" if place is None else "a second '@'", tok)
        place = tok.text
        if place == "stage":
            ln.expect("(", "after '@stage' (the stage number: '@stage(1)')")
            stage = _expr(ln)
            ln.expect(")", "to close '@stage('")
    ln.expect("=", "after the stored tensor name")
    dims = _dims(ln)
    if not _at_shape(ln):
        return Stored(pattern, ref, place, dims, pattern.pos, stage)
    ln.next()
    ln.expect("(", "after 'as' (the stored shape: 'as (h, n)')")
    return Stored(pattern, ref, place, dims, pattern.pos, stage, _exprs(ln, "'as ('"))


def _at_shape(ln: _Line) -> bool:
    # 'as (' after a stored rule's dims starts its stored shape: 'as' is no axis name there.
    return ln.peek().kind == "name" and ln.peek().text == "as" and ln.peek(1).text == "("


def _keyword_follows(ln: _Line) -> bool:
    # 'logical = ...' would be a stored tensor called 'logical'; a keyword is followed by more.
    nxt = ln.peek(1)
    return not (nxt.kind == "punct" and nxt.text in ("=", "->", "@"))


def _pattern(ln: _Line, tok: _Tok) -> Pattern:
    parts: list[str | Capture] = []
    text = tok.text
    i = 0
    lit = ""
    while i < len(text):
        ch = text[i]
        if ch == "}":
            raise SpecError("unbalanced '}' in name", source=ln.source, line=ln.lineno, col=tok.col + i, text=ln.text)
        if ch != "{":
            lit += ch
            i += 1
            continue
        close = text.find("}", i)
        if close < 0:
            raise SpecError("unclosed '{' in name (expected '{name}' or '{name/axis}')", source=ln.source, line=ln.lineno, col=tok.col + i, text=ln.text)
        body = text[i + 1 : close]
        pos = Pos(ln.lineno, tok.col + i, close - i + 1, ln.source)
        if lit:
            parts.append(lit)
            lit = ""
        if body.startswith("="):
            parts.append(Computed(_sub_expr(ln, body[1:], tok.col + i + 2), pos))
            i = close + 1
            continue
        m = _CAPTURE.fullmatch(body)
        if m is None:
            raise SpecError(
                f"bad capture '{{{body}}}' (expected '{{name}}', '{{name/axis}}', '{{name@axis}}', an offset "
                "'+expr' after any of them, or '{=expr}')",
                source=ln.source, line=ln.lineno, col=tok.col + i, length=close - i + 1, text=ln.text,
            )
        offset = _sub_expr(ln, m.group("offset"), tok.col + i + 1 + m.start("offset")) if m.group("offset") else None
        parts.append(Capture(m.group("name"), m.group("axis"), pos, "global" if m.group("sep") == "@" else "local",
                             offset))
        i = close + 1
    if lit:
        parts.append(lit)
    return Pattern(tuple(parts), text, ln.pos(tok))


_CAPTURE = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<sep>[/@])(?P<axis>[A-Za-z_][A-Za-z0-9_]*))?"
                      r"(?:\+(?P<offset>.+))?")


def _sub_expr(ln: _Line, text: str, col: int) -> Expr:
    """An expression written inside a name's braces, parsed on its own; errors point into the line."""
    sub = _Line(ln.source, ln.lineno, ln.text)  # errors show the whole line
    sub.end = col - 1 + len(text)
    sub._tokenize(col - 1)
    e = _expr(sub)
    if sub.peek().kind != "end":
        raise sub.fail(f"unexpected '{sub.peek().text}' in '{text}'")
    return e


def _dims(ln: _Line) -> tuple[Term, ...] | None:
    if ln.at("scalar"):
        ln.next()
        return None
    terms = _terms(ln, stop=("end",))
    if not terms:
        raise ln.fail(f"expected dims (axis names, '(', '[', '{{') or 'scalar', found {_describe(ln.peek())}")
    return terms


def _terms(ln: _Line, stop: tuple[str, ...]) -> tuple[Term, ...]:
    out: list[Term] = []
    while True:
        tok = ln.peek()
        if tok.kind == "end" or (tok.kind == "punct" and tok.text in stop) or _at_shape(ln):
            return tuple(out)
        out.append(_term(ln))


def _term(ln: _Line) -> Term:
    tok = ln.peek()
    term: Term
    if tok.kind == "name":
        ln.next()
        term = Axis(tok.text, ln.pos(tok))
    elif tok.text == "{" and tok.kind == "punct":
        ln.next()
        name = ln.name("an index name inside '{ }'")
        ln.expect("}")
        term = Index(name.text, ln.pos(name))
    elif tok.text == "(" and tok.kind == "punct":
        ln.next()
        inner = _terms(ln, stop=(")",))
        ln.expect(")", "to close '('")
        term = Product(inner, ln.pos(tok))
    elif tok.text == "[" and tok.kind == "punct":
        ln.next()
        parts = [_part(ln)]
        while ln.at("|"):
            ln.next()
            parts.append(_part(ln))
        ln.expect("]", "to close '['")
        term = Concat(tuple(parts), ln.pos(tok))
    else:
        raise ln.fail(f"expected an axis name, '(', '[' or '{{', found {_describe(tok)}")
    while ln.peek().kind == "punct" and ln.peek().text in ("/", "~"):
        op = ln.next()
        if op.text == "/":
            axis = ln.name("a mesh axis after '/'")
            mode, widths = "even", ()
            if ln.at(":"):
                ln.next()
                if ln.at("("):
                    ln.next()
                    mode, widths = "widths", _exprs(ln, "the widths")
                else:
                    m = ln.name("'chunk' or '(widths)' after ':'")
                    if m.text not in ("chunk", "even"):
                        raise ln.fail(f"unknown split mode '{m.text}' (expected one of: chunk, even, (w1, w2, ...))", m)
                    mode = m.text
            term = Split(term, axis.text, mode, widths, ln.pos(axis))
        else:
            multiple = _eatom(ln)
            policy = "zero"
            if ln.at(":"):
                ln.next()
                p = ln.name("'zero' or 'last' after ':'")
                if p.text not in ("zero", "last"):
                    raise ln.fail(f"unknown pad policy '{p.text}' (expected one of: zero, last)", p)
                policy = p.text
            term = Pad(term, multiple, policy, ln.pos(op))
    return term


def _part(ln: _Line) -> Part:
    name = ln.name("a part name (a logical tensor alias) or 'pad'")
    ln.expect(":", "after the part name")
    if name.text == "pad":
        return Part(None, (), _expr(ln), ln.pos(name))
    terms = _terms(ln, stop=("|", "]"))
    if not terms:
        raise ln.fail(f"expected the axes of part '{name.text}', found {_describe(ln.peek())}")
    return Part(name.text, terms, None, ln.pos(name))


def _flatop(ln: _Line) -> FlatOp:
    tok = ln.name("a flat operation (" + ", ".join(FLAT_OPS) + ")")
    if tok.text not in FLAT_OPS:
        raise ln.fail(f"unknown flat operation '{tok.text}' (expected one of: {', '.join(FLAT_OPS)})", tok)
    if tok.text in ("reverse", "perparam", "coalesce"):
        return FlatOp(tok.text, None, ln.pos(tok))
    if tok.text == "split":
        return FlatOp("split", ln.name("a mesh axis after 'split'").text, ln.pos(tok))
    if tok.text in ("only", "except", "alone"):
        return FlatOp(tok.text, ln.word(f"a glob of stored names after '{tok.text}'").text, ln.pos(tok))
    return FlatOp(tok.text, _expr(ln), ln.pos(tok))


# Expressions: precedence climbing over + - and * / //.


def _exprs(ln: _Line, opened: str) -> tuple[Expr, ...]:
    """``expr (',' expr)* ')'``: after an opening '(' (``opened`` says which, for the message)."""
    out = [_expr(ln)]
    while ln.at(","):
        ln.next()
        out.append(_expr(ln))
    ln.expect(")", f"to close {opened}")
    return tuple(out)


def _expr(ln: _Line) -> Expr:
    left = _prod(ln)
    while ln.peek().kind == "punct" and ln.peek().text in ("+", "-"):
        op = ln.next()
        left = Op(op.text, left, _prod(ln), ln.pos(op))
    return left


def _prod(ln: _Line) -> Expr:
    left = _eatom(ln)
    while ln.peek().kind == "punct" and ln.peek().text in ("*", "/", "//"):
        op = ln.next()
        left = Op(op.text, left, _eatom(ln), ln.pos(op))
    return left


def _eatom(ln: _Line) -> Expr:
    tok = ln.peek()
    if tok.kind == "int":
        ln.next()
        return Num(int(tok.text), ln.pos(tok))
    if tok.kind == "name":
        ln.next()
        if ln.at("("):
            if tok.text not in FUNCTIONS:
                raise ln.fail(f"unknown function '{tok.text}' (expected one of: {', '.join(FUNCTIONS)})", tok)
            ln.next()
            return Call(tok.text, _exprs(ln, f"{tok.text}("), ln.pos(tok))
        return Var(tok.text, ln.pos(tok))
    if tok.kind == "punct" and tok.text == "(":
        ln.next()
        inner = _expr(ln)
        ln.expect(")", "to close '('")
        return inner
    raise ln.fail(f"expected a number, a name or '(', found {_describe(tok)}")
