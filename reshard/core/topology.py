"""Parallel topology: axis degrees, rank order and pipeline layer placement.

Rank order. ``order`` names mesh axes fastest first. Dense parameters see a
global rank through tp, cp, dp, pp; with the default ``tp-cp-ep-dp-pp``::

    rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))

ep is not a factor of world_size. Expert parameters see the same rank through
etp, ep, edp, pp with ``etp`` Megatron's ``--expert-tensor-parallel-size`` (tp
unless given) and ``edp = tp * dp * cp // (etp * ep)`` (Megatron's expert rank
generator: the order with cp dropped, tp read as etp and dp as edp), by default::

    rank = etp_r + etp * (ep_r + ep * (edp_r + edp * pp_r))

At etp = tp that is ``edp = dp * cp // ep``, and ep must divide dp * cp; at another
etp, etp * ep must divide tp * dp * cp (tp 2, dp 1, ep 2, etp 1 is a world of 2).
An order that omits ep gets it just before dp; one that omits cp is valid only
with cp=1. Both views must give every rank the same pp coordinate, and at etp = tp
the same tp coordinate (Megatron requires equal pp groups); ``Topology`` checks this.

Pipeline. Layers fill virtual stages ``v = 0, 1, ...`` in order; virtual stage
``v`` lives on stage ``v % pp``, chunk ``v // pp`` (Megatron's interleaved
schedule), and ``local`` counts from 0 inside each (stage, chunk).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from reshard.errors import TopologyError

__all__ = ["AXES", "LayerPlace", "Topology", "parse_topology"]

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
DEGREE_AXES = ("tp", "pp", "dp", "cp", "ep", "edp", "etp", "vpp")
COORD_AXES = ("tp", "cp", "dp", "pp", "ep", "edp", "etp")
KEYS = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "zero", "stages", "layout", "order")
_INT_KEYS = ("tp", "pp", "dp", "cp", "ep", "vpp", "zero")
_LAYOUT_SYMBOLS = "EtmL"
_MAX_LAYOUT = 1_000_000  # unrolled layout symbols; guards against 't*999999999'


@dataclass(frozen=True, slots=True)
class LayerPlace:
    """Where one global layer lives in the pipeline."""

    stage: int
    """pp coordinate of the stage holding the layer."""
    chunk: int
    """Virtual pipeline chunk on that stage; 0 without vpp."""
    local: int
    """Index inside its (stage, chunk), from 0, as Megatron numbers a model chunk's layers."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Degrees of the parallel axes, their rank order and the pipeline split."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert parallel; divides dp * cp (etp * ep divides tp * dp * cp at an etp other than tp) and is not a factor
    of world_size."""
    etp: int | None = None
    """Expert tensor parallel degree (Megatron's ``--expert-tensor-parallel-size``); None: tp's."""
    vpp: int = 1
    """Virtual pipeline chunks per stage."""
    zero: int = 0
    """ZeRO / distributed-optimizer stage 0..3; carried, not interpreted here."""
    stages: tuple[int, ...] | None = None
    """Layers per virtual stage, length pp * vpp; None splits layers evenly."""
    order: str = DEFAULT_ORDER
    """Rank order, fastest axis first, '-'-separated."""

    def __post_init__(self) -> None:
        for name in _INT_KEYS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TopologyError(f"{name} must be an integer, got {value!r}")
            if name != "zero" and value < 1:
                raise TopologyError(f"{name} must be >= 1, got {value}")
        if self.etp is not None and (not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp < 1):
            raise TopologyError(f"etp must be an integer >= 1, got {self.etp!r}")
        if self.etp is None or self.etp == self.tp:
            if (self.dp * self.cp) % self.ep:
                raise TopologyError(f"ep({self.ep}) does not divide dp({self.dp}) * cp({self.cp}) = "
                                    f"{self.dp * self.cp}")
        elif (self.tp * self.dp * self.cp) % (self.etp * self.ep):
            raise TopologyError(f"etp({self.etp}) * ep({self.ep}) = {self.etp * self.ep} does not divide tp({self.tp}) "
                                f"* dp({self.dp}) * cp({self.cp}) = {self.tp * self.dp * self.cp}")
        if not 0 <= self.zero <= 3:
            raise TopologyError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.stages is not None:
            self._check_stages()
        self._check_order()

    def _check_stages(self) -> None:
        stages = self.stages
        if isinstance(stages, list):  # accept a list, store a tuple so the topology stays hashable
            object.__setattr__(self, "stages", stages := tuple(stages))
        if not isinstance(stages, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) for n in stages):
            raise TopologyError(f"stages must be a tuple of integers, got {stages!r}")
        if len(stages) != self.pp * self.vpp:
            expected = f"pp({self.pp}) * vpp({self.vpp}) = {self.pp * self.vpp}"
            raise TopologyError(f"stages has {len(stages)} entries, expected {expected}")
        if min(stages) < 0:
            raise TopologyError(f"stages entries must be >= 0, got {_plus(stages)}")

    def _check_order(self) -> None:
        if not isinstance(self.order, str):
            raise TopologyError(f"order must be a string, got {self.order!r}")
        names = self.order.split("-")
        for name in names:
            if name not in AXES:
                known = ", ".join(AXES)
                raise TopologyError(f"order '{self.order}' names unknown axis '{name}' (expected axes from: {known})")
            if names.count(name) > 1:
                raise TopologyError(f"order '{self.order}' names '{name}' twice")
        for name in ("tp", "dp", "pp", "cp"):
            if name not in names and (name != "cp" or self.cp > 1):
                need = f", needed with cp({self.cp})" if name == "cp" else ""
                raise TopologyError(f"order '{self.order}' does not name {name}{need}")
        dense, expert = self._views()
        for axis in ("tp", "pp"):
            if axis not in expert:  # an etp of its own: the experts' tensor-parallel ranks are not tp's
                continue
            d, e = dense[axis][0], expert[axis][0]
            if getattr(self, axis) > 1 and d != e:
                raise TopologyError(
                    f"order '{self.order}' gives {axis} stride {d} in the dense view ({'-'.join(dense)}) "
                    f"but {e} in the expert view ({'-'.join(expert)}); both must agree"
                )

    def _views(self) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
        """Axis -> (stride, degree), fastest first: the dense view (tp cp dp pp), the expert view (tp ep edp pp, or
        etp ep edp pp at an etp other than tp)."""
        names = self.order.split("-")
        if "cp" not in names:
            names.append("cp")
        dense = _radix([(a, getattr(self, a)) for a in names if a != "ep"])
        if "ep" not in names:
            names.insert(names.index("dp"), "ep")
        renamed = {"dp": ("edp", self.edp)}
        if self.etp is not None and self.etp != self.tp:
            renamed["tp"] = ("etp", self.etp)
        return dense, _radix([renamed.get(a, (a, getattr(self, a))) for a in names if a != "cp"])

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data parallel degree: tp * dp * cp // (etp * ep), which is dp * cp // ep at etp = tp."""
        return self.tp * self.dp * self.cp // ((self.etp or self.tp) * self.ep)

    def degree(self, axis: str) -> int:
        """Degree of ``axis``, one of tp, pp, dp, cp, ep, edp, etp (tp unless the topology has an etp), vpp."""
        if axis not in DEGREE_AXES:
            raise TopologyError(f"unknown axis '{axis}' (expected one of: {', '.join(DEGREE_AXES)})")
        return self.tp if axis == "etp" and self.etp is None else getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of global ``rank``: tp, cp, dp, pp from the dense view, ep, edp and etp (the experts'
        tensor-parallel rank: tp's unless the topology has an etp of its own) from the expert view."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank!r} is out of range for world_size({self.world_size})")
        out = {a: rank // s % d for view in self._views() for a, (s, d) in view.items()}
        out.setdefault("etp", out["tp"])
        return {a: out[a] for a in COORD_AXES}

    def rank(self, **coords: int) -> int:
        """Global rank of dense coordinates tp, cp, dp, pp (missing ones are 0; ep, edp and etp are ignored)."""
        for name in coords:
            if name not in COORD_AXES:
                raise TopologyError(f"unknown coordinate '{name}' (expected one of: {', '.join(COORD_AXES)})")
        total = 0
        for axis, (stride, d) in self._views()[0].items():
            c = coords.get(axis, 0)
            if not isinstance(c, int) or not 0 <= c < d:
                raise TopologyError(f"{axis} coordinate {c!r} is out of range for {axis}({d})")
            total += c * stride
        return total

    def check_world_size(self, world_size: int) -> None:
        """Raise unless tp * cp * dp * pp == ``world_size``.

        The message lists tp, then cp, dp, pp when their degree is not 1:
        ``tp(4) * dp(3) * pp(2) = 24 != world_size(16)``.
        """
        if world_size != self.world_size:
            factors = [(a, getattr(self, a)) for a in ("tp", "cp", "dp", "pp") if a == "tp" or getattr(self, a) != 1]
            shown = " * ".join(f"{a}({d})" for a, d in factors)
            raise TopologyError(f"{shown} = {self.world_size} != world_size({world_size})")

    def check_divisible(self, tensor: str, what: str, extent: int, axis: str) -> None:
        """Raise unless ``extent`` (the size of ``tensor``'s dim ``what``) divides evenly over ``axis``."""
        d = self.degree(axis)
        if extent % d:
            raise TopologyError(f"{tensor}: {what}({extent}) is not divisible by {axis}({d})")

    def layer_placement(self, num_layers: int) -> tuple[LayerPlace, ...]:
        """The place of each global layer 0 .. num_layers - 1.

        >>> Topology(pp=2, vpp=2).layer_placement(4)[2]
        LayerPlace(stage=0, chunk=1, local=0)
        """
        return _placement(self.pp, self.vpp, self.stages, num_layers)

    def __str__(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        for key, default in (("cp", 1), ("ep", 1), ("etp", None), ("vpp", 1), ("zero", 0)):
            if getattr(self, key) != default:
                parts.append(f"{key}={getattr(self, key)}")
        if self.stages is not None:
            parts.append(f"stages={_plus(self.stages)}")
        if self.order != DEFAULT_ORDER:
            parts.append(f"order={self.order}")
        return ",".join(parts)


@functools.lru_cache(maxsize=256)
def _placement(pp: int, vpp: int, stages: tuple[int, ...] | None, num_layers: int) -> tuple[LayerPlace, ...]:
    k = pp * vpp
    if num_layers < 0:
        raise TopologyError(f"num_layers must be >= 0, got {num_layers}")
    if stages is None:
        if num_layers % k:
            hint = tuple(num_layers // k + (v < num_layers % k) for v in range(k))
            raise TopologyError(
                f"num_layers({num_layers}) is not divisible by pp({pp}) * vpp({vpp}) = {k}; "
                f"give explicit stages, e.g. stages={_plus(hint)}"
            )
        stages = (num_layers // k,) * k
    elif sum(stages) != num_layers:
        raise TopologyError(f"stages {_plus(stages)} = {sum(stages)} != num_layers({num_layers})")
    return tuple(LayerPlace(v % pp, v // pp, j) for v, n in enumerate(stages) for j in range(n))


def parse_topology(text: str) -> Topology:
    """Parse a topology string; ``str(topology)`` is its canonical form.

    Grammar (whitespace around keys and values is ignored)::

        topology := [ key "=" value { "," key "=" value } ]
        key      := tp | pp | dp | cp | ep | etp | vpp | zero | stages | layout | order
        stages   := INT { "+" INT }          layers per virtual stage, e.g. 3+4+4+3
        order    := axis { "-" axis }        fastest first, e.g. tp-pp-dp
        layout   := Megatron --pipeline-model-parallel-layout, e.g. E|(tt|)*3,tL

    ``layout`` sets ``stages`` to the number of ``t`` per virtual stage and,
    when ``vpp`` is not given, vpp to (virtual stages) / pp. Commas inside a
    layout are Megatron's cosmetic commas, not item separators.

    >>> str(parse_topology("pp=2, layout=Et|tt|t|tL"))
    'tp=1,pp=2,dp=1,vpp=2,stages=1+2+1+1'
    """
    if not text.strip():
        return Topology()
    values: dict[str, str] = {}
    for key, value in _items(text):
        if key not in KEYS:
            raise TopologyError(f"unknown topology key '{key}' in '{text}' (expected one of: {', '.join(KEYS)})")
        if key in values:
            raise TopologyError(f"duplicate topology key '{key}' in '{text}'")
        values[key] = value
    if "stages" in values and "layout" in values:
        raise TopologyError(f"give stages or layout, not both, in '{text}'")
    kwargs: dict = {k: _int(k, values[k], text) for k in (*_INT_KEYS, "etp") if k in values}
    if "order" in values:
        kwargs["order"] = "-".join(p.strip() for p in values["order"].split("-"))
    if "stages" in values:
        raw = values["stages"]
        if not re.fullmatch(r"\s*-?[0-9]+\s*(\+\s*-?[0-9]+\s*)*", raw):
            raise TopologyError(f"topology key 'stages' needs integers joined by '+', got '{raw}' in '{text}'")
        kwargs["stages"] = tuple(int(n) for n in raw.split("+"))
    try:
        topo = Topology(**kwargs)
        if "layout" in values:
            stages = _layout_stages(values["layout"])
            vpp = topo.vpp if "vpp" in values else len(stages) // topo.pp
            if len(stages) != topo.pp * vpp:
                want = f"pp({topo.pp}) * vpp({vpp}) = {topo.pp * vpp}"
                if "vpp" not in values:
                    want = f"a multiple of pp({topo.pp})"
                raise TopologyError(f"layout '{values['layout']}' has {len(stages)} virtual stages, expected {want}")
            topo = replace(topo, vpp=vpp, stages=stages)
    except TopologyError as e:
        raise TopologyError(f"invalid topology '{text}': {e}") from None
    return topo


def _items(text: str) -> list[tuple[str, str]]:
    items: list[tuple[str, str]] = []
    for piece in text.split(","):
        if "=" in piece:
            key, _, value = piece.partition("=")
            items.append((key.strip(), value.strip()))
        elif items and items[-1][0] == "layout":  # a Megatron layout may contain cosmetic commas
            items[-1] = ("layout", f"{items[-1][1]},{piece.strip()}")
        elif piece.strip():
            raise TopologyError(f"expected key=value, got '{piece.strip()}' in '{text}'")
        else:
            raise TopologyError(f"empty item in '{text}'")
    return items


def _int(key: str, raw: str, text: str) -> int:
    if not re.fullmatch(r"-?[0-9]+", raw):
        raise TopologyError(f"topology key '{key}' needs an integer, got '{raw}' in '{text}'")
    return int(raw)


def _layout_stages(layout: str) -> tuple[int, ...]:
    """Count of decoder layers 't' per virtual stage of a Megatron layout string."""
    stack: list[list[str]] = [[]]
    last: list[str] = []  # the atom a following '*n' repeats
    i = 0
    while i < len(layout):
        ch = layout[i]
        if ch in _LAYOUT_SYMBOLS or ch == "|":
            last = [ch]
            stack[-1].append(ch)
        elif ch == "(":
            stack.append([])
            last = []
        elif ch == ")":
            if len(stack) == 1:
                raise TopologyError(f"unmatched ')' at position {i} in layout '{layout}'")
            last = stack.pop()
            stack[-1] += last
        elif ch == "*":
            count = re.match(r"[0-9]+", layout[i + 1 :])
            if not last:
                raise TopologyError(f"'*' at position {i} in layout '{layout}' has nothing to repeat")
            if count is None:
                raise TopologyError(f"'*' at position {i} in layout '{layout}' needs a count, e.g. t*3")
            n = int(count.group())
            if len(stack[-1]) + len(last) * (n - 1) > _MAX_LAYOUT:
                raise TopologyError(f"layout '{layout}' unrolls to more than {_MAX_LAYOUT} symbols")
            del stack[-1][len(stack[-1]) - len(last) :]
            stack[-1] += last * n
            last = []
            i += len(count.group())
        elif ch not in ", \t":
            raise TopologyError(
                f"unknown layout symbol '{ch}' at position {i} in '{layout}' (expected one of: E, t, m, L, |, (, ), *n)"
            )
        i += 1
    if len(stack) > 1:
        raise TopologyError(f"unclosed '(' in layout '{layout}'")
    stages = "".join(stack[0]).split("|")
    if "m" in stack[0]:
        raise TopologyError(f"layout '{layout}': MTP layers ('m') are not supported")
    for sym, name, v, at in (("E", "embedding", 0, 0), ("L", "loss", len(stages) - 1, -1)):
        found = [w for w, s in enumerate(stages) for c in s if c == sym]
        if len(found) != 1:
            raise TopologyError(f"layout '{layout}' has {len(found)} '{sym}' ({name}), expected exactly one")
        if not stages[v] or stages[v][at] != sym:
            where = "open the first" if sym == "E" else "close the last"
            raise TopologyError(
                f"layout '{layout}': '{sym}' ({name}) must {where} virtual stage, "
                f"found in virtual stage {found[0]} '{stages[found[0]]}'"
            )
    return tuple(s.count("t") for s in stages)


def _radix(degrees: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """Axis -> (stride, degree) of a mixed-radix rank decomposition, fastest axis first."""
    out: dict[str, tuple[int, int]] = {}
    stride = 1
    for axis, d in degrees:
        out[axis] = (stride, d)
        stride *= d
    return out


def _plus(values: tuple[int, ...]) -> str:
    return "+".join(map(str, values))
