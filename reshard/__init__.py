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

from reshard.api import convert, inspect, load, open_checkpoint, plan, verify  # noqa: E402
from reshard.catalog import load_spec  # noqa: E402
from reshard.layout import resolve  # noqa: E402
from reshard.topology import Topology, parse_topology  # noqa: E402

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
