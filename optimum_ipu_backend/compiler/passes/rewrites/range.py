"""Range (absent from PopART) as a constant, or as arithmetic over its static length."""

from __future__ import annotations

import math

import numpy as np
import onnx

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


class RangeRewrite(Rewrite):
    """Range becomes a constant (constant inputs) or start + running sum of delta over its static length."""

    op_types = frozenset({"Range"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        start, limit, delta = node.input[0], node.input[1], node.input[2]
        hint = node.name or "Range"
        values = [scope.constant(name) for name in (start, limit, delta)]
        if all(v is not None for v in values):
            scope.add_constant(range_values(*values), hint, exact_name=node.output[0])  # type: ignore[misc]
            return []
        dims = scope.shape(node.output[0])
        if dims is None or len(dims) != 1 or dims[0] is None:
            raise CannotLower(
                "its inputs are not constants and its output length is not known statically; fix the input "
                "shapes and fold constants first so that start/limit/delta are computed at compile time"
            )
        length = int(dims[0])
        elem_type = scope.require_elem_type(start)
        dtype = numpy_dtype(elem_type)
        if length == 0:
            scope.add_constant(np.zeros((0,), dtype=dtype), hint, exact_name=node.output[0])
            return []
        if length == 1:
            return [scope.make_node("Unsqueeze", [start], [node.output[0]], hint, axes=[0])]
        if elem_type in FLOAT_TYPES:
            # A running sum rounds like onnxruntime's loop (value += delta); start + i * delta would not.
            start_1d = scope.make_node("Unsqueeze", [start], 1, f"{hint}/start_1d", axes=[0])
            delta_1d = scope.make_node("Unsqueeze", [delta], 1, f"{hint}/delta_1d", axes=[0])
            repeat = scope.add_constant(np.array([length - 1], dtype=np.int64), f"{hint}/repeat")
            deltas = scope.make_node("Expand", [delta_1d.output[0], repeat], 1, f"{hint}/deltas")
            steps = scope.make_node(
                "Concat", [start_1d.output[0], deltas.output[0]], 1, f"{hint}/steps", axis=0
            )
            axis = scope.add_constant(np.array(0, dtype=np.int32), f"{hint}/axis")
            running = scope.make_node("CumSum", [steps.output[0], axis], [node.output[0]], hint)
            return [start_1d, delta_1d, deltas, steps, running]
        # Integer arithmetic is exact, so start + i * delta equals the running sum.
        index = scope.add_constant(np.arange(length, dtype=dtype), f"{hint}/index")
        offsets = scope.make_node("Mul", [index, delta], 1, f"{hint}/offsets")
        return [offsets, scope.make_node("Add", [offsets.output[0], start], [node.output[0]], hint)]
