"""Mod with fmod=0 on floating-point operands, as the truncated fmod=1 remainder moved to B's sign.

Mod-28 defines fmod=0 for floats as ``A - floor(A / B) * B`` with the sign of B (Mod-10 and Mod-13 only
defined it for integers). Computed that way the quotient rounds; computed as numpy and ONNX's reference
do, it is exact: r = fmod(A, B), then r + B where r is nonzero and its sign differs from B's, and a zero
result takes B's sign. That also gives the special cases Mod-28 lists (x = inf or y = 0: NaN from fmod;
y = inf: x, or y when the signs differ). Integer Mods and fmod=1 mean the same at opset 11 and stay.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from ...graphs import attribute
from .common import GraphScope, Rewrite, numpy_dtype

# The floating-point types Mod-10 takes (bfloat16 Mods are left to the opset-11 type check, which refuses).
_OPSET11_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE})


class ModRewrite(Rewrite):
    """Mod(A, B, fmod=0) on floats becomes Mod(fmod=1) with the remainder moved to B's sign."""

    op_types = frozenset({"Mod"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        if int(attribute(node, "fmod", 0)) == 1:
            return None
        elem_type = scope.require_elem_type(node.input[0])
        if elem_type not in _OPSET11_FLOAT_TYPES:
            return None
        a, b = node.input[0], node.input[1]
        hint = node.name or "Mod"
        dtype = numpy_dtype(elem_type)
        zero = scope.add_constant(np.zeros((), dtype), f"{hint}/zero")
        plus_one = scope.add_constant(np.ones((), dtype), f"{hint}/plus_one")
        minus_one = scope.add_constant(-np.ones((), dtype), f"{hint}/minus_one")
        nodes: list[onnx.NodeProto] = []

        def emit(op_type: str, step: str, *inputs: str, **attributes: Any) -> str:
            nodes.append(scope.make_node(op_type, inputs, 1, f"{hint}/{step}", **attributes))
            return nodes[-1].output[0]

        r = emit("Mod", "fmod", a, b, fmod=1)
        below = emit(
            "And", "below", emit("Less", "r_negative", r, zero), emit("Greater", "b_positive", b, zero)
        )
        b_negative = emit("Less", "b_negative", b, zero)
        above = emit("And", "above", emit("Greater", "r_positive", r, zero), b_negative)
        moved = emit(
            "Where", "moved", emit("Or", "signs_differ", below, above), emit("Add", "plus_b", r, b), r
        )
        # Every result now has B's sign except zeros; |moved| times B's sign (+-1) gives zeros B's sign too,
        # exactly. (A Where choosing -0.0 would not: onnxruntime's Where returns it as +0.0.)
        sign_of_b = emit("Where", "sign_of_b", b_negative, minus_one, plus_one)
        nodes.append(
            scope.make_node("Mul", [emit("Abs", "magnitude", moved), sign_of_b], [node.output[0]], hint)
        )
        return nodes
