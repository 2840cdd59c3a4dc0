"""``MegatronFormat``, the ``megatron`` format's entry points, and ``FORMAT``, its instance.

``detect``, ``open`` (read the rank files, choose the spec, map tensors to items),
``target`` (the layout and non-tensor state of a model written at a topology), ``write``
and ``files_of``; the work is done by the sibling modules.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path

from reshard.core.layout import MASTER, PARAM, Item
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.execution.session import WriteSession
from reshard.formats.base import Fill, Progress, Source, Target, check_sizes, require_sizes
from reshard.formats.identity import write_identity
from reshard.formats.megatron.args import (
    _bucket_size,
    _namespace,
    _sizes_from_args,
    _topology_from_args,
    megatron_args,
)
from reshard.formats.megatron.etp import check_etp, etp_ranks, own_etp, restrict
from reshard.formats.megatron.extra import _default_dtypes, _target_state
from reshard.formats.megatron.files import (
    CHECKPOINT_VERSION,
    DISTOPT_FILE,
    MODEL_FILE,
    TRACKER,
    _chunks,
    _flat_items,
    _is_legacy,
    _iteration_dir,
    _Rank,
    _rank0_file,
    _rank_dir_name,
    _read,
)
from reshard.formats.megatron.identity import agreed_family, carried_identity, read_carried, unknown_model
from reshard.formats.megatron.reader import _Reader
from reshard.formats.megatron.small import _is_tensor
from reshard.formats.megatron.specs import (
    _FLAT_NAMES,
    _check_registration_order,
    _flat_sections,
    _has_flat,
    _per_ep,
    _resolve,
    _with_vocab_pad,
    experts_of,
    is_legacy,
    is_local,
    spec_name,
)
from reshard.formats.megatron.state import KEY, MegatronState, carried_args, state_of
from reshard.formats.megatron.writer import _Writer
from reshard.formats.specs import layout_spec, require_family, source_family
from reshard.io.bounds import brief
from reshard.io.location import as_path
from reshard.models import moe_experts


class MegatronFormat:
    """Megatron-LM torch-format checkpoints; see the package docstring (``reshard.formats.megatron``)."""

    name = "megatron"

    def detect(self, path: Path) -> bool:
        path = as_path(path)
        try:
            it_dir = _iteration_dir(path)[0]
        except CheckpointFormatError:  # a broken tracker beside iteration directories: open names what is wrong
            return (path / TRACKER).is_file() and any(re.fullmatch(r"iter_[0-9]{7,}|release", p.name)
                                                       for p in path.iterdir())
        return any(p.name.startswith("mp_rank_") and (p / MODEL_FILE).is_file() for p in it_dir.iterdir())

    def open(self, path: Path, *, spec: str | None = None, sizes: Mapping[str, int] | None = None) -> Source:
        """Read every rank file's pickle (no tensor data) and map each tensor to a layout item.

        ``Source.extra["megatron"]`` is a ``MegatronState`` (``reshard.formats.megatron.state``):

        - ``args``: the ``argparse.Namespace`` attributes of rank (tp 0, pp 0), as a dict;
        - ``iteration``, ``release``, ``checkpoint_version``;
        - ``top_keys``: the file's top-level keys in order;
        - ``other``: other top-level entries (``num_floating_point_operations_so_far``,
          ``rerun_state_machine``, …) of rank (0, 0), tensors as ``SmallTensor``;
        - ``opt_param_scheduler``;
        - ``optimizer``, a ``MegatronOptimizer``: ``kind`` (an ``OptimizerKind``, ``fp16``,
          ``fp32``, ``distributed``, or None), ``param_groups`` (without ``params``),
          ``grad_scaler``, ``step`` (the per-parameter ``step`` all parameters share, or None),
          ``state_keys`` (per-parameter state key order), ``buffer_dtypes`` (distributed:
          ``(param_dtype, grad_dtype)`` names);
        - ``rng_state``: per ``(tp, pp, ep)``, the file's ``rng_state`` tree;
        - ``extra_state``: per ``_extra_state`` key with global layer and expert numbers, per tp rank,
          its value.

        Args:
          path: the save directory (with ``latest_checkpointed_iteration.txt``) or an
            ``iter_XXXXXXX``/``release`` directory.
          spec: a spec name or path instead of the one chosen from ``args``.
          sizes: model sizes overriding or completing ``args`` (``vocab`` when ``args`` lacks
            ``vocab_size``).

        Raises:
          CheckpointFormatError: a missing, extra or inconsistent rank file, an unsupported
            feature, or a tensor no rule maps, naming the file and the key.
        """
        path = as_path(path)
        it_dir, iteration, release = _iteration_dir(path)
        if (it_dir / "metadata.json").exists() or (it_dir / ".metadata").exists():
            raise CheckpointFormatError(
                f"{it_dir}: a torch_dist/DCP checkpoint (metadata.json/.metadata); the megatron format reads "
                "--ckpt-format torch checkpoints (mp_rank_* directories) only")
        first_path = _rank0_file(it_dir)
        first = _read(first_path)
        if "args" not in first:
            raise CheckpointFormatError(f"{first_path}: no 'args', so the topology and model sizes are unknown")
        args = _namespace(first["args"], str(first_path))
        topo = _topology_from_args(args, str(first_path), sum(p.name.startswith("mp_rank_") for p in it_dir.iterdir()))
        distopt = bool(args.get("use_distributed_optimizer"))
        check_etp(topo, f"{first_path}: args", moe=bool(args.get("num_experts")))
        ranks = self._read_ranks(it_dir, topo, first_path, first, iteration)
        if distopt:
            topo = replace(topo, zero=1)
        model_sizes = _sizes_from_args(args, sizes or {}, topo, str(first_path))
        tied = not args.get("untie_embeddings_and_output_weights", False)
        save_dir = path if (path / TRACKER).is_file() else it_dir.parent
        carried, config_path = read_carried(save_dir, save_dir.parent)
        family = agreed_family(args, carried, first_path, config_path, spec=spec)  # what the args (or config) say
        if spec is None and family is None:
            first_tensor = _first_tensor(first, topo, first_path)
            raise CheckpointFormatError(unknown_model(first_path, args, topo.tp, first_tensor))
        if spec is None and family.name == "gpt2":
            if not tied:
                raise CheckpointFormatError(
                    f"{first_path}: GPT-2-style models are supported with the output layer tied to the embedding "
                    "(args.untie_embeddings_and_output_weights is True); give a spec for this one")
            spec = None if _is_legacy(first) else spec_name(family, distopt=distopt)
        if spec is None and family.experts:
            if tied:
                raise CheckpointFormatError(
                    f"{first_path}: a mixture-of-experts model with tied embeddings; the {family.name} family is "
                    "untied: give a spec for this one")
            spec = spec_name(family, local=args.get("transformer_impl") == "local", distopt=distopt, ep=topo.ep,
                             mtp=bool(args.get("mtp_num_layers")), experts=moe_experts.impl_from_args(args),
                             etp=own_etp(topo))
        if spec is None and _is_legacy(first):
            if distopt:
                raise CheckpointFormatError(
                    f"{first_path}: a legacy (non-mcore) model with the distributed optimizer; the legacy layout "
                    "holds Megatron's plain optimizer: give a spec for this one")
            spec = spec_name(family, legacy=True, tied=tied)
        name = spec or spec_name(family, tied=tied, distopt=distopt, local=args.get("transformer_impl") == "local")
        spec_ast = layout_spec(name)
        per_ep = _per_ep(spec_ast)
        if topo.ep > 1 and not per_ep:
            raise CheckpointFormatError(
                f"{first_path}: expert_model_parallel_size={topo.ep}, but spec {name} has no section per ep")
        reader = _Reader(ranks, topo, name, per_ep, model_sizes.get("experts", 0))
        stored = sum(len(ps) for ps in reader.params.values())  # each layer and expert holds a tensor at least
        model_sizes = check_sizes(model_sizes, f"{first_path}: args", counts={"layers": stored, "experts": stored})
        model_sizes["bucket_size"] = _bucket_size(args, topo) if distopt else 0
        # Weights first, so an unknown tensor is named before the optimizer's structure is judged.
        layout = restrict(_resolve(spec_ast, topo, model_sizes, {"model": (PARAM,), "optim": (), "expert_optim": ()}),
                          topo)
        where = reader.map(layout)
        opt_states = reader.optimizer_states()
        if opt_states:
            states = {"model": (PARAM, *opt_states)} if not distopt else \
                {"model": (PARAM,), "optim": opt_states, "expert_optim": opt_states}
            layout = restrict(_resolve(spec_ast, topo, model_sizes, states), topo)
            where = reader.map(layout)
        state = reader.extra(args, layout)
        state.iteration, state.release = iteration, release
        state.checkpoint_version = first.get("checkpoint_version", CHECKPOINT_VERSION)
        return Source(format=self.name, path=path, spec_name=name, spec=spec_ast, topology=topo,
                      sizes=model_sizes, layout=layout, where=where,
                      model=replace(carried, family=family.name if family else None,
                                    hints=family.config_hints(args) if family else {}),
                      progress=Progress(iteration=iteration), extra={KEY: state})

    def _read_ranks(self, it_dir: Path, topo: Topology, first_path: Path, first: dict,
                    iteration: int | None) -> dict[tuple[int, int, int], _Rank]:
        expected = {_rank_dir_name(t, p, topo.pp, e, topo.ep): (t, p, e) for t, p, e in etp_ranks(topo)}
        found = {p.name for p in it_dir.iterdir() if p.name.startswith("mp_rank_") and p.is_dir()}
        missing = sorted(n for n in expected if not (it_dir / n / MODEL_FILE).is_file())
        if missing:
            raise CheckpointFormatError(
                f"{it_dir}: missing rank file {missing[0]}/{MODEL_FILE}"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; args say "
                f"tensor_model_parallel_size={topo.tp}, pipeline_model_parallel_size={topo.pp}"
                f"{f', expert_model_parallel_size={topo.ep}' if topo.ep > 1 else ''}"
                f"{f', expert_tensor_parallel_size={topo.etp}' if own_etp(topo) else ''}")
        extra = sorted(found - set(expected))
        if extra:
            raise CheckpointFormatError(
                f"{it_dir}: unexpected rank directory {extra[0]}; args say tensor_model_parallel_size={topo.tp}, "
                f"pipeline_model_parallel_size={topo.pp}, expert_model_parallel_size={topo.ep} "
                f"({', '.join(sorted(expected))})")
        ranks: dict[tuple[int, int, int], _Rank] = {}
        first_it = first.get("iteration")
        if iteration is not None and first_it is not None and first_it != iteration:
            raise CheckpointFormatError(
                f"{first_path}: iteration {brief(first_it)}, but {TRACKER} says {iteration}; the checkpoint mixes "
                "iterations")
        for name, (t, p, e) in sorted(expected.items(), key=lambda kv: (kv[1][1], kv[1][2], kv[1][0])):
            fpath = it_dir / name / MODEL_FILE
            obj = first if fpath == first_path else _read(fpath)
            if obj.get("iteration") != first_it:
                raise CheckpointFormatError(
                    f"{fpath}: iteration {brief(obj.get('iteration'))}, but {first_path} has iteration "
                    f"{brief(first_it)}; "
                    "the checkpoint mixes iterations")
            if "args" in obj and fpath != first_path:
                a = _namespace(obj["args"], str(fpath))
                got = (a.get("tensor_model_parallel_size"), a.get("pipeline_model_parallel_size"),
                       a.get("expert_model_parallel_size") or 1)
                if got != (topo.tp, topo.pp, topo.ep):
                    raise CheckpointFormatError(
                        f"{fpath}: args say (tp, pp, ep) = {brief(got)}, but {first_path} says "
                        f"tp={topo.tp}, pp={topo.pp}, ep={topo.ep}")
            rank = _Rank(t, p, e, fpath, obj)
            dpath = it_dir / name / DISTOPT_FILE
            if dpath.is_file():
                rank.distopt, rank.distopt_path = _read(dpath, model=False), dpath
            ranks[(t, p, e)] = rank
        with_opt = [r for r in ranks.values() if r.distopt is not None]
        if with_opt and len(with_opt) != len(ranks):
            lacking = next(r for r in ranks.values() if r.distopt is None)
            raise CheckpointFormatError(f"{lacking.path.parent}: missing {DISTOPT_FILE} (other ranks have one)")
        args = _namespace(first["args"], str(first_path))
        if with_opt and not args.get("use_distributed_optimizer", False):
            raise CheckpointFormatError(
                f"{with_opt[0].distopt_path}: found, but args.use_distributed_optimizer is False")
        if (args.get("use_distributed_optimizer") and not args.get("no_save_optim") and "optimizer" in first
                and not with_opt):
            raise CheckpointFormatError(
                f"{it_dir}: args.use_distributed_optimizer is True and the optimizer was saved, but no rank has "
                f"{DISTOPT_FILE}")
        return ranks

    # -- target

    def target(self, source: Source, topology: Topology, *, spec: str | None = None,
               vocab_pad: str | None = None) -> Target:
        """The layout and non-tensor state of ``source``'s model written as Megatron at ``topology``.

        ``vocab_pad`` fills the rows that pad the vocabulary to a multiple of
        ``make_vocab_size_divisible_by * tp``: ``zero``, or ``last`` (copies of the last
        real row, as Megatron's ``tools/checkpoint`` pads when it grows a vocabulary);
        None keeps the spec's own pad policy (the shipped specs pad with zeros).

        The distributed optimizer is used when ``topology.zero`` is 1 (``zero=1`` in a
        topology string) or ``spec`` names a ``-distopt`` spec. ``Target.extra["megatron"]`` is the
        ``MegatronState`` ``write`` needs besides item bytes: ``args`` (updated for the topology),
        ``iteration``, ``checkpoint_version``, ``opt_param_scheduler``, ``optimizer``,
        per-(tp, pp, ep) ``rng_state``, per-(tp, pp, ep, chunk) ``model_order`` (keys, with
        ``_extra_state`` values), ``other`` and ``top_keys``. A mixture-of-experts target at
        ep > 1 gets the dense + expert optimizer pair (``expert_param_groups``).

        RNG state is carried from the source rank with the same (tp, pp, ep) when tp, pp and
        ep are unchanged (and dp too with ``--data-parallel-random-init``); otherwise it is the
        state ``_set_random_seed(args.seed)`` gives that rank at the start of a run
        (``megatron/training/initialize.py``): python ``random``, numpy and torch CPU
        generators seeded ``seed + 100 * pp_rank`` (``+ 10 * dp_rank`` with
        data_parallel_random_init), the CUDA default state and the rng trackers
        ``data-parallel-rng`` (seed), ``model-parallel-rng`` (seed + 2718 + tp_rank),
        ``expert-parallel-rng`` (seed + 1024 + 100 * ep_rank + tp_rank) with offset 0
        (``model_parallel_cuda_manual_seed``).
        """
        if topology.zero > 1:
            raise CheckpointFormatError(f"zero={topology.zero}: Megatron's distributed optimizer is ZeRO-1 (zero=1)")
        if topology.cp > 1:
            raise CheckpointFormatError(f"{topology}: the megatron format does not support cp > 1 yet")
        meg = source.format == self.name and isinstance(source.extra.get(KEY), MegatronState)
        src_args = carried_args(source) if meg else {}  # not meg: Megatron's state is synthesized
        sizes = {k: v for k, v in source.sizes.items() if k != "bucket_size"}
        sizes.setdefault("vocab_div", src_args.get("make_vocab_size_divisible_by") or 128)
        family = source_family(source) if spec is not None else \
            require_family(source, "Megatron stores each family's tensors its own way")
        if meg:
            tied = not src_args.get("untie_embeddings_and_output_weights", False)
        else:  # tied when the family's output projection is not stored on its own
            tied = family is None or family.tied_in(source.layout.tensors)
        if family is not None:
            require_sizes(source, family.sizes, "megatron")
        moe = family is not None and family.experts
        if moe and spec is None and tied:
            raise CheckpointFormatError(f"the {family.name} family is untied; tied embeddings need a spec of their own")
        legacy = meg and is_legacy(source.spec_name) and spec is None
        local = meg and is_local(source.spec_name)
        if topology.etp is None and moe and meg and source.topology.etp == 1:  # the source's etp=1 carries on
            topology = replace(topology, etp=1)
        if topology.etp == topology.tp or (topology.etp is not None and not moe):
            topology = replace(topology, etp=None if topology.etp == topology.tp else topology.etp)
        check_etp(topology, f"topology {topology}", moe=moe)
        name = spec or spec_name(family, tied=tied, distopt=topology.zero == 1, ep=topology.ep, local=local,
                                 legacy=legacy, mtp=sizes.get("hf_layers", 0) > sizes.get("layers", 0),
                                 etp=own_etp(topology))
        spec_ast = layout_spec(name)
        distopt = _has_flat(spec_ast)
        per_ep = _per_ep(spec_ast)
        if topology.ep > 1 and not per_ep:
            raise CheckpointFormatError(
                f"{topology}: ep > 1 needs a mixture-of-experts spec with sections per ep; {name} has none")
        flats = _flat_sections(spec_ast)
        if distopt and "expert_optim" in flats and topology.ep == 1:
            raise CheckpointFormatError(
                f"spec {name} gives experts a buffer of their own, but at ep=1 Megatron keeps them in the dense "
                f"buffer (they are allreduce params); use {spec_name(family, local=is_local(name), distopt=True)}")
        if distopt and moe and topology.ep > 1 and "expert_optim" not in flats:
            raise CheckpointFormatError(
                f"spec {name} keeps experts in the dense buffer, but at ep={topology.ep} Megatron gives them an "
                f"optimizer of their own; use "
                f"{spec_name(family, local=is_local(name), distopt=True, ep=topology.ep)}")
        if legacy and topology.zero == 1:
            raise CheckpointFormatError("zero=1: the legacy Megatron-LM layout has no distributed optimizer; "
                                        "give a spec for the legacy model's buckets")
        topology = replace(topology, zero=1 if distopt else 0)
        src_states = [s for s in source.layout.states if s != PARAM]
        opt_states = ((MASTER,) if MASTER in src_states else ()) + tuple(sorted(set(src_states) - {MASTER}))
        if distopt and opt_states and MASTER not in opt_states:
            raise CheckpointFormatError(
                f"the distributed optimizer stores fp32 main params (state '{MASTER}'), which {source.path} lacks "
                f"(it has {', '.join(opt_states)})")
        states = {"model": (PARAM,), "optim": opt_states, "expert_optim": opt_states} if distopt else \
            {"model": (PARAM, *opt_states)}
        args = megatron_args(sizes, topology, base=src_args, tied=tied, family=family.name if family else "llama")
        if not meg and family is not None:
            try:
                args.update(family.args_from_config(source.model.config))
            except CheckpointFormatError as e:
                raise CheckpointFormatError(f"{source.path}: config.json: {e}") from None
        if moe and not meg:
            args.update(family.megatron_moe_args(sizes, source.model.config or {}, source.model.hints, source.path))
        if is_legacy(name) != (meg and is_legacy(source.spec_name)):  # the model class changes
            args.update(use_legacy_models=is_legacy(name), use_mcore_models=not is_legacy(name))
        if is_local(name) != local:
            args["transformer_impl"] = "local" if is_local(name) else "transformer_engine"
        if moe:
            args.update(moe_experts.args_for(experts_of(name)))
        sizes["bucket_size"] = _bucket_size(args, topology) if distopt else 0
        if vocab_pad is not None:
            if vocab_pad not in ("zero", "last"):
                raise CheckpointFormatError(f"vocab_pad '{vocab_pad}': expected zero or last")
            spec_ast = _with_vocab_pad(spec_ast, vocab_pad)
        layout = restrict(_resolve(spec_ast, topology, sizes, states), topology)
        unit_axes = ("tp", "pp", "ep") if per_ep else ("tp", "pp")
        bad = next((it for it in layout.items if it.section not in ("model", *_FLAT_NAMES)
                    or tuple(a for a, _ in it.unit) != unit_axes), None)
        if bad is not None:
            raise CheckpointFormatError(
                f"spec {name} stores {bad} per {', '.join(a for a, _ in bad.unit) or 'nothing'}; the torch format "
                "holds sections 'model' and 'optim' per (tp, pp) rank, or per (tp, pp, ep) rank for experts "
                "(distrib_optim.pt is gathered on dp rank 0)")
        _check_registration_order(layout, name, strict=distopt)
        state = _target_state(source, topology, layout, args, meg, family.name if family else "llama")
        dtypes = _default_dtypes(source, layout)
        return Target(format=self.name, spec_name=name, spec=spec_ast, topology=topology, sizes=sizes,
                      layout=layout, dtypes=dtypes, model=carried_identity(source, family), extra={KEY: state})

    # -- write

    def write(self, target: Target, out: Path, fill: Fill, session: WriteSession | None = None, *,
              only: Collection[Path] | None = None) -> list[Path]:
        """Write every rank's ``model_optim_rng.pt`` (and ``distrib_optim.pt``) and the tracker file.

        Item bytes come from ``fill`` through ``session`` (its windows, checksums and progress); the files
        are streamed, never built in memory. With ``only``, just
        those rank files and not the tracker. Returns the files written, relative to ``out``.
        """
        written = _Writer(target, Path(out), fill, session or WriteSession(), only).run()
        if not only:  # beside the tracker: the model's identity as the source carried it, for later conversions
            written += write_identity(Path(out), target.model)
        return written

    def files_of(self, target: Target) -> dict[Item, Path]:
        """The file, relative to the checkpoint directory, that holds each item of ``target``."""
        state = state_of(target)
        it_dir = "release" if state.release else f"iter_{int(state.iteration or 0):07d}"
        out = {}
        for item in target.layout.items:
            u = dict(item.unit)
            name = DISTOPT_FILE if item.section in _FLAT_NAMES else MODEL_FILE
            out[item] = Path(it_dir) / _rank_dir_name(u.get("tp", 0), u.get("pp", 0), target.topology.pp,
                                                      u.get("ep", 0), target.topology.ep) / name
        return out


def _first_tensor(first: dict, topo: Topology, where: Path) -> tuple[str, tuple[int, ...]] | None:
    """The first model tensor of a rank file (its key and shape), as the state dict lists it."""
    for sd in _chunks(first, topo.vpp, str(where)).values():
        for key, value in _flat_items(sd, where) if isinstance(sd, Mapping) else ():
            if _is_tensor(value) and not key.endswith("_extra_state"):
                return key, tuple(int(n) for n in value.shape)
    return None


FORMAT = MegatronFormat()
