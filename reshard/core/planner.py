"""The copy planner: a pure function from two layouts to a copy plan.

``plan(src, dst)`` intersects, per logical tensor and state, the fragments the
source layout stores with the fragments the destination layout needs, and
returns every copy as (source strided region -> destination strided region).
It opens no file. ``Plan.validate()`` proves the result: every copy in bounds,
every destination item covered exactly once apart from its padding.

Replicas. A logical box stored more than once in the source (tied embeddings,
tp-replicated norms, dp replicas) is read from one place: the copy of the same
item when the destination has it (so ``plan(A, A)`` is whole-item copies),
otherwise the first replica in item order, so each source span is read once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from reshard.core.collector import collector_paused
from reshard.core.cover import Meetings, offset_of
from reshard.core.geometry import Box, contains
from reshard.core.layout import Fragment, Item, ItemInfo, Layout, LogicalTensor
from reshard.errors import PlanError

__all__ = ["Copy", "Plan", "plan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Copy:
    """Copy one box of one logical tensor from a source item into a destination item.

    Offsets and strides are in elements of each item's row-major flat order;
    ``lengths`` is the box's extent per axis of the tensor's view.
    """

    src: Item
    src_offset: int
    src_strides: tuple[int, ...]
    dst: Item
    dst_offset: int
    dst_strides: tuple[int, ...]
    lengths: tuple[int, ...]
    tensor: str
    state: str
    box: Box
    """The logical box copied (in the tensor's axis view), for reports and errors."""

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


_new = object.__new__
_set = object.__setattr__



def _check_region(c: Copy, side: str, item: Item, offset: int, strides: tuple[int, ...], size: int | None,
                  problems: list[str]) -> None:
    """Add to ``problems`` where one side of a copy is outside its item (``size``: its elements; None: the item is
    not in the plan)."""
    if size is None:
        problems.append(f"{side} item {item} of {c.tensor} {c.box} is not in the plan")
        return
    first = last = offset  # its lowest and highest element: a negative stride reaches below its first
    for n, st in zip(c.lengths, strides):
        if st < 0:
            first += (n - 1) * st
        else:
            last += (n - 1) * st
    if first < 0 or last >= size:
        problems.append(f"{c.tensor} {c.box}: {side} region [{first}, {last}] is outside {item} of {size} elements")

def _reach(lengths: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """How far past its first element a region of ``lengths`` and ``strides`` reaches (its last element's offset
    from its first), or -1 where a stride is negative (``_check_region`` then checks it the long way)."""
    if any(st < 0 for st in strides):
        return -1
    return sum((n - 1) * st for n, st in zip(lengths, strides))


def _dense(lengths: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """The elements of a region of ``lengths`` and ``strides`` when they are one row-major run (what ``_runs`` finds
    as one run), else 0."""
    expected = 1
    for n, s in zip(reversed(lengths), reversed(strides)):
        if n > 1 and s != expected:
            return 0
        expected *= n
    return expected


def _new_copy(src: Item, src_offset: int, src_strides: tuple[int, ...], dst: Item, dst_offset: int,
              dst_strides: tuple[int, ...], lengths: tuple[int, ...], tensor: str, state: str, box: Box) -> Copy:
    """``Copy(src=..., ...)`` with its fields in order, made at nearly twice the speed: a plan makes them by the
    hundred thousand, and the keywords and a frozen dataclass's per-field lookup of ``object.__setattr__`` cost
    more than the object."""
    c = _new(Copy)
    _set(c, "src", src)
    _set(c, "src_offset", src_offset)
    _set(c, "src_strides", src_strides)
    _set(c, "dst", dst)
    _set(c, "dst_offset", dst_offset)
    _set(c, "dst_strides", dst_strides)
    _set(c, "lengths", lengths)
    _set(c, "tensor", tensor)
    _set(c, "state", state)
    _set(c, "box", box)
    return c


@dataclass(frozen=True, slots=True)
class Plan:
    """Every copy that turns the source items into the destination items."""

    src_items: Mapping[Item, ItemInfo]
    dst_items: Mapping[Item, ItemInfo]
    copies: tuple[Copy, ...]
    """Grouped by destination item (in the destination layout's order), then by destination offset."""
    tensors: Mapping[str, LogicalTensor]

    def by_dst(self) -> dict[Item, list[Copy]]:
        out: dict[Item, list[Copy]] = defaultdict(list)
        for c in self.copies:
            out[c.dst].append(c)
        return out

    def reads(self) -> dict[Item, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
        """Per source item, the distinct regions to read, ``(offset, strides, lengths)``, by offset.

        A region several destinations need (a replica fanned out) appears once.
        """
        out: dict[Item, set] = defaultdict(set)
        for c in self.copies:
            out[c.src].add((c.src_offset, c.src_strides, c.lengths))
        return {item: sorted(regions) for item, regions in sorted(out.items())}

    def work_units(self, src_file: Callable[[Item], str] | None = None,
                   dst_file: Callable[[Item], str] | None = None) -> list[tuple[list[str], list[str]]]:
        """Independent units of work: connected components of the file transfer graph.

        The graph is bipartite: source files on one side, destination files on
        the other, an edge wherever a copy runs between them. Each component
        can run in its own process or on its own host. Files are named by
        ``src_file``/``dst_file`` (default: one per item's section and unit).
        Returns ``(source files, destination files)`` per component, largest first.
        """
        import networkx as nx  # here alone: importing it costs every process (and worker) some 75 ms

        src_file = src_file or _default_file
        dst_file = dst_file or _default_file
        graph = nx.Graph()
        for item in self.dst_items:
            graph.add_node(("dst", dst_file(item)))
        for c in self.copies:
            graph.add_edge(("src", src_file(c.src)), ("dst", dst_file(c.dst)))
        units = []
        for comp in nx.connected_components(graph):
            srcs = sorted(name for side, name in comp if side == "src")
            dsts = sorted(name for side, name in comp if side == "dst")
            units.append((srcs, dsts))
        units.sort(key=lambda u: (-len(u[0]) - len(u[1]), u[1]))
        return units

    def validate(self, max_runs: int = 5_000_000) -> dict[str, int]:
        """Prove the plan: bounds, and exact cover of every destination item.

        Checks that every copy's source and destination regions lie inside
        their items, and that the copies into each destination item never
        overlap and add up to the item's mapped (non-padding) elements. Overlap
        is checked exactly on contiguous runs; if a plan has more than
        ``max_runs`` runs the overlap check covers the first items up to
        that budget and the volume check covers all.

        Returns:
          ``{"copies": ..., "runs": ..., "unchecked_items": ...}``: runs compared
          for overlap, and destination items whose overlap check the budget cut.

        Raises:
          PlanError: naming the item, tensor and box at fault.
        """
        problems: list[str] = []
        # An item of one name may be in both layouts with different sizes: each side has its own table. Copies come
        # in runs of one source or destination item: each item is looked up once per run (hashing one is a Python
        # call, and a plan may hold 100,000 items).
        groups: list[tuple[Item, list[Copy]]] = []  # per run of copies into one destination item
        last_src = last_dst = None
        src_size = dst_size = None
        group: list[Copy] = []
        # The last element a region reaches past its first, per (lengths, strides): a model has few shapes, and a
        # plan may hold 100,000 copies; -1 for a region with a negative reach, checked the long way.
        reach: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
        for c in self.copies:
            if c.src is not last_src:
                last_src = c.src
                info = self.src_items.get(last_src)
                src_size = None if info is None else info.numel
            if c.dst is not last_dst:
                last_dst = c.dst
                info = self.dst_items.get(last_dst)
                dst_size = None if info is None else info.numel
                group = []
                groups.append((last_dst, group))
            group.append(c)
            lengths = c.lengths
            src_reach = reach.get((lengths, c.src_strides))
            if src_reach is None:
                src_reach = reach[lengths, c.src_strides] = _reach(lengths, c.src_strides)
            dst_reach = reach.get((lengths, c.dst_strides))
            if dst_reach is None:
                dst_reach = reach[lengths, c.dst_strides] = _reach(lengths, c.dst_strides)
            if src_size is None or not 0 <= c.src_offset <= c.src_offset + src_reach < src_size:
                _check_region(c, "source", c.src, c.src_offset, c.src_strides, src_size, problems)
            if dst_size is None or not 0 <= c.dst_offset <= c.dst_offset + dst_reach < dst_size:
                _check_region(c, "destination", c.dst, c.dst_offset, c.dst_strides, dst_size, problems)
        budget = max_runs
        unchecked = 0
        dense: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}  # (lengths, strides) -> elements, if one run
        for (item, info), copies in zip(self.dst_items.items(), _per_item(groups, self.dst_items)):
            if len(copies) == 1:  # most items: one copy, and a dense one is one run, which nothing overlaps
                c = copies[0]
                n = dense.get((c.lengths, c.dst_strides))
                if n is None:
                    n = dense[c.lengths, c.dst_strides] = _dense(c.lengths, c.dst_strides)
                if n and budget >= 1:
                    if n != info.mapped:
                        problems.append(f"{item}: copies write {n} elements, the item maps {info.mapped} (of "
                                        f"{info.numel}); {_missing_hint(copies, self.tensors)}")
                    budget -= 1
                    continue
            total = sum(c.numel for c in copies)
            if total != info.mapped:
                problems.append(f"{item}: copies write {total} elements, the item maps {info.mapped} (of {info.numel}); "
                                f"{_missing_hint(copies, self.tensors)}")
            runs = []
            for c in copies:
                r = _runs(c.dst_offset, c.dst_strides, c.lengths, budget)
                if r is None:
                    budget = -1
                    break
                budget -= len(r)
                runs += [(s, n, c) for s, n in r]
            if budget < 0:
                unchecked += 1
                continue
            if len(runs) < 2:
                continue
            runs.sort(key=lambda x: x[0])
            for (s0, n0, c0), (s1, _, c1) in zip(runs, runs[1:]):
                if s0 + n0 > s1:
                    problems.append(f"{item}: {c0.tensor} {c0.box} and {c1.tensor} {c1.box} both write element {s1}")
                    break
        if problems:
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise PlanError("invalid plan:\n  " + "\n  ".join(problems[:20]) + more)
        return {"copies": len(self.copies), "runs": max_runs - max(budget, 0), "unchecked_items": unchecked}

    def summary(self) -> dict[str, int]:
        """Counts: copies, items, elements written, and elements read (each distinct region of ``reads`` once)."""
        regions = {(c.src, c.src_offset, c.src_strides, c.lengths) for c in self.copies}
        return {
            "copies": len(self.copies),
            "src_items": len(self.src_items),
            "dst_items": len(self.dst_items),
            "elements_written": sum(c.numel for c in self.copies),
            "elements_read": sum(math.prod(r[3]) for r in regions),
        }

    def to_json(self) -> dict:
        """A JSON-ready dict; ``Plan.from_json`` restores an equal plan."""
        items = sorted(set(self.src_items) | set(self.dst_items))
        index = {it: k for k, it in enumerate(items)}
        return {
            "items": [_item_json(it) for it in items],
            "src_items": {str(index[it]): _info_json(i) for it, i in self.src_items.items()},
            "dst_items": {str(index[it]): _info_json(i) for it, i in self.dst_items.items()},
            "tensors": {n: {"shape": list(t.shape), "axes": list(t.axes), "view": list(t.view), "blob": t.blob, "dim_axes": list(t.dim_axes)}
                        for n, t in self.tensors.items()},
            "copies": [
                [index[c.src], c.src_offset, list(c.src_strides), index[c.dst], c.dst_offset, list(c.dst_strides),
                 list(c.lengths), c.tensor, c.state, list(c.box.offsets)]
                for c in self.copies
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        items = [Item(d["section"], tuple((a, c) for a, c in d["unit"]), d["chunk"], d["state"], d["key"]) for d in data["items"]]
        tensors = {n: LogicalTensor(name=n, shape=tuple(t["shape"]), axes=tuple(t["axes"]), view=tuple(t["view"]), blob=t["blob"],
                                    dim_axes=tuple(t["dim_axes"])) for n, t in data["tensors"].items()}
        copies = tuple(
            Copy(src=items[s], src_offset=so, src_strides=tuple(ss), dst=items[d], dst_offset=do, dst_strides=tuple(ds),
                 lengths=tuple(ln), tensor=t, state=st, box=Box(tuple(bo), tuple(ln)))
            for s, so, ss, d, do, ds, ln, t, st, bo in data["copies"]
        )
        return cls(
            src_items=MappingProxyType({items[int(k)]: _info_from(v) for k, v in data["src_items"].items()}),
            dst_items=MappingProxyType({items[int(k)]: _info_from(v) for k, v in data["dst_items"].items()}),
            copies=copies,
            tensors=MappingProxyType(tensors),
        )


def plan(src: Layout, dst: Layout) -> Plan:
    """Compute the copies that turn items laid out as ``src`` into items laid out as ``dst``.

    Pure: reads only the two layouts. Cost: per logical tensor and state,
    one pass that meets all its destination fragments with its source boxes
    (``reshard.core.cover``; vectorized where there are many), so O(D * S)
    elementary comparisons for D destination and S source fragments of that
    tensor; tensors and states laid out alike share one pass. Python's cyclic
    collector is paused meanwhile (``reshard.core.collector``).

    Raises:
      PlanError: a destination fragment the source cannot fill (naming the
        tensor, state, box and destination item), or a logical tensor whose
        view differs between the layouts.

    >>> # p = plan(resolve(spec, parse_topology("tp=2"), sizes), resolve(spec, parse_topology("tp=4"), sizes))
    """
    with collector_paused():
        return _plan(src, dst)


def _plan(src: Layout, dst: Layout) -> Plan:
    problems: list[str] = []
    for name in sorted({f.tensor for f in dst.fragments}):
        want = dst.tensors[name]
        have = src.tensors.get(name)
        if have is not None and (have.view != want.view or have.shape != want.shape):
            problems.append(f"{name}: source view {dict(zip(have.axes, have.view))} (shape {have.shape}) "
                            f"!= destination view {dict(zip(want.axes, want.view))} (shape {want.shape})")
    if problems:
        raise PlanError("the layouts disagree on logical tensors:\n  " + "\n  ".join(problems[:20]))

    sources: dict[tuple[str, str], list[Fragment]] = defaultdict(list)
    own: dict[Item, dict[tuple[str, str], list[Fragment]]] = {}
    # A layout lists an item's fragments together: each item is looked up once per run of them, not once per
    # fragment (hashing an item is a Python call, and a large layout has millions of fragments). Only the items of
    # the destination are asked for (its fragments' items are among them: they are ranked by its items below).
    wanted_items = dst.items
    last = None
    mine: dict[tuple[str, str], list[Fragment]] | None = None
    for f in src.fragments:
        if not f.fill:
            key = (f.tensor, f.state)
            sources[key].append(f)
            if f.item is not last:
                last = f.item
                mine = own.setdefault(last, {}) if last in wanted_items else None
            if mine is not None:
                mine.setdefault(key, []).append(f)

    # Every copy with the destination fragment it fills; then sorted by destination place.
    copies: list[Copy] = []
    filled: list[int] = []
    wanted: dict[tuple[str, str], list[int]] = defaultdict(list)
    # Per destination fragment left to meet, the source's fragments of its key in its own item, if any: where its
    # parts are read from when a box is held by several items.
    owned_at: dict[int, list[Fragment]] = {}
    last = None
    for k, f in enumerate(dst.fragments):
        if f.item is not last:
            last = f.item
            mine = own.get(last) if own else None
        # The same item in the source holds the whole box: copy in place (plan(A, A) is item -> itself).
        key = (f.tensor, f.state)
        owned = mine.get(key) if mine else None
        if not owned:
            same = None
        elif len(owned) == 1:  # most often: the item holds one fragment of the tensor
            same = owned[0] if contains(owned[0].box, f.box) else None
        else:
            same = next((s for s in owned if contains(s.box, f.box)), None)
        if same is None:
            same = _sole_holder(sources.get(key), f.box)
        if same is not None:
            copies.append(_new_copy(same.item, offset_of(same, f.box), same.strides, last, f.offset, f.strides,
                                    f.box.lengths, f.tensor, f.state, f.box))
            filled.append(k)
        else:
            wanted[key].append(k)
            if owned:
                owned_at[k] = owned
    missing: list[tuple[int, str]] = []
    meetings_of = Meetings()
    dst_frags = dst.fragments
    for key, ks in wanted.items():
        frags = [dst_frags[k] for k in ks]
        held = sources.get(key)
        if not held:
            meetings = [[] for _ in frags]
        else:
            meetings = meetings_of.meet(held, frags, [owned_at.get(k) for k in ks] if owned_at else [None] * len(ks))
        for k, f, meets in zip(ks, frags, meetings):
            for s, common, src_at, dst_at in meets:
                copies.append(_new_copy(s.item, src_at, s.strides, f.item, dst_at, f.strides, common.lengths, f.tensor,
                                        f.state, common))
                filled.append(k)
            if len(meets) == 1 and meets[0][1] is f.box:  # the whole box from one place (most often)
                continue
            got = sum(common.volume for _, common, _, _ in meets)
            if got != f.box.volume:
                why = "no such tensor in the source" if held is None and f.tensor not in src.tensors else (
                    f"state '{f.state}' not in the source (it has: {', '.join(src.states) or 'none'})" if held is None
                    else f"source covers {got} of {f.box.volume} elements")
                missing.append((k, f"{f.tensor} [{f.state}] {f.box} for {f.item}: {why}"))
    if missing:
        lines = [why for _, why in sorted(missing)]
        more = f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else ""
        raise PlanError("the source does not hold everything the destination needs:\n  " + "\n  ".join(lines[:20]) + more)
    return Plan(
        src_items=MappingProxyType(_dict_of(src.items)),
        dst_items=MappingProxyType(_dict_of(dst.items)),
        copies=_in_destination_order(copies, filled, dst),
        tensors=MappingProxyType({n: t for n, t in dst.tensors.items()}),
    )


def _sole_holder(held: list[Fragment] | None, box: Box) -> Fragment | None:
    """The one fragment the source has of a (tensor, state), ``held``, if it holds all of ``box`` (a whole tensor,
    chunked): what meeting them would give, found without gathering the tensor's destination fragments first."""
    if held is not None and len(held) == 1 and contains(held[0].box, box):
        return held[0]
    return None


def _in_destination_order(copies: list[Copy], filled: list[int], dst: Layout) -> tuple[Copy, ...]:
    """The copies by destination item (in the layout's order) and offset; copies of the same item and offset by
    the destination fragment they fill (``filled``, its index in the layout), then in the order they were made."""
    # Each fragment's run (of fragments in one item), then each run's item's place in the layout: a layout most
    # often lists its items in the order its fragments come in, and then the runs are its items and none is hashed.
    runs: list[Item] = []
    run_of: list[int] = []
    last = None
    for f in dst.fragments:
        if f.item is not last:
            last = f.item
            runs.append(last)
        run_of.append(len(runs) - 1)
    items = list(dst.items)
    if runs == items:
        ranks = run_of
    else:
        rank_of = {item: k for k, item in enumerate(items)}
        rank_of_run = [rank_of[item] for item in runs]
        ranks = [rank_of_run[r] for r in run_of]
    try:  # one stable numpy sort (numbers past int64 take the list's sort)
        at = np.array(filled, dtype=np.int64)
        keys = (at, np.fromiter((c.dst_offset for c in copies), dtype=np.int64, count=len(copies)),
                np.array(ranks, dtype=np.int64)[at])
    except OverflowError:
        order = sorted(range(len(copies)), key=lambda j: (ranks[filled[j]], copies[j].dst_offset, filled[j]))
        return tuple(map(copies.__getitem__, order))
    return tuple(map(copies.__getitem__, np.lexsort(keys).tolist()))


def _dict_of(items: Mapping[Item, ItemInfo]) -> dict[Item, ItemInfo]:
    """A plain dict copy of a layout's items; a dict's own copy, which need not hash every item again."""
    if isinstance(items, (dict, MappingProxyType)):
        out = items.copy()
        if type(out) is dict:
            return out
    return dict(items)


def _per_item(groups: list[tuple[Item, list[Copy]]], items: Mapping[Item, ItemInfo]) -> list[list[Copy]]:
    """For each of ``items``, in order, the copies into it, from the groups of consecutive copies into one item:
    most often each group is the next item (a plan lists its copies by destination item), and then no item is
    hashed."""
    if [item for item, _ in groups] == list(items):
        return [copies for _, copies in groups]
    by_item: dict[Item, list[Copy]] = {}
    for item, copies in groups:
        by_item.setdefault(item, []).extend(copies)
    return [by_item.get(item, []) for item in items]


def _runs(offset: int, strides: tuple[int, ...], lengths: tuple[int, ...], budget: int) -> list[tuple[int, int]] | None:
    """The contiguous flat runs ``(start, length)`` of a strided box, or None past ``budget``."""
    expected = 1
    for n, s in zip(reversed(lengths), reversed(strides)):
        if n > 1 and s != expected:
            break
        expected *= n
    else:  # row-major and dense: one run (most copies)
        return [(offset, expected)]
    axes = sorted(((s, n) for s, n in zip(strides, lengths) if n > 1), reverse=True)
    run = 1
    while axes and axes[-1][0] == run:
        run *= axes.pop()[1]
    count = math.prod(n for _, n in axes)
    if count > budget:
        return None
    starts = [offset]
    for s, n in axes:
        starts = [b + j * s for b in starts for j in range(n)]
    return [(b, run) for b in starts]


def _missing_hint(copies: list[Copy], tensors: Mapping[str, LogicalTensor]) -> str:
    names = sorted({c.tensor for c in copies})
    return f"tensors written: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}" if names else "nothing is written to it"


def _default_file(item: Item) -> str:
    where = ",".join(f"{a}={c}" for a, c in item.unit)
    return f"{item.section}[{where}]"


def _item_json(item: Item) -> dict:
    return {"section": item.section, "unit": [list(u) for u in item.unit], "chunk": item.chunk, "state": item.state, "key": item.key}


def _info_json(info: ItemInfo) -> dict:
    return {"shape": list(info.shape), "mapped": info.mapped, "fill": info.fill, "rule": info.rule,
            **({"tensor": info.tensor} if info.tensor is not None else {})}


def _info_from(d: dict) -> ItemInfo:
    return ItemInfo(shape=tuple(d["shape"]), mapped=d["mapped"], fill=d["fill"], rule=d["rule"],
                    tensor=d.get("tensor"))
