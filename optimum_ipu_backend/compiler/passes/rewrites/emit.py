"""The builder a decomposing rewrite writes its replacement nodes with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from .common import GraphScope


class NodeEmitter:
    """Collects the nodes that replace one node, each named after it, and the constants they read."""

    def __init__(self, node: onnx.NodeProto, scope: GraphScope) -> None:
        self.scope = scope
        self.hint = node.name or node.op_type
        self.nodes: list[onnx.NodeProto] = []

    def __call__(
        self, op_type: str, inputs: Sequence[str], suffix: str, output: str | None = None, **attrs: Any
    ) -> str:
        """Append one node; its output is ``output`` (a replaced node's output) or a fresh name."""
        outputs: list[str] | int = [output] if output else 1
        new = self.scope.make_node(op_type, inputs, outputs, f"{self.hint}/{suffix}", **attrs)
        self.nodes.append(new)
        return new.output[0]

    def constant(self, value: Any, dtype: np.dtype | type, suffix: str) -> str:
        return self.scope.add_constant(np.asarray(value, dtype=dtype), f"{self.hint}/{suffix}")

    def shape(self, dims: Sequence[int], suffix: str) -> str:
        """A constant int64 shape, the form Reshape-5 reads at compile time."""
        return self.constant(list(dims), np.int64, suffix)

    def cast(self, name: str, from_type: int, to_type: int, suffix: str) -> str:
        """``name`` converted to ``to_type``; no node when it already has that type."""
        return name if from_type == to_type else self("Cast", [name], suffix, to=to_type)
