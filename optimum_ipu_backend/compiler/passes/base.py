"""The contract every compiler pass follows.

A pass takes a whole ``onnx.ModelProto`` and returns a new one (it may mutate and return its
argument). Each pass states, in ``guarantee``, the one property the graph has after it runs; the
verify pass checks the union of those properties at the end of the pipeline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import onnx


@dataclass(frozen=True)
class PassContext:
    """What every pass may read: the static shapes asked for and the numeric precision."""

    input_shapes: Mapping[str, Sequence[int]]
    precision: str = "fp32"  # "fp32" or "fp16"


@dataclass
class PassReport:
    """What one pass changed, for `optimum-ipu check` and for logs."""

    name: str
    changed: bool
    summary: str
    nodes_before: int
    nodes_after: int
    ops_removed: dict[str, int] = field(default_factory=dict)
    ops_added: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class GraphPass(ABC):
    """One named rewrite of the graph."""

    name: ClassVar[str]
    guarantee: ClassVar[str]

    def __init__(self) -> None:
        #: What the last run changed, in words, for its PassReport; each run starts it afresh.
        self.notes: list[str] = []

    @abstractmethod
    def run(self, model: onnx.ModelProto, ctx: PassContext) -> onnx.ModelProto:
        """Return the rewritten model."""
