"""LayerNormalization (opset 17) decomposed into opset-11 arithmetic."""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, input_at, numpy_dtype

_LOW_PRECISION = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


class LayerNormalizationRewrite(Rewrite):
    """LayerNormalization-17 becomes ReduceMean/Sub/Mul/ReduceMean/Add/Sqrt/Div/Mul/Add with equal outputs."""

    op_types = frozenset({"LayerNormalization"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, scale, bias = node.input[0], node.input[1], input_at(node, 2)
        axis = int(attribute(node, "axis", -1))
        epsilon = float(attribute(node, "epsilon", 1e-5))
        stash_type = int(attribute(node, "stash_type", onnx.TensorProto.FLOAT))
        # Negative axes need no rank: ReduceMean-11 accepts them, and they name the trailing dims.
        axes = list(range(axis, 0)) if axis < 0 else list(range(axis, scope.require_rank(x)))
        if not axes:
            raise CannotLower(f"axis {axis} leaves no dimension to normalize")
        x_type = scope.require_elem_type(x)
        # As in the operator's reference function, statistics are computed in stash_type; only
        # half-precision inputs are widened (PopART has no double, and widening float32 is a no-op).
        widen = stash_type == onnx.TensorProto.FLOAT and x_type in _LOW_PRECISION
        compute_type = onnx.TensorProto.FLOAT if widen else x_type
        hint = node.name or "LayerNormalization"
        nodes: list[onnx.NodeProto] = []

        def emit(
            op_type: str, inputs: list[str], suffix: str, output: str | None = None, **attrs: object
        ) -> str:
            outputs: list[str] | int = [output] if output else 1
            new = scope.make_node(op_type, inputs, outputs, f"{hint}/{suffix}", **attrs)
            nodes.append(new)
            return new.output[0]

        x_compute = x if compute_type == x_type else emit("Cast", [x], "cast_in", to=compute_type)
        mean_output = _optional_output(node, 1)
        inv_std_output = _optional_output(node, 2)
        # Variance of the centred values: squaring un-centred activations overflows float16. Of the
        # float16-safe forms measured (docs/compiler.md, "LayerNormalization accuracy"), none is closer to
        # float64 or to onnxruntime's kernel; this is the shortest, and the variance pattern that
        # precision_fp16 keeps in float32 (Mul(d, d), ReduceMean, Add, Sqrt).
        mean = emit("ReduceMean", [x_compute], "mean", mean_output, axes=axes, keepdims=1)
        deviation = emit("Sub", [x_compute, mean], "deviation")
        squared = emit("Mul", [deviation, deviation], "squared")
        variance = emit("ReduceMean", [squared], "variance", axes=axes, keepdims=1)
        eps = scope.add_constant(np.array(epsilon, dtype=numpy_dtype(compute_type)), f"{hint}/epsilon")
        std_dev = emit("Sqrt", [emit("Add", [variance, eps], "variance_eps")], "std_dev")
        if inv_std_output:
            emit("Reciprocal", [std_dev], "inv_std_dev", inv_std_output)
        normalized = emit("Div", [deviation, std_dev], "normalized")
        if compute_type != x_type:
            normalized = emit("Cast", [normalized], "cast_out", to=x_type)
        if bias:
            scaled = emit("Mul", [normalized, scale], "scaled")
            emit("Add", [scaled, bias], "biased", node.output[0])
        else:
            emit("Mul", [normalized, scale], "scaled", node.output[0])
        return nodes


def _optional_output(node: onnx.NodeProto, index: int) -> str | None:
    return node.output[index] if index < len(node.output) and node.output[index] else None
