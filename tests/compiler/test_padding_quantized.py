"""The padding proof on a static QDQ graph (ORTQuantizer's format, opset 13 to 18): a constant
DequantizeLinear is evaluated (onnx's reference implements it from opset 19 only, with the same meaning for
these types), and QuantizeLinear on data, which has no padding rule, yields 8-bit integers the next
DequantizeLinear can be run on, so the verdict names QuantizeLinear itself."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.padding import PaddedInput, PaddingAnalyzer


def _initializer(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value, name)


@pytest.mark.parametrize("opset", [13, 18])
def test_a_qdq_graph_is_refused_naming_quantize_linear(opset):
    nodes = [
        helper.make_node("DequantizeLinear", ["b", "b_scale", "b_zero"], ["bias"], name="bias_dequantize"),
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"], name="x_quantize"),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xf"], name="x_dequantize"),
        helper.make_node("Add", ["xf", "bias"], ["y"], name="add"),
    ]
    initializers = [
        _initializer("b", np.arange(-4, 4, dtype=np.int8).reshape(1, 8)),
        _initializer("b_scale", np.float32(0.5)),
        _initializer("b_zero", np.int8(0)),
        _initializer("x_scale", np.float32(0.05)),
        _initializer("x_zero", np.uint8(128)),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", opset)])
    axis_map = np.where(np.arange(6) < 4, np.arange(6), -1)
    analyzer = PaddingAnalyzer(model)
    env, _ = analyzer._run({"x": PaddedInput((6, 8), (4, 8), (axis_map, None), 0)})
    assert env["xq"].elem_type == TensorProto.UINT8 and env["y"].elem_type == TensorProto.FLOAT
    proof = analyzer.prove({"x": PaddedInput((6, 8), (4, 8), (axis_map, None), 0)})
    assert not proof.exact
    assert any("'x_quantize' (QuantizeLinear): has no padding rule" in p for p in proof.problems), (
        proof.problems
    )
