"""The ``hf`` format's entry points: read ``config.json`` and the safetensors headers, choose the model
family's layout, and write shards, index and configs."""

from __future__ import annotations

import copy
import math
import re
from itertools import repeat
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from reshard.core.dtypes import SUPPORTED
from reshard.core.layout import Item, Layout
from reshard.core.resolve import resolve
from reshard.core.spec import Spec, parse_spec
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.execution.session import Slot, WriteSession
from reshard.formats.base import Fill, Located, Source, Target, check_sizes, given_sizes
from reshard.formats.derived import (
    Recorded,
    derived_spec_name,
    is_derived,
    recorded_of,
    whole_derived,
    whole_derived_of,
    whole_text,
)
from reshard.formats.hf.files import _check_param_only, _listing, _shard_plan, _stored_tensors, _target_dtypes
from reshard.formats.identity import CONFIG_NAME, read_identity, write_identity
from reshard.formats.specs import layout_spec, require_family, source_family, spec_text
from reshard.io.location import as_path
from reshard.io.safetensors_io import INDEX_NAME, WEIGHTS_NAME, SafetensorsWriter, TensorInfo
from reshard.models import Family, known_family
from reshard.models.config import hf_config


_OWN_NAMES = ("megatron", "mcore-dist")
"""Formats whose tensor names are the framework's (stacked, fused), not the model's: no family, no hf."""


_LAYER = re.compile(r"(?:^|\.)layers\.([0-9]+)\.")
"""A decoder layer's index in a Hugging Face tensor name."""


class HFFormat:
    """The ``hf`` format adapter (see ``reshard.formats.base.Format``)."""

    name = "hf"

    def detect(self, path: Path) -> bool:
        path = as_path(path)
        return (path / CONFIG_NAME).is_file() and ((path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file())

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read ``config.json`` and the safetensors headers, and match every stored tensor to the spec.

        The layout is the model family's when a family claims the config's ``model_type`` (tensors the
        family does not name, such as adapters or a value head, are added under their own names), else
        derived from the safetensors headers alone. ``Source.model`` carries ``config.json``,
        ``generation_config.json`` and the tokenizer files.

        Raises:
          CheckpointFormatError: a file is missing or malformed, the model is
            tied and no tied spec is shipped, or the stored tensors do not
            match the spec (all mismatches listed, each with its file).
        """
        path = as_path(path)
        config_path = path / CONFIG_NAME
        model = read_identity(path)
        config = model.config or {}
        stored = _stored_tensors(path)
        family = known_family(config)
        layout = None
        if spec is not None:
            spec_name, spec_obj = spec, layout_spec(spec)
        elif family is None:  # a model no family describes: every tensor under its own name, as stored
            spec_name = derived_spec_name(self.name)
            spec_obj, layout = whole_derived_of({n: t.shape for n, (_, t) in stored.items()}, self.name, path)
        else:
            spec_name = hf_spec_name(family, config, config_path)
            spec_obj = layout_spec(spec_name)
        model_sizes = family.sizes_from_config(config, config_path) if family else {}
        if family is not None and "hf_layers" in family.sizes:  # MTP layers: the ones the files hold
            model_sizes["hf_layers"] = _hf_layers(stored, model_sizes["layers"], path)
        model_sizes = check_sizes(model_sizes, config_path, counts=dict.fromkeys(("layers", "experts"), len(stored)))
        model_sizes.update(given_sizes(sizes))
        if layout is None:
            layout = resolve(spec_obj, Topology(), model_sizes)
        if spec is None and family is not None:  # tensors the family does not name (adapters, a value head)
            keys = {it.key for it in layout.items}
            extras = [Recorded(n, t.shape) for n, (_, t) in stored.items() if n not in keys and not family.names(n)]
            if extras:
                spec_obj = with_extras(spec_name, extras, path)
                layout = resolve(spec_obj, Topology(), model_sizes)
        _check_param_only(layout, spec_name)
        where = _located(layout, stored)
        if where is not None:
            return Source(format=self.name, path=path, spec_name=spec_name, spec=spec_obj, topology=Topology(),
                          sizes=model_sizes, layout=layout, where=where, model=model)
        where = {}
        problems: list[str] = []
        matched: set[str] = set()
        for item, info in layout.items.items():
            hit = stored.get(item.key)
            if hit is None:
                problems.append(f"tensor '{item.key}' is missing (spec rule '{info.rule}')")
                continue
            file, tensor = hit
            matched.add(item.key)
            if tensor.shape != info.shape:
                problems.append(f"{file}: tensor '{item.key}' has shape {list(tensor.shape)}, "
                                f"the spec expects {list(info.shape)}")
            elif tensor.dtype not in SUPPORTED:
                problems.append(f"{file}: tensor '{item.key}' has dtype {tensor.dtype}, which reshard cannot copy "
                                f"(supported: {', '.join(SUPPORTED)})")
            else:
                where[item] = Located(file, tensor.data_offset, tensor.dtype)
        beyond: set[int] = set()
        for name, (file, _) in stored.items():
            if name not in matched:
                problems.append(f"{file}: tensor '{name}' matches no item of spec '{spec_name}'")
                layer = _LAYER.search(name)
                if layer and "layers" in model_sizes and int(layer.group(1)) >= model_sizes["layers"]:
                    beyond.add(int(layer.group(1)))
        if beyond:  # layers after the decoder's: multi-token prediction, in a family without it
            problems.insert(0, f"layer(s) {', '.join(map(str, sorted(beyond)))} lie beyond num_hidden_layers "
                               f"({model_sizes['layers']}), which the {family.name} family has no layers for "
                               "(multi-token-prediction layers are DeepSeek-V3's)")
        if problems:
            raise CheckpointFormatError(
                f"{path}: the stored tensors do not match spec '{spec_name}':\n  " + _listing(problems))
        return Source(format=self.name, path=path, spec_name=spec_name, spec=spec_obj, topology=Topology(),
                      sizes=model_sizes, layout=layout, where=where, model=model)

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        """The unsharded layout of ``source``'s model, with a ``config.json`` for it.

        ``Target.model.config`` is the source's own config when the source
        is hf, otherwise a minimal ``LlamaConfig`` built from the sizes (edit
        it before ``write`` to set rope, epsilon or token ids).
        ``Target.max_shard_size`` (bytes, or a string like ``"5GB"``)
        may be set to change the shard size (default 5GB).

        Raises:
          TopologyError: ``topology`` is sharded (hf checkpoints are not).
          CheckpointFormatError: the source's model is tied and no tied spec is shipped.
        """
        axes = ("tp", "pp", "dp", "cp", "ep", "vpp")
        sharded = [f"{a}({topology.degree(a)})" for a in axes if topology.degree(a) > 1]
        if sharded:
            raise TopologyError(f"hf checkpoints are unsharded: cannot write {', '.join(sharded)} (use tp=1,pp=1,dp=1)")
        from_hf = source.format == self.name
        family = source_family(source)
        config_known = isinstance(source.model.config, dict)
        layout = None
        if spec is not None:
            spec_name, spec_obj = spec, layout_spec(spec)
        elif from_hf:
            spec_name, spec_obj = source.spec_name, source.spec
            if is_derived(spec_name):  # whole tensors under their own names: the source's own layout
                layout = source.layout
        elif family is not None and (not is_derived(source.spec_name) or source.module_names):
            tied = family.can_tie and family.tied_in(source.layout.tensors)
            spec_name = hf_spec_name(family, {"tie_word_embeddings": tied}, source.path)
            spec_obj = layout_spec(spec_name)
            family_tensors = resolve(spec_obj, Topology(), source.sizes).tensors
            extras = [t for t in recorded_of(source.layout) if t.name not in family_tensors]
            if extras:
                spec_obj = with_extras(spec_name, extras, source.path)
        elif source.format in _OWN_NAMES:  # Megatron's stacked, fused names are not the model's
            require_family(source, "a Hugging Face checkpoint names its tensors as the model does, and "
                           f"{source.format} stores them under its own fused names")  # raises naming the model
            raise CheckpointFormatError(f"{source.path}: read as '{source.spec_name}' ({source.format}'s own stacked, "
                                        "fused names), which Hugging Face names cannot be derived from; give a spec")
        elif config_known:  # no family's layout in the source: every tensor under its own name
            spec_name = derived_spec_name(self.name)
            spec_obj, layout = whole_derived(recorded_of(source.layout), self.name, source.path)
        else:
            raise CheckpointFormatError(
                f"{source.path}: which model this is is recorded nowhere (no config.json beside it, no model family "
                "in its layout), and a Hugging Face checkpoint needs its config; put the model's config.json beside "
                "the source")
        if layout is None:
            layout = resolve(spec_obj, Topology(), source.sizes)
        _check_param_only(layout, spec_name)
        dtypes = _target_dtypes(source, layout)
        if from_hf or family is None or is_derived(spec_name):
            config = copy.deepcopy(source.model.config)
        else:
            tied = family.tied_in(layout.tensors)
            config = hf_config(family, source.sizes, dtypes.values(), carried=source.model.config,
                               hints=source.model.hints, tied=tied)
        model = replace(source.model, config=config, generation_config=copy.deepcopy(source.model.generation_config))
        return Target(format=self.name, spec_name=spec_name, spec=spec_obj, topology=Topology(),
                      sizes=dict(source.sizes), layout=layout, dtypes=dtypes, model=model)

    def write(self, target: Target, out: Path, fill: Fill, session: WriteSession | None = None, *,
              only: Collection[Path] | None = None) -> list[Path]:
        """Write the safetensors shards, the index (when there are several shards) and ``config.json``.

        Item bytes come through ``session`` (a fresh one if None): its windows, checksums and progress.
        With ``only``, just those shards, and not the index or ``config.json``.

        Tensors are ordered embedding, layer 0, layer 1, ..., then the rest,
        split into shards as ``save_pretrained`` splits them; each shard file
        is byte-identical to what ``safetensors.torch.save_file`` writes for
        its tensors with metadata ``{"format": "pt"}``.

        Raises:
          CheckpointFormatError: the target holds a state other than ``param``,
            an item has no dtype, or ``fill`` returns the wrong number of bytes.
        """
        out = Path(out)
        session = session or WriteSession()
        plan = _shard_plan(target)
        shards, by_key, tensors = plan.shards, plan.by_key, plan.tensors
        wanted = None if only is None else set(only)
        written: list[Path] = []
        for file, names in shards.shards:
            if wanted is not None and Path(file) not in wanted:
                continue
            spec = {n: tensors[n] for n in names}
            with SafetensorsWriter(out / file, spec, metadata={"format": "pt"}, open_file=session.open) as w:
                # one Slot per tensor, its fields from C (``map``): a shard may hold 100,000 small tensors
                infos = list(w.tensors.values())
                starts = [t.data_offset for t in infos]
                slots = map(Slot, map(by_key.__getitem__, w.tensors), [t.numel for t in infos],
                            [spec[n][0] for n in w.tensors], starts, starts,
                            [t.data_offset + t.nbytes for t in infos], w.tensors)
                for run in session.runs(slots):  # small tensors side by side: filled and written together
                    if len(run) > 1:
                        session.stream_run(fill, run, lambda run, data: w.write_run([s.key for s in run], data))
                        continue
                    s = run[0]
                    session.stream_item(fill, s.item, s.numel, s.dtype, lambda data, name=s.key: w.write(name, data),
                                        at=s.data)
            written.append(Path(file))
        if only:  # a worker's share: index and configs are written by the call with only=()
            return written
        if shards.sharded:
            total_parameters = sum(map(math.prod, [shape for _, shape in tensors.values()]))
            (out / INDEX_NAME).write_text(shards.index_json(total_parameters), encoding="utf-8")
            written.append(Path(INDEX_NAME))
        if target.model.config is None:
            raise CheckpointFormatError(f"{out}: no config.json for this checkpoint (its model family is unknown)")
        written += write_identity(out, target.model)
        return written

    def files_of(self, target: Target) -> dict[Item, Path]:
        """The shard, relative to the checkpoint directory, that holds each item of ``target``."""
        plan = _shard_plan(target)
        by_key = plan.by_key
        files: dict[Item, Path] = {}
        for name, names in plan.shards.shards:
            files.update(zip(map(by_key.__getitem__, names), repeat(Path(name))))
        return {it: files[it] for it in plan.items}

FORMAT = HFFormat()


def _located(layout: Layout, stored: Mapping[str, tuple[Path, TensorInfo]]) -> dict[Item, Located] | None:
    """Where each item's bytes are when every item finds its stored tensor, of its shape and of a dtype reshard
    copies, and every stored tensor is some item's; else None, and ``HFFormat.open`` goes item by item to list
    what does not match.

    A checkpoint may hold 100,000 tensors: each check here runs over all of them at once, in C (comparing lists
    of shapes, most of them the very tuples the layout was derived from), with no Python step per item.
    """
    items = layout.items
    hits = list(map(stored.get, [it.key for it in items]))
    if None in hits:
        return None
    tensors = [t for _, t in hits]
    keys = {it.key for it in items}
    if len(keys) != len(stored) or [t.shape for t in tensors] != [info.shape for info in items.values()]:
        return None
    dtypes = [t.dtype for t in tensors]
    if not set(dtypes) <= SUPPORTED.keys():
        return None
    located = map(Located, [file for file, _ in hits], [t.data_offset for t in tensors], dtypes)
    return dict(zip(items, located, strict=True))


def _hf_layers(stored: Mapping[str, Any], layers: int, where: Path) -> int:
    """The layers a checkpoint numbers: the decoder's and the multi-token-prediction (MTP) layers after them,
    which a config may declare (``num_nextn_predict_layers``) and the files still lack (transformers saves none).

    Raises:
      CheckpointFormatError: the layers after the decoder's are not numbered on from it (a gap).
    """
    after = sorted({n for name in stored if (m := _LAYER.search(name)) and (n := int(m.group(1))) >= layers})
    gap = next((n for k, n in enumerate(after) if n != layers + k), None)
    if gap is not None:
        raise CheckpointFormatError(f"{where}: layer {gap} follows the decoder's {layers} layers without layer "
                                    f"{layers + after.index(gap)}; multi-token-prediction layers are numbered on "
                                    f"from num_hidden_layers ({layers})")
    return layers + len(after)


def hf_spec_name(family: Family | None, config: Mapping[str, Any], where: Path) -> str:
    """The generated layout of a Hugging Face checkpoint of ``family``: ``hf-<family>``, ``-tied`` when the
    config ties the output projection to the embedding."""
    if family is None:
        raise CheckpointFormatError(f"{where}: no model family; pass a spec")
    tied = family.config_ties(config)
    if tied and not family.can_tie and not family.tied_default:
        raise CheckpointFormatError(f"{where}: tied {family.name} checkpoints are not supported yet "
                                    "(tie_word_embeddings is true)")
    return f"hf-{family.name}" + ("-tied" if tied and family.can_tie else "")


def with_extras(spec_name: str, extras: list[Recorded], where: Path) -> Spec:
    """The family's layout ``spec_name`` plus ``extras``, tensors it does not name (LoRA adapters, a value
    head), each unsharded under its own name."""
    text = spec_text(spec_name) + "\n" + whole_text(extras, where, section="extras")
    return parse_spec(text, source=f"<{spec_name} with {len(extras)} tensors of {where}>")
