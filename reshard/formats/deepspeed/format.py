"""``DeepSpeedFormat``, the ``deepspeed`` format's entry points: ``detect``, ``open``, ``target``,
``new_target``, ``write`` and ``files_of``; and ``FORMAT``, its instance.

Each dispatches on the checkpoint: ZeRO stage 3 to ``zero3``; ZeRO-1/2, with or without the
pipeline engine, to the methods here, which use ``zero12`` (layout and checks), ``pipe`` (layer
files) and ``write`` (file trees).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from reshard.core.layout import MASTER, PARAM, Item
from reshard.core.resolve import resolve
from reshard.core.topology import Topology, parse_topology
from reshard.errors import CheckpointFormatError, SpecError, TopologyError
from reshard.execution.session import WriteSession
from reshard.formats.base import (
    MAX_COUNT,
    Fill,
    Located,
    ModelMeta,
    Source,
    Target,
    expect_int,
    name_of,
    require_sizes,
)
from reshard.formats.deepspeed.files import (
    _OPTIM_FILE,
    _find_files,
    _get,
    _hf_config,
    _locate,
    _param_shapes,
    _read,
    _write_file,
    model_file,
    optim_file,
)
from reshard.formats.deepspeed.pipe import (
    _check_layers,
    _is_pipeline,
    _layer_files,
    _layer_tree,
    _pipeline_degrees,
    _pipeline_names,
    _pipeline_stages,
)
from reshard.formats.deepspeed.sizes import _llama_sizes
from reshard.formats.deepspeed.state import (
    DeepSpeedExtra,
    DsOptimizer,
    _carry,
    _ds_config,
    _optim_template,
    _template,
    synthesize_extra,
)
from reshard.formats.deepspeed.write import _model_tree, _optim_tree, _write_extra
from reshard.formats.deepspeed.zero3 import files_of_zero3, is_zero3, open_zero3, target_zero3, write_zero3
from reshard.formats.deepspeed.zero12 import (
    _check_model,
    _check_optim,
    _flat_states,
    _groups,
    _ranks,
    _refuse_options,
    _spec_info,
    _splits_over,
    _stage,
)
from reshard.formats.specs import family_of, layout_spec, source_family, target_config
from reshard.models import get_family

__all__ = ["FORMAT", "DeepSpeedFormat"]

DEFAULT_SPEC = "deepspeed-llama"
SPEC_BY_GROUPS = {1: "deepspeed-llama", 2: "deepspeed-llama-hf-trainer"}
"""The shipped spec for a checkpoint with this many param groups."""
PIPE_SPEC_BY_GROUPS = {1: "deepspeed-pipe-llama"}
"""The same for a pipeline-engine checkpoint."""


class DeepSpeedFormat:
    """DeepSpeed ZeRO checkpoints: ``engine.save_checkpoint`` directories (stage 3 read by ``zero3``)."""

    name = "deepspeed"

    def detect(self, path: Path) -> bool:
        try:
            _, _, tag_dir = _locate(Path(path))
            dirs = [tag_dir]
        except CheckpointFormatError:  # a broken 'latest' beside DeepSpeed tag dirs: open names what is wrong
            dirs = [d for d in Path(path).iterdir() if d.is_dir()] if (Path(path) / "latest").is_file() else []
        try:
            return any(_OPTIM_FILE.fullmatch(p.name) or is_zero3([p.name]) for d in dirs for p in d.iterdir())
        except OSError:
            return False

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read a ZeRO-1/2 checkpoint's metadata, resolve its layout and prove the layout against every file.

        ``path`` is the save dir (with ``latest``) or a tag dir. The spec defaults to the
        shipped one for the number of param groups. Sizes come from ``sizes``, else a Hugging
        Face ``config.json`` in the tag dir, the save dir or its parent, else the shapes
        (at tp=1), which cannot tell heads from head dim.

        Raises:
          CheckpointFormatError: naming the file and what disagrees (rank files missing or
            beyond ``dp_world_size``, a param placed elsewhere than the spec says, ...).
        """
        root, tag, tag_dir = _locate(Path(path))
        if is_zero3([p.name for p in tag_dir.iterdir()]):
            return open_zero3(self.name, root, tag, tag_dir, spec=spec, sizes=sizes)
        files = _find_files(Path(path))
        models = [_read(p) for p in files.model]
        first = models[0]
        dp, mp = (expect_int(_get(first, k, files.model[0]), k, files.model[0], lo=1, hi=MAX_COUNT)
                  for k in ("dp_world_size", "mp_world_size"))
        if mp != len(files.model):
            raise CheckpointFormatError(f"{files.model[0]}: mp_world_size is {mp} but {files.tag_dir} "
                                        f"has {len(files.model)} model files")
        pipeline = bool(files.layers) or first.get("module", {}) is None
        pp, tp = _pipeline_degrees(first, files, mp) if pipeline else (1, mp)
        for t, row in enumerate(files.optim):
            if len(row) != dp:
                raise CheckpointFormatError(f"{files.tag_dir}: {len(row)} optimizer files for mp rank {t:02d} but "
                                            f"{files.model[t].name} says dp_world_size={dp}")
            for d in range(dp):
                if (want := files.tag_dir / optim_file(t, d, files.bf16_names)) not in row:
                    raise CheckpointFormatError(f"{want}: missing (dp_world_size={dp})")
        optims = [[_read(p) for p in row] for row in files.optim]
        osd0 = _get(optims[0][0], "optimizer_state_dict", files.optim[0][0], Mapping)
        optimizer = DsOptimizer.ZERO if "zero_stage" in osd0 else DsOptimizer.BF16
        stage = _stage(osd0["zero_stage"], files.optim[0][0]) if optimizer == DsOptimizer.ZERO else 1
        _refuse_options(first, files.model[0])
        shapes = [_param_shapes(tree, p) for tree, p in zip(models, files.model, strict=True)]
        spec_name = spec or (PIPE_SPEC_BY_GROUPS if pipeline else SPEC_BY_GROUPS).get(len(shapes[0]))
        if spec_name is None:
            raise CheckpointFormatError(f"{files.model[0]}: {len(shapes[0])} param groups, and no shipped spec "
                                        "has that many; give a spec")
        parsed = layout_spec(spec_name)
        info = _spec_info(parsed, spec_name)
        for path, groups in zip(files.model, shapes, strict=True):
            if len(info.groups) != len(groups):
                raise CheckpointFormatError(f"{path}: {len(groups)} param groups in param_shapes, "
                                            f"but spec '{spec_name}' has {len(info.groups)} flat buffers")
        if tp > 1 and not _splits_over(parsed, "tp"):
            raise CheckpointFormatError(f"{files.model[0]}: mp_world_size={tp} but spec '{spec_name}' splits "
                                        "nothing over tp; give a spec that says how tp splits the model")
        if pipeline != _is_pipeline(parsed):
            raise CheckpointFormatError(f"{files.tag_dir}: {'a' if pipeline else 'not a'} pipeline-engine checkpoint, "
                                        f"but spec '{spec_name}' describes {'no' if pipeline else 'a'} pipeline")
        named = _pipeline_names([g for tree in shapes for g in tree]) if pipeline else shapes[0]
        all_sizes = _llama_sizes(files, named if tp == 1 else [], sizes, sum(len(g) for tree in shapes for g in tree))
        stages = _pipeline_stages(shapes, all_sizes.get("layers"), pp) if pipeline else None
        try:
            topology = Topology(tp=tp, pp=pp, dp=dp, zero=stage, stages=stages)
        except TopologyError as e:
            raise CheckpointFormatError(f"{files.model[0]}: {e}") from None
        flat_states = _flat_states(optims, files)
        try:
            layout = resolve(parsed, topology, all_sizes, states={info.optim_section: (MASTER, *flat_states)})
        except TopologyError as e:
            raise CheckpointFormatError(f"{files.tag_dir}: {e}") from None
        except SpecError as e:  # most often a size neither given, nor in a config.json, nor told by the shapes
            known = ", ".join(f"{k}={v}" for k, v in sorted(all_sizes.items()))
            raise CheckpointFormatError(f"{files.tag_dir}: spec '{spec_name}' does not resolve with the sizes known "
                                        f"({known}); give the others with sizes, or a config.json\n{e}") from None
        where: dict[Item, Located] = {}
        for m, pt in enumerate(_ranks(topology)):
            groups = _groups(layout, info, pt)
            _check_model(layout, info, models[m], files.model[m], pt, groups, shapes[m], spec_name, where)
            for d in range(dp):
                _check_optim(layout, info, optims[m][d], files.optim[m][d], pt, d, groups, optimizer, flat_states,
                             spec_name, where)
        if pipeline:
            _check_layers(layout, info, files, spec_name, where)
        elastic = not isinstance(osd0["base_optimizer_state"], Mapping)
        extra = DeepSpeedExtra(tag=files.tag, zero_stage=stage, optimizer=optimizer, bf16_names=files.bf16_names,
                               elastic=elastic, model_states=_template(first, files.model[0], drop=("module",)),
                               optim_states=_optim_template(optims[0][0], files.optim[0][0]),
                               module_order=tuple(name_of(k) for k in first["module"] or ()),
                               layer_model_axis=not any(t is None for _, t in files.layers))
        config = _hf_config(files)
        return Source(format=self.name, path=files.root, spec_name=spec_name, spec=parsed, topology=topology,
                      sizes=all_sizes, layout=layout, where=where, model=ModelMeta(config=config or None),
                      extra={"deepspeed": extra})

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        """The DeepSpeed layout of ``source``'s model at ``topology``.

        ``topology.zero`` picks the stage (0: the source's, or 2; 1 under a pipeline). A
        DeepSpeed source's non-tensor state is carried; any other source gets
        ``synthesize_extra``'s. ``pp`` > 1 means the pipeline engine: a pipeline spec
        (by default ``deepspeed-pipe-llama``), whose layer files are written too.
        """
        family = source_family(source)
        if spec is None and family is not None and family.name != "llama":
            raise CheckpointFormatError(f"{source.path}: a {family.name} model; the deepspeed format supports "
                                        "Llama-style models (the llama family) so far")
        # A source that records no family (a universal checkpoint without config.json) is laid out by the llama
        # family's names, which its tensors must match exactly; no config.json then claims which model it is.
        if topology.vpp != 1:
            raise TopologyError(f"DeepSpeed's pipeline engine has no virtual stages: vpp({topology.vpp}) must be 1")
        if topology.cp != 1 or topology.ep != 1:
            raise TopologyError(f"DeepSpeed ZeRO checkpoints here have cp=1 and ep=1, got {topology}")
        if spec is None:
            require_sizes(source, (family or get_family("llama")).sizes, "deepspeed")
        carried = source.extra.get("deepspeed") if source.format == self.name else None
        spec_name = spec or (source.spec_name if carried else DEFAULT_SPEC)
        if spec is None and topology.pp > 1 and not _is_pipeline(layout_spec(spec_name)):
            spec_name = PIPE_SPEC_BY_GROUPS[1]
        pipeline = _is_pipeline(layout_spec(spec_name))
        if topology.pp != 1 and not pipeline:
            raise TopologyError(f"spec '{spec_name}' describes DeepSpeed's engine without a pipeline: pp({topology.pp}) "
                                "must be 1 (give a pipeline spec, such as deepspeed-pipe-llama)")
        default = carried.zero_stage if carried else 3 if "zero3" in source.extra else 2
        stage = topology.zero or (min(default, 1) if pipeline else default)
        if pipeline and stage > 1:
            raise TopologyError(f"DeepSpeed runs ZeRO stage 0 or 1 under a pipeline, not zero={stage}")
        if stage == 3:
            return target_zero3(self.name, source, topology, spec)
        if stage not in (1, 2):
            raise TopologyError(f"DeepSpeed target: writing ZeRO stage {stage} is not supported yet (only 1 and 2); "
                                "give zero=1 or zero=2 in the topology")
        parsed = layout_spec(spec_name)
        info = _spec_info(parsed, spec_name)
        if topology.tp > 1 and not _splits_over(parsed, "tp"):
            raise TopologyError(f"spec '{spec_name}' splits nothing over tp; DeepSpeed at tp({topology.tp}) "
                                "needs a spec that does")
        # The source's order of states: a DeepSpeed source's is its optimizer's key order.
        src_states = list(dict.fromkeys(it.state for it in source.layout.items if it.state != PARAM))
        fp32 = all(loc.dtype == "float32" for it, loc in source.where.items() if it.state == PARAM)
        if MASTER not in src_states and fp32 and any(it.state == PARAM for it in source.where):
            src_states.insert(0, MASTER)  # fp32 training: the weights are the master copy (reshard.api aliases them)
        if MASTER not in src_states:
            raise CheckpointFormatError(f"a DeepSpeed checkpoint needs the fp32 master weights (state '{MASTER}'); "
                                        f"the source has: {', '.join(source.layout.states)}")
        states = (MASTER, *[s for s in src_states if s != MASTER])
        layout = resolve(parsed, topology, source.sizes, states={info.optim_section: states})
        model_dtype = next((loc.dtype for it, loc in source.where.items() if it.state == PARAM), "float32")
        if carried is not None:
            extra = _carry(carried, stage, len(info.groups), spec_name)
        else:
            extra = synthesize_extra(groups=len(info.groups), dtype=model_dtype, zero_stage=stage, states=states[1:],
                                     dp=topology.dp)
        dtypes = {it: model_dtype if it.section in info.model_sections else "float32" for it in layout.items}
        return Target(format=self.name, spec_name=spec_name, spec=parsed, topology=topology, sizes=dict(source.sizes),
                      layout=layout, dtypes=dtypes, model=_model(source, family),
                      extra={"deepspeed": extra})

    def new_target(self, topology: str | Topology, sizes: Mapping[str, int], *, spec: str = DEFAULT_SPEC,
                   dtype: str = "bfloat16", zero_stage: int = 2, states: tuple[str, ...] = ("exp_avg", "exp_avg_sq"),
                   **options: Any) -> Target:
        """A target from scratch with synthesized non-tensor state (``synthesize_extra(**options)``), for fixtures.

        >>> t = FORMAT.new_target("dp=2", {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "layers": 2})
        >>> t.layout.states
        ('exp_avg', 'exp_avg_sq', 'master', 'param')
        """
        topo = parse_topology(topology) if isinstance(topology, str) else topology
        parsed = layout_spec(spec)
        info = _spec_info(parsed, spec)
        layout = resolve(parsed, topo, sizes, states={info.optim_section: (MASTER, *states)})
        options.setdefault("dp", topo.dp)
        extra = synthesize_extra(groups=len(info.groups), dtype=dtype, zero_stage=zero_stage, states=states, **options)
        dtypes = {it: dtype if it.section in info.model_sections else "float32" for it in layout.items}
        family = family_of(spec) if isinstance(spec, str) else None  # a fresh run of a family's model
        return Target(format=self.name, spec_name=spec, spec=parsed, topology=topo, sizes=dict(sizes), layout=layout,
                      model=ModelMeta(family=family.name if family else None),
                      dtypes=dtypes, extra={"deepspeed": extra})

    def write(self, target: Target, out: Path, fill: Fill, session: WriteSession | None = None, *,
              only: Collection[Path] | None = None) -> list[Path]:
        """Write ``latest``, the model files and the optimizer files of ``target`` under ``out``.

        Recomputed for the target topology: ``param_shapes``, ``param_slice_mappings``,
        ``group_paddings``, ``param_alignment_paddings``, ``partition_count``,
        ``dp_world_size``, ``mp_world_size``, ``checkpoint_parallel_dimensions``, and in
        ``ds_config`` the ZeRO stage and ``train_batch_size`` (= micro batch * accumulation
        steps * dp, when the config gives all three). Everything else comes from
        ``target.extra["deepspeed"]`` (synthesized when absent). Module tensors get a
        storage each (DeepSpeed's share their group's flat buffer; torch loads both alike).
        Item bytes come through ``session`` (a fresh one if None): its windows, checksums and progress.
        With ``only``, just those rank files, and not ``config.json`` or ``latest``.
        """
        if "zero3" in target.extra:
            return write_zero3(target, out, fill, session or WriteSession(), only=only)
        info = _spec_info(target.spec, target.spec_name)
        topo = target.topology
        extra, dtype = _write_extra(target, info)
        session = session or WriteSession()
        keep = None if only is None else set(only)
        flat_states = tuple(dict.fromkeys(it.state for it in target.layout.items if it.section == info.optim_section))
        ds_config = _ds_config(extra.model_states.get("ds_config"), topo.dp, extra.zero_stage)
        pipeline = _is_pipeline(target.spec)
        (Path(out) / extra.tag).mkdir(parents=True, exist_ok=True)
        written = []
        for m, pt in enumerate(_ranks(topo)):
            groups = _groups(target.layout, info, pt)
            rel = Path(extra.tag) / model_file(m)
            # A pipeline's model files hold no items: the call that writes the item-less files writes them.
            if keep is None or rel in keep or (pipeline and not keep):
                tree = _model_tree(extra, info, groups, pt, target, ds_config, pipeline)
                _write_file(Path(out) / rel, *tree, fill, target, session)
                written.append(rel)
            for d in range(topo.dp):
                rel = Path(extra.tag) / optim_file(m, d, extra.bf16_names)
                if keep is None or rel in keep:
                    tree = _optim_tree(extra, info, groups, pt, d, flat_states, target, ds_config)
                    _write_file(Path(out) / rel, *tree, fill, target, session)
                    written.append(rel)
        if pipeline:
            for rel, items in _layer_files(target, info, extra).items():
                if keep is None or rel in keep:
                    _write_file(Path(out) / rel, *_layer_tree(target, items), fill, target, session)
                    written.append(rel)
        if keep:  # a worker's share: the files holding no items are written by the call with only=()
            return written
        # As the transformers Trainer leaves it: the model's config.json beside the tag
        # directory, so the checkpoint names its own attention layout.
        config = target_config(target, [dtype])
        if config is not None:
            (Path(out) / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (Path(out) / "latest").write_text(extra.tag)
        return [*written, *([Path("config.json")] if config is not None else []), Path("latest")]


    def files_of(self, target: Target) -> dict[Item, Path]:
        """The file, relative to the checkpoint directory, that holds each item of ``target``."""
        if "zero3" in target.extra:
            return files_of_zero3(target)
        info = _spec_info(target.spec, target.spec_name)
        extra, _ = _write_extra(target, info)
        out = {it: rel for rel, items in _layer_files(target, info, extra).items() for it in items.values()}
        tps = target.topology.tp
        for item in target.layout.items:
            if item in out:
                continue
            u = dict(item.unit)
            mp = u.get("pp", 0) * tps + u.get("tp", 0)
            name = optim_file(mp, u["dp"], extra.bf16_names) if item.section == info.optim_section else model_file(mp)
            out[item] = Path(extra.tag) / name
        return out


FORMAT = DeepSpeedFormat()


def _model(source: Source, family) -> ModelMeta:
    """The model identity a DeepSpeed target writes beside its files (as the transformers Trainer leaves a
    config.json): the source's, when it records one."""
    return ModelMeta(family=family.name if family else None, config=source.model.config,
                     hints=dict(source.model.hints))
