"""An input axis the graph ties to the batch under another name (SD3's transformer adds ``timestep``, axis
"step", to each row of "batch_size"): padding only the batch would make operands that cannot broadcast, so
the batch is compiled at its exact size, with a verdict that names the node, and the outputs match CPU."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from emulator_sessions import cpu_outputs, emulator_session
from onnx import TensorProto, helper, numpy_helper


def _timestep_added_per_row(out_dir: Path) -> Path:
    """y = hidden + timestep[:, None] * w: hidden ['batch_size', 8], timestep ['step']."""
    weights = numpy_helper.from_array(np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8), "w")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    graph = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["timestep", "axes"], ["column"], name="/time/Unsqueeze"),
            helper.make_node("Mul", ["column", "w"], ["embedded"], name="/time/Mul"),
            helper.make_node("Add", ["hidden", "embedded"], ["y"], name="/time/Add"),
        ],
        "tied",
        [
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch_size", 8]),
            helper.make_tensor_value_info("timestep", TensorProto.FLOAT, ["step"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", 8])],
        initializer=[weights, axes],
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 13)]), out_dir / "model.onnx"
    )
    return out_dir


def test_a_batch_tied_to_an_unpadded_axis_compiles_exactly_naming_the_node(tmp_path, caplog):
    onnx_dir = _timestep_added_per_row(tmp_path / "onnx")
    session = emulator_session(onnx_dir, tmp_path / "cache")
    rng = np.random.default_rng(0)
    feed = {
        "hidden": rng.standard_normal((3, 8)).astype(np.float32),  # 3 rows: the batch plan would pad to 4
        "timestep": np.array([999.0, 500.0, 1.0], np.float32),
    }
    with caplog.at_level(logging.WARNING):
        (got,) = session.run(None, feed)
    np.testing.assert_allclose(got, cpu_outputs(onnx_dir, feed)[0], atol=1e-5)
    verdict = session.padding_verdicts()["batch_size"]
    assert verdict.startswith("exact"), verdict
    assert "'/time/Add' (Add)" in verdict and "ties a padded axis to one that is not padded" in verdict
    assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]  # a refusal, not a crash
    assert [entry["shapes"]["hidden"] for entry in session.compiled_executables()] == [(3, 8)]
