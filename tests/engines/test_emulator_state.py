"""The carried-state contract (``engines.base.state_updates``) on the host emulator: an initializer that an
``ai.graphcore`` CopyVarUpdate overwrites keeps its value from one run to the next, runs read the value
from before the run, and ``write_state`` replaces it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.engines.base import CompileOptions, EngineContractError
from optimum_ipu_backend.engines.emulator import HostEmulatorEngine


def counter_graph(path, *, external: bool) -> None:
    """y = (S + x) * 2 and S <- y; the update node comes first, so readers after it must still see the
    old S (PopART orders every reader of a variable before its update)."""
    state = numpy_helper.from_array(np.zeros((2, 3), np.float32), "S")
    two = numpy_helper.from_array(np.full((2, 3), 2.0, np.float32), "two")
    nodes = [
        helper.make_node("CopyVarUpdate", ["S", "y"], ["S_updated"], domain="ai.graphcore"),
        helper.make_node("Add", ["S", "x"], ["sum"]),
        helper.make_node("Mul", ["sum", "two"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "counter",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [state, two],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 11), helper.make_opsetid("ai.graphcore", 1)]
    )
    kwargs = (
        {"save_as_external_data": True, "location": "g.onnx.data", "size_threshold": 0} if external else {}
    )
    onnx.save(model, path, **kwargs)


@pytest.mark.parametrize("external", [False, True])
def test_state_persists_between_runs_and_can_be_written(tmp_path, external):
    counter_graph(tmp_path / "g.onnx", external=external)
    with HostEmulatorEngine("emulator") as engine:
        executable = engine.compile(tmp_path / "g.onnx", CompileOptions())
        assert [spec.name for spec in executable.state] == ["S"]
        assert [spec.name for spec in executable.inputs] == ["x"]
        assert [spec.name for spec in executable.outputs] == ["y"]
        ones = np.ones((2, 3), np.float32)
        np.testing.assert_array_equal(executable.run({"x": ones})["y"], 2.0)  # (0 + 1) * 2
        np.testing.assert_array_equal(executable.run({"x": ones})["y"], 6.0)  # (2 + 1) * 2
        executable.write_state({"S": np.full((2, 3), 10.0, np.float32)})
        np.testing.assert_array_equal(executable.run({"x": ones})["y"], 22.0)
        with pytest.raises(EngineContractError, match="float32\\[2, 3\\]"):
            executable.write_state({"S": np.zeros((3, 2), np.float32)})
        with pytest.raises(EngineContractError, match="not state"):
            executable.write_state({"two": np.zeros((2, 3), np.float32)})


def test_a_graph_without_state_refuses_write_state(tmp_path):
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "plain",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        ),
        opset_imports=[helper.make_opsetid("", 11)],
    )
    onnx.save(model, tmp_path / "plain.onnx")
    with HostEmulatorEngine("emulator") as engine:
        executable = engine.compile(tmp_path / "plain.onnx", CompileOptions())
        assert executable.state == ()
        with pytest.raises(EngineContractError, match="keeps no state"):
            executable.write_state({"x": np.zeros(2, np.float32)})
