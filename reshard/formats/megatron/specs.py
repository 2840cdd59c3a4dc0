"""Which layout describes a Megatron checkpoint, and how Megatron names and orders parameters.

The generated layout's name for a model family and options (``spec_name``) and the flat
``distrib_optim`` sections; ``_resolve``, which applies Megatron's bucketing only where
Megatron does; megatron-core's parameter registration order and the checks a
distributed-optimizer spec must pass against it; expert parameter keys and their
numbering; the vocabulary pad policy of a spec.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from reshard.core.layout import Item, Layout
from reshard.core.resolve import resolve
from reshard.core.spec import Flat, Section, Spec
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError
from reshard.models import Family


def spec_name(family: Family, *, tied: bool = False, distopt: bool = False, ep: int = 1, local: bool = False,
              legacy: bool = False, mtp: bool = False, experts: str = "sequential", etp: bool = False) -> str:
    """The generated layout (``reshard.formats.specs``) of a Megatron checkpoint of ``family``: Megatron-core
    (``-local`` with ``--transformer-impl local``) or the legacy model; ``-tied`` output layer; ``-mtp`` with
    multi-token-prediction layers (``args.mtp_num_layers``); with the distributed optimizer, one coalesced buffer
    (``-distopt-torch``), or at ep > 1 a dense and an expert buffer (``-ep-distopt-torch``), as
    ``distrib_optim.pt`` holds them; ``experts``: ``-grouped`` or ``-tegrouped`` (``reshard.models.moe_experts``);
    ``etp``: experts split over an expert tensor parallelism of their own (whole on every tp rank at 1)."""
    if legacy:
        return f"megatron-legacy-{family.name}{'-tied' if tied and family.can_tie else ''}"
    parts = ["megatron", family.name]
    if tied and family.can_tie:
        parts.append("tied")
    if local:
        parts.append("local")
    if mtp:
        parts.append("mtp")
    if experts != "sequential" and family.experts:
        parts.append(experts)
    if etp and family.experts:
        parts.append("etp")
    if distopt:
        parts += [*(["ep"] if ep > 1 and family.experts else []), "distopt", "torch"]
    return "-".join(parts)


def is_local(name: str) -> bool:
    """Whether a generated Megatron layout is of megatron-core's local layers."""
    return name.startswith("megatron-") and "local" in name.split("-")[2:]


def experts_of(name: str) -> str:
    """How a generated Megatron layout stores its experts: ``grouped``, ``tegrouped`` or ``sequential``."""
    options = name.split("-")[2:] if name.startswith("megatron-") else []
    return next((o for o in ("grouped", "tegrouped") if o in options), "sequential")


def is_legacy(name: str) -> bool:
    return name.startswith("megatron-legacy-")


# The distrib_optim.pt buffers each flat section holds: the dense optimizer's, or the expert optimizer's.
_FLAT_NAMES = {"optim": "distrib_optim", "expert_optim": "expert_distrib_optim"}


def _per_ep(spec: Spec) -> bool:
    """Whether the spec's sections are per expert-parallel rank (the ``_EEE`` files)."""
    return any(isinstance(st, Section) and "ep" in st.axes for st in spec.statements)


def _is_expert(key: str) -> bool:
    """An expert parameter (``allreduce`` False at ep > 1: the expert optimizer's, not the dense one's)."""
    return ".mlp.experts." in key


_EXPERT_NUM = re.compile(r"(\.mlp\.experts\.local_experts\.)([0-9]+)(\.)")


def _renumber_expert(key: str, fn: Callable[[int], int]) -> str:
    return _EXPERT_NUM.sub(lambda m: f"{m.group(1)}{fn(int(m.group(2)))}{m.group(3)}", key, count=1)


def _has_flat(spec: Spec) -> bool:
    return any(isinstance(st, Flat) for st in spec.statements)


def _flat_sections(spec: Spec) -> set[str]:
    out, current = set(), None
    for st in spec.statements:
        if isinstance(st, Section):
            current = st.name
        elif isinstance(st, Flat) and current:
            out.add(current)
    return out


def _without_alone(spec: Spec) -> Spec:
    """``spec`` without its flat buffers' ``alone`` ops."""
    if not any(isinstance(st, Flat) and any(op.op == "alone" for op in st.ops) for st in spec.statements):
        return spec
    return replace(spec, statements=tuple(replace(st, ops=tuple(op for op in st.ops if op.op != "alone"))
                                          if isinstance(st, Flat) else st for st in spec.statements))


def _resolve(spec: Spec, topo: Topology, sizes: Mapping[str, int], states: Mapping[str, tuple[str, ...]]) -> Layout:
    """``resolve``, with Megatron's bucketing only on (pp rank 0, chunk 0).

    DistributedDataParallel drops bucketing on stages with pp rank > 0, and the trainer
    on model chunks > 0 (``disable_bucketing``); a spec has one ``bucket_size``, so the
    flat sections of the other units come from a resolution with ``bucket_size = 0``.
    A tied embedding gets a bucket of its own (the spec's ``alone`` ops) at pp > 1 only: megatron-core marks it
    ``shared_embedding`` on the first and last stage, and not on a single stage.
    """
    if topo.pp == 1:
        spec = _without_alone(spec)
    bucket = int(sizes.get("bucket_size", 0))
    if not bucket or (topo.pp == 1 and topo.vpp == 1):
        return resolve(spec, topo, sizes, states=states)
    one = resolve(spec, topo, {**sizes, "bucket_size": 0}, states=states)
    bucketed = resolve(spec, topo, sizes, states=states)
    flat = _flat_sections(spec)

    def first(it: Item) -> bool:
        return it.section in flat and dict(it.unit).get("pp", 0) == 0 and it.chunk == 0

    items = {it: info for it, info in one.items.items() if not first(it)}
    items.update({it: info for it, info in bucketed.items.items() if first(it)})
    frags = tuple(f for f in one.fragments if not first(f.item)) + tuple(f for f in bucketed.fragments if first(f.item))
    return Layout(topology=topo, tensors=one.tensors, items=MappingProxyType(items), fragments=frags, order=one.order)


# Megatron-core GPT registration order (named_parameters, and so state_dict order):
# GPTModel registers embedding, decoder (layers, then final_layernorm), output_layer;
# TransformerLayer its norms and sublayers; Attention registers core_attention and
# linear_proj before SelfAttention adds linear_qkv (megatron/core/transformer/attention.py).
_TOP = ("embedding.", "decoder.layers.", "decoder.final_layernorm.", "mtp.layers.", "output_layer.")
_LAYER = ("input_layernorm.", "self_attention.", "pre_cross_attn_layernorm.", "cross_attention.",
          "pre_mlp_layernorm.", "mlp.")
_SUB = {
    # MLASelfAttention (multi_latent_attention.py) adds its projections, then its latent norms.
    "self_attention.": ("core_attention.", "linear_proj.", "linear_qkv.", "linear_q_proj.", "linear_q_down_proj.",
                        "linear_q_up_proj.", "linear_kv_down_proj.", "linear_kv_up_proj.", "q_layernorm.",
                        "k_layernorm.", "kv_layernorm."),
    "mlp.": ("router.", "linear_fc1.", "linear_fc2.", "experts.", "shared_experts."),
}
_LAYER_KEY = re.compile(r"decoder\.layers\.([0-9]+)\.(.*)")


_LOCAL_EXPERT = re.compile(r"experts\.local_experts\.([0-9]{1,9})\.linear_fc([12])\.")


# MultiTokenPredictionLayer (multi_token_prediction.py) registers enorm, hnorm, eh_proj, its transformer layer
# (a decoder layer's names), final_layernorm; GPTModel registers the MTP block between decoder and output layer.
_MTP_KEY = re.compile(r"mtp\.layers\.([0-9]+)\.(enorm|hnorm|eh_proj|transformer_layer|final_layernorm)\.(.*)")
_MTP_PARTS = ("enorm", "hnorm", "eh_proj", "transformer_layer", "final_layernorm")


def _mcore_rank(key: str) -> tuple[int, ...] | None:
    """Sort key of a state-dict key in Megatron-core's registration order; None if unknown."""
    extra = int(key.endswith("._extra_state"))
    mtp = _MTP_KEY.fullmatch(key)
    if mtp is not None:
        inner = _mcore_rank(f"decoder.layers.0.{mtp.group(3)}") if mtp.group(2) == "transformer_layer" else \
            (1, 0, 0, 0, 0, 0, extra)
        return None if inner is None else (_TOP.index("mtp.layers."), int(mtp.group(1)),
                                           _MTP_PARTS.index(mtp.group(2)), *inner[2:])
    m = _LAYER_KEY.fullmatch(key)
    if m is None:
        top = next((k for k, p in enumerate(_TOP) if key.startswith(p)), None)
        return None if top is None else (top, 0, 0, 0, 0, 0, extra)
    rest = m.group(2)
    part = next((k for k, p in enumerate(_LAYER) if rest.startswith(p)), None)
    if part is None:
        return None
    sub_names = _SUB.get(_LAYER[part], ())
    tail = rest[len(_LAYER[part]):]
    sub = next((k for k, p in enumerate(sub_names) if tail.startswith(p)), 0 if not sub_names else None)
    if sub is None:
        return None
    # SequentialMLP registers each local expert whole: expert 0's fc1 and fc2, then expert 1's, ...
    e = _LOCAL_EXPERT.match(tail) if sub_names and sub_names[sub] == "experts." else None
    expert = (int(e.group(1)), int(e.group(2))) if e else (0, 0)
    return (1, int(m.group(1)), part, sub, *expert, extra)


def _mcore_order(keys: list[str]) -> list[str]:
    ranks = {}
    for k in keys:
        r = _mcore_rank(k)
        if r is None:
            raise CheckpointFormatError(f"cannot place '{k}' in Megatron-core's parameter registration order")
        ranks[k] = r
    return sorted(keys, key=lambda k: ranks[k])  # stable: a module's own params keep spec order


def _check_registration_order(layout: Layout, spec_name: str, *, strict: bool) -> None:
    """The spec's registration order must be Megatron's where a flat buffer depends on it."""
    if not strict:
        return
    for name, items in layout.order.items():
        keys = [it.key for it in items]
        want = _mcore_order(keys)
        if keys != want:
            k = next(i for i, (a, b) in enumerate(zip(keys, want, strict=True)) if a != b)
            raise CheckpointFormatError(
                f"spec {spec_name} registers '{keys[k]}' where Megatron registers '{want[k]}' ({name}); the "
                "distributed optimizer's buffers follow Megatron's order, so this spec would misplace them")


def _order_name(unit: tuple[tuple[str, int], ...], chunk: int, section: str = "model") -> str:
    """The key of ``Layout.order`` for a unit's model chunk (as ``resolve`` names it)."""
    return f"{section}/{','.join(f'{a}={c}' for a, c in unit)}/{chunk}"


def _with_vocab_pad(spec_ast: Spec, policy: str) -> Spec:
    """``spec_ast`` with every padding of the ``vocab`` axis filled by ``policy`` (zero or last)."""
    from reshard.core.spec import Axis, Concat, Pad, Product, Split, Stored

    def term(t: Any) -> Any:
        if isinstance(t, Pad):
            inner = term(t.term)
            vocab = isinstance(inner, Axis) and inner.name == "vocab"
            return replace(t, term=inner, policy=policy if vocab else t.policy)
        if isinstance(t, Split):
            return replace(t, term=term(t.term))
        if isinstance(t, Product):
            return replace(t, terms=tuple(term(x) for x in t.terms))
        if isinstance(t, Concat):
            return replace(t, parts=tuple(replace(p, terms=tuple(term(x) for x in p.terms)) for p in t.parts))
        return t

    statements = tuple(replace(st, dims=tuple(term(d) for d in st.dims)) if isinstance(st, Stored) and st.dims else st
                       for st in spec_ast.statements)
    return replace(spec_ast, statements=statements)
