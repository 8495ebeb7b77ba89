"""Gelu, Mish, HardSwish and Celu (absent from PopART's opset 11) as the arithmetic of their definitions.

Each replacement is the operator's ONNX function body (or, for Gelu, its formula) in opset-11 operators
PopART implements, evaluated in the input's element type as the body is.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, numpy_dtype, text_attribute
from .emit import NodeEmitter


class ActivationRewrite(Rewrite):
    """Gelu-20 (exact and tanh), Mish-18/22, HardSwish-14/22, Celu-12 as opset-11 element-wise nodes."""

    op_types = frozenset({"Gelu", "Mish", "HardSwish", "Celu"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, y = node.input[0], node.output[0]
        dtype = numpy_dtype(scope.require_elem_type(x))
        emit = NodeEmitter(node, scope)
        if node.op_type == "Mish":
            # x * tanh(softplus(x))
            emit("Mul", [x, emit("Tanh", [emit("Softplus", [x], "softplus")], "tanh")], "mish", y)
        elif node.op_type == "HardSwish":
            # x * max(0, min(1, x / 6 + 1 / 2)): HardSigmoid with the body's alpha and beta.
            hard_sigmoid = emit("HardSigmoid", [x], "hard_sigmoid", alpha=1.0 / 6.0, beta=0.5)
            emit("Mul", [x, hard_sigmoid], "hard_swish", y)
        elif node.op_type == "Celu":
            # alpha * Elu(x / alpha) with Elu's alpha 1, as the function body.
            alpha = emit.constant(float(attribute(node, "alpha", 1.0)), dtype, "alpha")
            elu = emit("Elu", [emit("Div", [x, alpha], "scaled")], "elu", alpha=1.0)
            emit("Mul", [alpha, elu], "celu", y)
        else:
            _gelu(node, x, y, dtype, emit)
        return emit.nodes


def _gelu(node: onnx.NodeProto, x: str, y: str, dtype: np.dtype, emit: NodeEmitter) -> None:
    """0.5 * x * (1 + erf(x / sqrt(2))), or with tanh(sqrt(2 / pi) * (x + 0.044715 x^3)) for erf."""
    approximate = text_attribute(node, "approximate", "none")
    if approximate == "none":
        scaled = emit("Div", [x, emit.constant(math.sqrt(2.0), dtype, "sqrt_2")], "scaled")
        phi_part = emit("Erf", [scaled], "erf")
    elif approximate == "tanh":
        cubed = emit("Mul", [emit("Mul", [x, x], "squared"), x], "cubed")
        inner = emit("Add", [x, emit("Mul", [emit.constant(0.044715, dtype, "c0"), cubed], "cubic")], "inner")
        sqrt_2_over_pi = emit.constant(math.sqrt(2.0 / math.pi), dtype, "sqrt_2_over_pi")
        phi_part = emit("Tanh", [emit("Mul", [sqrt_2_over_pi, inner], "tanh_input")], "tanh")
    else:
        raise CannotLower(f"approximate={approximate!r} is neither 'none' nor 'tanh'")
    one_plus = emit("Add", [emit.constant(1.0, dtype, "one"), phi_part], "one_plus")
    half_x = emit("Mul", [emit.constant(0.5, dtype, "half"), x], "half_x")
    emit("Mul", [half_x, one_plus], "gelu", y)
