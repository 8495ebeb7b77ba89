"""Rank-0 (scalar) inputs and outputs keep shape (), as CPU onnxruntime gives them, on every way of
running a session (run, OrtValues, host IO binding)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from optimum_ipu_backend.session import create_session


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """A dot product of two vectors (a scalar output) plus a scalar input, on ipu (emulator) and CPU."""
    nodes = [
        helper.make_node("MatMul", ["a", "b"], ["dot"]),
        helper.make_node("Add", ["dot", "offset"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("offset", TensorProto.FLOAT, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    path = str(tmp_path_factory.mktemp("scalars") / "model.onnx")
    onnx.save(model, path)
    ipu = create_session(path, providers=["ipu"], provider_options={"device": "emulator"})
    return ipu, ort.InferenceSession(path, providers=["CPUExecutionProvider"])


FEED = {
    "a": np.array([1.0, 2.0, 3.0], np.float32),
    "b": np.array([4.0, -5.0, 6.0], np.float32),
    "offset": np.array(0.5, np.float32),
}


def test_run_returns_a_scalar_like_cpu(sessions):
    ipu, cpu = sessions
    (expected,) = cpu.run(None, FEED)
    (actual,) = ipu.run(None, FEED)
    assert actual.shape == expected.shape == ()
    np.testing.assert_allclose(actual, expected, rtol=1e-6)


def test_ort_values_keep_the_scalar(sessions):
    ipu, cpu = sessions
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in FEED.items()}
    (actual,) = ipu.run_with_ort_values(None, values)
    assert actual.numpy().shape == ()
    np.testing.assert_allclose(actual.numpy(), cpu.run(None, FEED)[0], rtol=1e-6)


def test_io_binding_keeps_the_scalar(sessions):
    ipu, cpu = sessions
    binding = ipu.io_binding()
    for name, array in FEED.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("y")
    ipu.run_with_iobinding(binding)
    (actual,) = binding.copy_outputs_to_cpu()
    assert actual.shape == ()
    np.testing.assert_allclose(actual, cpu.run(None, FEED)[0], rtol=1e-6)
