"""Range (absent from PopART) as a constant, or as arithmetic over its static length."""

from __future__ import annotations

import math

import numpy as np
import onnx

from ...graphs import attribute
from .common import FLOAT_TYPES, CannotLower, GraphScope, Rewrite, numpy_dtype


def range_values(start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Range's output computed as onnxruntime does: n = ceil((limit - start) / delta), then a running sum."""
    dtype = np.asarray(start).dtype
    start_v, limit_v, delta_v = (np.asarray(v, dtype=dtype).reshape(()) for v in (start, limit, delta))
    if delta_v == 0:
        raise CannotLower("Range with delta 0 has no defined length")
    # The difference is taken in double, not in the element type (a float32 difference can round up
    # past a whole number of steps: -0.4f - -0.1f = -0.30000001f gives 4 steps of -0.1f instead of 3).
    length = max(int(math.ceil((float(limit_v) - float(start_v)) / float(delta_v))), 0)
    if length == 0:
        return np.zeros((0,), dtype=dtype)
    # Each element is the previous one plus delta, rounded in the element type (a running sum).
    steps = np.full((length,), delta_v, dtype=dtype)
    steps[0] = start_v
    return np.add.accumulate(steps, dtype=dtype)


# Range-27 computes float16/bfloat16 ranges in its stash_type (float32 by default), then casts back.
_STASHED_TYPES = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
_STASH_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})


def _stash_type(node: onnx.NodeProto, since_version: int, elem_type: int) -> int:
    """The element type the range is accumulated in."""
    if since_version < 27 or elem_type not in _STASHED_TYPES:
        return elem_type
    stash_type = int(attribute(node, "stash_type", onnx.TensorProto.FLOAT))
    if stash_type not in _STASH_TYPES:
        raise CannotLower(f"stash_type {stash_type} is neither float nor double, the types Range-27 allows")
    return stash_type


class RangeRewrite(Rewrite):
    """Range becomes a constant (constant inputs) or start + running sum of delta over its static length."""

    op_types = frozenset({"Range"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        start, limit, delta = node.input[0], node.input[1], node.input[2]
        hint = node.name or "Range"
        elem_type = scope.require_elem_type(start)
        stash_type = _stash_type(node, since_version, elem_type)
        values = [scope.constant(name) for name in (start, limit, delta)]
        if all(v is not None for v in values):
            stashed = (np.asarray(v).astype(numpy_dtype(stash_type)) for v in values)  # type: ignore[union-attr]
            computed = range_values(*stashed).astype(numpy_dtype(elem_type))
            scope.add_constant(computed, hint, exact_name=node.output[0])
            return []
        dims = scope.shape(node.output[0])
        if dims is None or len(dims) != 1 or dims[0] is None:
            raise CannotLower(
                "its inputs are not constants and its output length is not known statically; fix the input "
                "shapes and fold constants first so that start/limit/delta are computed at compile time"
            )
        length = int(dims[0])
        if stash_type == elem_type:
            return _running_range(start, delta, length, elem_type, node.output[0], scope, hint)
        to_stash = [
            scope.make_node("Cast", [name], 1, f"{hint}/stash", to=stash_type) for name in (start, delta)
        ]
        stashed = scope.names.fresh(f"{hint}/stashed")
        in_stash = _running_range(*(c.output[0] for c in to_stash), length, stash_type, stashed, scope, hint)
        cast_back = scope.make_node("Cast", [stashed], [node.output[0]], hint, to=elem_type)
        return [*to_stash, *in_stash, cast_back]


def _running_range(
    start: str, delta: str, length: int, elem_type: int, output: str, scope: GraphScope, hint: str
) -> list[onnx.NodeProto]:
    """Range over a static ``length`` from ``start`` and ``delta`` computed on the device into ``output``."""
    dtype = numpy_dtype(elem_type)
    if length == 0:
        scope.add_constant(np.zeros((0,), dtype=dtype), hint, exact_name=output)
        return []
    if length == 1:
        return [scope.make_node("Unsqueeze", [start], [output], hint, axes=[0])]
    if elem_type in FLOAT_TYPES:
        # A running sum rounds like onnxruntime's loop (value += delta); start + i * delta would not.
        start_1d = scope.make_node("Unsqueeze", [start], 1, f"{hint}/start_1d", axes=[0])
        delta_1d = scope.make_node("Unsqueeze", [delta], 1, f"{hint}/delta_1d", axes=[0])
        repeat = scope.add_constant(np.array([length - 1], dtype=np.int64), f"{hint}/repeat")
        deltas = scope.make_node("Expand", [delta_1d.output[0], repeat], 1, f"{hint}/deltas")
        steps = scope.make_node("Concat", [start_1d.output[0], deltas.output[0]], 1, f"{hint}/steps", axis=0)
        axis = scope.add_constant(np.array(0, dtype=np.int32), f"{hint}/axis")
        running = scope.make_node("CumSum", [steps.output[0], axis], [output], hint)
        return [start_1d, delta_1d, deltas, steps, running]
    # Integer arithmetic is exact, so start + i * delta equals the running sum.
    index = scope.add_constant(np.arange(length, dtype=dtype), f"{hint}/index")
    offsets = scope.make_node("Mul", [index, delta], 1, f"{hint}/offsets")
    return [offsets, scope.make_node("Add", [offsets.output[0], start], [output], hint)]
