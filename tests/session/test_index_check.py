"""The per-call index check on one-node graphs, against CPU onnxruntime: what ONNX accepts is served with
CPU's results (negative indices counted from the end, each GatherND column within its own axis), and what
it refuses never reaches the device."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from optimum_ipu_backend.errors import InvalidFeedError
from optimum_ipu_backend.session import create_session


def _session_pair(tmp_path, op_type, inputs, output_shape, **attributes):
    """An ipu (emulator) session and a CPU session of one ``op_type`` node reading ``inputs``."""
    node = helper.make_node(
        op_type, [name for name, *_ in inputs], ["y"], name=f"the_{op_type}", **attributes
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(name, elem, shape) for name, elem, shape in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    path = str(tmp_path / "model.onnx")
    onnx.save(model, path)
    ipu = create_session(path, providers=["ipu"], provider_options={"device": "emulator"})
    return ipu, ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def _same_as_cpu(ipu, cpu, feed):
    (expected,) = cpu.run(None, feed)
    (actual,) = ipu.run(None, feed)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected)


DATA = np.arange(30, dtype=np.float32).reshape(3, 10)


@pytest.mark.parametrize("op_type, output_shape", [("Gather", [3, 3, 3]), ("GatherElements", [3, 3])])
def test_negative_indices_count_from_the_end_like_cpu(tmp_path, op_type, output_shape):
    inputs = [("data", TensorProto.FLOAT, [3, 10]), ("indices", TensorProto.INT64, [3, 3])]
    ipu, cpu = _session_pair(tmp_path, op_type, inputs, output_shape, axis=1)
    indices = np.array([[-10, -1, 9], [0, -5, 4], [-3, 2, -9]], np.int64)
    _same_as_cpu(ipu, cpu, {"data": DATA, "indices": indices})
    indices[2, 1] = -11
    with pytest.raises(InvalidFeedError, match=r"holds -11 at position \[2, 1\].*must lie in \[-10, 9\]"):
        ipu.run(None, {"data": DATA, "indices": indices})


def test_scatter_elements_negative_indices_like_cpu(tmp_path):
    inputs = [
        ("data", TensorProto.FLOAT, [3, 10]),
        ("indices", TensorProto.INT64, [1, 3]),
        ("updates", TensorProto.FLOAT, [1, 3]),
    ]
    ipu, cpu = _session_pair(tmp_path, "ScatterElements", inputs, [3, 10], axis=1)
    feed = {
        "data": DATA,
        "indices": np.array([[-1, 0, -4]], np.int64),
        "updates": -np.ones((1, 3), np.float32),
    }
    _same_as_cpu(ipu, cpu, feed)


def test_each_gather_nd_column_lies_within_its_own_axis(tmp_path):
    # column 0 addresses the 3 rows, column 1 the 10 columns: 7 is valid there though 3 rows are fewer
    inputs = [("data", TensorProto.FLOAT, [3, 10]), ("indices", TensorProto.INT64, [4, 2])]
    ipu, cpu = _session_pair(tmp_path, "GatherND", inputs, [4])
    indices = np.array([[2, 7], [0, 9], [-3, -10], [1, 3]], np.int64)
    _same_as_cpu(ipu, cpu, {"data": DATA, "indices": indices})
    for position, value in (((3, 1), 10), ((3, 0), 3)):
        bad = indices.copy()
        bad[position] = value
        with pytest.raises(InvalidFeedError, match=rf"holds {value} at position \[3, {position[1]}\]"):
            ipu.run(None, {"data": DATA, "indices": bad})
