"""Pow-12+ with an exponent type unlike the base (or an integer base) brought to Pow-7's single type."""

from __future__ import annotations

import numpy as np
import onnx

from .common import FLOAT_TYPES, CannotLower, GraphScope, Rewrite, numpy_dtype

_LARGEST_UNROLLED_EXPONENT = 8


class PowRewrite(Rewrite):
    """Pow with an exponent of another type gets it cast to the float base type; an integer base with a
    small constant non-negative integer exponent becomes repeated Mul."""

    op_types = frozenset({"Pow"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        if since_version < 12:
            return None
        base, exponent = node.input[0], node.input[1]
        base_type, exponent_type = scope.require_elem_type(base), scope.require_elem_type(exponent)
        hint = node.name or "Pow"
        if base_type in FLOAT_TYPES:
            if exponent_type == base_type:
                return None
            constant = scope.constant(exponent)
            if constant is not None:
                cast_exponent = scope.add_constant(
                    constant.astype(numpy_dtype(base_type)), f"{hint}/exponent"
                )
                return [scope.make_node("Pow", [base, cast_exponent], [node.output[0]], hint)]
            cast = scope.make_node("Cast", [exponent], 1, f"{hint}/exponent", to=base_type)
            return [cast, scope.make_node("Pow", [base, cast.output[0]], [node.output[0]], hint)]
        return _integer_power(node, scope, hint)


def _integer_power(node: onnx.NodeProto, scope: GraphScope, hint: str) -> list[onnx.NodeProto]:
    base, exponent = node.input[0], node.input[1]
    value = scope.constant(exponent)
    if value is None or value.ndim != 0 or float(value) != int(value):
        raise CannotLower(
            "Pow-7 takes float bases only; an integer base needs a constant scalar integer exponent"
        )
    power = int(value)
    if not 0 <= power <= _LARGEST_UNROLLED_EXPONENT:
        raise CannotLower(f"integer Pow with exponent {power} is outside 0..{_LARGEST_UNROLLED_EXPONENT}")
    if power == 0:
        # x ** 0 == 1 for every x; multiplying by zero keeps the broadcast shape of the inputs.
        dtype = numpy_dtype(scope.require_elem_type(base))
        zero = scope.add_constant(np.zeros((), dtype), f"{hint}/zero")
        one = scope.add_constant(np.ones((), dtype), f"{hint}/one")
        times_zero = scope.make_node("Mul", [base, zero], 1, f"{hint}/times_zero")
        return [times_zero, scope.make_node("Add", [times_zero.output[0], one], [node.output[0]], hint)]
    nodes: list[onnx.NodeProto] = []
    product = base
    for step in range(1, power):
        output = [node.output[0]] if step == power - 1 else 1
        nodes.append(scope.make_node("Mul", [product, base], output, f"{hint}/{step}"))
        product = nodes[-1].output[0]
    if not nodes:
        nodes.append(scope.make_node("Identity", [base], [node.output[0]], hint))
    return nodes
