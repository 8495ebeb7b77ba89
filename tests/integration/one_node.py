"""A one-node ONNX model on disk, for tests of commands and patches that need a graph but not a model."""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto, helper, save


def save_one_node_model(path: Path, op: str = "Relu", shape: tuple[int, ...] = (1, 4)) -> Path:
    """``y = op(x)`` on a float tensor of ``shape``, opset 13, saved to ``path``."""
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"])],
        f"one_{op.lower()}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return Path(path)
