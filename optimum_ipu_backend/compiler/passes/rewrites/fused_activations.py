"""onnxruntime's fused activations (com.microsoft Gelu, BiasGelu, FastGelu, QuickGelu) and BiasAdd as the
opset-11 arithmetic of onnxruntime's definitions.

ORTOptimizer fuses the Gelu subgraphs of BERT-like models into these; PopART knows none of them.

- Gelu: 0.5·x·(1 + erf(x/√2)); BiasGelu: the same of A + B; FastGelu: the tanh approximation
  0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) of X (+ bias). Both forms are the builders ONNX's own Gelu-20
  lowers to (``activations.gelu_erf`` / ``gelu_tanh``), which follow onnxruntime's kernels step by step.
- QuickGelu: x·Sigmoid(alpha·x), alpha 1.702 by default; alpha = 1 (SiLU) skips the scaling, as the kernel.
- BiasAdd: (X + bias) + skip, X [N, S, C], bias [C], skip like X, added in that order in the element type,
  as onnxruntime's (CUDA-only) kernel adds.

The Gelu family computes float16 inputs in float32 and rounds the result once: onnxruntime has float32
kernels only and runs a float16 node between Casts to float32 and back, so the lowering does the same
(rounding each of eight float16 steps would drift by several ulps). A bias must be 1-D and as long as the
input's last dimension, which onnxruntime checks at run time; any other shape is refused rather than
broadcast into an answer onnxruntime would not give. PopART holds no double or bfloat16 tensors, so
those element types are refused.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx
from onnx import TensorProto

from ...graphs import attribute
from .activations import gelu_erf, gelu_tanh
from .common import CannotLower, GraphScope, Rewrite, input_at
from .emit import NodeEmitter

MS_DOMAIN = "com.microsoft"
#: QuickGelu's alpha when the attribute is absent (onnxruntime's schema and kernel).
QUICK_GELU_ALPHA = 1.702
#: The element types PopART computes, and the one the Gelu family computes them in (module docstring).
_ELEMENT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16})
_COMPUTE_TYPE = TensorProto.FLOAT


class FusedGeluRewrite(Rewrite):
    """com.microsoft Gelu, BiasGelu, FastGelu (bias optional) and QuickGelu-1 as opset-11 element-wise ops."""

    op_types = frozenset({"Gelu", "BiasGelu", "FastGelu", "QuickGelu"})
    domain: ClassVar[str] = MS_DOMAIN

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, y = node.input[0], node.output[0]
        elem_type = _require_float(scope, node, x)
        compute_type, dtype = _COMPUTE_TYPE, np.float32
        emit = NodeEmitter(node, scope)
        bias = input_at(node, 1) if node.op_type in ("BiasGelu", "FastGelu") else ""
        if node.op_type == "BiasGelu" and not bias:
            raise CannotLower("BiasGelu needs its bias input B")
        if bias:
            _require_bias_of_last_dimension(scope, node, x, bias)
        # Computed in float32; a float16 result is rounded once, by the last Cast.
        computed_y = y if compute_type == elem_type else scope.names.fresh(f"{emit.hint}/float32_result")
        value = emit.cast(x, elem_type, compute_type, "x_to_float32")
        if bias:
            value = emit(
                "Add", [value, emit.cast(bias, elem_type, compute_type, "bias_to_float32")], "biased"
            )
        if node.op_type in ("Gelu", "BiasGelu"):
            gelu_erf(emit, value, computed_y, dtype)
        elif node.op_type == "FastGelu":
            gelu_tanh(emit, value, computed_y, dtype)
        else:
            alpha = float(attribute(node, "alpha", QUICK_GELU_ALPHA))
            scaled = value
            if alpha != 1.0:
                scaled = emit("Mul", [value, emit.constant(alpha, dtype, "alpha")], "alpha_x")
            emit("Mul", [value, emit("Sigmoid", [scaled], "sigmoid")], "quick_gelu", computed_y)
        if computed_y != y:
            emit("Cast", [computed_y], "to_float16", y, to=elem_type)
        return emit.nodes


class BiasAddRewrite(Rewrite):
    """com.microsoft BiasAdd-1: (X + bias) + skip for X and skip [N, S, C] and bias [C]."""

    op_types = frozenset({"BiasAdd"})
    domain: ClassVar[str] = MS_DOMAIN

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, bias, skip = node.input[:3]
        _require_float(scope, node, x)
        dims = scope.require_static_shape(x, "BiasAdd requires to be [batch, sequence, channels]")
        skip_dims = scope.require_static_shape(skip, "BiasAdd requires to be shaped like its input")
        if len(dims) != 3 or skip_dims != dims:
            raise CannotLower(
                f"BiasAdd takes an input and skip of one shape [batch, sequence, channels]; "
                f"got input {list(dims)} and skip {list(skip_dims)}"
            )
        _require_bias_of_last_dimension(scope, node, x, bias)
        emit = NodeEmitter(node, scope)
        emit("Add", [emit("Add", [x, bias], "biased"), skip], "bias_add", node.output[0])
        return emit.nodes


def _require_float(scope: GraphScope, node: onnx.NodeProto, x: str) -> int:
    elem_type = scope.require_elem_type(x)
    if elem_type not in _ELEMENT_TYPES:
        raise CannotLower(
            f"{node.op_type} of {onnx.helper.tensor_dtype_to_string(elem_type)}: PopART computes float32 "
            "and float16 only"
        )
    return elem_type


def _require_bias_of_last_dimension(scope: GraphScope, node: onnx.NodeProto, x: str, bias: str) -> None:
    """onnxruntime's check: the bias is 1-D and as long as the input's last dimension."""
    why = f"{node.op_type} adds a bias along the last dimension"
    dims = scope.require_static_shape(x, why)
    bias_dims = scope.require_static_shape(bias, why)
    if not dims or list(bias_dims) != [dims[-1]]:
        raise CannotLower(
            f"bias '{bias}' of shape {list(bias_dims)} is not 1-D and as long as the last dimension of "
            f"input '{x}' {list(dims)}"
        )
