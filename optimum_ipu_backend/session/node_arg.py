"""``NodeArg`` look-alikes built from the ONNX graph, in onnxruntime's formats.

optimum-onnx reads ``.name``, ``.shape`` (ints, dim_param strings, or None) and ``.type``
(``'tensor(float)'``) of ``get_inputs()``/``get_outputs()``; the order of outputs is how it maps
results, so it must equal the graph's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

ORT_TYPE_NAMES = {
    onnx.TensorProto.FLOAT: "float",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT16: "uint16",
    onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.STRING: "string",
    onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.DOUBLE: "double",
    onnx.TensorProto.UINT32: "uint32",
    onnx.TensorProto.UINT64: "uint64",
    onnx.TensorProto.BFLOAT16: "bfloat16",
}


@dataclass(frozen=True)
class NodeArg:
    name: str
    shape: list[int | str | None]
    type: str
    elem_type: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type))

    def __repr__(self) -> str:  # mirrors onnxruntime's NodeArg repr
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"


def node_arg(name: str, shape: list[int | str | None], elem_type: int) -> NodeArg:
    """A NodeArg from a graph input's or output's name, symbolic shape and ONNX element type."""
    type_name = ORT_TYPE_NAMES.get(elem_type, "undefined")
    return NodeArg(name, list(shape), f"tensor({type_name})", elem_type)
