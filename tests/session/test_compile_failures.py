"""What a call gets when its graph cannot be compiled: the category says whose fault it is.

A shape error only where the call chose a dimension; the compiler's own error where the model fixes every
dimension; a compiler bug as a bug, never as a shape problem. A caller-overridable initializer is served
with its default and a feed that overrides it is refused by name.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from emulator_sessions import emulator_session
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler import LegalizationError
from optimum_ipu_backend.compiler.errors import CompilerBugError
from optimum_ipu_backend.compiler.passes.fold_constants import FoldConstants
from optimum_ipu_backend.errors import InvalidFeedError
from optimum_ipu_backend.session.failures import UnsupportedShapeError


def _save(tmp_path, nodes, inputs, outputs, initializers=(), opset=13):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", opset)])
    directory = tmp_path / "export"
    directory.mkdir()
    onnx.save(model, directory / "model.onnx")
    return directory


def _runtime_shape(tmp_path, dims):
    """An Expand whose shape is fed at run time: PopART needs it as a constant, whatever the sizes."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return _save(tmp_path, [helper.make_node("Expand", ["x", "shape"], ["y"])], [x, shape], [y])


def test_a_compiler_bug_reaches_the_caller_as_one_even_for_a_call_chosen_shape(tmp_path, monkeypatch):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    export = _save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [x], [y])
    session = emulator_session(export, tmp_path / "cache")

    def crash(self, model, ctx):
        raise KeyError("a bug")

    monkeypatch.setattr(FoldConstants, "run", crash)
    with pytest.raises(CompilerBugError, match="Compiler bug: the fold_constants pass failed") as raised:
        session.run(None, {"x": np.ones((2, 3), np.float32)})
    assert not isinstance(raised.value, UnsupportedShapeError)


def test_a_model_that_fixes_every_dimension_gets_the_compilers_error(tmp_path):
    session = emulator_session(_runtime_shape(tmp_path, [2, 3]), tmp_path / "cache")
    with pytest.raises(LegalizationError, match="computed at run time") as raised:
        session.run(None, {"x": np.ones((2, 3), np.float32), "shape": np.array([2, 3])})
    assert not isinstance(raised.value, UnsupportedShapeError)
    assert "input dimension" not in str(raised.value)  # no advice about sizes the model fixes


def test_a_call_chosen_dimension_makes_it_a_shape_error(tmp_path):
    session = emulator_session(_runtime_shape(tmp_path, ["batch", 3]), tmp_path / "cache")
    with pytest.raises(UnsupportedShapeError, match=r"input 'x' float32\[2, 3\]"):
        session.run(None, {"x": np.ones((2, 3), np.float32), "shape": np.array([2, 3])})


def test_an_initializer_default_is_served_and_cannot_be_overridden(tmp_path):
    bias = np.float32([1.0, 2.0, 3.0])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    listed = helper.make_tensor_value_info("bias", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    export = _save(
        tmp_path,
        [helper.make_node("Add", ["x", "bias"], ["y"])],
        [x, listed],
        [y],
        [numpy_helper.from_array(bias, "bias")],
    )
    session = emulator_session(export, tmp_path / "cache")
    assert [arg.name for arg in session.get_inputs()] == ["x"]
    feed = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(session.run(None, {"x": feed})[0], feed + bias)
    with pytest.raises(InvalidFeedError, match=r"overrides \['bias'\].*compiles that default"):
        session.run(None, {"x": feed, "bias": np.zeros(3, np.float32)})


def test_a_refusal_whatever_the_sizes_is_no_shape_error_even_for_a_call_chosen_dimension(tmp_path):
    """float64 has no Poplar type at any size: the compiler's error, without advice about sizes."""
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["batch", 3])
    session = emulator_session(
        _save(tmp_path, [helper.make_node("Neg", ["x"], ["y"])], [x], [y]), tmp_path / "c"
    )
    with pytest.raises(LegalizationError, match="DOUBLE, which Poplar cannot hold") as raised:
        session.run(None, {"x": np.ones((2, 3), np.float64)})
    assert not isinstance(raised.value, UnsupportedShapeError)
    assert "input dimension" not in str(raised.value)
