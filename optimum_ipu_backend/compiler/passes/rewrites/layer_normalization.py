"""LayerNormalization (opset 17) decomposed into opset-11 arithmetic."""

from __future__ import annotations

import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, input_at, numpy_dtype
from .emit import NodeEmitter

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
        emit = NodeEmitter(node, scope)
        x_compute = emit.cast(x, x_type, compute_type, "cast_in")
        normalized = standardize(
            emit, x_compute, axes, epsilon, compute_type, _optional_output(node, 1), _optional_output(node, 2)
        )
        normalized = emit.cast(normalized, compute_type, x_type, "cast_out")
        if bias:
            scaled = emit("Mul", [normalized, scale], "scaled")
            emit("Add", [scaled, bias], "biased", node.output[0])
        else:
            emit("Mul", [normalized, scale], "scaled", node.output[0])
        return emit.nodes


def standardize(
    emit: NodeEmitter,
    x: str,
    axes: list[int],
    epsilon: float,
    compute_type: int,
    mean_output: str | None = None,
    inv_std_output: str | None = None,
) -> str:
    """``(x - mean) / sqrt(variance + epsilon)`` over ``axes``, with ``x`` already in ``compute_type``.

    The one definition of layer normalization's first stage, shared with onnxruntime's fused forms
    (fused_normalizations.py). ``mean_output`` and ``inv_std_output`` name the statistics when wanted.
    """
    # Variance of the centred values: squaring un-centred activations overflows float16. Of the
    # float16-safe forms measured (docs/compiler.md, "LayerNormalization accuracy"), none is closer to
    # float64 or to onnxruntime's kernel; this is the shortest, and the variance pattern that
    # precision_fp16 keeps in float32 (Mul(d, d), ReduceMean, Add, Sqrt).
    mean = emit("ReduceMean", [x], "mean", mean_output, axes=axes, keepdims=1)
    deviation = emit("Sub", [x, mean], "deviation")
    squared = emit("Mul", [deviation, deviation], "squared")
    variance = emit("ReduceMean", [squared], "variance", axes=axes, keepdims=1)
    eps = emit.constant(epsilon, numpy_dtype(compute_type), "epsilon")
    std_dev = emit("Sqrt", [emit("Add", [variance, eps], "variance_eps")], "std_dev")
    if inv_std_output:
        emit("Reciprocal", [std_dev], "inv_std_dev", inv_std_output)
    return emit("Div", [deviation, std_dev], "normalized")


def _optional_output(node: onnx.NodeProto, index: int) -> str | None:
    return node.output[index] if index < len(node.output) and node.output[index] else None
