"""onnxruntime's fused normalizations (what ORTOptimizer writes) as opset-11 arithmetic.

SkipLayerNormalization and SkipSimplifiedLayerNormalization (com.microsoft) normalize
``input + skip (+ bias)`` over the last axis; EmbedLayerNormalization (com.microsoft) normalizes the sum
of a word, a position and (optionally) a segment embedding and counts each mask row's ones;
SimplifiedLayerNormalization (registered by onnxruntime in the DEFAULT domain, which ONNX itself does not
define) is RMS normalization over ``[axis, rank)``. The statistics are those of LayerNormalization and
RMSNormalization (``layer_normalization.standardize``, ``normalizations.rms_normalize``); the rest follows
onnxruntime's CPU kernels, the oracle of the tests: float16 is computed in float32 from the inputs to
the scaled output, rounded once at the end (as the kernels convert), and the extra outputs (mean,
inv_std_var, input_skip_bias_sum, mask_index, embedding_sum) are computed when some node or the graph
reads them. What those kernels reject or leave undefined is refused.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, input_at
from .emit import NodeEmitter
from .layer_normalization import standardize
from .normalizations import rms_normalize, trailing_axes

_FLOAT = onnx.TensorProto.FLOAT
#: Element types onnxruntime's CPU kernels take (bfloat16, in the schemas, has no CPU kernel to match).
_SKIP_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16})
#: The schemas' epsilon defaults.
_FUSED_EPSILON = 1e-12
_SIMPLIFIED_EPSILON = 1e-5


def _output(node: onnx.NodeProto, index: int) -> str | None:
    return node.output[index] if index < len(node.output) and node.output[index] else None


def _affine(
    emit: NodeEmitter,
    normalized: str,
    gamma: str,
    beta: str,
    compute_type: int,
    operand_type: int,
    output_type: int,
    output: str,
) -> None:
    """``normalized * gamma (+ beta)`` in ``compute_type``, then rounded once to ``output_type``."""
    final = output if compute_type == output_type else None
    scaled = emit(
        "Mul",
        [normalized, emit.cast(gamma, operand_type, compute_type, "gamma")],
        "scaled",
        None if beta else final,
    )
    if beta:
        scaled = emit("Add", [scaled, emit.cast(beta, operand_type, compute_type, "beta")], "shifted", final)
    if final is None:
        emit("Cast", [scaled], "cast_out", output, to=output_type)


class FusedNormalizationRewrite(Rewrite):
    """com.microsoft's SkipLayerNormalization, SkipSimplifiedLayerNormalization, EmbedLayerNormalization."""

    op_types = frozenset(
        {"SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization"}
    )
    domain = "com.microsoft"

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        if node.op_type == "EmbedLayerNormalization":
            return _embed_layer_normalization(node, scope)
        return _skip_layer_normalization(node, scope, simplified=node.op_type.startswith("SkipSimplified"))


def _skip_layer_normalization(
    node: onnx.NodeProto, scope: GraphScope, simplified: bool
) -> list[onnx.NodeProto]:
    x, skip, gamma = node.input[:3]
    # SkipSimplifiedLayerNormalization has no beta: its 4th input is the bias.
    beta, bias = ("", input_at(node, 3)) if simplified else (input_at(node, 3), input_at(node, 4))
    x_type = scope.require_elem_type(x)
    if x_type not in _SKIP_TYPES:
        raise CannotLower(
            f"element type {onnx.helper.tensor_dtype_to_string(x_type)}: onnxruntime's CPU kernel, "
            "the definition this lowering matches, takes float and float16"
        )
    x_dims = scope.require_static_shape(x, "the skip must broadcast to it as onnxruntime's kernel reads it")
    skip_dims = scope.require_static_shape(skip, "it must broadcast to the input")
    if len(x_dims) not in (2, 3) or tuple(np.broadcast_shapes(x_dims, skip_dims)) != x_dims:
        raise CannotLower(f"input {x_dims} and skip {skip_dims} are not shapes onnxruntime's kernel takes")
    mean_output, inv_std_output, sum_output = _output(node, 1), _output(node, 2), _output(node, 3)
    if simplified and mean_output:
        raise CannotLower(
            "its mean output is read, which RMS normalization does not compute (onnxruntime's kernel "
            "leaves it as zeros); no meaning to reproduce"
        )
    compute_type = _FLOAT
    emit = NodeEmitter(node, scope)
    # As the kernel: (input + skip) + bias, in float32 for float16 inputs.
    total = emit(
        "Add",
        [emit.cast(x, x_type, compute_type, "input"), emit.cast(skip, x_type, compute_type, "skip")],
        "input_skip",
    )
    if bias:
        total = emit("Add", [total, emit.cast(bias, x_type, compute_type, "bias")], "input_skip_bias")
    if sum_output:
        if compute_type == x_type:
            emit("Identity", [total], "sum", sum_output)
        else:
            emit("Cast", [total], "sum", sum_output, to=x_type)
    epsilon = float(attribute(node, "epsilon", _FUSED_EPSILON))
    if simplified:
        normalized = rms_normalize(emit, total, [-1], epsilon, compute_type, inv_std_output)
    else:
        normalized = standardize(emit, total, [-1], epsilon, compute_type, mean_output, inv_std_output)
    _affine(emit, normalized, gamma, beta, compute_type, x_type, x_type, node.output[0])
    return emit.nodes


def _embed_layer_normalization(node: onnx.NodeProto, scope: GraphScope) -> list[onnx.NodeProto]:
    input_ids, segment_ids, word, position, segment, gamma, beta = (input_at(node, i) for i in range(7))
    mask, position_ids = input_at(node, 7), input_at(node, 8)
    word_type = scope.require_elem_type(word)
    if word_type != _FLOAT:
        raise CannotLower(
            f"element type {onnx.helper.tensor_dtype_to_string(word_type)}: onnxruntime's CPU kernel, the "
            "definition this lowering matches, takes float only"
        )
    if segment_ids and not segment:
        raise CannotLower("segment_ids without a segment_embedding: onnxruntime's kernel rejects every id")
    batch, sequence = scope.require_static_shape(input_ids, "its sequence length selects the positions")
    emit = NodeEmitter(node, scope)
    total = emit("Gather", [word, input_ids], "word", axis=0)
    if position_ids:
        # [batch or 1, sequence] ids: the [1, sequence] form is shared by every row, as Add broadcasts it.
        positions = emit("Gather", [position, position_ids], "position", axis=0)
    else:
        positions = _first_rows(emit, position, sequence, "position")
    total = emit("Add", [total, positions], "word_position")
    if segment:
        if segment_ids:
            segments = emit("Gather", [segment, segment_ids], "segment", axis=0)
        else:
            # Without ids onnxruntime's kernel adds the segment table's first row to every token.
            segments = _first_rows(emit, segment, 1, "segment")
        total = emit("Add", [total, segments], "embedding_sum")
    sum_output = _output(node, 2)
    if sum_output:
        emit("Identity", [total], "sum", sum_output)
    epsilon = float(attribute(node, "epsilon", _FUSED_EPSILON))
    normalized = standardize(emit, total, [-1], epsilon, _FLOAT)
    _affine(emit, normalized, gamma, beta, _FLOAT, _FLOAT, _FLOAT, node.output[0])
    mask_index = _output(node, 1)
    if mask_index:
        if mask:
            # onnxruntime counts the entries equal to 1 in each row (not the row's sum).
            ones = emit("Equal", [mask, emit.constant(1, np.int32, "one")], "is_one")
            counts = emit("Cast", [ones], "is_one_int", to=onnx.TensorProto.INT32)
            emit("ReduceSum", [counts], "mask_index", mask_index, axes=[1], keepdims=0)
        else:
            scope.add_constant(np.zeros([batch], np.int32), "mask_index", exact_name=mask_index)
    return emit.nodes


def _first_rows(emit: NodeEmitter, table: str, count: int, what: str) -> str:
    """Rows [0, count) of an embedding table (a Slice-10 on axis 0)."""
    bounds = [
        emit.constant([value], np.int64, f"{what}_{name}") for name, value in (("start", 0), ("end", count))
    ]
    return emit("Slice", [table, *bounds, emit.constant([0], np.int64, f"{what}_axis")], what)


class SimplifiedLayerNormalizationRewrite(Rewrite):
    """onnxruntime's SimplifiedLayerNormalization (default domain): RMS normalization over [axis, rank)."""

    op_types = frozenset({"SimplifiedLayerNormalization"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, scale = node.input[:2]
        axes = trailing_axes(node, scope, x)
        x_type, scale_type = scope.require_elem_type(x), scope.require_elem_type(scale)
        x_dims = scope.require_static_shape(x, "the scale must have the shape of its normalized dims")
        scale_dims = scope.require_static_shape(scale, "it must have the shape of the normalized dims")
        normalized_dims = x_dims[len(x_dims) + axes[0] if axes[0] < 0 else axes[0] :]
        if tuple(scale_dims) != tuple(normalized_dims):
            raise CannotLower(
                f"scale {scale_dims} is not of the normalized dims {normalized_dims} of {x_dims}"
            )
        stash_type = int(attribute(node, "stash_type", _FLOAT))
        if stash_type != _FLOAT:
            raise CannotLower(f"stash_type {stash_type}: onnxruntime's CPU kernel computes in float")
        if x_type not in _SKIP_TYPES or scale_type not in _SKIP_TYPES:
            raise CannotLower(
                "onnxruntime's CPU kernel, the definition matched, is tested on float and float16"
            )
        emit = NodeEmitter(node, scope)
        x_compute = emit.cast(x, x_type, _FLOAT, "cast_in")
        epsilon = float(attribute(node, "epsilon", _SIMPLIFIED_EPSILON))
        normalized = rms_normalize(emit, x_compute, axes, epsilon, _FLOAT, _output(node, 1))
        _affine(emit, normalized, scale, "", _FLOAT, scale_type, scale_type, node.output[0])
        return emit.nodes
