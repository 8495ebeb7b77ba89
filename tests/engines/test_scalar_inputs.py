"""A rank-0 input (a diffusion UNet's ``timestep``) reaches the engine as a 0-d array on every device-step
path, on the emulator and on both SDK engines (the double): onnxruntime refuses a numpy scalar in its
place, and PopTorch's batch rule needs a dim 0 on every input, which a scalar gets as ``[steps]``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from sdk_testing import use_sdk_double

from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession


@pytest.mark.parametrize("device_iterations", [1, 2])
def test_a_scalar_input_runs_on_the_emulator(tmp_path: Path, device_iterations: int) -> None:
    _check_scalar_input(tmp_path, {"device": "emulator"}, device_iterations)


@pytest.mark.parametrize("engine", ["popart", "poptorch"])
@pytest.mark.parametrize("device_iterations", [1, 2])
def test_a_scalar_input_runs_on_the_sdk_engines(tmp_path: Path, engine: str, device_iterations: int) -> None:
    with use_sdk_double(tmp_path / "sdk", ipus=1):
        _check_scalar_input(tmp_path, {"device": "ipu", "engine": engine}, device_iterations)


def _check_scalar_input(tmp_path: Path, device: dict, device_iterations: int) -> None:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["sample", "timestep"], ["out"])],
        "scaled",
        [
            helper.make_tensor_value_info("sample", TensorProto.FLOAT, ["batch_size", 4]),
            helper.make_tensor_value_info("timestep", TensorProto.FLOAT, []),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch_size", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    options = {**device, "executable_cache_dir": str(tmp_path / "cache")}
    if device_iterations > 1:
        options.update(device_iterations=device_iterations, batch_size="1")
    session = IPUInferenceSession(str(path), options=IPUProviderOptions.parse(options, tmp_path))
    feed = {"sample": np.arange(8, dtype=np.float32).reshape(2, 4), "timestep": np.array(3.0, np.float32)}
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)
    np.testing.assert_array_equal(session.run(None, feed)[0], expected[0])
    session.close()
