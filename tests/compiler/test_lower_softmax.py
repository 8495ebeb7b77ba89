"""Softmax/LogSoftmax-13 (one axis) expressed with the opset-11 operators that flatten at their axis.

The opset-11 kernel over the last axis is onnxruntime's opset-13 kernel after its own transpose, so the
outputs agree to atol 1e-6 (in practice exactly).
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT
from hypothesis import strategies as st


def _softmax(op_type, shape, axis, opset=18):
    return lt.one_node_model(op_type, [("x", FLOAT, shape)], [("y", FLOAT, shape)], opset=opset, axis=axis)


def test_inner_axis_is_transposed_to_the_end_and_back():
    lowered = lt.lower_and_compare(
        _softmax("Softmax", (2, 3, 4), 1), {"x": lt.random_array(0, (2, 3, 4), np.float32)}
    )
    transposes = [n for n in lowered.graph.node if n.op_type == "Transpose"]
    assert len(transposes) == 2
    assert [n.op_type for n in lowered.graph.node] == ["Transpose", "Softmax", "Transpose"]


def test_last_axis_needs_no_transpose():
    lowered = lt.lower(_softmax("LogSoftmax", (2, 3, 4), 2))
    assert lt.op_types(lowered) == {"LogSoftmax"}


def test_opset_11_softmax_keeps_its_flattening_semantics():
    model = _softmax("Softmax", (2, 3, 4), 1, opset=11)
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(1, (2, 3, 4), np.float32)})
    assert lt.op_types(lowered) == {"Softmax"}


@lt.property_test(
    op_type=st.sampled_from(["Softmax", "LogSoftmax"]),
    shape=lt.shapes(1, 4),
    data=st.data(),
    seed=lt.seeds,
)
def test_same_outputs_for_every_axis(op_type, shape, data, seed):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    model = _softmax(op_type, shape, axis, opset=data.draw(st.sampled_from([13, 18])))
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32, -30, 30)})
