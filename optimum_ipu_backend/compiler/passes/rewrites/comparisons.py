"""LessOrEqual/GreaterOrEqual (opset 12) expressed with opset-11 comparisons."""

from __future__ import annotations

import onnx

from .common import FLOAT_TYPES, GraphScope, Rewrite

_STRICT_OPPOSITE = {"LessOrEqual": "Greater", "GreaterOrEqual": "Less"}
_STRICT_SAME = {"LessOrEqual": "Less", "GreaterOrEqual": "Greater"}


class ComparisonRewrite(Rewrite):
    """a<=b / a>=b become Or(Less|Greater, Equal) on floats (NaN-exact) and Not(Greater|Less) on integers."""

    op_types = frozenset({"LessOrEqual", "GreaterOrEqual"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        a, b = node.input[0], node.input[1]
        hint = node.name or node.op_type
        if scope.require_elem_type(a) in FLOAT_TYPES:
            # Not(a > b) would be true when either side is NaN; a<b or a==b is false then, as required.
            strict = scope.make_node(_STRICT_SAME[node.op_type], [a, b], 1, f"{hint}/strict")
            equal = scope.make_node("Equal", [a, b], 1, f"{hint}/equal")
            either = scope.make_node("Or", [strict.output[0], equal.output[0]], [node.output[0]], hint)
            return [strict, equal, either]
        opposite = scope.make_node(_STRICT_OPPOSITE[node.op_type], [a, b], 1, f"{hint}/opposite")
        negated = scope.make_node("Not", [opposite.output[0]], [node.output[0]], hint)
        return [opposite, negated]
