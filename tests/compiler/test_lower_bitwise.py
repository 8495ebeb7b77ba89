"""BitwiseNot lowered to a subtraction from all ones: exactly onnxruntime's result on every integer type it
takes, the extremes of each included; uint32 and uint64 are refused."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from onnx import TensorProto, helper


def _bitwise_not(dtype):
    elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return lt.one_node_model("BitwiseNot", [("x", elem_type, [2, 5])], [("y", elem_type, [2, 5])], opset=18)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16])
def test_same_outputs_as_bitwise_not(dtype):
    info = np.iinfo(dtype)
    x = np.array([[info.min, info.min + 1, -1 if info.min else 1, 0, 1], [2, 77, info.max - 1, info.max, 5]])
    lowered = lt.lower_and_compare(_bitwise_not(dtype), {"x": x.astype(dtype)}, atol=0)
    assert "BitwiseNot" not in lt.op_types(lowered)


@pytest.mark.parametrize("elem_type", [TensorProto.UINT32, TensorProto.UINT64])
def test_wide_unsigned_integers_are_refused(elem_type):
    model = lt.one_node_model("BitwiseNot", [("x", elem_type, [3])], [("y", elem_type, [3])], opset=18)
    lt.assert_refused(model, "the_BitwiseNot.*UINT")
