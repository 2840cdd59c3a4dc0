"""The library's entry points: open, plan, convert, load, verify, inspect.

Each is one call a user or the CLI makes, and each reads as the same pipeline, one layer per step:
open (``reshard.formats``: a format reads a checkpoint's metadata into a ``Source``), resolve (the
format resolves the target's spec in ``reshard.core``: a ``Target``), plan (``reshard.core.planner``),
execute (``reshard.execution``: format writers fed by ``PlanFill``), manifest
(``reshard.execution.manifest``).
"""

from reshard.api.converting import ConvertResult, convert
from reshard.api.inspecting import inspect
from reshard.api.loading import RankState, load
from reshard.api.planning import PlanReport, open_checkpoint, plan
from reshard.api.verifying import VerifyResult, verify

__all__ = ["ConvertResult", "PlanReport", "RankState", "VerifyResult", "convert", "inspect", "load", "open_checkpoint",
           "plan", "verify"]
