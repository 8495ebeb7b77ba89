"""Shape-15's start/end attributes as Shape followed by a Slice of the shape vector."""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import GraphScope, Rewrite


class ShapeSliceRewrite(Rewrite):
    """Shape(start, end) becomes Shape then Slice(starts=[start], ends=[end]) on the shape vector."""

    op_types = frozenset({"Shape"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        start, end = attribute(node, "start"), attribute(node, "end")
        if start is None and end is None:
            return None
        hint = node.name or "Shape"
        full = scope.make_node("Shape", [node.input[0]], 1, f"{hint}/full")
        # Slice clamps out-of-range bounds exactly as Shape-15 clamps start/end.
        starts = scope.add_constant(np.array([start or 0], dtype=np.int64), f"{hint}/start")
        ends_value = np.iinfo(np.int64).max if end is None else int(end)
        ends = scope.add_constant(np.array([ends_value], dtype=np.int64), f"{hint}/end")
        return [full, scope.make_node("Slice", [full.output[0], starts, ends], [node.output[0]], hint)]
