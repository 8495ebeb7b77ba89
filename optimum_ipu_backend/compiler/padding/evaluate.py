"""Concrete evaluation of single nodes, for the parts of a graph the padding proof computes exactly.

onnx's reference implementation gives every standard operator; the operators that shape and index
arithmetic is made of get a direct numpy path, because the proof evaluates them many times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from optimum_ipu_backend.compiler.graphs import attributes, constant_node_value


class EvaluationError(Exception):
    """A node could not be evaluated (an operator onnx's reference implementation lacks, bad inputs)."""


def constant_value(node: onnx.NodeProto) -> np.ndarray:
    """The value of a ``Constant`` node."""
    value = constant_node_value(node)
    if value is None:
        raise EvaluationError(f"Constant {node.name!r} has no supported value attribute")
    return value


def _shape(node, inputs, attrs):
    shape = np.array(inputs[0].shape, dtype=np.int64)
    rank = len(shape)
    start = attrs.get("start", 0)
    end = attrs.get("end", rank)
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = max(0, min(rank, end + rank if end < 0 else end))
    return [shape[start:end]]


def _gather(node, inputs, attrs):
    data, indices = inputs
    axis = attrs.get("axis", 0)
    indices = np.where(indices < 0, indices + data.shape[axis], indices)
    return [np.take(data, indices, axis=axis)]


def _unsqueeze(node, inputs, attrs):
    axes = attrs["axes"] if "axes" in attrs else [int(a) for a in inputs[1].reshape(-1)]
    rank = inputs[0].ndim + len(axes)
    result = inputs[0]
    for axis in sorted(a + rank if a < 0 else a for a in axes):
        result = np.expand_dims(result, axis)
    return [result]


def _squeeze(node, inputs, attrs):
    data = inputs[0]
    if "axes" in attrs:
        axes = attrs["axes"]
    elif len(inputs) > 1 and inputs[1] is not None:
        axes = [int(a) for a in inputs[1].reshape(-1)]
    else:
        axes = [axis for axis, size in enumerate(data.shape) if size == 1]
    return [np.squeeze(data, axis=tuple(a + data.ndim if a < 0 else a for a in axes))]


def _concat(node, inputs, attrs):
    return [np.concatenate(inputs, axis=attrs["axis"])]


def _binary(function: Callable) -> Callable:
    def run(node, inputs, attrs):
        return [np.asarray(function(inputs[0], inputs[1]))]

    return run


def _integer_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)  # ONNX integer division truncates
    return a / b


def _cast(node, inputs, attrs):
    dtype = helper.tensor_dtype_to_np_dtype(attrs["to"])
    return [inputs[0].astype(dtype)]


def _where(node, inputs, attrs):
    return [np.where(inputs[0], inputs[1], inputs[2])]


def _range(node, inputs, attrs):
    start, limit, delta = (x.reshape(()) for x in inputs)
    return [np.arange(start, limit, delta, dtype=np.result_type(start, limit, delta))]


def _constant_of_shape(node, inputs, attrs):
    value = numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, np.float32)
    return [np.full(tuple(int(d) for d in inputs[0].reshape(-1)), value.reshape(-1)[0], dtype=value.dtype)]


def reshape_target(shape: Sequence[int], target: np.ndarray, allowzero: int = 0) -> tuple[int, ...]:
    """The output shape of ``Reshape`` from the input shape and the target operand."""
    dims = [int(d) for d in target.reshape(-1)]
    if not allowzero:
        dims = [shape[i] if d == 0 else d for i, d in enumerate(dims)]
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1]))
        total = int(np.prod(shape))
        dims[dims.index(-1)] = total // known if known else 0
    return tuple(dims)


def _reshape(node, inputs, attrs):
    return [inputs[0].reshape(reshape_target(inputs[0].shape, inputs[1], attrs.get("allowzero", 0)))]


def _expand(node, inputs, attrs):
    target = tuple(int(d) for d in inputs[1].reshape(-1))
    shape = np.broadcast_shapes(inputs[0].shape, target)
    return [np.broadcast_to(inputs[0], shape).copy()]


def slice_indices(shape: Sequence[int], starts, ends, axes=None, steps=None) -> list[tuple[int, np.ndarray]]:
    """Per sliced axis, the input coordinates ``Slice`` keeps, in output order."""
    starts = [int(s) for s in np.asarray(starts).reshape(-1)]
    ends = [int(e) for e in np.asarray(ends).reshape(-1)]
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [int(a) for a in np.asarray(axes).reshape(-1)]
    steps = [1] * len(starts) if steps is None else [int(s) for s in np.asarray(steps).reshape(-1)]
    result = []
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = axis + rank if axis < 0 else axis
        size = shape[axis]
        # range(), not slicing: .indices() may return -1 as a stop, which slicing would read as 'last'
        result.append((axis, np.arange(*slice(start, end, step).indices(size), dtype=np.int64)))
    return result


def _slice(node, inputs, attrs):
    data = inputs[0]
    if len(inputs) == 1:  # opset < 10: attributes
        picks = slice_indices(data.shape, attrs["starts"], attrs["ends"], attrs.get("axes"))
    else:
        picks = slice_indices(
            data.shape,
            inputs[1],
            inputs[2],
            inputs[3] if len(inputs) > 3 and inputs[3] is not None else None,
            inputs[4] if len(inputs) > 4 and inputs[4] is not None else None,
        )
    result = data
    for axis, picked in picks:
        result = np.take(result, picked, axis=axis)
    return [result]


def _transpose(node, inputs, attrs):
    return [np.transpose(inputs[0], attrs.get("perm"))]


def _identity(node, inputs, attrs):
    return [inputs[0]]


def _compare(function: Callable) -> Callable:
    return _binary(function)


def _reduce(function: Callable) -> Callable:
    def run(node, inputs, attrs):
        data = inputs[0]
        if "axes" in attrs:
            axes = attrs["axes"]
        elif len(inputs) > 1 and inputs[1] is not None and inputs[1].size:
            axes = [int(a) for a in inputs[1].reshape(-1)]
        else:
            axes = None
        if axes is None and attrs.get("noop_with_empty_axes", 0):
            return [data]
        axis = None if axes is None else tuple(a + data.ndim if a < 0 else a for a in axes)
        return [
            np.asarray(function(data, axis=axis, keepdims=bool(attrs.get("keepdims", 1))), dtype=data.dtype)
        ]

    return run


def _max_pool_1d(node, inputs, attrs):
    """MaxPool over one spatial axis ([N, C, L]), the form the audio frame masks take: the reference
    implementation loops in Python, seconds for 30 s of samples. Other forms go to the reference."""
    data = inputs[0]
    kernel = attrs.get("kernel_shape", [])
    if (
        data.ndim != 3
        or len(kernel) != 1
        or len(node.output) != 1
        or attrs.get("ceil_mode", 0)
        or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")
        or any(d != 1 for d in attrs.get("dilations", [1]))
        or not np.issubdtype(data.dtype, np.floating)
    ):
        return None
    (stride,) = attrs.get("strides", [1])
    begin, end = attrs.get("pads", [0, 0])
    # Pads never win a max (ONNX MaxPool ignores padded positions): -inf stands for them.
    padded = np.pad(data, ((0, 0), (0, 0), (begin, end)), constant_values=-np.inf)
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel[0], axis=2)[:, :, ::stride]
    return [windows.max(axis=-1).astype(data.dtype)]


_FAST: dict[str, Callable] = {
    "Shape": _shape,
    "Gather": _gather,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Concat": _concat,
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _binary(_integer_div),
    "Equal": _compare(np.equal),
    "Less": _compare(np.less),
    "Greater": _compare(np.greater),
    "LessOrEqual": _compare(np.less_equal),
    "GreaterOrEqual": _compare(np.greater_equal),
    "And": _binary(np.logical_and),
    "Or": _binary(np.logical_or),
    "Not": lambda node, inputs, attrs: [np.logical_not(inputs[0])],
    "Cast": _cast,
    "Where": _where,
    "Range": _range,
    "ConstantOfShape": _constant_of_shape,
    "Reshape": _reshape,
    "Expand": _expand,
    "Slice": _slice,
    "Transpose": _transpose,
    "Identity": _identity,
    "MaxPool": _max_pool_1d,
    "ReduceSum": _reduce(np.sum),
    "ReduceMax": _reduce(np.max),
    "ReduceMin": _reduce(np.min),
    "ReduceProd": _reduce(np.prod),
}


#: Operators whose reference implementation (onnx.reference) starts at a later opset than the operator:
#: evaluated with that version, which computes the same for every input the earlier opsets allow.
#: DequantizeLinear: onnx implements only version 19 and later; 19 adds float8 inputs and float16 scales to
#: version 13 (and 13 the axis of per-axis scales to 10), nothing else.
_REFERENCE_SINCE: dict[str, int] = {"DequantizeLinear": 19}


class Evaluator:
    """Evaluates nodes of one model concretely (reference implementations are built once per node)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._opsets = {opset.domain or "": opset.version for opset in model.opset_import}
        self._reference: dict[bytes, Any] = {}

    def run(self, node: onnx.NodeProto, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        try:
            if node.op_type == "Constant":
                return [constant_value(node)]
            fast = _FAST.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            if fast is not None:
                result = fast(node, list(inputs), attributes(node))
                if result is not None:  # None: a form the fast path leaves to the reference
                    return result
            return self._run_reference(node, inputs)
        except EvaluationError:
            raise
        except Exception as error:  # a failure here means "not computable", never a crash of the proof
            raise EvaluationError(f"{node.op_type} {node.name!r}: {type(error).__name__}: {error}") from error

    def _run_reference(self, node: onnx.NodeProto, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        from onnx.reference import ReferenceEvaluator
        from onnx.reference.ops import load_op

        # The node's content: protobuf hands out new Python objects (``id()`` is not stable), and the two
        # branches of an If may hold nodes of the same name and outputs that differ.
        key = node.SerializeToString()
        op = self._reference.get(key)
        if op is None:
            domain = node.domain or ""
            version = self._opsets.get(domain, self._opsets.get("ai.onnx", 18))
            if domain == "":
                version = max(version, _REFERENCE_SINCE.get(node.op_type, version))
            cls = load_op(domain, node.op_type, version)
            op = cls(
                node,
                {
                    "log": lambda *args: None,
                    "opsets": self._opsets,
                    "verbose": 0,
                    "new_ops": None,
                    "existing_functions": {},
                    "evaluator_cls": ReferenceEvaluator,
                },
            )
            self._reference[key] = op
        results = op.run(*inputs)
        return [np.asarray(result) for result in (results if isinstance(results, tuple) else (results,))]
