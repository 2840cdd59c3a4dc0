"""reshard: change a training checkpoint's parallel layout, bit-exactly, at disk speed.

Vocabulary, used the same way in code, docs and messages:

- **axis**: a mesh (parallelism) axis: ``tp``, ``pp``, ``dp``, ``cp``, ``ep``, ``edp``.
- **dim**: a tensor dimension.
- **rank**: one process of a topology; **shard**: what one rank holds of one tensor.
- **item**: one stored array (a tensor in a file, or a flat optimizer buffer).
- **fragment**: one box of one logical tensor and where it sits in an item.
- **span**: a byte range in a file.
- **logical tensor**: the full, unpadded, unfused tensor (Hugging Face names).
- **state**: ``param`` (model weights), ``master`` (fp32 master copy), or an
  optimizer state such as ``exp_avg``.
"""

from reshard.errors import CheckpointFormatError, PlanError, ReshardError, SpecError, TopologyError

__version__ = "0.1.0"

# The public names, each from the layer that defines it. They are imported on first use, so that
# ``import reshard.core.spec`` (the spec language, the planner) loads neither torch nor the formats.
_LAZY = {
    "convert": "reshard.api", "inspect": "reshard.api", "load": "reshard.api", "open_checkpoint": "reshard.api",
    "plan": "reshard.api", "verify": "reshard.api",
    "load_spec": "reshard.formats.specs:layout_spec", "resolve": "reshard.core.resolve",
    "Topology": "reshard.core.topology", "parse_topology": "reshard.core.topology",
}

__all__ = [
    "CheckpointFormatError",
    "PlanError",
    "ReshardError",
    "SpecError",
    "Topology",
    "TopologyError",
    "__version__",
    "convert",
    "inspect",
    "load",
    "load_spec",
    "open_checkpoint",
    "parse_topology",
    "plan",
    "resolve",
    "verify",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard' has no attribute '{name}'")
    import importlib

    module, _, attr = module.partition(":")
    return getattr(importlib.import_module(module), attr or name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
