"""Gelu, Mish, HardSwish and Celu (absent from PopART's opset 11) as the arithmetic of their definitions.

Each replacement is the operator's ONNX function body (or, for Gelu, its formula) in opset-11 operators
PopART implements, evaluated in the input's element type as the body is. Gelu's two forms are computed in
the order of onnxruntime's kernels; ``gelu_erf`` and ``gelu_tanh`` are also what com.microsoft's Gelu,
BiasGelu and FastGelu lower to (``fused_activations``).
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
    approximate = text_attribute(node, "approximate", "none")
    if approximate == "none":
        gelu_erf(emit, x, y, dtype)
    elif approximate == "tanh":
        gelu_tanh(emit, x, y, dtype)
    else:
        raise CannotLower(f"approximate={approximate!r} is neither 'none' nor 'tanh'")


#: The tanh form's constants as onnxruntime's Gelu and FastGelu kernels fold them: tanh(x·(C·x² + B)).
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_CUBIC = 0.044715 * SQRT_2_OVER_PI


def gelu_erf(emit: NodeEmitter, x: str, y: str, dtype: np.dtype | type) -> str:
    """``y`` = 0.5·x·(1 + erf(x·(1/√2))), in ``dtype``: the exact Gelu.

    The order of onnxruntime's kernels (ONNX Gelu-20 and com.microsoft Gelu/BiasGelu alike): x times the
    rounded 1/√2, Erf, plus one, times 0.5·x.
    """
    scaled = emit("Mul", [x, emit.constant(1.0 / math.sqrt(2.0), dtype, "sqrt_half")], "scaled")
    return _half_x_times_one_plus(emit, x, y, dtype, emit("Erf", [scaled], "erf"))


def gelu_tanh(emit: NodeEmitter, x: str, y: str, dtype: np.dtype | type) -> str:
    """``y`` = 0.5·x·(1 + tanh(x·(C·x² + B))), B = √(2/π), C = 0.044715·√(2/π), in ``dtype``.

    √(2/π)·(x + 0.044715·x³) as onnxruntime's kernels compute it (ONNX Gelu-20 approximate='tanh' and
    com.microsoft FastGelu alike): ((C·x)·x + B)·x, so that each rounding falls where theirs does.
    """
    cubic = emit("Mul", [emit("Mul", [emit.constant(TANH_CUBIC, dtype, "c"), x], "c_x"), x], "c_x_x")
    slope = emit("Add", [cubic, emit.constant(SQRT_2_OVER_PI, dtype, "b")], "slope")
    tanh = emit("Tanh", [emit("Mul", [x, slope], "tanh_input")], "tanh")
    return _half_x_times_one_plus(emit, x, y, dtype, tanh)


def _half_x_times_one_plus(emit: NodeEmitter, x: str, y: str, dtype: np.dtype | type, phi_part: str) -> str:
    """(0.5·x)·(phi_part + 1), the last step both Gelu forms share."""
    one_plus = emit("Add", [phi_part, emit.constant(1.0, dtype, "one")], "one_plus")
    half_x = emit("Mul", [emit.constant(0.5, dtype, "half"), x], "half_x")
    return emit("Mul", [half_x, one_plus], "gelu", y)
