"""What a DeepSpeed target takes from a source of any format: how it is laid out (derived from the source's
tensors, or its family's), the training dtype and the model's identity."""

from __future__ import annotations

import copy

from reshard.core.layout import PARAM
from reshard.errors import CheckpointFormatError
from reshard.formats.base import ModelMeta, Source, require_sizes
from reshard.formats.derived import is_derived
from reshard.formats.specs import require_family, source_family

__all__ = ["derivable", "family_spec", "fp32_weights", "target_model", "weights_dtype"]


def weights_dtype(source: Source) -> str | None:
    """The training dtype: the source's trained params' weights' (not a buffer's), else any weights'; None when
    the source holds no weights (ZeRO-3, a universal checkpoint)."""
    trained = {f.tensor for f in source.layout.fragments if f.state != PARAM}
    weights = [(f.tensor in trained, source.where[f.item].dtype) for f in source.layout.fragments
               if f.state == PARAM and f.item in source.where]
    return max(weights, key=lambda w: w[0])[1] if weights else None


def fp32_weights(source: Source) -> bool:
    """Whether the weights of the source's trained params (those it holds optimizer state for; all, when it
    holds none) are fp32, so that they are the fp32 masters (fp32 training: FSDP2). A frozen param's or a
    buffer's dtype (an int64 counter) says nothing of the masters."""
    trained = {f.tensor for f in source.layout.fragments if f.state != PARAM}
    return all(source.where[f.item].dtype == "float32" for f in source.layout.fragments
               if f.state == PARAM and f.item in source.where and (not trained or f.tensor in trained))


def target_model(source: Source) -> ModelMeta:
    """The model identity a DeepSpeed target writes beside its files (as the transformers Trainer leaves a
    config.json and the tokenizer): the source's, when it records one."""
    family = source_family(source)
    return ModelMeta(family=family.name if family else None, config=copy.deepcopy(source.model.config),
                     generation_config=copy.deepcopy(source.model.generation_config), files=dict(source.model.files),
                     hints=dict(source.model.hints))


def family_spec(source: Source, needs: str, suffix: str = "", prefix: str = "deepspeed") -> str:
    """``<prefix>-<family><suffix>`` of a source whose layout is its family's (``needs`` says why it must be)."""
    family = require_family(source, needs)
    tied = family.can_tie and family.tied_in(source.layout.tensors)
    if prefix != "deepspeed" and (any(t.hf_dims for t in family.tensors) or family.tied_default or tied):
        raise CheckpointFormatError(
            f"{source.path}: a {family.name} model{' tied' * tied}; DeepSpeed's pipeline engine is laid out for a "
            "family only where Hugging Face stores its tensors as the model holds them, untied (not so here: a "
            "pipeline ties its head through tied_modules): convert a DeepSpeed checkpoint of it, or give a spec")
    require_sizes(source, family.sizes, "deepspeed")
    return f"{prefix}-{family.name}{'-tied' * tied}{suffix}"


def derivable(source: Source) -> bool:
    """Whether a DeepSpeed layout of ``source`` is derived from its tensors (no family's layout in it)."""
    return "ds_model" in source.extra or is_derived(source.spec_name) or source_family(source) is None
