"""What a model family is: its logical tensors with their Hugging Face names, and what each format needs
to know about them that the names and shapes do not say.

A family is data, declared once in its own module (``reshard/models/llama.py``, ...) and listed in
the registry (``reshard/models/__init__.py``). The formats derive their layouts from it with their
own rules: a Hugging Face checkpoint stores every logical tensor under its own name; DeepSpeed
stores the module's parameters in registration order; DCP splits the columns or rows of the
tensors a tensor-parallel plan splits; Megatron stores the family's own fused names, which the
family spells out in the spec language (``megatron``). No format keeps a copy of a family.
"""

from __future__ import annotations

import re

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["COLWISE", "ROWWISE", "Family", "Tensor"]

COLWISE = 0
"""A tensor-parallel plan splits the tensor's dim 0 (its output features: ``ColwiseParallel``)."""
ROWWISE = 1
"""A tensor-parallel plan splits the tensor's dim 1 (its input features: ``RowwiseParallel``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    """One logical tensor of a family."""

    name: str
    """Its Hugging Face name, with ``{i}`` for the layer and ``{e}`` for the expert."""
    alias: str
    """The short name spec rules refer to it by (``q``, ``gate``, ``embed``)."""
    dims: str
    """Its dims in the spec language, in the orientation of the logical tensor (``(g qpg hd) h``)."""
    hf_dims: str | None = None
    """How Hugging Face stores it, as transformers' module holds it, when that differs (GPT-2's Conv1D weights are
    ``[in, out]``)."""
    tp: int | None = None
    """The dim a tensor-parallel plan splits (``COLWISE``, ``ROWWISE``), or None: replicated."""
    decay: bool = True
    """Whether trainers apply weight decay to it (transformers' Trainer exempts norms and biases)."""
    untied_only: bool = False
    """The output projection: stored only when the model does not tie it to the embedding."""
    parts: tuple[Tensor, ...] = ()
    """The logical tensors this one concatenates where the model itself stores them fused (Phi-3's ``qkv_proj``
    is [q; k; v]): ``dims`` is then a concatenation naming them by alias (``[q: g qpg hd | k: g hd | v: g hd] h``)
    and only the parts are logical tensors."""

    @property
    def ref(self) -> str:
        """What a stored rule of this tensor puts between its name and ``=``: `` -> alias``, or nothing for a
        fused tensor (a concatenation's parts name their own targets)."""
        return "" if self.parts else f" -> {self.alias}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """A model family: its tensors, how its config gives their sizes, and how Megatron stores them."""

    name: str
    model_types: tuple[str, ...]
    """Hugging Face ``config.model_type`` values that are this family."""
    accepts: Callable[[Mapping[str, Any]], bool] = lambda config: True
    """Whether a config of one of ``model_types`` is this family's, where families share a ``model_type``
    (DeepSeek-V3 with and without the queries' compression, told apart by ``q_lora_rank``)."""
    architectures: tuple[str, ...]
    """Hugging Face ``config.architectures`` of this family; the first is what reshard writes."""
    preamble: str
    """``let`` and ``index`` lines the tensors' dims and names use."""
    tensors: tuple[Tensor, ...]
    """Every logical tensor, in the order a Hugging Face checkpoint of it lists them."""
    registration: tuple[str, ...]
    """Aliases in the order ``model.named_parameters()`` registers them (DeepSpeed's flat-buffer order)."""
    hf_order: tuple[str, ...] = ()
    """Aliases in the order reshard writes a Hugging Face checkpoint's state dict (empty: ``tensors``' order)."""
    sizes: tuple[str, ...]
    """The size variables the dims use (``h``, ``heads``, ...)."""
    tied_default: bool = False
    """Whether the family ties its output projection to the embedding unless its config says otherwise."""
    can_tie: bool = True
    """Whether the output projection may be tied (False: always stored, or always tied if it is absent)."""
    sizes_from_config: Callable[[Mapping[str, Any], Path | str], dict[str, int]]
    """The sizes from a Hugging Face config dict (CheckpointFormatError naming what is missing)."""
    config_from_sizes: Callable[[Mapping[str, int], Any], dict[str, Any]]
    """A minimal Hugging Face config dict for the sizes (and the most common of the given dtypes)."""
    megatron: Callable[..., str | None] | None = None
    """The body of the Megatron-core model section (names, fusions, tp splits), given ``tied`` and ``local``
    (Transformer Engine layers or ``--transformer-impl local``); None where Megatron cannot hold it so."""
    megatron_args: Callable[[Mapping[str, int], bool], dict[str, Any]] | None = None
    """The Megatron args of the model's architecture for ``(sizes, tied)`` (layers, widths, norm, activation,
    positions, biases): what a Megatron run of this family is started with."""
    is_megatron: Callable[[Mapping[str, Any]], bool] | None = None
    """Whether a Megatron run's args describe this family (how a Megatron checkpoint names its model)."""
    config_hints: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda args: {}
    """The Hugging Face config fields a Megatron run's args record (epsilon, rope base, tying, routing)."""
    args_from_config: Callable[[Any], dict[str, Any]] = lambda config: {}
    """The Megatron args a Hugging Face config implies beyond the sizes (the inverse of ``config_hints``)."""
    megatron_moe_args: Callable[..., dict[str, Any]] | None = None
    """Megatron's mixture-of-experts args from the sizes, the config and the hints (MoE families)."""
    megatron_legacy: Callable[[bool], str | None] | None = None
    """The body of the legacy (non-mcore) Megatron-LM model section given ``tied``, where it exists."""
    torch_dist: bool = False
    """Whether megatron-core's torch_dist holds the model as it holds the family's ``megatron`` layout (Transformer
    Engine names, which megatron-core's local layers map theirs to there, but for an MoE layer's pre-MLP norm), each
    tensor whole, experts stacked, layers stacked too or, where they are of several kinds, keyed one by one:
    ``mcore-dist`` derives its layout from that one (``reshard.formats.specs``); Megatron-Bridge saves its layouts
    (the Gemma families') through the same dist_checkpointing, so they have one too."""
    experts: bool = False
    """A mixture-of-experts family: expert tensors split over ``ep`` in Megatron."""
    buffers: tuple[str, ...] = ()
    """Aliases of persistent buffers: in the model's state dict, but no parameter (in no optimizer state or flat
    buffer, never sharded by FSDP); DeepSeek-V3's expert-choice bias."""
    sizes_from_args: Callable[[Mapping[str, Any], Callable[..., int]], dict[str, int]] | None = None
    """The sizes a Megatron run's args give beyond Llama's (h, heads, f, layers, vocab), with a reader of one
    integer arg that refuses a missing or bad one; None where Llama's are all."""
    module: tuple[Tensor, ...] = ()
    """The tensors of transformers' module (its state dict: what FSDP2's DCP and DeepSpeed save), in registration
    order, where the module holds them otherwise than the files do: transformers 5 fuses the experts of each MoE
    layer (``mlp.experts.gate_up_proj`` ``[experts, 2f, h]``, ``down_proj`` ``[experts, h, f]``), whose files keep
    them per expert. Each is a stored tensor of the logical ones (``parts``, or ``-> alias`` under another name);
    empty where the module holds the files' tensors (``tensors`` in ``registration`` order)."""
    plain_megatron: str = ""
    """What plain megatron-core cannot express of this family, naming the config fields ("" where it can): why
    the Megatron layouts it lacks (``megatron`` None, or None for ``local``) are refused. Such a family's Megatron
    layout, where it has one, is Megatron-Bridge's; its args alone cannot say it (``is_megatron`` is None), so a
    Megatron checkpoint of it is read with its carried ``config.json`` only."""

    def stored(self, tied: bool) -> tuple[Tensor, ...]:
        """The tensors a checkpoint of this family stores, with the output projection tied or not."""
        return tuple(t for t in self.tensors if not (tied and t.untied_only))

    def config_ties(self, config: Any) -> bool:
        """What a Hugging Face config (a config.json's dict) of this family says of tying the output projection to
        the embedding: ``tie_word_embeddings``, by default the family's; anything but a dict says the default."""
        if not isinstance(config, Mapping):
            return self.tied_default
        return bool(config.get("tie_word_embeddings", self.tied_default))

    def tied_in(self, names: Collection[str]) -> bool:
        """Whether a checkpoint holding tensors ``names`` ties the output projection to the embedding."""
        if not self.can_tie:
            return self.tied_default
        return not any(t.untied_only and t.name in names for t in self.tensors)

    @property
    def base_text(self) -> str:
        """What ``include NAME`` gives: the logical tensors, without the output projection where it is optional."""
        return self.logical_text(tied=self.can_tie)

    def logical_text(self, tied: bool) -> str:
        """The family's logical tensors in the spec language."""
        lines = [self.preamble.strip(), ""]
        lines += [f"logical {p.name} as {p.alias} = {p.dims}" for t in self.stored(tied) for p in t.parts or (t,)]
        return "\n".join(lines) + "\n"

    def names(self, name: str, tensors: Collection[Tensor] | None = None) -> bool:
        """Whether ``name`` is one of the family's tensor names (any layer, any expert; tied or not), or of
        ``tensors`` where given."""
        return any(re.fullmatch(re.sub(r"\\\{[A-Za-z_]+\\\}", "[0-9]+", re.escape(t.name)), name)
                   for t in (self.tensors if tensors is None else tensors))

    def by_registration(self, tied: bool) -> list[Tensor]:
        stored = {t.alias: t for t in self.stored(tied)}
        return [stored[a] for a in self.registration if a in stored]

    def module_tensors(self, tied: bool) -> list[Tensor]:
        """The tensors of transformers' module in registration order (``module``, else the files' tensors)."""
        if not self.module:
            return self.by_registration(tied)
        return [t for t in self.module if not (tied and t.untied_only)]

    def module_names(self) -> frozenset[str]:
        """The names (with ``{i}``, ``{e}``) of the module's tensors that are no logical tensor's: its fused ones."""
        def pattern(name: str) -> str:  # which index a layer's tensor is named by does not matter
            return re.sub(r"\{[A-Za-z_]+\}", "{}", name)

        logical = {pattern(p.name) for t in self.tensors for p in t.parts or (t,)}
        return frozenset(t.name for t in self.module_tensors(tied=False) if pattern(t.name) not in logical)

    def module_turned(self) -> tuple[Tensor, ...]:
        """The module's tensors it holds in other dims than the logical ones, under their names: GPT-2's Conv1D
        weights, ``[in, out]`` (``hf_dims``: the files store them as the module holds them)."""
        return tuple(t for t in self.module_tensors(tied=False) if t.hf_dims and t.hf_dims != t.dims)
