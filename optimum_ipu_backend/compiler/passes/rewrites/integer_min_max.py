"""Min/Max/Clip/Relu on integers (opset 11 and PopART take floats only) as Where over comparisons."""

from __future__ import annotations

import numpy as np
import onnx

from .common import FLOAT_TYPES, GraphScope, Rewrite, input_at, numpy_dtype

_COMPARISON = {"Min": "Less", "Max": "Greater"}
# Min/Max-12, Clip-12 and Relu-14 added the integer types; earlier versions are float-only anyway.
_INTEGER_SINCE = {"Min": 12, "Max": 12, "Clip": 12, "Relu": 14}


def _select(
    scope: GraphScope, op_type: str, a: str, b: str, output: str | None, hint: str
) -> list[onnx.NodeProto]:
    """Min(a, b) as Where(a < b, a, b), Max as Where(a > b, a, b); Where broadcasts like Min/Max do."""
    keep_a = scope.make_node(_COMPARISON[op_type], [a, b], 1, f"{hint}/{_COMPARISON[op_type].lower()}")
    select = scope.make_node("Where", [keep_a.output[0], a, b], [output] if output else 1, hint)
    return [keep_a, select]


class IntegerMinMaxRewrite(Rewrite):
    """Integer Min/Max (n-ary, broadcasting), Clip and Relu become Less/Greater+Where; float ones stay."""

    op_types = frozenset({"Min", "Max", "Clip", "Relu"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        if since_version < _INTEGER_SINCE[node.op_type]:
            return None
        elem_type = scope.require_elem_type(node.input[0])
        if elem_type in FLOAT_TYPES:
            return None  # same semantics at opset 11 for float types
        hint = node.name or node.op_type
        if node.op_type == "Relu":
            zero = scope.add_constant(np.zeros((), dtype=numpy_dtype(elem_type)), f"{hint}/zero")
            return _select(scope, "Max", node.input[0], zero, node.output[0], hint)
        if node.op_type == "Clip":
            return _lower_clip(node, scope, hint)
        operands = [name for name in node.input if name]
        if len(operands) == 1:
            return [scope.make_node("Identity", operands, [node.output[0]], hint)]
        nodes: list[onnx.NodeProto] = []
        accumulated = operands[0]
        for position, operand in enumerate(operands[1:], start=2):
            output = node.output[0] if position == len(operands) else None
            nodes += _select(scope, node.op_type, accumulated, operand, output, f"{hint}/{position - 1}")
            accumulated = nodes[-1].output[0]
        return nodes


def _lower_clip(node: onnx.NodeProto, scope: GraphScope, hint: str) -> list[onnx.NodeProto]:
    low, high = input_at(node, 1), input_at(node, 2)
    if not low and not high:
        return [scope.make_node("Identity", [node.input[0]], [node.output[0]], hint)]
    nodes: list[onnx.NodeProto] = []
    current = node.input[0]
    if low:
        nodes += _select(scope, "Max", current, low, None if high else node.output[0], f"{hint}/min")
        current = nodes[-1].output[0]
    if high:
        nodes += _select(scope, "Min", current, high, node.output[0], f"{hint}/max")
    return nodes
