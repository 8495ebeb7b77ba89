"""Errors raised when a graph cannot be made PopART-ready."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from optimum_ipu_backend.errors import UnsupportedModelError

if TYPE_CHECKING:
    import onnx

    from .passes.base import PassReport

DEFAULT_HINTS = (
    "re-export the model with optimum (a newer or older opset can avoid an operator)",
    "pass static sizes for every dynamic input dimension (input_shapes / --shape NAME=DIMS)",
    "try the other precision (precision='fp32' or 'fp16')",
    "file an issue with the model id and this message so the missing rewrite can be added",
)


@dataclass(frozen=True)
class UnsupportedNode:
    """One node (or graph tensor) that keeps the graph from being PopART-ready."""

    name: str
    op_type: str
    domain: str
    reason: str

    def describe(self) -> str:
        op = f"{self.domain}::{self.op_type}" if self.domain not in ("", "ai.onnx") else self.op_type
        return f"{self.name or '<unnamed>'} ({op}): {self.reason}"


class LegalizationError(UnsupportedModelError):
    """The graph could not be legalized; the message lists every offending node and what to do."""

    def __init__(
        self,
        summary: str,
        nodes: Iterable[UnsupportedNode] = (),
        hints: Iterable[str] | None = None,
    ) -> None:
        self.summary = summary
        self.nodes: list[UnsupportedNode] = list(nodes)
        self.hints: list[str] = list(DEFAULT_HINTS if hints is None else hints)
        # Filled in by the pipeline: what the passes before the failing one did, and which pass failed.
        self.reports: list[PassReport] = []
        self.failed_pass: str | None = None
        # The graph as the failing pass received it (shapes are static once fix_shapes has run).
        self.model: onnx.ModelProto | None = None
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [self.summary]
        if self.nodes:
            lines.append(f"{len(self.nodes)} offending node(s):")
            lines.extend(f"  - {node.describe()}" for node in self.nodes)
        if self.hints:
            lines.append("What you can do:")
            lines.extend(f"  * {hint}" for hint in self.hints)
        return "\n".join(lines)
