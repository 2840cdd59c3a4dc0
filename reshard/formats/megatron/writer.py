"""``_Writer``: each rank's ``model_optim_rng.pt`` (and ``distrib_optim.pt``) and the tracker file.

It builds every rank file's object tree with ``TensorSpec`` leaves (the model state dicts,
the optimizer state dict or the distributed optimizer's buffers, small state as bytes) and
streams the item bytes into it in windows, never building a file in memory.
"""

from __future__ import annotations

import argparse
import re
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

from reshard.core.layout import MASTER, PARAM, Item
from reshard.errors import CheckpointFormatError
from reshard.execution.session import WriteSession
from reshard.formats.base import Fill, Target
from reshard.formats.megatron.etp import etp_ranks, holds_dense_buffers
from reshard.formats.megatron.files import DISTOPT_FILE, MODEL_FILE, TRACKER, _buffer_key, _nested, _rank_dir_name
from reshard.formats.megatron.param_groups import _assign_groups
from reshard.formats.megatron.small import _map_small
from reshard.formats.megatron.specs import _FLAT_NAMES, _is_expert
from reshard.formats.megatron.state import OptimizerKind, state_of
from reshard.io.torch_types import SmallTensor
from reshard.io.torchfile import TensorSpec, TorchDtype, TorchFileWriter



class _Writer:
    """Builds each rank's object trees with TensorSpec leaves and streams the item bytes into them."""

    def __init__(self, target: Target, out: Path, fill: Fill, session: WriteSession,
                 only: Collection[Path] | None = None) -> None:
        self.only = None if only is None else set(only)
        self.session = session
        self.t = target
        self.x = state_of(target)
        self.order: dict[tuple[int, int, int, int], list[tuple[str, Any]]] = self.x.model_order or {}
        self.out = out
        self.fill = fill
        self.topo = target.topology
        self._optim_items: dict[tuple[str, int, int, int, int], dict[str, Item]] = {}
        for it in target.layout.items:
            if it.section in _FLAT_NAMES:
                u = dict(it.unit)
                self._optim_items.setdefault((it.section, u["tp"], u["pp"], u.get("ep", 0), it.chunk), {})[it.state] = it

    def run(self) -> list[Path]:
        x = self.x
        release = x.release
        it_dir = "release" if release else f"iter_{int(x.iteration or 0):07d}"
        distopt = x.optimizer.kind is OptimizerKind.DISTRIBUTED
        written: list[Path] = []
        for t, p, e in etp_ranks(self.topo):  # every (tp, pp, ep), or those Megatron saves at etp != tp
            rel = Path(it_dir) / _rank_dir_name(t, p, self.topo.pp, e, self.topo.ep)
            (self.out / rel).mkdir(parents=True, exist_ok=True)
            if self.only is None or rel / MODEL_FILE in self.only:
                self._file(self.out / rel / MODEL_FILE, self._model_tree(t, p, e))
                written.append(rel / MODEL_FILE)
            if distopt and (self.only is None or rel / DISTOPT_FILE in self.only):
                self._file(self.out / rel / DISTOPT_FILE, self._distopt_tree(t, p, e))
                written.append(rel / DISTOPT_FILE)
        if not self.only:  # the tracker: by a full write, or the call with only=() after parallel workers
            (self.out / TRACKER).write_text("release" if release else str(int(x.iteration or 0)))
            written.append(Path(TRACKER))
        return written

    # -- trees

    def _leaf(self, sources: dict, item: Item) -> TensorSpec:
        key = len(sources)
        sources[key] = item
        return TensorSpec(self._dtype(item), self.t.layout.items[item].shape, key=key)

    def _small_leaf(self, sources: dict, obj: Any) -> Any:
        """A copy of ``obj`` with SmallTensors as TensorSpec leaves, their bytes noted in ``sources``."""
        def leaf(st: SmallTensor) -> TensorSpec:
            key = len(sources)
            sources[key] = st
            return TensorSpec(st.dtype, st.shape, key=key)
        return _map_small(obj, leaf)

    def _dtype(self, item: Item) -> str:
        dtype = self.t.dtypes.get(item)
        if dtype is None:
            dtype = "float32" if item.state != PARAM else "bfloat16"
        return dtype

    def _model_tree(self, t: int, p: int, e: int) -> tuple[dict, dict]:
        x = self.x
        sources: dict[int, Any] = {}  # TensorSpec key -> the Item or SmallTensor its bytes come from
        entries: dict[str, Any] = {
            "args": argparse.Namespace(**x.args),
            "checkpoint_version": x.checkpoint_version,
            "iteration": int(x.iteration or 0),
        }
        chunks = {}
        order = self.order
        for c in range(self.topo.vpp):
            sd = OrderedDict()
            for key, value in order.get((t, p, e, c), []):
                is_item = isinstance(value, Item)
                sd[key] = self._leaf(sources, value) if is_item else self._small_leaf(sources, value.value)
            chunks["model" if self.topo.vpp == 1 else f"model{c}"] = _nested(sd)
        entries.update(chunks)
        optimizer = self._optimizer(t, p, e, sources)
        if optimizer is not None:
            entries["optimizer"] = optimizer
        if x.opt_param_scheduler is not None:
            entries["opt_param_scheduler"] = self._small_leaf(sources, x.opt_param_scheduler)
        for k, v in x.other.items():
            entries[k] = self._small_leaf(sources, v)
        if (t, p, e) in x.rng_state:
            entries["rng_state"] = self._small_leaf(sources, x.rng_state[(t, p, e)])
        return _ordered_top(entries, x.top_keys, list(chunks)), sources

    def _params(self, t: int, p: int, e: int = 0) -> list[tuple[int, str, Item]]:
        """This rank's parameters in named_parameters order over its model chunks."""
        order = self.order
        return [(c, key, v) for c in range(self.topo.vpp) for key, v in order.get((t, p, e, c), [])
                if isinstance(v, Item)]

    def _optimizer(self, t: int, p: int, e: int, sources: dict) -> Any:
        o = self.x.optimizer
        kind = o.kind
        if kind is None:
            return None
        if kind is OptimizerKind.DISTRIBUTED:
            def one(groups: list[dict]) -> dict[str, Any]:
                out: dict[str, Any] = {"optimizer": {"param_groups": self._small_leaf(sources, groups)}}
                if o.has_grad_scaler:
                    out["grad_scaler"] = self._small_leaf(sources, o.grad_scaler)
                return out
            if o.expert_param_groups is None:
                return one(o.param_groups)
            return [one(o.param_groups), one(o.expert_param_groups)]
        params = self._params(t, p, e)
        where = f"{self.t.spec_name} at {self.topo}, rank tp={t}, pp={p}{f', ep={e}' if self.topo.ep > 1 else ''}"
        if o.expert_param_groups is None:
            return self._one_optimizer(params, o.param_groups, sources, where)
        return [self._one_optimizer([x for x in params if not _is_expert(x[1])], o.param_groups, sources, where),
                self._one_optimizer([x for x in params if _is_expert(x[1])], o.expert_param_groups, sources,
                                    where + ", expert optimizer")]

    def _one_optimizer(self, params: list[tuple[int, str, Item]], param_groups: list[dict], sources: dict,
                       where: str) -> Any:
        """One fp16 or fp32 optimizer's state dict over ``params``."""
        o = self.x.optimizer
        kind = o.kind
        groups = [dict(g) for g in param_groups]
        out: dict[str, Any] = {}
        assign = _assign_groups(groups, [(key, self.t.layout.items[it].shape) for _, key, it in params], where)
        state: dict[int, dict] = {}
        masters: list[list[TensorSpec]] = []
        n = 0
        for g, members in enumerate(assign):
            ids, group_masters = [], []
            for k in members:
                _, _, item = params[k]
                ids.append(n)
                per = {}
                for name in o.state_keys:
                    per[name] = self._small_leaf(sources, o.step) if name == "step" else \
                        self._leaf(sources, replace(item, state=name))
                state[n] = per
                if kind is OptimizerKind.FP16:
                    if self._dtype(item) not in ("bfloat16", "float16"):
                        raise CheckpointFormatError(
                            f"{item}: a {self._dtype(item)} weight with an fp32 main param; Megatron keeps main "
                            "params for 16-bit weights only")
                    group_masters.append(self._leaf(sources, replace(item, state=MASTER)))
                n += 1
            groups[g] = self._small_leaf(sources, {**groups[g], "params": ids})
            masters.append(group_masters)
        inner = {"state": {i: state[i] for i in sorted(state) if state[i]}, "param_groups": groups}
        if kind is OptimizerKind.FP32:
            return inner
        out["optimizer"] = inner
        if o.has_grad_scaler:
            out["grad_scaler"] = self._small_leaf(sources, o.grad_scaler)
        out["fp32_from_fp16_params"] = masters
        return out

    def _distopt_tree(self, t: int, p: int, e: int) -> tuple[Any, dict]:
        """distrib_optim.pt of rank (t, p, e): one optimizer's buffers, or [dense, expert] with the dense ones
        only in the ep rank 0 file (its writer is dense data-parallel rank 0; save_parameter_state)."""
        sources: dict[int, Any] = {}
        if self.x.optimizer.expert_param_groups is None:
            return self._buffers_tree("optim", t, p, e, sources), sources
        dense = self._buffers_tree("optim", t, p, e, sources) if holds_dense_buffers(self.topo, e) else None
        return [dense, self._buffers_tree("expert_optim", t, p, e, sources)], sources

    def _buffers_tree(self, section: str, t: int, p: int, e: int, sources: dict[int, Any]) -> dict:
        o = self.x.optimizer
        grad_key = (o.buffer_dtypes or (None, None))[1]
        tree: dict[Any, Any] = {"buckets_coalesced": True}
        gbuf = 0
        for c in range(self.topo.vpp):
            items = self._optim_items.get((section, t, p, e, c))
            if not items:
                continue
            params = [v for k, v in self.order.get((t, p, e, c), []) if isinstance(v, Item)]
            param_dtype = self._dtype(params[0]) if params else "bfloat16"
            grad_dtype = grad_key or ("float32" if self.x.args.get("accumulate_allreduce_grads_in_fp32")
                                      else param_dtype)
            n = self.t.layout.items[next(iter(items.values()))].shape[0]
            buf: dict[str, Any] = {_buffer_key(s): self._leaf(sources, items[s]) for s in o.opt_states}
            buf["numel_unpadded"] = n
            tree[gbuf] = {(TorchDtype(param_dtype), TorchDtype(grad_dtype)): buf}
            gbuf += 1
        return tree

    # -- bytes

    def _file(self, path: Path, tree_and_sources: tuple[Any, dict]) -> None:
        tree, sources = tree_and_sources
        with TorchFileWriter(path, tree, open_file=self.session.open) as w:
            for key in w.entries:
                src = sources[key]
                if isinstance(src, SmallTensor):
                    w.write(key, src.data)
                    continue
                self.session.stream_item(self.fill, src, self.t.layout.items[src].numel, self._dtype(src),
                                         lambda data, key=key: w.write(key, data), at=w.entries[key][0])


_TOP_ORDER = ("args", "checkpoint_version", "iteration", "<models>", "optimizer", "opt_param_scheduler",
              "rerun_state_machine", "rng_state", "num_floating_point_operations_so_far")


def _ordered_top(entries: dict[str, Any], source_keys: list[str], models: list[str]) -> dict[str, Any]:
    """The top-level dict in the source file's key order, else generate_state_dict's."""
    base = [k for k in source_keys if not re.fullmatch(r"model[0-9]*", k)]
    if source_keys:
        first_model = next((i for i, k in enumerate(source_keys) if re.fullmatch(r"model[0-9]*", k)), None)
        if first_model is not None:
            base.insert(sum(1 for k in source_keys[:first_model] if not re.fullmatch(r"model[0-9]*", k)), "<models>")
    order = base or list(_TOP_ORDER)
    for k in _TOP_ORDER:  # entries the source lacked (an optimizer it did not have, ...), in canonical position
        if k not in order:
            after = [o for o in _TOP_ORDER[: _TOP_ORDER.index(k)] if o in order]
            order.insert(order.index(after[-1]) + 1 if after else 0, k)
    out: dict[str, Any] = {}
    for k in order:
        if k == "<models>":
            out.update({m: entries[m] for m in models})
        elif k in entries:
            out[k] = entries[k]
    out.update({k: v for k, v in entries.items() if k not in out})
    return out
