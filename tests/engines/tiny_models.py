"""A tiny static-friendly graph for the engine tests: cheap to legalize and compile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper


def tiny_model(path: Path, seed: int = 0, sequence: int | str = "sequence_length") -> Path:
    """y = relu(x @ W) and ids + 1; the batch dimension is dynamic, the sequence too unless given."""
    rng = np.random.default_rng(seed)
    weight = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], rng.standard_normal(12).astype(np.float32))
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
            helper.make_node("Relu", ["xw"], ["y"], name="relu"),
            helper.make_node("Add", ["input_ids", "one"], ["ids_plus_one"], name="add"),
        ],
        "tiny",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", sequence]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", 4]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", 3]),
            helper.make_tensor_value_info("ids_plus_one", TensorProto.INT64, ["batch_size", sequence]),
        ],
        [weight, one],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=7), path)
    return path


def feed(batch: int = 3, seq: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, 1000, size=(batch, seq), dtype=np.int64),
        "x": rng.standard_normal((batch, 4)).astype(np.float32),
    }


def reference(path: Path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)
