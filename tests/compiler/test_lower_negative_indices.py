"""Gather and ScatterElements with negative indices: the lowered graph maps them into [0, size - 1] before
the indexing node reads them (PopART is not documented to count from the end), with the same outputs.

onnxruntime counts negative indices from the end itself, so equal outputs alone would not show the
mapping: each case also reads back the index operand of the lowered node and checks it is never negative.
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import onnx
from graph_testing import FLOAT, INT32, INT64, copy_model, run_ort
from hypothesis import strategies as st


def _indices_read(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Lower ``model`` (checking its outputs stay the same) and return what its indexing node reads."""
    lowered = lt.lower_and_compare(model, feeds)
    op_type = model.graph.node[0].op_type
    (indexing,) = [node for node in lowered.graph.node if node.op_type == op_type]
    name = indexing.input[1]
    for init in lowered.graph.initializer:
        if init.name == name:
            return onnx.numpy_helper.to_array(init)
    probe = copy_model(lowered)
    inferred = onnx.shape_inference.infer_shapes(probe)
    typed = {value.name: value for value in (*inferred.graph.input, *inferred.graph.value_info)}
    probe.graph.output.append(typed[name])
    return run_ort(probe, feeds)[name]


def _gather_model(data_shape, index_shape, axis, index_type, constant=None):
    at = axis % len(data_shape)
    output_shape = (*data_shape[:at], *index_shape, *data_shape[at + 1 :])
    inputs = [("data", FLOAT, data_shape)]
    if constant is None:
        inputs.append(("indices", index_type, index_shape))
    return lt.one_node_model(
        "Gather",
        inputs,
        [("y", FLOAT, output_shape)],
        None if constant is None else {"indices": constant},
        opset=13,
        axis=axis,
    )


@lt.property_test(
    data_shape=lt.shapes(1, 3, 1, 4),
    index_shape=lt.shapes(0, 2, 1, 3),
    data=st.data(),
    seed=lt.seeds,
    index_type=st.sampled_from([INT32, INT64]),
)
def test_gather_runtime_indices_reach_the_node_non_negative(data_shape, index_shape, data, seed, index_type):
    axis = data.draw(st.integers(-len(data_shape), len(data_shape) - 1))
    size = data_shape[axis]
    dtype = np.int32 if index_type == INT32 else np.int64
    indices = np.random.default_rng(seed).integers(-size, size, index_shape).astype(dtype)
    values = lt.random_array(seed, data_shape, np.float32)
    model = _gather_model(data_shape, index_shape, axis, index_type)
    read = _indices_read(model, {"data": values, "indices": indices})
    np.testing.assert_array_equal(read, np.where(indices < 0, indices + size, indices))


def test_constant_negative_indices_are_mapped_at_compile_time():
    model = _gather_model((5, 2), (3,), 0, INT64, constant=np.array([-1, 0, -5], np.int64))
    read = _indices_read(model, {"data": lt.random_array(0, (5, 2), np.float32)})
    np.testing.assert_array_equal(read, [4, 0, 0])


def test_a_gather_with_non_negative_constant_indices_is_left_alone():
    model = _gather_model((5, 2), (2,), 0, INT64, constant=np.array([1, 4], np.int64))
    assert lt.lower(model).graph.node[0].input[1] == "indices"


@lt.property_test(
    data_shape=lt.shapes(1, 3, 1, 4), data=st.data(), seed=lt.seeds, opset=st.sampled_from([13, 18])
)
def test_scatter_elements_runtime_indices_reach_the_node_non_negative(data_shape, data, seed, opset):
    rank = len(data_shape)
    axis = data.draw(st.integers(-rank, rank - 1))
    size = data_shape[axis]
    rng = np.random.default_rng(seed)
    # a permutation along the axis: no two updates share a target (which one wins would be unspecified)
    distinct = np.argsort(rng.random(data_shape), axis=axis)
    indices = np.where(rng.integers(0, 2, data_shape) == 1, distinct - size, distinct).astype(np.int64)
    index_shape = data_shape
    attributes = {"reduction": "none"} if opset >= 16 else {}
    model = lt.one_node_model(
        "ScatterElements",
        [("data", FLOAT, data_shape), ("indices", INT64, index_shape), ("updates", FLOAT, index_shape)],
        [("y", FLOAT, data_shape)],
        opset=opset,
        axis=axis,
        **attributes,
    )
    feeds = {
        "data": lt.random_array(seed, data_shape, np.float32),
        "indices": indices,
        "updates": lt.random_array(seed + 1, index_shape, np.float32),
    }
    read = _indices_read(model, feeds)
    np.testing.assert_array_equal(read, np.where(indices < 0, indices + size, indices))


def test_runtime_indices_into_an_axis_of_unknown_size_are_refused():
    model = lt.one_node_model(
        "Gather", [("data", FLOAT, ("n", 3)), ("indices", INT64, (2,))], [("y", FLOAT, (2, 3))], axis=0
    )
    lt.assert_refused(model, "the_Gather.*size of its indexed axis")
