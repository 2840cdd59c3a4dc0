"""The one exception family of reshard.

Every error a user can cause (a bad spec, topology, checkpoint or plan) is a
``ReshardError``; anything else escaping reshard is a bug.
"""

from __future__ import annotations

__all__ = ["CheckpointFormatError", "PlanError", "ReshardError", "SpecError", "TopologyError"]


class ReshardError(Exception):
    """Base class of every error reshard raises on purpose."""


class TopologyError(ReshardError):
    """A topology string or a parallel layout that cannot hold."""


class PlanError(ReshardError):
    """A copy plan that cannot be built, or one that does not cover its targets exactly."""


class CheckpointFormatError(ReshardError):
    """A checkpoint file that is missing, malformed or unsafe."""


class SpecError(ReshardError):
    """A layout spec that is malformed (syntax) or meaningless (resolution).

    Carries the position so the message can quote the line with a caret under
    the offending token:

        specs/llama.spec:14:46: unknown axis 'gg' (declared axes: h, g, hd)
            decoder.layers.{i}.x = (gg/tp hd) h
                                    ^^
    """

    def __init__(
        self,
        message: str,
        *,
        source: str = "",
        line: int = 0,
        col: int = 0,
        length: int = 1,
        text: str = "",
    ) -> None:
        self.message = message
        self.source = source
        self.line = line  # 1-based; 0 when the error has no position
        self.col = col  # 1-based column of the token's first character
        self.length = max(1, length)
        self.text = text  # the whole source line
        super().__init__(str(self))

    def __str__(self) -> str:
        if not self.line:
            return f"{self.source}: {self.message}" if self.source else self.message
        head = f"{self.source}:{self.line}:{self.col}: {self.message}"
        if not self.text:
            return head
        caret = " " * (self.col - 1) + "^" * self.length
        return f"{head}\n    {self.text}\n    {caret}"
