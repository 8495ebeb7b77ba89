"""GroupNormalization, RMSNormalization, MeanVarianceNormalization and LpNormalization (absent from
PopART's opset 11) as opset-11 reductions and arithmetic.

Each follows its ONNX function body (LpNormalization, which has none, its definition and onnxruntime's
kernel), with one deliberate difference: variances are the mean of the squared centred values, not
E[x^2] - E[x]^2, which is the same quantity without the cancellation that can make it negative.
Statistics are computed in ``stash_type`` where the operator has one, as its body does.
"""

from __future__ import annotations

import math

import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, numpy_dtype
from .emit import NodeEmitter

# MeanVarianceNormalization's body adds this to the standard deviation (not to the variance).
_MVN_EPSILON = 1e-9


def _centred_variance(emit: NodeEmitter, x: str, axes: list[int]) -> tuple[str, str]:
    """``x - mean`` and the mean of its square over ``axes`` (kept as size-1 dims)."""
    mean = emit("ReduceMean", [x], "mean", axes=axes, keepdims=1)
    deviation = emit("Sub", [x, mean], "deviation")
    variance = emit(
        "ReduceMean", [emit("Mul", [deviation, deviation], "squared")], "variance", axes=axes, keepdims=1
    )
    return deviation, variance


def trailing_axes(node: onnx.NodeProto, scope: GraphScope, x: str) -> list[int]:
    """The axes ``[axis, rank)`` of the ``axis`` attribute (default -1); negative ones need no rank."""
    axis = int(attribute(node, "axis", -1))
    axes = list(range(axis, 0)) if axis < 0 else list(range(axis, scope.require_rank(x)))
    if not axes:
        raise CannotLower(f"axis {axis} leaves no dimension to normalize")
    return axes


class GroupNormalizationRewrite(Rewrite):
    """GroupNormalization-18 (scale and bias per group) and -21 (per channel, statistics in stash_type)."""

    op_types = frozenset({"GroupNormalization"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, scale, bias = node.input[:3]
        dims = scope.require_static_shape(x, "GroupNormalization reshapes into groups and back")
        groups = int(attribute(node, "num_groups", 0))
        if len(dims) < 2 or groups <= 0 or dims[1] % groups:
            raise CannotLower(f"num_groups={groups} does not divide the channels of an input of shape {dims}")
        batch, channels = dims[0], dims[1]
        x_type = scope.require_elem_type(x)
        per_channel = since_version >= 21
        affine_size = channels if per_channel else groups
        for operand in (scale, bias):
            operand_dims = scope.require_static_shape(operand, f"it must hold {affine_size} values")
            if math.prod(operand_dims) != affine_size:
                raise CannotLower(f"'{operand}' of shape {operand_dims} does not hold {affine_size} values")
        compute_type = int(attribute(node, "stash_type", onnx.TensorProto.FLOAT)) if per_channel else x_type
        emit = NodeEmitter(node, scope)
        grouped_shape = emit.shape([batch, groups, math.prod(dims[1:]) // groups], "grouped_shape")
        grouped = emit("Reshape", [emit.cast(x, x_type, compute_type, "cast_in"), grouped_shape], "grouped")
        deviation, variance = _centred_variance(emit, grouped, [2])
        epsilon = emit.constant(float(attribute(node, "epsilon", 1e-5)), numpy_dtype(compute_type), "epsilon")
        std_dev = emit("Sqrt", [emit("Add", [variance, epsilon], "variance_eps")], "std_dev")
        normalized = emit("Div", [deviation, std_dev], "normalized")
        if per_channel:
            # Scale and bias have one value per channel: regroup [N, G, C/G * spatial] as [N, C, spatial].
            normalized = emit.cast(normalized, compute_type, x_type, "cast_out")
            channel_shape = emit.shape([batch, channels, math.prod(dims[2:])], "channel_shape")
            normalized = emit("Reshape", [normalized, channel_shape], "per_channel")
        # [G] or [C] as [1, G or C, 1], which broadcasts along the grouped or per-channel layout.
        affine_shape = emit.shape([1, -1, 1], "affine_shape")
        scaled = emit("Mul", [normalized, emit("Reshape", [scale, affine_shape], "scale")], "scaled")
        biased = emit("Add", [scaled, emit("Reshape", [bias, affine_shape], "bias")], "biased")
        emit("Reshape", [biased, emit.shape(dims, "shape")], "restored", node.output[0])
        return emit.nodes


class RMSNormalizationRewrite(Rewrite):
    """RMSNormalization-23: x / sqrt(mean(x^2) + epsilon) over ``[axis, rank)``, times scale."""

    op_types = frozenset({"RMSNormalization"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, scale = node.input[:2]
        axes = trailing_axes(node, scope, x)
        x_type = scope.require_elem_type(x)
        compute_type = int(attribute(node, "stash_type", onnx.TensorProto.FLOAT))
        emit = NodeEmitter(node, scope)
        x_compute = emit.cast(x, x_type, compute_type, "cast_in")
        epsilon = float(attribute(node, "epsilon", 1e-5))
        normalized = rms_normalize(emit, x_compute, axes, epsilon, compute_type)
        emit(
            "Mul", [emit.cast(normalized, compute_type, x_type, "cast_out"), scale], "scaled", node.output[0]
        )
        return emit.nodes


def rms_normalize(
    emit: NodeEmitter,
    x: str,
    axes: list[int],
    epsilon: float,
    compute_type: int,
    inv_rms_output: str | None = None,
) -> str:
    """``x / sqrt(mean(x^2) + epsilon)`` over ``axes``, with ``x`` already in ``compute_type``.

    The one definition of root-mean-square normalization, shared with onnxruntime's fused forms
    (fused_normalizations.py); ``inv_rms_output`` names ``1 / sqrt(mean(x^2) + epsilon)`` when wanted.
    """
    squared = emit("Mul", [x, x], "squared")
    mean_square = emit("ReduceMean", [squared], "mean_square", axes=axes, keepdims=1)
    eps = emit.constant(epsilon, numpy_dtype(compute_type), "epsilon")
    rms = emit("Sqrt", [emit("Add", [mean_square, eps], "mean_square_eps")], "rms")
    if inv_rms_output:
        emit("Reciprocal", [rms], "inv_rms", inv_rms_output)
    return emit("Div", [x, rms], "normalized")


class MeanVarianceNormalizationRewrite(Rewrite):
    """MeanVarianceNormalization-9/13: (x - mean) / (std + 1e-9) over the ``axes`` attribute."""

    op_types = frozenset({"MeanVarianceNormalization"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x = node.input[0]
        rank = scope.require_rank(x)
        axes = [int(a) for a in attribute(node, "axes", [0, 2, 3])]
        if not axes or any(not -rank <= a < rank for a in axes):
            raise CannotLower(f"axes {axes} are not axes of a rank-{rank} input")
        emit = NodeEmitter(node, scope)
        deviation, variance = _centred_variance(emit, x, axes)
        epsilon = emit.constant(_MVN_EPSILON, numpy_dtype(scope.require_elem_type(x)), "epsilon")
        std_eps = emit("Add", [emit("Sqrt", [variance], "std_dev"), epsilon], "std_dev_eps")
        emit("Div", [deviation, std_eps], "normalized", node.output[0])
        return emit.nodes


class LpNormalizationRewrite(Rewrite):
    """LpNormalization-1/22 (p = 1 or 2): x / ReduceL1 or ReduceL2 over ``axis``; an all-zero slice stays 0.

    ONNX's reference divides 0 by 0 there (NaN); onnxruntime's kernel, the oracle, writes zeros, which the
    division by 1 in place of a zero norm reproduces.
    """

    op_types = frozenset({"LpNormalization"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x = node.input[0]
        p = int(attribute(node, "p", 2))
        if p not in (1, 2):
            raise CannotLower(f"p={p}: LpNormalization defines only p=1 and p=2")
        dtype = numpy_dtype(scope.require_elem_type(x))
        emit = NodeEmitter(node, scope)
        norm = emit(f"ReduceL{p}", [x], "norm", axes=[int(attribute(node, "axis", -1))], keepdims=1)
        zero_norm = emit("Equal", [norm, emit.constant(0.0, dtype, "zero")], "zero_norm")
        divisor = emit("Where", [zero_norm, emit.constant(1.0, dtype, "one"), norm], "divisor")
        emit("Div", [x, divisor], "normalized", node.output[0])
        return emit.nodes
