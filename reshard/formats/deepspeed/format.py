"""``DeepSpeedFormat``, the ``deepspeed`` format's entry points: ``detect``, ``open``, ``target``,
``new_target``, ``write`` and ``files_of``; and ``FORMAT``, its instance.

Each dispatches on the checkpoint: ZeRO stage 3 to ``zero3``; ZeRO-1/2, with or without the
pipeline engine, to the methods here, which use ``zero12`` (layout and checks), ``pipe`` (layer
files) and ``write`` (file trees).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from reshard.core.layout import MASTER, PARAM, Item, Layout
from reshard.core.resolve import resolve
from reshard.core.spec import Spec
from reshard.core.topology import Topology, parse_topology
from reshard.errors import CheckpointFormatError, SpecError, TopologyError
from reshard.execution.session import WriteSession
from reshard.formats.base import (
    MAX_COUNT,
    Fill,
    Located,
    ModelMeta,
    Progress,
    Source,
    Target,
    expect_int,
    expect_step,
    given_sizes,
    name_of,
)
from reshard.formats.deepspeed.derive import (
    DsModel,
    derived,
    model_of_layout,
    model_of_source,
    recorded_model,
    zero12_text,
)
from reshard.formats.deepspeed.files import (
    _OPTIM_FILE,
    _Files,
    _find_files,
    _get,
    _locate,
    _param_shapes,
    _read,
    _write_file,
    config_path,
    model_file,
    optim_file,
)
from reshard.formats.deepspeed.pipe import (
    _check_layers,
    _is_pipeline,
    _layer_files,
    _layer_tree,
    _pipelined,
    _pipeline_degrees,
    _pipeline_names,
    _pipeline_stages,
    recorded_pipeline,
)
from reshard.formats.deepspeed.sizes import _llama_sizes
from reshard.formats.deepspeed.sources import derivable, family_spec, fp32_weights, target_model, weights_dtype
from reshard.formats.deepspeed.state import (
    DeepSpeedExtra,
    DsOptimizer,
    Scalar,
    _carry,
    _ds_config,
    _optim_template,
    _template,
    _without_fragments,
    synthesize_extra,
)
from reshard.formats.deepspeed.write import _model_tree, _optim_tree, _write_extra
from reshard.formats.deepspeed.zero3 import (
    Zero3Extra,
    extra_for_zero12,
    files_of_zero3,
    is_zero3,
    open_zero3,
    target_zero3,
    write_zero3,
)
from reshard.formats.deepspeed.zero12 import (
    _check_model,
    _check_optim,
    _flat_states,
    _groups,
    _ranks,
    _refuse_options,
    _spec_info,
    _SpecInfo,
    _splits_over,
    _stage,
)
from reshard.formats.derived import derived_spec_name, is_derived
from reshard.formats.identity import read_identity, write_identity
from reshard.formats.specs import BUFFERS, family_of, layout_spec, target_config
from reshard.io.location import as_path
from reshard.models import known_family
from reshard.models.config import config_sizes

__all__ = ["FORMAT", "DeepSpeedFormat"]

DEFAULT_SPEC = "deepspeed-llama"
"""``new_target``'s spec: a fresh run of the llama family."""


class DeepSpeedFormat:
    """DeepSpeed ZeRO checkpoints: ``engine.save_checkpoint`` directories (stage 3 read by ``zero3``)."""

    name = "deepspeed"

    def detect(self, path: Path) -> bool:
        try:
            _, _, tag_dir = _locate(as_path(path))
            dirs = [tag_dir]
        except CheckpointFormatError:  # a broken 'latest' beside DeepSpeed tag dirs: open names what is wrong
            dirs = [d for d in as_path(path).iterdir() if d.is_dir()] if (as_path(path) / "latest").is_file() else []
        try:
            return any(_OPTIM_FILE.fullmatch(p.name) or is_zero3([p.name]) for d in dirs for p in d.iterdir())
        except OSError:
            return False

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read a ZeRO checkpoint's metadata, lay it out and prove the layout against every file.

        ``path`` is the save dir (with ``latest``) or a tag dir. Without ``spec`` the layout is derived
        from what the files record (``derive``): every param under its own name in its param group's flat
        buffer, frozen params, persistent buffers and tied copies in the module, so a model of any family,
        or of none, reads alike; a pipeline-engine checkpoint is laid out by the family its ``config.json``
        names, or without one derived too (``pipe.recorded_pipeline``, tp = 1). ``Source.model`` holds the
        ``config.json``, generation config and tokenizer files found in the tag dir, the save dir or its
        parent; the sizes come from that config (when a model family claims it) and ``sizes``; with a
        ``spec``, also from the Llama tensor shapes.

        Raises:
          CheckpointFormatError: naming the file and what disagrees (rank files missing or
            beyond ``dp_world_size``, a param placed elsewhere than the spec says, ...).
        """
        root, tag, tag_dir = _locate(as_path(path))
        identity = read_identity(tag_dir, root, root.parent)
        if is_zero3([p.name for p in tag_dir.iterdir()]):
            return open_zero3(self.name, root, tag, tag_dir, spec=spec, sizes=sizes, identity=identity)
        files = _find_files(as_path(path))
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
        ds_model = None
        layer_trees = None
        if spec is not None:
            spec_name, parsed = spec, layout_spec(spec)
        elif pipeline and (family_spec_name := _pipeline_spec(identity, files, len(shapes[0]), tp)) is not None:
            spec_name, parsed = family_spec_name, layout_spec(family_spec_name)
        elif pipeline:
            layer_trees = {p: _read(p) for p in files.layers.values()}
            ds_model = recorded_pipeline(models, files, shapes, layer_trees)
            spec_name = _derived_name(ds_model)
            parsed = derived(zero12_text(ds_model, stage, files.tag_dir), files.tag_dir)
        else:
            if tp > 1:
                name, shape = next(((n, s) for g in shapes[0] for n, s in g), ("?", ()))
                raise CheckpointFormatError(
                    f"{files.model[0]}: mp_world_size={tp}, and DeepSpeed does not record how tensor parallelism "
                    f"split its tensors ('{name}' is {list(shape)} on this rank): give a spec that says so")
            ds_model = recorded_model(first, files.model[0], shapes[0])
            spec_name = _derived_name(ds_model)
            parsed = derived(zero12_text(ds_model, stage, files.tag_dir), files.tag_dir)
        info = _spec_info(parsed, spec_name)
        for path, groups in zip(files.model, shapes, strict=True):
            if len(info.groups) != len(groups):
                raise CheckpointFormatError(f"{path}: {len(groups)} param groups in param_shapes, "
                                            f"but spec '{spec_name}' has {len(info.groups)} flat buffers")
        if tp > 1 and not _splits_over(parsed, "tp"):
            raise CheckpointFormatError(f"{files.model[0]}: mp_world_size={tp} but spec '{spec_name}' splits "
                                        "nothing over tp; give a spec that says how tp splits the model")
        if pipeline != _pipelined(parsed, ds_model):
            raise CheckpointFormatError(f"{files.tag_dir}: {'a' if pipeline else 'not a'} pipeline-engine checkpoint, "
                                        f"but spec '{spec_name}' describes {'no' if pipeline else 'a'} pipeline")
        count = sum(len(g) for tree in shapes for g in tree)
        if ds_model is not None:  # nothing is told from the shapes: the config's sizes, and the caller's
            all_sizes = config_sizes(identity.config, config_path(files.tag_dir, files.root),
                                     tensors=len(ds_model.tensors))
            all_sizes.update(given_sizes(sizes))
        else:
            named = _pipeline_names([g for tree in shapes for g in tree]) if pipeline else shapes[0]
            all_sizes = _llama_sizes(files, named if tp == 1 else [], sizes, count)
        stages = _pipeline_stages(shapes, all_sizes.get("layers"), pp) if pipeline and not ds_model else None
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
        empty_layers = _check_layers(layout, info, files, spec_name, where, layer_trees) if pipeline else ()
        elastic = not isinstance(osd0["base_optimizer_state"], Mapping)
        extra = DeepSpeedExtra(tag=files.tag, zero_stage=stage, optimizer=optimizer, bf16_names=files.bf16_names,
                               elastic=elastic, model_states=_template(_without_fragments(first), files.model[0],
                                                                       drop=("module",)),
                               optim_states=_optim_template(optims[0][0], files.optim[0][0]),
                               module_order=tuple(name_of(k) for k in first["module"] or ()),
                               layer_model_axis=not any(t is None for _, t in files.layers),
                               empty_layers=empty_layers)
        steps = first.get("global_steps")
        progress = Progress(iteration=expect_step(steps, "global_steps", files.model[0]) if steps is not None else None)
        return Source(format=self.name, path=files.root, spec_name=spec_name, spec=parsed, topology=topology,
                      sizes=all_sizes, layout=layout, where=where, model=identity, progress=progress,
                      extra={"deepspeed": extra, **({"ds_model": ds_model} if ds_model else {})})

    def target(self, source: Source, topology: Topology, *, spec: str | None = None) -> Target:
        """The DeepSpeed layout of ``source``'s model at ``topology``.

        ``topology.zero`` picks the stage (0: the source's, or 2; 1 under a pipeline). Without ``spec``,
        at tp = pp = 1, the layout is derived (``derive``): a DeepSpeed source's own param groups, frozen
        params, buffers and tied weights; any other source's tensors in the order it records them, in one
        param group. A source laid out by a model family's spec (a Hugging Face Llama, a Megatron
        checkpoint) keeps that family's layout, in ``named_parameters()`` order; tp or pp > 1 needs the
        family (``pp`` > 1 is the pipeline engine: ``deepspeed-pipe-<family>``, whose layer files are
        written too), but for a pipeline derived from a DeepSpeed source, at the source's pp and tp = 1. A
        DeepSpeed source's non-tensor state is carried; any other source gets ``synthesize_extra``'s.
        """
        if topology.vpp != 1:
            raise TopologyError(f"DeepSpeed's pipeline engine has no virtual stages: vpp({topology.vpp}) must be 1")
        if topology.cp != 1 or topology.ep != 1:
            raise TopologyError(f"DeepSpeed ZeRO checkpoints here have cp=1 and ep=1, got {topology}")
        carried = source.extra.get("deepspeed") if source.format == self.name else None
        spec_name = _target_spec(source, topology, spec, carried is not None)
        pipeline = _derived_pipeline(source) if spec_name is None else _is_pipeline(layout_spec(spec_name))
        if topology.pp != 1 and not pipeline:
            raise TopologyError(f"spec '{spec_name}' describes DeepSpeed's engine without a pipeline: "
                                f"pp({topology.pp}) must be 1 (give a pipeline spec, such as deepspeed-pipe-llama)")
        default = carried.zero_stage if carried else 3 if "zero3" in source.extra else 2
        stage = topology.zero or (min(default, 1) if pipeline else default)
        if pipeline and stage > 1:
            raise TopologyError(f"DeepSpeed runs ZeRO stage 0 or 1 under a pipeline, not zero={stage}")
        if stage == 3:
            return target_zero3(self.name, source, topology, spec)
        if stage not in (1, 2):
            raise TopologyError(f"DeepSpeed target: writing ZeRO stage {stage} is not supported yet (only 1, 2 and 3); "
                                "give zero=1, zero=2 or zero=3 in the topology")
        ds_model = model_of_source(source) if spec_name is None else None
        if ds_model is not None:
            spec_name = _derived_name(ds_model)
            parsed = derived(zero12_text(ds_model, stage, source.path), source.path)
        else:
            parsed = layout_spec(spec_name)
        info = _spec_info(parsed, spec_name)
        if topology.tp > 1 and not _splits_over(parsed, "tp"):
            raise TopologyError(f"spec '{spec_name}' splits nothing over tp; DeepSpeed at tp({topology.tp}) "
                                "needs a spec that does")
        states = _target_states(source)
        layout = resolve(parsed, topology, source.sizes, states={info.optim_section: states})
        model_dtype = weights_dtype(source) or "float32"
        if carried is not None:
            extra = _carry(carried, stage, len(info.groups), spec_name)
        else:
            extra = extra_for_zero12(source, stage, len(info.groups), model_dtype, states[1:], topology.dp)
        if ds_model is not None:
            extra = dataclasses.replace(extra, module_order=tuple(k for k, _ in ds_model.module))
        else:
            ds_model = _family_model(spec_name, parsed, layout, info)
        dtypes = {it: model_dtype if it.section in info.model_sections else "float32" for it in layout.items}
        return Target(format=self.name, spec_name=spec_name, spec=parsed, topology=topology, sizes=dict(source.sizes),
                      layout=layout, dtypes=dtypes, model=target_model(source),
                      extra={"deepspeed": extra, **({"ds_model": ds_model} if ds_model else {})})

    def new_target(self, topology: str | Topology, sizes: Mapping[str, int], *, spec: str = DEFAULT_SPEC,
                   model: DsModel | None = None, dtype: str = "bfloat16", zero_stage: int = 2,
                   states: tuple[str, ...] = ("exp_avg", "exp_avg_sq"), **options: Any) -> Target:
        """A target from scratch with synthesized non-tensor state (``synthesize_extra(**options)``), for fixtures:
        laid out by ``spec``, or, given a ``model``, derived from it (``derive``).

        >>> t = FORMAT.new_target("dp=2", {"h": 16, "heads": 4, "g": 2, "hd": 4, "f": 24, "vocab": 100, "layers": 2})
        >>> t.layout.states
        ('exp_avg', 'exp_avg_sq', 'master', 'param')
        """
        topo = parse_topology(topology) if isinstance(topology, str) else topology
        if model is not None:
            spec = _derived_name(model)
            parsed = derived(zero12_text(model, zero_stage, "new_target"), "new_target")
        else:
            parsed = layout_spec(spec)
        info = _spec_info(parsed, spec)
        layout = resolve(parsed, topo, sizes, states={info.optim_section: (MASTER, *states)})
        options.setdefault("dp", topo.dp)
        extra = synthesize_extra(groups=len(info.groups), dtype=dtype, zero_stage=zero_stage, states=states, **options)
        if model is not None:
            extra = dataclasses.replace(extra, module_order=tuple(k for k, _ in model.module))
        dtypes = {it: dtype if it.section in info.model_sections else "float32" for it in layout.items}
        family = family_of(spec) if model is None else None  # a fresh run of a family's model
        model = model or _family_model(spec, parsed, layout, info)
        return Target(format=self.name, spec_name=spec, spec=parsed, topology=topo, sizes=dict(sizes), layout=layout,
                      model=ModelMeta(family=family.name if family else None), dtypes=dtypes,
                      extra={"deepspeed": extra, **({"ds_model": model} if model else {})})

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
        pipeline = _pipelined(target.spec, target.extra.get("ds_model"))
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
                if keep is None or rel in keep or (not items and not keep):  # an empty layer's: item-less
                    _write_file(Path(out) / rel, *_layer_tree(target, items), fill, target, session)
                    written.append(rel)
        if keep:  # a worker's share: the files holding no items are written by the call with only=()
            return written
        # As the transformers Trainer leaves them: the model's config.json (and tokenizer files) beside the tag
        # directory, so the checkpoint names its own model.
        identity = write_identity(Path(out), target.model, target_config(target, [dtype]))
        (Path(out) / "latest").write_text(extra.tag)
        return [*written, *identity, Path("latest")]

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


def _target_spec(source: Source, topology: Topology, spec: str | None, carried: bool) -> str | None:
    """The spec a DeepSpeed target of ``source`` is laid out by; None: derived from the source (``derive``)."""
    if spec is not None:
        return spec
    if _derived_pipeline(source):
        _refuse_restaging(source, topology)
        return None
    if carried and not is_derived(source.spec_name) and (topology.pp == 1 or _is_pipeline(source.spec)):
        return source.spec_name  # a DeepSpeed source laid out by a family's spec or a user's keeps it
    if topology.tp == 1 and topology.pp == 1 and derivable(source):
        return None
    needs = ("DeepSpeed does not record how tensor parallelism splits a tensor" if topology.tp > 1 else
             "the pipeline engine's layers are laid out by the model's family" if topology.pp > 1 else
             "a family's flat buffers follow its registration order")
    return family_spec(source, needs, prefix="deepspeed-pipe" if topology.pp > 1 else "deepspeed")


def _target_states(source: Source) -> tuple[str, ...]:
    """The flat buffers' states: the fp32 master first, then the source's optimizer states in its order."""
    src_states = list(dict.fromkeys(it.state for it in source.layout.items if it.state != PARAM))
    fp32 = fp32_weights(source)
    if MASTER not in src_states and fp32 and any(it.state == PARAM for it in source.where):
        src_states.insert(0, MASTER)  # fp32 training: the weights are the master copy (reshard.api aliases them)
    if MASTER not in src_states:
        raise CheckpointFormatError(f"a DeepSpeed checkpoint needs the fp32 master weights (state '{MASTER}'); "
                                    f"the source has: {', '.join(source.layout.states)}")
    return (MASTER, *[s for s in src_states if s != MASTER])


def _family_model(spec_name: str, spec: Spec, layout: Layout, info: _SpecInfo) -> DsModel | None:
    """The ``DsModel`` of a family's layout outside the pipeline engine (its param groups, its persistent buffers
    for ``buffer_names`` and its tied head for ``shared_params``); None for a user's spec or a pipeline's."""
    if family_of(spec_name) is None or _is_pipeline(spec):
        return None
    groups = [section for section, _ in info.groups]
    buffers = [BUFFERS] if BUFFERS in info.module_sections else []
    return model_of_layout(layout, groups, [s for s in info.module_sections if s not in (*groups, *buffers)],
                           buffers=buffers)


def _derived_name(ds_model: DsModel) -> str:
    """A derived layout's name: ``deepspeed-derived``, or ``deepspeed-pipe-derived`` for the pipeline engine."""
    name = DeepSpeedFormat.name
    return derived_spec_name(f"{name}-pipe" if ds_model.pipeline else name)


def _derived_pipeline(source: Source) -> bool:
    """Whether ``source`` is a pipeline-engine checkpoint laid out from what it records (no family)."""
    ds_model = source.extra.get("ds_model")
    return isinstance(ds_model, DsModel) and ds_model.pipeline


def _refuse_restaging(source: Source, topology: Topology) -> None:
    """A derived pipeline converts at its own pp and tp = 1 only: which layers a stage holds at another pp is
    the model's PipelineModule partitioning, and how tp splits a tensor its code, neither recorded."""
    pp = source.topology.pp
    if topology.pp == pp and topology.tp == 1:
        return
    ds_model: DsModel = source.extra["ds_model"]
    name, stage = next(((n, s) for n, s in ds_model.stages if s > 0), ds_model.stages[-1])
    why = (f"which stage holds '{name}' (on stage {stage} of {pp}) at pp={topology.pp} is the model's "
           "PipelineModule partitioning" if topology.pp != pp else
           f"how tensor parallelism splits '{name}' at tp={topology.tp} is the model's code")
    raise CheckpointFormatError(
        f"{source.path}: a pipeline-engine checkpoint of a model no family describes, at pp={pp}: {why}, which "
        f"DeepSpeed does not record; convert it at pp={pp} and tp=1, or put the model's config.json naming a family "
        "reshard knows beside it (or give a spec, deepspeed-pipe-<family>)")


def _pipeline_spec(identity: ModelMeta, files: _Files, groups: int, tp: int) -> str | None:
    """The spec of a pipeline-engine checkpoint: the family's its config.json names; None (derived from what the
    files record) without one, at tp = 1."""
    family = known_family(identity.config) if isinstance(identity.config, dict) else None
    if family is None and tp == 1:
        return None
    if family is None:
        raise CheckpointFormatError(
            f"{files.tag_dir}: a pipeline-engine checkpoint (layer_*-model_states.pt) at tp={tp}, whose tensors "
            "DeepSpeed stores split without recording how, and no config.json naming a family reshard knows beside "
            "it (in the tag dir, the save dir or its parent): put the model's config.json there, or give a spec "
            "(deepspeed-pipe-<family>)")
    if groups != 1:
        raise CheckpointFormatError(f"{files.model[0]}: {groups} param groups; a pipeline-engine layout has one: "
                                    "give a spec")
    return f"deepspeed-pipe-{family.name}"


def optimizer_groups(source: Source) -> tuple[Any, ...]:
    """A DeepSpeed source's param groups as torch's optimizer gives them (``reshard.formats.dcp.ParamGroup``:
    hyperparameters, params by name in flat-buffer order, the group's Adam ``step``), for a target of another
    format. Empty for another format's source, a layout a spec gives (its groups are the spec's, not named
    params), an elastic checkpoint (which keeps no hyperparameters) or groups holding anything but plain
    values."""
    from reshard.formats.dcp import ParamGroup

    ds_model = source.extra.get("ds_model") if source.format == FORMAT.name else None
    if not isinstance(ds_model, DsModel):
        return ()
    zero12: DeepSpeedExtra | None = source.extra.get("deepspeed")
    zero3: Zero3Extra | None = source.extra.get("zero3")
    if zero12 is not None:
        inner = zero12.optim_states["optimizer_state_dict"]["base_optimizer_state"]
    elif zero3 is not None:
        inner = zero3.optim_states.get("optimizer_state_dict")
    else:
        return ()
    if not isinstance(inner, Mapping):
        return ()
    groups, states = inner.get("param_groups"), inner.get("state") or {}
    if not isinstance(groups, list) or len(groups) != len(ds_model.groups) or not isinstance(states, Mapping):
        return ()
    out = []
    for g, (group, params) in enumerate(zip(groups, ds_model.groups, strict=True)):
        hyper = {k: v for k, v in group.items() if k != "params"} if isinstance(group, Mapping) else None
        if hyper is None or not all(_plain(v) for v in hyper.values()):
            return ()
        step = states.get(g, {}).get("step") if isinstance(states.get(g), Mapping) else None
        out.append(ParamGroup(hyper, tuple(params), step if isinstance(step, Scalar) else None))
    return tuple(out)


def _plain(value: Any) -> bool:
    plain = (bool, int, float, str, type(None))
    return isinstance(value, plain) or (isinstance(value, tuple | list) and all(isinstance(v, plain) for v in value))
