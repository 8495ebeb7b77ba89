"""BitwiseNot (absent from PopART's opset 11) as a subtraction, which is exact on every integer it takes.

In two's complement ~x = -1 - x, and on n-bit unsigned integers ~x = (2^n - 1) - x; neither subtraction
can overflow. Opset-11 Sub takes 32- and 64-bit integers only, so 8- and 16-bit ones are computed in
int32 (where the result is within the narrow type's range) and cast back. uint32 and uint64 are refused:
int32 cannot hold 2^32 - 1, and onnxruntime, which runs the emulated graph, has no unsigned Sub.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...op_table import dtype_name
from .common import CannotLower, GraphScope, Rewrite, numpy_dtype
from .emit import NodeEmitter

_T = onnx.TensorProto
_NARROW = frozenset({_T.INT8, _T.INT16, _T.UINT8, _T.UINT16})


class BitwiseNotRewrite(Rewrite):
    """BitwiseNot-18: Sub(all ones, x), in int32 for 8- and 16-bit integers."""

    op_types = frozenset({"BitwiseNot"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x = node.input[0]
        x_type = scope.require_elem_type(x)
        if x_type not in _NARROW | {_T.INT32, _T.INT64}:
            raise CannotLower(f"BitwiseNot of {dtype_name(x_type)} has no exact opset-11 form")
        all_ones = np.iinfo(numpy_dtype(x_type)).max if x_type in {_T.UINT8, _T.UINT16} else -1
        compute_type = _T.INT32 if x_type in _NARROW else x_type
        emit = NodeEmitter(node, scope)
        ones = emit.constant(all_ones, numpy_dtype(compute_type), "all_ones")
        if compute_type == x_type:
            emit("Sub", [ones, x], "inverted", node.output[0])
        else:
            inverted = emit("Sub", [ones, emit.cast(x, x_type, compute_type, "widened")], "inverted")
            emit("Cast", [inverted], "narrowed", node.output[0], to=x_type)
        return emit.nodes
