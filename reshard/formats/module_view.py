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

The module holds some tensors under the files' names in other dims (GPT-2's Conv1D weights are ``[in, out]``, the
logical ones ``[out, in]``: ``Family.module_turned``), and a tied model's state dict holds its output projection
beside the embedding it is (``lm_head.weight``). A job's checkpoint holds them so, and is read through the module
too: a turned tensor by its dims, the output projection as a second copy of the embedding. Which dims a turned
tensor is in is told by the checkpoint's shapes, all turned tensors together (GPT-2's ``c_attn`` is never square,
its ``c_proj`` may be): a DCP checkpoint that reshard wrote in the logical dims before is read as it is.
"""

from __future__ import annotations

from reshard.core.chunks import through
from reshard.core.layout import Layout
from reshard.core.resolve import resolve
from reshard.core.spec import parse_spec
from reshard.core.topology import Topology
from reshard.errors import CheckpointFormatError, ReshardError
from reshard.formats.base import Source
from reshard.formats.specs import TIED_HEAD, family_of, module_text, source_family
from reshard.models.family import Family

__all__ = ["MODULE_FORMATS", "module_family", "module_layout", "module_tied", "view_layout", "view_source"]

MODULE_FORMATS = ("dcp", "deepspeed", "ucp")
"""The formats that hold a module's state dict, under its names."""


def module_layout(family: Family, sizes: dict[str, int], where: object, tied: bool = False) -> Layout:
    """transformers' module of ``family`` at ``sizes``, unsharded: each tensor of its state dict one item, keyed by
    its name, holding the logical tensors it stores (a ``tied`` model's ``lm_head.weight`` the embedding)."""
    name = f"module-{family.name}{'-tied' if tied else ''}"
    try:
        return resolve(parse_spec(module_text(family, tied), name), Topology(), dict(sizes))
    except ReshardError as e:
        raise CheckpointFormatError(f"{where}: its tensors are named as transformers' {family.name} module holds "
                                    f"them, which cannot be laid out at its sizes: {e}") from e


def module_tied(family: Family, config: object) -> bool:
    """Whether transformers' module of ``family`` with ``config`` (a config.json's dict, or None) ties its output
    projection to the embedding: always, never, or as the config says."""
    return family.config_ties(config) if family.can_tie else family.tied_default


def view_layout(layout: Layout, family: Family, sizes: dict[str, int], where: object,
                tied: bool = False) -> Layout | None:
    """``layout`` in ``family``'s logical tensors where it holds tensors of the family's module that no file holds
    (fused ones), turned ones in the module's dims, or a ``tied`` model's output projection; None where it holds
    none."""
    fused_names = family.module_names()
    viewed = [t for t in family.module_tensors(tied=False) if t.name in fused_names] + list(family.module_turned())
    head = tied and TIED_HEAD in layout.tensors
    if not head and not any(family.names(n, viewed) for n in layout.tensors):  # no resolve without them
        return None
    whole = module_layout(family, sizes, where, tied)
    fused = {it.key for it in whole.items} - set(whole.tensors)
    keys = fused & set(layout.tensors)
    keys |= _turned(layout, whole, family, where)
    return through(layout, whole, keys) if keys else None


def _turned(layout: Layout, whole: Layout, family: Family, where: object) -> set[str]:
    """The tensors of ``layout`` that are held in the module's turned dims: all of its turned ones, or none where it
    holds them in the logical dims (reshard's earlier DCP of GPT-2); by their shapes, a square one as the others.

    Raises:
      CheckpointFormatError: some in the module's dims and some in the logical ones, or in neither.
    """
    turned = family.module_turned()
    names = [n for n in layout.tensors if family.names(n, turned)]
    if not names:
        return set()
    held = {it.key: info.shape for it, info in whole.items.items() if it.key in set(names)}
    module, logical, neither = [], [], []
    for n in names:
        shape, logical_shape = layout.tensors[n].shape, whole.tensors[n].shape
        if shape == held[n] and shape != logical_shape:
            module.append(n)
        elif shape == logical_shape and shape != held[n]:
            logical.append(n)
        elif shape not in (held[n], logical_shape):
            neither.append(f"'{n}' is {list(shape)}, not {list(held[n])}")
    if module and logical:
        neither.append(f"'{module[0]}' is as the module holds it, '{logical[0]}' as its logical tensor")
    if neither:
        raise CheckpointFormatError(f"{where}: a {family.name} checkpoint must hold its tensors all as transformers' "
                                    "module holds them or all as their logical tensors: " + "; ".join(neither[:3]))
    return set() if logical else set(names)


def view_source(source: Source) -> Source:
    """``source`` read in its family's logical tensors, where it is a checkpoint of a module's state dict that holds
    tensors its files do not, or holds some otherwise (``Source.module_names`` says so then); as it is otherwise."""
    family = source_family(source)
    if family is None or source.format not in MODULE_FORMATS or family_of(source.spec_name) is not None:
        return source
    tied = module_tied(family, source.model.config)
    viewed = view_layout(source.layout, family, source.sizes, source.path, tied)
    if viewed is not None:
        source.layout = viewed
        source.module_names = True
    return source


def module_family(source: Source) -> Family | None:
    """The family whose module a DCP target of ``source`` names and lays out its tensors as
    (``Family.module_tensors``), where they differ from the files': fused or turned ones; None where the target
    keeps the source's own names: a family without such tensors, a model of none, or a module checkpoint that holds
    the files' names of fused tensors (a transformers 4 job's)."""
    family = source_family(source)
    if family is None:
        return None
    if family.module_turned():
        return family
    if not family.module_names():
        return None
    if source.format in MODULE_FORMATS and not source.module_names:
        return None
    return family
