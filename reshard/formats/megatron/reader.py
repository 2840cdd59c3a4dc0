"""``_Reader``: the tensors of a checkpoint's rank files mapped to layout items.

It reads each rank's model state dicts, its per-parameter optimizer state (fp16, fp32,
or the dense + expert pair) or its ``distrib_optim.pt`` buffers, maps every tensor to an
item and every item to a tensor (fail closed both ways), and gathers the non-tensor state
``MegatronFormat.open`` reports in ``Source.extra`` (a ``MegatronState``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from reshard.core.dtypes import SUPPORTED
from reshard.core.layout import MASTER, PARAM, Item, Layout
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.formats.base import Located, expect_int
from reshard.formats.megatron.etp import dense_holder, holds_dense_buffers
from reshard.formats.megatron.files import DISTOPT_FILE, _buffer_key, _buffer_state, _chunks, _flat_items, _Rank
from reshard.formats.megatron.param_groups import _assign_groups
from reshard.formats.megatron.small import _capture, _contiguous_offset, _dtype_name, _is_tensor, _small
from reshard.formats.megatron.specs import (
    _EXPERT_NUM,
    _FLAT_NAMES,
    _LAYER_KEY,
    _is_expert,
    _order_name,
    _renumber_expert,
)
from reshard.formats.megatron.state import MegatronOptimizer, MegatronState, OptimizerKind
from reshard.io.bounds import brief
from reshard.io.torch_types import SmallTensor


class _Reader:
    """Maps the tensors of a checkpoint's rank files to layout items."""

    def __init__(self, ranks: dict[tuple[int, int, int], _Rank], topo: Topology, spec_name: str, per_ep: bool,
                 experts: int) -> None:
        self.ranks = ranks
        self.topo = topo
        self.spec_name = spec_name
        self.per_ep = per_ep  # items carry an ep coordinate (the spec's sections are per ep)
        self.experts = experts
        # per rank: [(chunk, key, TensorRef)] params in named_parameters order, and extra states
        self.params: dict[tuple[int, int, int], list[tuple[int, str, Any]]] = {}
        self.extras: dict[tuple[int, int, int], list[tuple[int, str, Any]]] = {}
        for rk, r in ranks.items():
            ps, xs = [], []
            for c, sd in _chunks(r.obj, topo.vpp, str(r.path)).items():
                if not isinstance(sd, Mapping):
                    raise CheckpointFormatError(f"{r.path}: model chunk {c} is a {type(sd).__name__}, not a state dict")
                for key, value in _flat_items(sd, r.path):
                    if key.endswith("._extra_state") or key == "_extra_state":
                        xs.append((c, key, value))
                    elif _is_tensor(value):
                        ps.append((c, key, value))
                    else:
                        raise CheckpointFormatError(f"{r.path}: '{key}' is a {type(value).__name__}, not a tensor")
            self.params[rk], self.extras[rk] = ps, xs
        self.kind: OptimizerKind | None = None
        self.chained = False  # a ChainedOptimizer of a dense and an expert optimizer (MoE at ep > 1)
        self.state_keys: list[str] = []
        self.step: SmallTensor | None = None
        # per rank: {(chunk, key): {state: TensorRef}}
        self.per_param: dict[tuple[int, int, int], dict[tuple[int, str], dict[str, Any]]] = {}
        self.buffer_dtypes: tuple[str, str] | None = None

    def unit(self, t: int, p: int, e: int) -> tuple[tuple[str, int], ...]:
        return (("tp", t), ("pp", p)) + ((("ep", e),) if self.per_ep else ())

    # -- optimizer

    def optimizer_states(self) -> tuple[str, ...]:
        """Read the optimizer structure of every rank; return the per-parameter state names."""
        states: tuple[str, ...] | None = None
        for _, r in sorted(self.ranks.items()):
            opt = r.obj.get("optimizer")
            kind: OptimizerKind | None
            if opt is None:
                found: tuple[str, ...] = ()
                kind = None
            elif isinstance(opt, list):
                kind, found = self._chained(r, opt)
            elif r.distopt is not None:
                kind, found = OptimizerKind.DISTRIBUTED, self._distributed(r)
            else:
                kind, found = self._one(r, opt, None, "'optimizer'")
            if states is None:
                states, self.kind = found, kind
            elif (found, kind) != (states, self.kind):
                raise CheckpointFormatError(
                    f"{r.path}: optimizer {kind} with states {brief(list(found))}, "
                    f"but other ranks have {self.kind} with {brief(list(states))}")
        return states or ()

    def _one(self, r: _Rank, opt: Any, which: Callable[[str], bool] | None,
             shown: str) -> tuple[OptimizerKind, tuple[str, ...]]:
        """One fp16 or fp32 optimizer's kind and state names, over the params ``which`` selects."""
        if not isinstance(opt, Mapping):
            raise CheckpointFormatError(f"{r.path}: {shown} is a {type(opt).__name__}, expected a Megatron optimizer "
                                        "state dict")
        if "fp32_from_fp16_params" in opt:
            return OptimizerKind.FP16, self._per_param(r, opt.get("optimizer"), opt["fp32_from_fp16_params"], which)
        if "state" in opt and "param_groups" in opt:
            return OptimizerKind.FP32, self._per_param(r, opt, None, which)
        raise CheckpointFormatError(
            f"{r.path}: {shown} has keys {brief(list(opt))}; expected a Megatron optimizer state dict")

    def _chained(self, r: _Rank, opts: list) -> tuple[OptimizerKind, tuple[str, ...]]:
        """``ChainedOptimizer.state_dict()``: the dense optimizer's, then the expert optimizer's (MoE at ep > 1)."""
        experts = any(_is_expert(key) for _, key, _ in self.params[(r.tp, r.pp, r.ep)])
        if len(opts) != 2 or not experts:
            raise CheckpointFormatError(
                f"{r.path}: 'optimizer' is a list of {len(opts)} optimizers (a ChainedOptimizer); only the dense + "
                "expert pair of a mixture-of-experts model is supported")
        self.chained = True
        if r.distopt is not None:
            if not all(isinstance(o, Mapping) and isinstance(o.get("optimizer"), Mapping) for o in opts):
                raise CheckpointFormatError(f"{r.path}: 'optimizer' is not two DistributedOptimizer state dicts")
            return OptimizerKind.DISTRIBUTED, self._distributed(r)
        dense = self._one(r, opts[0], lambda k: not _is_expert(k), "'optimizer'[0] (dense)")
        expert = self._one(r, opts[1], _is_expert, "'optimizer'[1] (experts)")
        if dense != expert:
            raise CheckpointFormatError(
                f"{r.path}: the dense optimizer is {dense[0]} with states {list(dense[1])}, the expert optimizer "
                f"{expert[0]} with {list(expert[1])}")
        return dense

    def _groups(self, r: _Rank, inner: Any) -> list[dict]:
        groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise CheckpointFormatError(f"{r.path}: optimizer has no list of param_groups")
        return groups

    def _per_param(self, r: _Rank, inner: Mapping, masters: Any, which: Callable[[str], bool] | None) -> tuple[str, ...]:
        """fp16/fp32 optimizer: map optimizer index -> param through the param groups."""
        groups = self._groups(r, inner)
        params = [x for x in self.params[(r.tp, r.pp, r.ep)] if which is None or which(x[1])]
        assign = _assign_groups(groups, [(key, tuple(ref.shape)) for _, key, ref in params], str(r.path))
        state = inner.get("state", {})
        if not isinstance(state, Mapping) or not all(isinstance(v, Mapping) for v in state.values()):
            raise CheckpointFormatError(f"{r.path}: optimizer 'state' is not a mapping of parameter index to states")
        if masters is not None and (not isinstance(masters, list) or len(masters) != len(groups)):
            raise CheckpointFormatError(f"{r.path}: fp32_from_fp16_params does not have one list per param group")
        out: dict[tuple[int, str], dict[str, Any]] = {}
        names: tuple[str, ...] | None = None
        for g, members in enumerate(assign):
            indices = groups[g].get("params")
            if not isinstance(indices, list) or not all(type(i) is int for i in indices):
                raise CheckpointFormatError(f"{r.path}: param group {g}'s 'params' is {brief(indices, 60)}, not a "
                                            "list of parameter indices")
            low = [k for k in members if params[k][2].dtype in ("bfloat16", "float16")]
            if masters is not None and (not isinstance(masters[g], list) or len(masters[g]) != len(low)):
                raise CheckpointFormatError(
                    f"{r.path}: fp32_from_fp16_params[{g}] does not hold one main param per 16-bit parameter "
                    f"of param group {g} ({len(low)})")
            for i, k in enumerate(members):
                chunk, key, ref = params[k]
                where = f"{r.path}: optimizer state of '{key}'"
                found: dict[str, Any] = {}
                if masters is not None and k in low:
                    # Float16OptimizerWithFloat16Params keeps main params of its 16-bit params only, in group order.
                    j = low.index(k)
                    m = masters[g][j]
                    if not _is_tensor(m) or tuple(m.shape) != tuple(ref.shape):
                        raise CheckpointFormatError(
                            f"{where}: fp32_from_fp16_params[{g}][{j}] does not have its shape {tuple(ref.shape)}")
                    found[MASTER] = m
                per = state.get(indices[i], {})
                for name, value in per.items():
                    if not isinstance(name, str):
                        raise CheckpointFormatError(f"{where}: state name {brief(name, 40)} is not a string")
                    if name == "step" and _is_tensor(value) and tuple(value.shape) == ():
                        step = _small(value, where + ".step")
                        if self.step is not None and step != self.step:
                            raise CheckpointFormatError(f"{where}: step {step.data.hex()} ({step.dtype}) differs from "
                                                        f"another parameter's {self.step.data.hex()}")
                        self.step = step
                    elif _is_tensor(value) and tuple(value.shape) == tuple(ref.shape) and name not in (PARAM, MASTER):
                        found[name] = value
                    else:
                        shape = tuple(value.shape) if _is_tensor(value) else type(value).__name__
                        raise CheckpointFormatError(
                            f"{where}: state '{name}' ({shape}) does not map to the parameter {tuple(ref.shape)}")
                if not self.state_keys and per:
                    self.state_keys = list(per)
                got = tuple(found)
                if names is None:
                    names = got
                elif got != names:
                    raise CheckpointFormatError(f"{where}: states {list(got)}, other parameters have "
                                                f"{list(names)}")
                out[(chunk, key)] = found
        extra = set(state) - {groups[g]["params"][i] for g, m in enumerate(assign) for i in range(len(m))}
        if extra:
            raise CheckpointFormatError(
                f"{r.path}: optimizer state for index {brief(next(iter(extra)), 40)} belongs to no parameter")
        self.per_param.setdefault((r.tp, r.pp, r.ep), {}).update(out)
        return names or ()

    def _distributed(self, r: _Rank) -> tuple[str, ...]:
        """distrib_optim.pt: one optimizer's buffers, or ``[dense, expert]`` (MoE at ep > 1; ``None`` for the
        dense one except in the ep rank 0 file, whose writer is dense data-parallel rank 0)."""
        d, path = r.distopt, r.distopt_path
        if not isinstance(d, list):
            return self._buffers(r, d, "optim")
        if len(d) != 2 or not any(_is_expert(key) for _, key, _ in self.params[(r.tp, r.pp, r.ep)]):
            raise CheckpointFormatError(
                f"{path}: a list of {len(d)} optimizer states (a ChainedOptimizer); only the dense + expert pair of "
                "a mixture-of-experts model is supported")
        dense = holds_dense_buffers(self.topo, r.ep)
        if d[1] is None or (d[0] is None) == dense:
            raise CheckpointFormatError(
                f"{path}: holds {['dense' if d[0] is not None else None, 'expert' if d[1] is not None else None]}; "
                f"expert-parallel rank {r.ep}'s file holds {'the dense and the expert' if dense else 'the expert'} "
                "optimizer's buffers")
        self.chained = True
        names = self._buffers(r, d[1], "expert_optim")
        if d[0] is not None and self._buffers(r, d[0], "optim") != names:
            raise CheckpointFormatError(f"{path}: the dense and the expert buffers hold different states")
        return names

    def _buffers(self, r: _Rank, d: Any, section: str) -> tuple[str, ...]:
        path = r.distopt_path
        if not isinstance(d, Mapping) or not d.get("buckets_coalesced"):
            raise CheckpointFormatError(
                f"{path}: not the coalesced format of megatron-core >= 0.7 (no 'buckets_coalesced'); "
                "older per-bucket files are not supported yet")
        chunks = sorted(self._chunk_keys(r))
        bufs = {k: v for k, v in d.items() if k != "buckets_coalesced"}
        if set(bufs) != set(range(len(chunks))) or not all(type(k) is int for k in bufs):
            raise CheckpointFormatError(
                f"{path}: buffers {brief(list(bufs))}, expected one per model chunk {list(range(len(chunks)))}")
        out: dict[tuple[int, str], dict[str, Any]] = {}
        names: tuple[str, ...] | None = None
        for gbuf, dtypes in bufs.items():
            if not isinstance(dtypes, Mapping) or len(dtypes) != 1:
                raise CheckpointFormatError(f"{path}: buffer {gbuf} is not one (param_dtype, grad_dtype) group")
            (key, tensors), = dtypes.items()
            pair = (_dtype_name(key[0]), _dtype_name(key[1])) if isinstance(key, tuple) and len(key) == 2 else None
            if pair is None or not set(pair) <= set(SUPPORTED) or not isinstance(tensors, Mapping):
                raise CheckpointFormatError(
                    f"{path}: buffer {gbuf} is {{{brief(key, 60)}: {type(tensors).__name__}}}, expected "
                    "{(param_dtype, grad_dtype): {state: tensor}}")
            if self.buffer_dtypes not in (None, pair):
                raise CheckpointFormatError(
                    f"{path}: buffer {gbuf} has dtypes {pair}, another has {self.buffer_dtypes}")
            self.buffer_dtypes = pair
            found = {}
            for name, value in tensors.items():
                if name == "numel_unpadded":
                    continue
                if not isinstance(name, str) or not _is_tensor(value) or len(value.shape) != 1:
                    raise CheckpointFormatError(f"{path}: buffer {gbuf} entry {brief(name, 40)} is not a 1-D tensor "
                                                "under a state name")
                found[_buffer_state(name)] = value
            n = tensors.get("numel_unpadded")
            n = None if n is None else expect_int(n, f"buffer {gbuf} numel_unpadded", path)
            for name, value in found.items():
                if n is not None and int(value.shape[0]) != n:
                    raise CheckpointFormatError(
                        f"{path}: buffer {gbuf} '{name}' has {value.shape[0]} elements, numel_unpadded is {n}")
            got = tuple(found)
            if names is None:
                names = got
            elif got != names:
                raise CheckpointFormatError(f"{path}: buffer {gbuf} holds {list(got)}, others {list(names)}")
            out[(chunks[gbuf], section)] = found
        self.per_param.setdefault((r.tp, r.pp, r.ep), {}).update(out)
        if names and MASTER not in names:
            raise CheckpointFormatError(f"{path}: no '{_buffer_key(MASTER)}' (fp32 main params) in the buffers")
        return ((MASTER,) + tuple(n for n in names if n != MASTER)) if names else ()

    def _chunk_keys(self, r: _Rank) -> set[int]:
        return set(_chunks(r.obj, self.topo.vpp, str(r.path)))

    # -- items

    def map(self, layout: Layout) -> dict[Item, Located]:
        """Every tensor of every file to its item; fail closed both ways."""
        index = {(it.section, it.unit, it.chunk, it.state, it.key): it for it in layout.items}
        where: dict[Item, Located] = {}

        def place(section: str, rk: tuple[int, int, int], chunk: int, state: str, key: str, ref: Any, path: Path,
                  shown: str) -> None:
            it = index.get((section, self.unit(*rk), chunk, state, key))
            if it is None:
                raise CheckpointFormatError(
                    f"{path}: tensor '{shown}' is not in spec {self.spec_name} at {self.topo}"
                    f"{f' (model chunk {chunk})' if self.topo.vpp > 1 else ''}")
            want = layout.items[it].shape
            if tuple(ref.shape) != want:
                raise CheckpointFormatError(
                    f"{path}: '{shown}' has shape {tuple(ref.shape)}, the layout expects {want}")
            if it in where:
                raise CheckpointFormatError(f"{path}: '{shown}' is stored twice")
            where[it] = Located(path, _contiguous_offset(ref, f"{path}: '{shown}'"), _dtype_name(ref.dtype))

        for rk, r in self.ranks.items():
            for chunk, key, ref in self.params[rk]:
                place("model", rk, chunk, PARAM, key, ref, r.path, key)
            for (chunk, key), states in self.per_param.get(rk, {}).items():
                if r.distopt is not None:
                    for state, ref in states.items():
                        name = _buffer_key(state)
                        shown = f"[{chunk}][{_dtype_pair_text(self.buffer_dtypes)}]['{name}']"
                        if self.chained:
                            shown = f"[{0 if key == 'optim' else 1}]{shown}"
                        place(key, rk, chunk, state, f"{_FLAT_NAMES[key]}.{state}", ref, r.distopt_path or Path(),
                              shown)
                else:
                    for state, ref in states.items():
                        place("model", rk, chunk, state, key, ref, r.path, f"optimizer state '{state}' of {key}")
            if r.distopt is not None:
                self._check_order(layout, rk, r)
        for it in layout.items:  # the dense buffers of ep ranks > 0: replicas of ep rank 0's, stored there only
            u = dict(it.unit)
            if it.section == "optim" and u.get("ep", 0) > 0 and self.chained and it not in where:
                holder = dense_holder(self.topo, u["tp"])  # the ep rank whose file holds them
                twin = replace(it, unit=tuple((a, holder if a == "ep" else c) for a, c in it.unit))
                if twin in where:
                    where[it] = where[twin]
        missing = [it for it, info in layout.items.items() if info.mapped and it not in where]
        if missing:
            it = missing[0]
            u = dict(it.unit)
            r = self.ranks[(u["tp"], u["pp"], u.get("ep", 0))]
            raise CheckpointFormatError(
                f"{r.path.parent}: no tensor for {it} (spec {self.spec_name} expects it)"
                f"{f'; {len(missing) - 1} more missing' if len(missing) > 1 else ''}")
        return where

    def _check_order(self, layout: Layout, rk: tuple[int, int, int], r: _Rank) -> None:
        for chunk in range(self.topo.vpp):
            have = [key for c, key, _ in self.params[rk] if c == chunk]
            want = [it.key for it in layout.order.get(_order_name(self.unit(*rk), chunk), ())]
            if have != want:
                k = next((i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b),
                         min(len(have), len(want)))
                raise CheckpointFormatError(
                    f"{r.path}: model chunk {chunk} registers parameters in another order than spec {self.spec_name} "
                    f"(position {k}: '{(have + [None])[k]}' vs '{(want + [None])[k]}'); "
                    f"{DISTOPT_FILE} cannot be decoded")

    # -- non-tensor state

    def extra(self, args: dict, layout: Layout) -> MegatronState:
        """The non-tensor state of rank (0, 0, 0) (rng states of every rank); ``open`` adds iteration and release."""
        r0 = self.ranks[(0, 0, 0)]
        obj = r0.obj
        known = {"args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "rng_state"}
        known |= {k for k in obj if re.fullmatch(r"model[0-9]*", str(k))}
        opt = obj.get("optimizer")
        groups: list[dict] = []
        expert_groups: list[dict] | None = None
        scaler = None

        def groups_of(one: Any) -> list[dict]:
            inner = one if self.kind is OptimizerKind.FP32 else one.get("optimizer", {})
            return [{k: v for k, v in g.items() if k != "params"} for g in self._groups(r0, inner)]

        if isinstance(opt, list) and self.chained:
            groups, expert_groups = groups_of(opt[0]), groups_of(opt[1])
            opt = opt[0]
        elif isinstance(opt, Mapping):
            groups = groups_of(opt)
        if isinstance(opt, Mapping) and "grad_scaler" in opt:
            scaler = _capture(opt.get("grad_scaler"), f"{r0.path}: grad_scaler")
        extra_state: dict[str, dict[int, Any]] = {}
        places = self.topo.layer_placement(int(args["num_layers"]))
        local_to_global = {(pl.stage, pl.chunk, pl.local): g for g, pl in enumerate(places)}
        local_experts = self.experts // self.topo.ep if self.experts else 0
        for (t, p, e), xs in self.extras.items():
            for chunk, key, value in xs:
                m = _LAYER_KEY.fullmatch(key)
                name = key
                where = f"{self.ranks[(t, p, e)].path}: {key}"
                if m is not None:
                    layer = local_to_global.get((p, chunk, int(m.group(1)))) if len(m.group(1)) < 10 else None
                    expert = _EXPERT_NUM.search(key)
                    if layer is None or (local_experts and expert and not (len(expert.group(2)) < 10 and
                                                                            int(expert.group(2)) < local_experts)):
                        raise CheckpointFormatError(f"{where}: names a layer or expert this rank does not hold")
                    name = f"decoder.layers.{layer}.{m.group(2)}"
                    if local_experts:  # local expert numbers are global ones on ep rank e
                        name = _renumber_expert(name, lambda j: e * local_experts + j)
                per_tp = extra_state.setdefault(name, {})
                value = _capture(value, where)
                if t in per_tp and per_tp[t] != value:  # a replica over ep (dense) that is not one
                    raise CheckpointFormatError(
                        f"{where}: differs from the same entry of another expert-parallel rank; cannot tell "
                        "which to carry")
                per_tp[t] = value
        optimizer = MegatronOptimizer(
            kind=self.kind, param_groups=_capture(groups, f"{r0.path}: param_groups"),
            expert_param_groups=None if expert_groups is None else
            _capture(expert_groups, f"{r0.path}: param_groups of the expert optimizer"),
            grad_scaler=scaler, has_grad_scaler=isinstance(opt, Mapping) and "grad_scaler" in opt,
            step=self.step, state_keys=list(self.state_keys), buffer_dtypes=self.buffer_dtypes)
        return MegatronState(
            args=args,
            top_keys=[str(k) for k in obj],
            other={k: _capture(v, f"{r0.path}: {k}") for k, v in obj.items() if k not in known},
            opt_param_scheduler=_capture(obj.get("opt_param_scheduler"), f"{r0.path}: opt_param_scheduler"),
            optimizer=optimizer,
            rng_state={rk: _capture(r.obj["rng_state"], f"{r.path}: rng_state")
                       for rk, r in self.ranks.items() if "rng_state" in r.obj},
            extra_state=extra_state,
        )


def _dtype_pair_text(pair: tuple[str, str] | None) -> str:
    return "(?)" if pair is None else f"(torch.{pair[0]}, torch.{pair[1]})"
