"""Megatron-core's three ways of storing an MoE layer's routed SwiGLU experts (``mlp.experts.``), as layout rules.

- ``sequential`` (``SequentialMLP``, no ``--moe-grouped-gemm``): a module per local expert,
  ``local_experts.{e/ep}.linear_fc1.weight`` ``[gate f/tp | up f/tp] h`` and ``linear_fc2.weight`` ``h f/tp``,
  registered expert by expert.
- ``grouped`` (the legacy ``GroupedMLP``, ``--moe-grouped-gemm --moe-use-legacy-grouped-gemm``): two
  parameters for all local experts, ``weight1`` of shape ``[h, E/ep * 2f/tp]`` and ``weight2`` of shape
  ``[E/ep * f/tp, h]``. The grouped GEMM reads them as ``[E/ep, h, 2f/tp]`` and ``[E/ep, f/tp, h]`` (a view, so
  the bytes are expert-major and ``weight1``'s stored shape is a reshape, not a concatenation), each expert's fc1
  input-major with its gate half then its up half (the GLU chunks the output in two), each tp rank holding the
  same gate and up rows as ``SequentialMLP``'s. No biases (``GroupedMLP`` refuses ``--add-bias-linear``).
- ``tegrouped`` (``TEGroupedMLP``, ``--moe-grouped-gemm`` with Transformer Engine): Transformer Engine's
  ``GroupedLinear`` modules ``linear_fc1`` and ``linear_fc2``, a parameter per local expert,
  ``linear_fc1.weight{e/ep}`` ``[gate f/tp | up f/tp] h`` and ``linear_fc2.weight{e/ep}`` ``h f/tp`` (and
  ``bias{e/ep}``), ``[out, in]`` like ``SequentialMLP``'s. A ``GroupedLinear`` registers all its weights, then
  all its biases, so fc1's come before any of fc2's: the spec language registers a run of rules capturing
  ``{e/ep}`` expert by expert, so this layout holds no distributed-optimizer buffer.

transformers 5 holds them a fourth way in its module (``module_tensors``), whatever its files say: two parameters
per layer, ``mlp.experts.gate_up_proj`` ``[experts, 2f, h]`` (each expert's gate rows, then its up rows) and
``down_proj`` ``[experts, h, f]``, both ``[out, in]`` per expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.models.family import Tensor

__all__ = ["IMPLS", "args_for", "expert_rules", "impl_from_args", "module_tensors"]

IMPLS = ("sequential", "grouped", "tegrouped")
"""The spec options' names: ``sequential`` is the option-less layout."""


def expert_rules(at: str, f: str, names: tuple[str, str, str], *, impl: str = "sequential",
                 biases: tuple[str, str, str] | None = None) -> list[str] | None:
    """The rules of the routed experts under ``at`` (``decoder.layers.{i/pp}.mlp.``) stored as ``impl`` stores
    them: ``names`` the gate, up and down aliases, ``f`` each expert's width; ``biases`` the aliases of the gate,
    up and down biases (``--add-bias-linear``). None where ``impl`` cannot hold them (``grouped`` with biases)."""
    gate, up, down = names
    fc1 = f"[{gate}: {f}/tp | {up}: {f}/tp]"
    fc1_bias = down_bias = ""
    if biases is not None:
        fc1_bias, down_bias = f"[{biases[0]}: {f}/tp | {biases[1]}: {f}/tp]", biases[2]
    if impl == "grouped":
        if biases is not None:
            return None
        return [f"{at}experts.weight1 = {{e}}/ep h {fc1} as (h, 2*experts*{f}/(ep*tp))",
                f"{at}experts.weight2 -> {down} = {{e}}/ep {f}/tp h as (experts*{f}/(ep*tp), h)"]
    if impl == "tegrouped":
        fc1_at, fc2_at, num = f"{at}experts.linear_fc1.", f"{at}experts.linear_fc2.", "{e/ep}"
    else:
        fc1_at = f"{at}experts.local_experts.{{e/ep}}.linear_fc1."
        fc2_at, num = fc1_at.replace("linear_fc1", "linear_fc2"), ""
    return [f"{fc1_at}weight{num} = {fc1} h",
            *([f"{fc1_at}bias{num} = {fc1_bias}"] if biases else []),
            f"{fc2_at}weight{num} -> {down} = h {f}/tp",
            *([f"{fc2_at}bias{num} -> {down_bias} = h"] if biases else [])]


def impl_from_args(args: Mapping[str, Any]) -> str:
    """How a Megatron run stored its experts, from its args: without ``moe_grouped_gemm`` ``sequential``; with
    it ``grouped`` where ``moe_use_legacy_grouped_gemm`` or ``transformer_impl`` ``local`` (the local layers have
    no other grouped experts), else ``tegrouped`` (a Transformer Engine older than 1.7 builds ``GroupedMLP``
    there, which the args do not record: such a checkpoint's ``weight1`` keys are then refused as unknown)."""
    if not args.get("moe_grouped_gemm"):
        return "sequential"
    if args.get("moe_use_legacy_grouped_gemm") or args.get("transformer_impl") == "local":
        return "grouped"
    return "tegrouped"


def args_for(impl: str) -> dict[str, bool]:
    """The args of a Megatron run whose experts are stored as ``impl`` (``impl_from_args`` reads them back)."""
    return {"moe_grouped_gemm": impl != "sequential", "moe_use_legacy_grouped_gemm": impl == "grouped"}


def module_tensors(at: str, f: str, gate: Tensor, up: Tensor, down: Tensor) -> tuple[Tensor, Tensor]:
    """transformers 5's experts under ``at`` (``model.layers.{i}.mlp.experts.``) of the per-expert logical tensors
    ``gate``, ``up``, ``down`` (``{e}`` in their names), ``f`` each expert's width: ``gate_up_proj`` and
    ``down_proj``. No tensor-parallel plan: transformers packs ``gate_up_proj``'s shards (``packed_colwise``)."""
    return (Tensor(name=at + "gate_up_proj", alias=f"{gate.alias}_{up.alias}",
                   dims=f"{{e}} [{gate.alias}: {f} | {up.alias}: {f}] h", parts=(gate, up)),
            Tensor(name=at + "down_proj", alias=down.alias, dims=f"{{e}} h {f}"))
