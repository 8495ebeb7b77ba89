"""RotaryEmbedding-23 (absent from PopART's opset 11) and onnxruntime's RotaryEmbedding (com.microsoft,
what ORTOptimizer fuses Llama's rotary positions into at O4) as the Slice/Mul/Sub/Add/Concat of their
definition.

The input is brought to [batch, sequence, heads, head] (a Transpose of the 4-D form, a Reshape of the 3-D
one), the caches are gathered at ``position_ids`` when given and broadcast over the heads, the first
``rotary_embedding_dim`` values of each head are rotated as halves or interleaved pairs (cos·x1 − sin·x2,
sin·x1 + cos·x2, multiplied in the order of ONNX's reference) and the rest passed through, and the result
is brought back. Static shapes are needed; caches whose last dimension is not rotary_embedding_dim / 2 are
refused (ONNX's reference rejects them, its function body would slice them).
"""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, input_at
from .emit import NodeEmitter

_SWAP_HEADS_AND_SEQUENCE = [0, 2, 1, 3]


class RotaryEmbeddingRewrite(Rewrite):
    """RotaryEmbedding-23 on a [batch, heads, sequence, head] or [batch, sequence, hidden] input."""

    op_types = frozenset({"RotaryEmbedding"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, cos_cache, sin_cache = node.input[:3]
        emit = NodeEmitter(node, scope)
        num_heads = int(attribute(node, "num_heads", 0))
        return _rotate(emit, node, x, cos_cache, sin_cache, input_at(node, 3), num_heads, None)


class ContribRotaryEmbeddingRewrite(Rewrite):
    """onnxruntime's RotaryEmbedding (com.microsoft), which ORTOptimizer writes for Llama at O4.

    The same rotation as RotaryEmbedding-23 with the inputs in another order (input, position_ids, cos,
    sin) and positions always given: ``[batch, sequence]``, or one offset to which the kernel adds each
    token's index. Without num_heads a 3-D input's heads are as wide as the caches say (onnxruntime's
    rule). float16 is computed in float32 and rounded once, as onnxruntime's CPU kernel converts.
    """

    domain = "com.microsoft"
    op_types = frozenset({"RotaryEmbedding"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, positions, cos_cache, sin_cache = node.input[:4]
        # onnxruntime applies scale only where it rebuilds the caches (not on CPU, the tests' oracle), and
        # packed batching lays tokens out otherwise: both refused rather than guessed.
        if int(attribute(node, "is_packed_batching", 0)):
            raise CannotLower("is_packed_batching=1 (sequences packed without padding) is not lowered")
        if float(attribute(node, "scale", 1.0)) != 1.0:
            raise CannotLower(f"scale={attribute(node, 'scale', 1.0)} is not lowered")
        dims = scope.require_static_shape(x, "RotaryEmbedding splits it into heads")
        num_heads = int(attribute(node, "num_heads", 0))
        if int(attribute(node, "rotary_embedding_dim", 0)) and not num_heads:
            raise CannotLower("rotary_embedding_dim is set without num_heads (onnxruntime rejects it)")
        if len(dims) == 4 and num_heads not in (0, dims[1]):
            raise CannotLower(f"num_heads={num_heads} differs from the input's {dims[1]} heads")
        if len(dims) == 3 and not num_heads:
            width = 2 * scope.require_static_shape(cos_cache, "it gives the head size")[-1]
            num_heads = dims[2] // width if width and dims[2] % width == 0 else 0
        emit = NodeEmitter(node, scope)
        position_dims = scope.require_static_shape(positions, "its form (offset or per token) is needed")
        if len(position_dims) <= 1 and int(np.prod(position_dims)) == 1:
            sequence = dims[2] if len(dims) == 4 else dims[1]
            offsets = emit.constant(np.arange(sequence, dtype=np.int64)[None, :], np.int64, "token_index")
            positions = emit("Add", [positions, offsets], "positions")
        compute = onnx.TensorProto.FLOAT
        if scope.require_elem_type(x) not in (compute, onnx.TensorProto.FLOAT16):
            raise CannotLower("onnxruntime's CPU kernel takes float and float16 only")
        return _rotate(emit, node, x, cos_cache, sin_cache, positions, num_heads, compute)


def _rotate(
    emit: NodeEmitter,
    node: onnx.NodeProto,
    x: str,
    cos_cache: str,
    sin_cache: str,
    positions: str,
    num_heads: int,
    compute_type: int | None,
) -> list[onnx.NodeProto]:
    """The rotation of ``x`` by the caches (gathered at ``positions`` when given), written to
    ``node.output[0]``; with ``compute_type`` the arithmetic runs in that type and is rounded back once."""
    scope = emit.scope
    dims = scope.require_static_shape(x, "RotaryEmbedding splits it into heads")
    if len(dims) == 4:
        batch, heads, sequence, head_size = dims
        per_head = emit("Transpose", [x], "to_per_head", perm=_SWAP_HEADS_AND_SEQUENCE)
    elif len(dims) == 3 and num_heads > 0 and dims[2] % num_heads == 0:
        batch, sequence, heads, head_size = dims[0], dims[1], num_heads, dims[2] // num_heads
        split_shape = emit.shape([batch, sequence, heads, head_size], "heads_shape")
        per_head = emit("Reshape", [x, split_shape], "to_per_head")
    else:
        raise CannotLower(
            f"an input of shape {dims} with num_heads={num_heads} is neither [batch, heads, sequence, "
            "head] nor [batch, sequence, num_heads * head]"
        )
    rotary = int(attribute(node, "rotary_embedding_dim", 0)) or head_size
    if rotary % 2 or rotary > head_size:
        raise CannotLower(f"rotary_embedding_dim={rotary} is not an even size within the head ({head_size})")
    half = rotary // 2
    for cache in (cos_cache, sin_cache):
        cache_dims = scope.require_static_shape(cache, "its last dimension must be rotary_embedding_dim / 2")
        if cache_dims[-1] != half:
            raise CannotLower(f"cache '{cache}' of shape {cache_dims} does not end in {half}")
    x_type = scope.require_elem_type(x)
    compute_type = compute_type or x_type
    per_head = emit.cast(per_head, x_type, compute_type, "x_computed")

    def per_token(cache: str, name: str) -> str:
        """The cache as [batch, sequence, 1, half]: gathered at the positions, broadcast over heads."""
        cache_type = scope.require_elem_type(cache)
        if positions:
            cache = emit("Gather", [cache, positions], f"{name}_at_positions", axis=0)
        cache = emit.cast(cache, cache_type, compute_type, f"{name}_computed")
        return emit("Unsqueeze", [cache], f"{name}_per_head", axes=[2])

    def head_slice(start: int, end: int, step: int, suffix: str) -> str:
        bounds = [emit.constant([v], np.int64, f"{suffix}_{what}") for what, v in _slice(start, end, step)]
        return emit("Slice", [per_head, *bounds], suffix)

    cos, sin = per_token(cos_cache, "cos"), per_token(sin_cache, "sin")
    if int(attribute(node, "interleaved", 0)):
        x1, x2 = head_slice(0, rotary, 2, "even"), head_slice(1, rotary, 2, "odd")
    else:
        x1, x2 = head_slice(0, half, 1, "first_half"), head_slice(half, rotary, 1, "second_half")
    real = emit("Sub", [emit("Mul", [cos, x1], "cos_x1"), emit("Mul", [sin, x2], "sin_x2")], "real")
    imaginary = emit("Add", [emit("Mul", [sin, x1], "sin_x1"), emit("Mul", [cos, x2], "cos_x2")], "imag")
    if int(attribute(node, "interleaved", 0)):
        pairs = [emit("Unsqueeze", [part], f"pair{i}", axes=[4]) for i, part in enumerate((real, imaginary))]
        interleaved_shape = emit.shape([batch, sequence, heads, rotary], "rotated_shape")
        rotated = emit("Reshape", [emit("Concat", pairs, "pairs", axis=4), interleaved_shape], "rotated")
    else:
        rotated = emit("Concat", [real, imaginary], "rotated", axis=3)
    if rotary < head_size:
        rotated = emit("Concat", [rotated, head_slice(rotary, head_size, 1, "passed")], "joined", axis=3)
    rotated = emit.cast(rotated, compute_type, x_type, "rounded")
    if len(dims) == 4:
        emit("Transpose", [rotated], "to_input_layout", node.output[0], perm=_SWAP_HEADS_AND_SEQUENCE)
    else:
        emit("Reshape", [rotated, emit.shape(dims, "input_shape")], "to_input_layout", node.output[0])
    return emit.nodes


def _slice(start: int, end: int, step: int) -> list[tuple[str, int]]:
    """Slice-11's starts, ends, axes and steps for ``[start:end:step]`` of the head axis (3)."""
    return [("start", start), ("end", end), ("axis", 3), ("step", step)]
