"""Scan-8 (with a batch axis) taken to opset 11: the graph keeps its inputs and outputs, batch axis
included, and computes what CPU onnxruntime computes for the opset-8 graph; a batch other than 1 is
refused (Scan-9 has no batch axis, and onnx's converter only deletes it from the declared shapes)."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import onnx
from graph_testing import FLOAT, make_model, shape_of, tensor_info
from onnx import helper


def _scan_sum(batch: int) -> onnx.ModelProto:
    """ONNX's own Scan-8 example: a running sum over the sequence, per sample of the batch."""
    body = helper.make_graph(
        [
            helper.make_node("Add", ["sum_in", "next"], ["sum_out"]),
            helper.make_node("Identity", ["sum_out"], ["scan_out"]),
        ],
        "scan_body",
        [tensor_info("sum_in", FLOAT, [2]), tensor_info("next", FLOAT, [2])],
        [tensor_info("sum_out", FLOAT, [2]), tensor_info("scan_out", FLOAT, [2])],
    )
    node = helper.make_node(
        "Scan", ["", "initial", "x"], ["y", "z"], name="the_Scan", num_scan_inputs=1, body=body
    )
    return make_model(
        [node],
        [tensor_info("initial", FLOAT, [batch, 2]), tensor_info("x", FLOAT, [batch, 3, 2])],
        [tensor_info("y", FLOAT, [batch, 2]), tensor_info("z", FLOAT, [batch, 3, 2])],
        opset=8,
    )


def test_a_batch_of_one_keeps_the_graph_interface_and_the_results():
    model = _scan_sum(1)
    feeds = {
        "initial": np.array([[0.0, 1.0]], np.float32),
        "x": np.arange(6, dtype=np.float32).reshape(1, 3, 2),
    }
    lowered = lt.lower_and_compare(model, feeds)
    for before, after in (
        (model.graph.input, lowered.graph.input),
        (model.graph.output, lowered.graph.output),
    ):
        assert [(v.name, shape_of(v)) for v in before] == [(v.name, shape_of(v)) for v in after]


def test_a_larger_batch_is_refused():
    lt.assert_refused(_scan_sum(2), "the_Scan.*batch axis has size 2")
