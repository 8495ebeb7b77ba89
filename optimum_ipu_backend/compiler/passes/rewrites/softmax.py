"""Softmax/LogSoftmax-13 (one axis) expressed with the opset-11 operators (which flatten at axis)."""

from __future__ import annotations

import onnx

from ...graphs import attribute
from .common import GraphScope, Rewrite


class SoftmaxRewrite(Rewrite):
    """Softmax/LogSoftmax-13 over one axis become opset-11 Softmax/LogSoftmax over the last axis."""

    op_types = frozenset({"Softmax", "LogSoftmax"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        if since_version < 13:
            return None  # already the flattening semantics
        axis = int(attribute(node, "axis", -1))
        hint = node.name or node.op_type
        if axis == -1:
            # Opset 11 coerces to [prod(leading dims), last dim]: exactly a softmax over the last axis.
            return [scope.make_node(node.op_type, [node.input[0]], [node.output[0]], hint, axis=-1)]
        rank = scope.require_rank(node.input[0])
        axis = axis + rank if axis < 0 else axis
        if axis == rank - 1:
            return [scope.make_node(node.op_type, [node.input[0]], [node.output[0]], hint, axis=-1)]
        # Swapping the axis with the last one is its own inverse, so the same perm transposes back.
        perm = list(range(rank))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        to_last = scope.make_node("Transpose", [node.input[0]], 1, f"{hint}/to_last", perm=perm)
        normalized = scope.make_node(node.op_type, [to_last.output[0]], 1, hint, axis=-1)
        back = scope.make_node(
            "Transpose", [normalized.output[0]], [node.output[0]], f"{hint}/back", perm=perm
        )
        return [to_last, normalized, back]
