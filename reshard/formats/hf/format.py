"""The ``hf`` format's entry points: read ``config.json`` and the safetensors headers, choose the model
family's layout, and write shards, index and configs."""

from __future__ import annotations

import copy
import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from reshard.core.dtypes import SUPPORTED
from reshard.core.layout import Item
from reshard.core.resolve import resolve
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, TopologyError
from reshard.execution.session import WriteSession
from reshard.formats.base import (
    Fill,
    Located,
    ModelMeta,
    Source,
    Target,
    check_sizes,
    given_sizes,
    read_json,
)
from reshard.formats.hf.files import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    _check_param_only,
    _listing,
    _shard_plan,
    _stored_tensors,
    _target_dtypes,
)
from reshard.formats.specs import layout_spec, source_family
from reshard.io.safetensors_io import INDEX_NAME, WEIGHTS_NAME, SafetensorsWriter
from reshard.models import Family, family_for_config, known_family
from reshard.models.config import hf_config


class HFFormat:
    """The ``hf`` format adapter (see ``reshard.formats.base.Format``)."""

    name = "hf"

    def detect(self, path: Path) -> bool:
        path = Path(path)
        return (path / CONFIG_NAME).is_file() and ((path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file())

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read ``config.json`` and the safetensors headers, and match every stored tensor to the spec.

        ``Source.extra["config"]`` is the parsed ``config.json``
        (``extra["generation_config"]`` too when the directory has one).

        Raises:
          CheckpointFormatError: a file is missing or malformed, the model is
            tied and no tied spec is shipped, or the stored tensors do not
            match the spec (all mismatches listed, each with its file).
        """
        path = Path(path)
        config_path = path / CONFIG_NAME
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise CheckpointFormatError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
        family = family_for_config(config, str(config_path)) if spec is None else known_family(config)
        spec_name = spec or hf_spec_name(family, config, config_path)
        stored = _stored_tensors(path)
        model_sizes = family.sizes_from_config(config, config_path) if family else {}
        model_sizes = check_sizes(model_sizes, config_path, counts=dict.fromkeys(("layers", "experts"), len(stored)))
        model_sizes.update(given_sizes(sizes))
        spec_obj = layout_spec(spec_name)
        layout = resolve(spec_obj, Topology(), model_sizes)
        _check_param_only(layout, spec_name)
        where: dict[Item, Located] = {}
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
        for name, (file, _) in stored.items():
            if name not in matched:
                problems.append(f"{file}: tensor '{name}' matches no item of spec '{spec_name}'")
        if problems:
            raise CheckpointFormatError(
                f"{path}: the stored tensors do not match spec '{spec_name}':\n  " + _listing(problems))
        generation = path / GENERATION_CONFIG_NAME
        model = ModelMeta(config=config, generation_config=read_json(generation) if generation.is_file() else None)
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
        if spec is None and family is None:
            raise CheckpointFormatError(
                f"{source.path}: which model this is is recorded nowhere (no config.json beside it, no model family "
                "in its layout), and a Hugging Face checkpoint needs its config; put the model's config.json beside "
                "the source")
        tied = family is not None and family.can_tie and family.tied_in(source.layout.tensors)
        spec_name = spec or (source.spec_name if from_hf else hf_spec_name(family, {"tie_word_embeddings": tied},
                                                                            source.path))
        spec_obj = layout_spec(spec_name)
        layout = resolve(spec_obj, Topology(), source.sizes)
        _check_param_only(layout, spec_name)
        dtypes = _target_dtypes(source, layout)
        if from_hf:
            config = copy.deepcopy(source.model.config)
        elif family is not None:
            config = hf_config(family, source.sizes, dtypes.values(), carried=source.model.config,
                               hints=source.model.hints, tied=tied)
        else:
            config = None
        return Target(format=self.name, spec_name=spec_name, spec=spec_obj, topology=Topology(),
                      sizes=dict(source.sizes), layout=layout, dtypes=dtypes,
                      model=ModelMeta(config=config, generation_config=copy.deepcopy(source.model.generation_config)))

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
        items, by_key, dtype_of, shards = _shard_plan(target)
        written: list[Path] = []
        for file, names in shards.shards:
            if only is not None and Path(file) not in set(only):
                continue
            spec = {n: (dtype_of[by_key[n]], target.layout.items[by_key[n]].shape) for n in names}
            with SafetensorsWriter(out / file, spec, metadata={"format": "pt"}, open_file=session.open) as w:
                for name in w.order:
                    it = by_key[name]
                    session.stream_item(fill, it, target.layout.items[it].numel, dtype_of[it],
                                        lambda data, name=name: w.write(name, data))
            written.append(Path(file))
        if only:  # a worker's share: index and configs are written by the call with only=()
            return written
        if shards.sharded:
            total_parameters = sum(target.layout.items[it].numel for it in items)
            (out / INDEX_NAME).write_text(shards.index_json(total_parameters), encoding="utf-8")
            written.append(Path(INDEX_NAME))
        config = target.model.config
        if config is None:
            raise CheckpointFormatError(f"{out}: no config.json for this checkpoint (its model family is unknown)")
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        written.append(Path(CONFIG_NAME))
        if target.model.generation_config is not None:
            text = json.dumps(target.model.generation_config, indent=2, sort_keys=True) + "\n"
            (out / GENERATION_CONFIG_NAME).write_text(text, encoding="utf-8")
            written.append(Path(GENERATION_CONFIG_NAME))
        return written

    def files_of(self, target: Target) -> dict[Item, Path]:
        """The shard, relative to the checkpoint directory, that holds each item of ``target``."""
        items, _, _, shards = _shard_plan(target)
        where = shards.weight_map
        return {it: Path(where[it.key]) for it in items}

FORMAT = HFFormat()


def hf_spec_name(family: Family | None, config: Mapping[str, Any], where: Path) -> str:
    """The generated layout of a Hugging Face checkpoint of ``family``: ``hf-<family>``, ``-tied`` when the
    config ties the output projection to the embedding."""
    if family is None:
        raise CheckpointFormatError(f"{where}: no model family; pass a spec")
    tied = bool(config.get("tie_word_embeddings", family.tied_default))
    if tied and not family.can_tie and not family.tied_default:
        raise CheckpointFormatError(f"{where}: tied {family.name} checkpoints are not supported yet "
                                    "(tie_word_embeddings is true)")
    return f"hf-{family.name}" + ("-tied" if tied and family.can_tie else "")
