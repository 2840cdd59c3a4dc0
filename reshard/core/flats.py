"""Flat buffers: a section's params flattened into buffers (a distributed optimizer's), as the resolver lays them out.

``FlatBuffers`` is mixed into ``reshard.core.resolve._Resolver``: for each unit of a flat buffer's section it takes
the params of the section it is built from (one item per key), places them with ``terms.flat_layout`` and cuts
their fragments to the unit's share with ``terms.flat_pieces``. What every rank of the split axis shares (the
params kept, their places in the world buffer, the cuts of their fragments) is worked out once.
"""

from __future__ import annotations

import fnmatch
import math
from typing import TYPE_CHECKING

from reshard.core import spec as S
from reshard.core.layout import Fragment, Item, ItemInfo, new_fragment, new_item
from reshard.core.names import MESH_AXES
from reshard.core.terms import FlatCuts, flat_layout, flat_pieces
from reshard.errors import SpecError

__all__ = ["FlatBuffers", "order_key"]


class FlatBuffers:
    """The resolver's flat buffers; mixed into ``reshard.core.resolve._Resolver``, whose items, fragments,
    ``order``, ``item_frags``, ``blob_items``, ``add_item`` and ``err`` it uses."""

    items: dict[Item, ItemInfo]
    fragments: list[Fragment]
    order: dict[str, tuple[Item, ...]]
    item_frags: dict[Item, list[Fragment]]
    blob_items: set[Item]

    if TYPE_CHECKING:
        def err(self, message: str, pos: S.Pos | None) -> SpecError: ...

        def add_item(self, item: Item, info: ItemInfo, pos: S.Pos | None = None,
                     frags: list[Fragment] | None = None) -> None: ...

    def init_flats(self) -> None:
        # per source unit and chunk: its params (one per key) and their element counts
        self.flat_params: dict[str, tuple[list[Item], list[int]]] = {}
        # per flat rule and source unit: what ``flat_choose`` gives; every rank of the split axis shares it
        self.flat_chosen: dict[tuple, tuple] = {}
        # the params' contents (their fragments) met so far, numbered; per flat rule and content, where the flat
        # layout places the params in the world buffer (``terms.flat_layout``'s cache), and per rank of the split
        # axis too, each bucket's parts, item info and keys
        self.flat_contents: dict[tuple, int] = {}
        self.flat_places: dict[tuple, object] = {}
        self.flat_shares: dict[tuple, list[tuple]] = {}
        # per flat rule: its source section, name captures and split axis, checked once; ``terms.flat_pieces``'s caches
        self.flat_checked: dict[int, tuple[S.Section, set[str], tuple[str, ...]]] = {}
        # per flat rule and param key: whether its globs keep the param and give it a bucket of its own
        self.flat_globs: dict[int, dict[str, tuple[bool, bool]]] = {}
        self.flat_cuts = FlatCuts()

    def flat(self, sec: S.Section, fl: S.Flat, unit, chunk: int, states: tuple[str, ...], sections: dict[str, S.Section]) -> None:
        checked = self.flat_checked.get(id(fl))
        if checked is None:  # what does not depend on the unit, checked once per flat rule
            checked = self.flat_check(sec, fl, sections)
            self.flat_checked[id(fl)] = checked
        src, caps, split_axes = checked
        coords = dict(unit)
        src_unit = tuple((a, coords[a]) for a in src.axes)
        chosen_key = (id(fl), src_unit, chunk)
        chosen = self.flat_chosen.get(chosen_key)
        if chosen is None:  # shared by every rank of the split axis
            chosen = self.flat_choose(fl, src, src_unit, chunk)
            self.flat_chosen[chosen_key] = chosen
        params, numels, blob, alone, content = chosen
        if blob is not None:
            raise self.err(f"flat buffer {fl.pattern.text} would take blob '{blob.key}' of section '{fl.source}' as a param; "
                           "flat buffers hold tensors only (give blobs a section of their own, or 'except' them)", fl.pos)
        # Units whose params hold the same fragments (the attention of every expert-parallel rank) share their
        # buffers' geometry: only the items differ.
        share_key = (id(fl), content, tuple(coords[a] for a in split_axes))
        share = self.flat_shares.get(share_key)
        if share is None:
            buckets = flat_layout(fl, numels, coords, self, self.flat_places, (id(fl), content), alone=alone)
            unknown = caps - {"state", "bucket"}
            if unknown:
                raise self.err(f"a flat buffer name may capture only {{state}} and {{bucket}}, not {{{unknown.pop()}}}", fl.pos)
            if len(buckets) > 1 and "bucket" not in caps:
                raise self.err("this flat buffer has several buckets: put '{bucket}' in its name or add '| coalesce'", fl.pos)
            share = []
            for b, (length, pieces) in enumerate(buckets):
                if length == 0:
                    continue
                geo = [g for g in flat_pieces(params, self.item_frags, pieces, self.flat_cuts) if not g[4]]
                info = ItemInfo(shape=(length,), mapped=sum(math.prod(g[1].lengths) for g in geo), rule=fl.pattern.text)
                share.append((geo, info, [fl.pattern.format({"state": state, "bucket": b}) for state in states]))
            self.flat_shares[share_key] = share
        for geo, info, keys in share:
            for state, key in zip(states, keys):
                item = new_item(sec.name, unit, chunk, state, key)
                frags = [new_fragment(name, state, box, item, base, strides) for name, box, base, strides, _ in geo]
                self.add_item(item, info, fl.pos, frags)
                self.fragments += frags

    def flat_choose(self, fl: S.Flat, src: S.Section, src_unit: tuple, chunk: int) -> tuple:
        """The params a flat rule takes from a unit of its source section, their element counts, a blob among them
        if any, those its ``alone`` ops give a bucket of their own, and a number that is the same for units whose
        params hold the same fragments."""
        source_key = order_key(src.name, src_unit, chunk)
        if source_key not in self.flat_params:
            ordered = self.order.get(source_key)
            if ordered is None:
                raise self.err(f"section '{fl.source}' must come before the flat buffer built from it", fl.pos)
            first_state: dict[str, Item] = {}
            for it in ordered:
                first_state.setdefault(it.key, it)
            self.flat_params[source_key] = (list(first_state.values()), [self.items[p].numel for p in first_state.values()])
        params, numels = self.flat_params[source_key]
        # What the globs say of a key, asked once per flat rule and key (units of many stages hold the same keys)
        said = self.flat_globs.setdefault(id(fl), {})
        for p in params:
            if p.key not in said:
                said[p.key] = (_selected(p.key, fl.ops), _alone(p.key, fl.ops))
        kept = [k for k, p in enumerate(params) if said[p.key][0]]
        if len(kept) < len(params):
            params, numels = [params[k] for k in kept], [numels[k] for k in kept]
        alone = frozenset(k for k, p in enumerate(params) if said[p.key][1])
        content = (tuple(numels), alone, tuple(
            tuple((fr.tensor, fr.box.offsets, fr.box.lengths, fr.offset, fr.strides, fr.fill) for fr in self.item_frags[p])
            for p in params))
        return (params, numels, next((p for p in params if p in self.blob_items), None), alone,
                self.flat_contents.setdefault(content, len(self.flat_contents)))

    def flat_check(self, sec: S.Section, fl: S.Flat,
                   sections: dict[str, S.Section]) -> tuple[S.Section, set[str], tuple[str, ...]]:
        """A flat rule's source section, its name's captures and its split axis (if any), once its name, split axis
        and section are checked."""
        if not fl.pattern.plain:
            raise self.err("a flat buffer's name takes plain captures only ('{state}', '{bucket}')", fl.pos)
        src = sections.get(fl.source)
        if src is None:
            raise self.err(f"unknown section '{fl.source}' (declared: {', '.join(sections)})", fl.pos)
        split_axes = [op.arg for op in fl.ops if op.op == "split"]
        for ax in split_axes:
            if ax not in MESH_AXES:
                raise self.err(f"unknown mesh axis '{ax}' (expected one of: {', '.join(MESH_AXES)})", fl.pos)
        split_axes = split_axes[-1:]  # a repeated valued op keeps its last value
        if set(sec.axes) != set(src.axes) | set(split_axes):
            raise self.err(
                f"flat buffers of '{sec.name}' (per {', '.join(sec.axes) or 'nothing'}) must be stored per the axes of "
                f"'{src.name}' ({', '.join(src.axes) or 'none'}) plus its split axis ({', '.join(split_axes) or 'none'})",
                sec.pos)
        return src, {c.name for c in fl.pattern.captures}, tuple(split_axes)


def order_key(section: str, unit, chunk: int) -> str:
    return f"{section}/{','.join(f'{a}={c}' for a, c in unit)}/{chunk}"


def _alone(key: str, ops: tuple[S.FlatOp, ...]) -> bool:
    """Whether a flat buffer's ``alone`` globs give the param stored as ``key`` a bucket of its own."""
    return any(op.op == "alone" and fnmatch.fnmatchcase(key, op.arg) for op in ops)


def _selected(key: str, ops: tuple[S.FlatOp, ...]) -> bool:
    """Whether a flat buffer's ``only``/``except`` globs keep the param stored as ``key``."""
    for op in ops:
        if op.op == "only" and not fnmatch.fnmatchcase(key, op.arg):
            return False
        if op.op == "except" and fnmatch.fnmatchcase(key, op.arg):
            return False
    return True
