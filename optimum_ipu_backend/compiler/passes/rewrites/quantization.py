"""QuantizeLinear and DequantizeLinear with constant scales: exact float arithmetic, no integer tensor.

PopART's opset 11 has neither operator and the IPU no int8 arithmetic, but with compile-time scales and
zero points both are exact in float32, and computed the way onnxruntime's CPU kernels compute them:

* QuantizeLinear: ``y = x / scale`` (a division, as MLAS divides; a product by the reciprocal rounds
  differently), clamped to ``[qmin - zp, qmax - zp]``, rounded half to even, plus ``zp``. Its integer
  result stays a float32 tensor (integers up to 2**24 are exact), so the only readers it may have are
  DequantizeLinear nodes, which this rewrite lowers too: no int8 tensor reaches the device.
* DequantizeLinear: ``(q - zp) * scale``, the subtraction exact in float as it is in onnxruntime's int32.
  A constant ``q`` (quantized weights) is dequantized here, at compile time, with numpy.

Rounding is built from Floor, comparisons and exact products rather than PopART's Round: ONNX's Round
rounds halves to even, but Poplar's ROUND (what PopART's Round maps to) is the one TensorFlow's IPU
backend maps XLA's round-half-away-from-zero onto, so a value at a midpoint would differ.

A quantized weight below ``WEIGHT_MIN_BYTES`` is dequantized here; a larger one (held without its values while
legalizing) is attached as float32 holding its integers and dequantized on the device, by the same Sub and
Mul. Per-tensor and per-axis scales are lowered; block quantization, float8/int4/float4 types, float16
inputs or scales, and scales or zero points computed at run time are refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, input_at
from .emit import NodeEmitter

#: Quantized types whose every value is exact in float32; their ranges.
_INTEGER_RANGES: dict[int, tuple[int, int]] = {
    TensorProto.INT8: (-128, 127),
    TensorProto.UINT8: (0, 255),
    TensorProto.INT16: (-32768, 32767),
    TensorProto.UINT16: (0, 65535),
}
_FLOAT = TensorProto.FLOAT


def _type_name(elem_type: int) -> str:
    return TensorProto.DataType.Name(elem_type).lower()


@dataclass(frozen=True)
class _Quantization:
    """A node's scale and zero point, shaped to broadcast against its data input."""

    scale: np.ndarray  # float32
    zero_point: np.ndarray  # int64, same shape as scale
    elem_type: int  # the quantized type


def _quantization(node: onnx.NodeProto, scope: GraphScope, quantized_type: int | None) -> _Quantization:
    """The constant scale and zero point of ``node``, or CannotLower naming what is not lowered.

    ``quantized_type`` is the type of the quantized tensor when known from elsewhere (DequantizeLinear's
    input); otherwise the zero point's type, then ``output_dtype``, then uint8 (ONNX's default).
    """
    if int(attribute(node, "block_size", 0)):
        raise CannotLower(
            "block quantization (block_size > 0) is not lowered: only per-tensor and per-axis scales are"
        )
    scale_name, zero_name = input_at(node, 1), input_at(node, 2)
    scale = scope.constant(scale_name)
    if scale is None:
        raise CannotLower(
            f"its scale '{scale_name}' is computed at run time (dynamic quantization): only constant scales "
            "and zero points can be computed exactly in float"
        )
    if scale.dtype != np.float32:
        raise CannotLower(f"its scale is {scale.dtype}: only float32 scales (float32 data) are lowered")
    if zero_name:
        zero = scope.constant(zero_name)
        if zero is None:
            raise CannotLower(
                f"its zero point '{zero_name}' is computed at run time: only constant zero points are lowered"
            )
        zero_type = onnx.helper.np_dtype_to_tensor_dtype(zero.dtype)
    else:
        zero, zero_type = np.zeros_like(scale, dtype=np.int64), None
    if scale.size == 1 and zero.size == 1:
        # One scale is per-tensor whatever its shape and axis, as onnxruntime reads it (a scalar or a
        # 1-element vector): ORTQuantizer writes a [1] scale beside a scalar zero point, with an axis
        # beyond a rank-1 input, for the LayerNormalization biases it quantizes per channel.
        scale, zero = scale.reshape(()), zero.reshape(())
    elem_type = quantized_type or zero_type or int(attribute(node, "output_dtype", 0)) or TensorProto.UINT8
    if elem_type not in _INTEGER_RANGES and elem_type != TensorProto.INT32:
        raise CannotLower(
            f"quantized type {_type_name(elem_type)} is not lowered: only int8, uint8, int16 and uint16 "
            "(and int32 constants dequantized at compile time) are exact in float32"
        )
    if zero.shape != scale.shape:
        raise CannotLower(f"its zero point has shape {zero.shape} and its scale {scale.shape}")
    if scale.ndim > 1:
        raise CannotLower(f"its scale has rank {scale.ndim}: only per-tensor and per-axis scales are lowered")
    if not np.all(np.isfinite(scale)) or np.any(scale == 0):
        raise CannotLower("its scale holds zero or a non-finite value")
    return _Quantization(scale, zero.astype(np.int64), elem_type)


def _broadcast(node: onnx.NodeProto, values: np.ndarray, rank: int | None) -> np.ndarray:
    """Per-axis ``values`` shaped to broadcast along the node's axis; per-tensor ones as scalars."""
    if values.ndim == 0:
        return values
    if rank is None:
        raise CannotLower("the rank of its data input is unknown; per-axis scales need it")
    axis = int(attribute(node, "axis", 1))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        raise CannotLower(f"its axis {attribute(node, 'axis', 1)} is outside a rank-{rank} input")
    shape = [1] * rank
    shape[axis] = values.size
    return values.reshape(shape)


def _round_half_to_even(emit: NodeEmitter, y: str) -> str:
    """``y`` (|y| < 2**22) rounded to the nearest integer, halves to even, with exact operations only.

    On |y|: f = floor(|y|), d = |y| - f (exact: f and |y| share a binade or f is 0); the result is
    f + (d > 0.5) + (d == 0.5) * (f mod 2), with the sign of y put back.
    """
    const = emit.constant
    magnitude = emit("Abs", [y], "abs")
    floor = emit("Floor", [magnitude], "floor")
    fraction = emit("Sub", [magnitude, floor], "fraction")
    half = const(0.5, np.float32, "half")
    above = emit("Cast", [emit("Greater", [fraction, half], "above_half")], "above", to=_FLOAT)
    tie = emit("Cast", [emit("Equal", [fraction, half], "at_half")], "tie", to=_FLOAT)
    two = const(2.0, np.float32, "two")
    halved = emit("Floor", [emit("Mul", [floor, half], "halve")], "floor_half")
    odd = emit("Sub", [floor, emit("Mul", [halved, two], "even")], "odd")
    rounded = emit("Add", [emit("Add", [floor, above], "up"), emit("Mul", [tie, odd], "to_even")], "rounded")
    return emit("Mul", [rounded, emit("Sign", [y], "sign")], "signed")


class QuantizeLinearRewrite(Rewrite):
    """QuantizeLinear and DequantizeLinear with constant scales, as float32 arithmetic (module doc)."""

    op_types = frozenset({"QuantizeLinear", "DequantizeLinear"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        if node.op_type == "QuantizeLinear":
            return self._quantize(node, scope)
        return self._dequantize(node, scope)

    def _quantize(self, node: onnx.NodeProto, scope: GraphScope) -> list[onnx.NodeProto]:
        x, output = node.input[0], node.output[0]
        x_type = scope.require_elem_type(x)
        if x_type != _FLOAT:
            raise CannotLower(f"its input is {_type_name(x_type)}: only float32 data is lowered")
        if int(attribute(node, "precision", 0)) not in (0, _FLOAT):
            raise CannotLower("a 'precision' other than float32 is not lowered")
        if output in scope.graph_outputs or output in scope.subgraph_reads:
            raise CannotLower(
                f"its integer output '{output}' leaves the graph or enters a subgraph: the IPU holds no "
                "int8 tensors, so only a QuantizeLinear read by DequantizeLinear nodes is lowered"
            )
        if not scope.only_feeds(output, frozenset({("DequantizeLinear", 0)})):
            raise CannotLower(
                f"its integer output '{output}' is read by {sorted({s[0] for s in scope.slots(output)})}: "
                "the IPU holds no int8 tensors, so only a QuantizeLinear read by DequantizeLinear nodes "
                "is lowered (it stays float32 holding integer values)"
            )
        quant = _quantization(node, scope, None)
        if quant.elem_type not in _INTEGER_RANGES:
            raise CannotLower(f"quantizing to {_type_name(quant.elem_type)} is not lowered")
        low, high = _INTEGER_RANGES[quant.elem_type]
        rank = scope.rank(x)
        emit = NodeEmitter(node, scope)
        zero = _broadcast(node, quant.zero_point, rank)
        scaled = emit(
            "Div", [x, emit.constant(_broadcast(node, quant.scale, rank), np.float32, "scale")], "div"
        )
        # Clamped before rounding, as MLAS does: the bounds are integers, so the order does not matter
        # for finite values, and |y| stays small enough for the exact rounding.
        low_bound = emit.constant((low - zero).astype(np.float32), np.float32, "low")
        high_bound = emit.constant((high - zero).astype(np.float32), np.float32, "high")
        clamped = emit("Min", [emit("Max", [scaled, low_bound], "max"), high_bound], "clamp")
        rounded = _round_half_to_even(emit, clamped)
        emit(
            "Add", [rounded, emit.constant(zero.astype(np.float32), np.float32, "zero_point")], "add", output
        )
        _retype_float(scope, output)
        return emit.nodes

    def _dequantize(self, node: onnx.NodeProto, scope: GraphScope) -> list[onnx.NodeProto]:
        q, output = node.input[0], node.output[0]
        if int(attribute(node, "output_dtype", 0)) not in (0, _FLOAT):
            raise CannotLower("an output_dtype other than float32 is not lowered")
        producer = scope.producer.get(q)
        from_lowered_quantize = producer is not None and producer.op_type == "QuantizeLinear"
        q_value = None if from_lowered_quantize else scope.constant(q)
        weight = not from_lowered_quantize and q_value is None and q in scope.graph_inputs
        if weight:
            _float_weight(scope, q)
        if not from_lowered_quantize and q_value is None and not weight:
            raise CannotLower(
                f"its integer input '{q}' is computed at run time and not by a QuantizeLinear: the IPU holds "
                "no int8 tensors, so only constant quantized values and QuantizeLinear outputs are lowered"
            )
        quantized_type = None if q_value is None else onnx.helper.np_dtype_to_tensor_dtype(q_value.dtype)
        if from_lowered_quantize:
            quantized_type = _quantization(producer, scope, None).elem_type
        quant = _quantization(node, scope, quantized_type)
        rank = scope.rank(q) if q_value is None else q_value.ndim
        scale = _broadcast(node, quant.scale, rank)
        zero = _broadcast(node, quant.zero_point, rank)
        emit = NodeEmitter(node, scope)
        if q_value is not None:
            # onnxruntime: float(int32(q) - int32(zp)) * scale, the product in float32.
            value = (q_value.astype(np.int64) - zero).astype(np.float32) * scale
            scope.add_constant(value.astype(np.float32), emit.hint, exact_name=output)
            return []
        if quant.elem_type == TensorProto.INT32:
            raise CannotLower("int32 values computed at run time are not exact in float32")
        shifted = emit("Sub", [q, emit.constant(zero.astype(np.float32), np.float32, "zero_point")], "sub")
        emit("Mul", [shifted, emit.constant(scale, np.float32, "scale")], "mul", output)
        return emit.nodes


def _float_weight(scope: GraphScope, name: str) -> None:
    """A quantized weight of ``WEIGHT_MIN_BYTES`` or more, which legalization holds as a typed input without
    its values (graphs.weight_free_copy): retyped float32, so that the pipeline attaches it as float32
    holding the same integers (exact for 8- and 16-bit types) and the DequantizeLinear that reads it is
    computed on the device. A weight read by anything else, or an int32 one, is refused."""
    declared = next((value for value in scope.graph.input if value.name == name), None)
    elem_type = None if declared is None else declared.type.tensor_type.elem_type
    if elem_type == _FLOAT:
        return  # retyped already, for another DequantizeLinear of the same weight
    if elem_type not in _INTEGER_RANGES:
        kind = "unknown" if elem_type is None else _type_name(elem_type)
        raise CannotLower(
            f"its integer input '{name}' is a graph input or a weight of type {kind}: only 8- and 16-bit "
            "weights are dequantized on the device (their integers are exact in float32)"
        )
    if not scope.only_feeds(name, frozenset({("DequantizeLinear", 0)})):
        raise CannotLower(
            f"its quantized weight '{name}' is also read by {sorted({s[0] for s in scope.slots(name)})}: "
            "only a weight read by DequantizeLinear nodes alone is held as float32"
        )
    declared.type.tensor_type.elem_type = _FLOAT
    _retype_float(scope, name)


def _retype_float(scope: GraphScope, name: str) -> None:
    """``name`` now holds float32 (integer values): say so wherever its integer type was recorded, so
    that shape inference after this pass does not find the two types in conflict."""
    for value in scope.graph.value_info:
        if value.name == name:
            value.type.tensor_type.elem_type = _FLOAT
    found = scope.type_of(name)
    retyped = onnx.TypeProto()
    if found is not None:
        retyped.CopyFrom(found)
    retyped.tensor_type.elem_type = _FLOAT
    scope.learn_type(name, retyped)
