"""Checkpoints of a module's state dict, whose names are not the files' names of its model family.

A Hugging Face checkpoint (and a Megatron one, through its family's rules) names a model's tensors as the
family's files do: ``Family.tensors``, the logical tensors. A job's checkpoint (FSDP2's DCP, DeepSpeed's, a
universal folder) names them as the job's module held them, and transformers' modules do not always hold what
their files store: Phi-3 and GPT-OSS store some tensors fused in the files too, and transformers 5 fuses each MoE
layer's experts (``mlp.experts.gate_up_proj``) that Mixtral's, Qwen3-MoE's and DeepSeek-V3's files keep per
expert (``Family.module``). Such a checkpoint is read in its family's logical tensors all the same
(``view_source``), so that it converts to any format; and a DCP target names its tensors as the module holds them
(``module_family``), so that FSDP2 jobs load it.

A module checkpoint whose names are the files' own (a job of transformers 4 holding experts one by one) keeps
them: it is read as it is, and a DCP or DeepSpeed target of it names them so too.
"""

from __future__ import annotations

from reshard.core.chunks import through
from reshard.core.layout import Layout
from reshard.core.resolve import resolve
from reshard.core.spec import parse_spec
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, ReshardError
from reshard.formats.base import Source
from reshard.formats.specs import family_of, module_text, source_family
from reshard.models.family import Family

__all__ = ["MODULE_FORMATS", "module_family", "module_layout", "view_layout", "view_source"]

MODULE_FORMATS = ("dcp", "deepspeed", "ucp")
"""The formats that hold a module's state dict, under its names."""


def module_layout(family: Family, sizes: dict[str, int], where: object) -> Layout:
    """transformers' module of ``family`` at ``sizes``, unsharded: each tensor of its state dict one item, keyed by
    its name, holding the logical tensors it stores."""
    name = f"module-{family.name}"
    try:
        return resolve(parse_spec(module_text(family, tied=False), name), Topology(), dict(sizes))
    except ReshardError as e:
        raise CheckpointFormatError(f"{where}: its tensors are named as transformers' {family.name} module holds "
                                    f"them, which cannot be laid out at its sizes: {e}") from e


def view_layout(layout: Layout, family: Family, sizes: dict[str, int], where: object) -> Layout | None:
    """``layout`` in ``family``'s logical tensors where it holds tensors of the family's module that no file holds
    (fused ones); None where it holds none."""
    fused_names = family.module_names()
    fused_tensors = [t for t in family.module_tensors(tied=False) if t.name in fused_names]
    if not any(family.names(n, fused_tensors) for n in layout.tensors):  # no resolve for a checkpoint without them
        return None
    whole = module_layout(family, sizes, where)
    fused = {it.key for it in whole.items} - set(whole.tensors)
    keys = fused & set(layout.tensors)
    return through(layout, whole, keys) if keys else None


def view_source(source: Source) -> Source:
    """``source`` read in its family's logical tensors, where it is a checkpoint of a module's state dict that holds
    tensors its files do not (``Source.module_names`` says so then); as it is otherwise."""
    family = source_family(source)
    if family is None or source.format not in MODULE_FORMATS or family_of(source.spec_name) is not None:
        return source
    viewed = view_layout(source.layout, family, source.sizes, source.path)
    if viewed is not None:
        source.layout = viewed
        source.module_names = True
    return source


def module_family(source: Source) -> Family | None:
    """The family whose module a DCP target of ``source`` names its tensors as (``Family.module_tensors``), where
    they differ from the files'; None where the target keeps the source's own names: a family without such
    tensors, a model of none, or a module checkpoint that holds the files' names (a transformers 4 job's)."""
    family = source_family(source)
    if family is None or not family.module_names():
        return None
    if source.format in MODULE_FORMATS and not source.module_names:
        return None
    return family
