"""GatherElements, GatherND and ScatterND as Gather/ScatterElements on flattened data: the same elements.

These rewrites only move elements (no arithmetic on the data), so every output is compared exactly
(atol 1e-6 on floats is never needed). Indices are drawn with negative values too; each case runs once
with the indices as a constant and once as a graph input.
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT32, INT64, run_ort
from hypothesis import strategies as st


def _run_both_ways(op_type, data, indices, extra_inputs, output_shape, index_type=INT64, **attributes):
    """Lower with constant indices, then with runtime indices; both must match the original."""
    data_spec = ("data", FLOAT, data.shape)
    feeds = {"data": data, **{name: value for name, value in extra_inputs}}
    extra_specs = [(name, FLOAT, value.shape) for name, value in extra_inputs]
    constant = lt.one_node_model(
        op_type,
        [data_spec, *extra_specs],
        [("y", FLOAT, output_shape)],
        {"indices": indices},
        node_inputs=["data", "indices", *[n for n, _ in extra_inputs]],
        **attributes,
    )
    lowered = lt.lower_and_compare(constant, feeds)
    assert op_type not in lt.op_types(lowered)
    runtime = lt.one_node_model(
        op_type,
        [data_spec, ("indices", index_type, indices.shape), *extra_specs],
        [("y", FLOAT, output_shape)],
        **attributes,
    )
    lowered = lt.lower_and_compare(runtime, {**feeds, "indices": indices})
    assert op_type not in lt.op_types(lowered)


def test_dynamic_data_shape_is_refused():
    model = lt.one_node_model(
        "GatherND", [("data", FLOAT, ("n", 3)), ("indices", INT64, (2, 1))], [("y", FLOAT, (2, 3))]
    )
    lt.assert_refused(model, "the_GatherND.*static shape")


@lt.property_test(
    data_shape=lt.shapes(1, 3, 1, 4),
    data=st.data(),
    seed=lt.seeds,
    reduction=st.sampled_from(["add", "mul", "max", "min"]),
)
def test_scatter_nd_reductions_match_with_repeated_indices(data_shape, data, seed, reduction):
    """Opset 16/18's reductions combine every update aimed at a position, repeats included (CPU applies
    them one after another); the lowering masks and reduces: equal up to the float sum's order."""
    rng = np.random.default_rng(seed)
    depth = data.draw(st.integers(1, len(data_shape)))
    addressed = data_shape[:depth]
    count = data.draw(st.integers(1, 6))
    targets = np.stack(np.unravel_index(rng.integers(0, int(np.prod(addressed)), count), addressed), axis=-1)
    negative = rng.integers(0, 2, targets.shape).astype(bool)
    indices = np.where(negative, targets - np.array(addressed), targets)
    indices = indices.astype(np.int64)
    updates = rng.uniform(-3, 3, (count, *data_shape[depth:])).astype(np.float32)
    values = rng.uniform(-3, 3, data_shape).astype(np.float32)
    feeds = {"data": values, "updates": updates}
    for constant in (True, False):
        inputs = [("data", FLOAT, data_shape), ("updates", FLOAT, updates.shape)]
        if not constant:
            inputs.insert(1, ("indices", INT64, indices.shape))
        model = lt.one_node_model(
            "ScatterND",
            inputs,
            [("y", FLOAT, data_shape)],
            {"indices": indices} if constant else None,
            node_inputs=["data", "indices", "updates"],
            reduction=reduction,
        )
        lowered = lt.lower_and_compare(
            model, feeds if constant else {**feeds, "indices": indices}, atol=1e-5, rtol=1e-6
        )
        assert "ScatterND" not in lt.op_types(lowered)


def test_scatter_nd_reduction_at_a_realistic_size_matches():
    # A key/value-cache-like update: 64 rows of 256 features into a [512, 256] table, with repeats.
    rng = np.random.default_rng(0)
    indices = rng.integers(0, 512, (64, 1)).astype(np.int64)
    updates = rng.standard_normal((64, 256)).astype(np.float32)
    model = lt.one_node_model(
        "ScatterND",
        [("data", FLOAT, (512, 256)), ("indices", INT64, (64, 1)), ("updates", FLOAT, (64, 256))],
        [("y", FLOAT, (512, 256))],
        reduction="add",
    )
    feeds = {
        "data": rng.standard_normal((512, 256)).astype(np.float32),
        "indices": indices,
        "updates": updates,
    }
    lt.lower_and_compare(model, feeds, atol=1e-5, rtol=1e-6)


@lt.property_test(
    data_shape=lt.shapes(1, 4, 1, 4),
    data=st.data(),
    seed=lt.seeds,
    index_type=st.sampled_from([INT32, INT64]),
)
def test_gather_elements_matches(data_shape, data, seed, index_type):
    rng = np.random.default_rng(seed)
    rank = len(data_shape)
    axis = data.draw(st.integers(-rank, rank - 1))
    size = data_shape[axis]
    index_shape = tuple(
        data.draw(st.integers(1, d)) if i != axis % rank else data.draw(st.integers(1, 4))
        for i, d in enumerate(data_shape)
    )
    dtype = np.int32 if index_type == INT32 else np.int64
    indices = rng.integers(-size, size, index_shape).astype(dtype)
    values = rng.uniform(-10, 10, data_shape).astype(np.float32)
    _run_both_ways("GatherElements", values, indices, [], index_shape, index_type=index_type, axis=axis)


@lt.property_test(data_shape=lt.shapes(1, 4, 1, 4), data=st.data(), seed=lt.seeds)
def test_gather_nd_matches(data_shape, data, seed):
    rng = np.random.default_rng(seed)
    rank = len(data_shape)
    batch_dims = data.draw(st.integers(0, rank - 1))
    depth = data.draw(st.integers(1, rank - batch_dims))
    extra = tuple(data.draw(st.lists(st.integers(1, 3), max_size=2)))
    batch = tuple(data_shape[:batch_dims])
    addressed = np.array(data_shape[batch_dims : batch_dims + depth])
    indices = rng.integers(-addressed, addressed, (*batch, *extra, depth)).astype(np.int64)
    values = rng.uniform(-10, 10, data_shape).astype(np.float32)
    output_shape = (*batch, *extra, *data_shape[batch_dims + depth :])
    _run_both_ways("GatherND", values, indices, [], output_shape, batch_dims=batch_dims)


@lt.property_test(data_shape=lt.shapes(1, 4, 1, 4), data=st.data(), seed=lt.seeds)
def test_scatter_nd_matches(data_shape, data, seed):
    rng = np.random.default_rng(seed)
    rank = len(data_shape)
    depth = data.draw(st.integers(1, rank))
    addressed = data_shape[:depth]
    # Distinct targets: with repeated indices ScatterND's result is undefined.
    cells = int(np.prod(addressed))
    count = data.draw(st.integers(1, cells))
    flat = rng.choice(cells, size=count, replace=False)
    targets = np.stack(np.unravel_index(flat, addressed), axis=-1)
    negative = rng.integers(0, 2, targets.shape).astype(bool)
    indices = np.where(negative, targets - np.array(addressed), targets).astype(np.int64)
    updates = rng.uniform(-10, 10, (count, *data_shape[depth:])).astype(np.float32)
    values = rng.uniform(-10, 10, data_shape).astype(np.float32)
    _run_both_ways("ScatterND", values, indices, [("updates", updates)], data_shape)


_VALUE_TYPES = {FLOAT: np.float32, INT32: np.int32, INT64: np.int64}


@lt.property_test(
    data_shape=lt.shapes(1, 3, 1, 4),
    data=st.data(),
    seed=lt.seeds,
    reduction=st.sampled_from(["add", "mul", "max", "min"]),
    value_type=st.sampled_from(sorted(_VALUE_TYPES)),
    index_type=st.sampled_from([INT32, INT64]),
    constant=st.booleans(),
)
def test_scatter_elements_reductions_match_with_repeated_indices(
    data_shape, data, seed, reduction, value_type, index_type, constant
):
    """ScatterElements-18's reductions along any axis, with indices counting from either end, repeats
    (CPU applies them one after another) and updates narrower than the data on the other axes."""
    rng = np.random.default_rng(seed)
    rank = len(data_shape)
    axis = data.draw(st.integers(-rank, rank - 1))
    size = data_shape[axis]
    index_shape = tuple(
        data.draw(st.integers(1, 5)) if k == axis % rank else data.draw(st.integers(1, d))
        for k, d in enumerate(data_shape)
    )
    indices = rng.integers(-size, size, index_shape).astype(np.int32 if index_type == INT32 else np.int64)
    dtype = _VALUE_TYPES[value_type]
    # Small values: a product of up to 5 repeats stays exact in int32 and well inside float32's range.
    values = lt.random_array(seed, data_shape, dtype, -3, 3)
    updates = lt.random_array(seed + 1, index_shape, dtype, -3, 3)
    feeds = {"data": values, "updates": updates}
    inputs = [("data", value_type, data_shape), ("updates", value_type, index_shape)]
    if not constant:
        inputs.insert(1, ("indices", index_type, index_shape))
        feeds["indices"] = indices
    model = lt.one_node_model(
        "ScatterElements",
        inputs,
        [("y", value_type, data_shape)],
        {"indices": indices} if constant else None,
        node_inputs=["data", "indices", "updates"],
        axis=axis,
        reduction=reduction,
    )
    lowered = lt.lower_and_compare(model, feeds, atol=1e-5, rtol=1e-6)
    assert "ScatterElements" not in lt.op_types(lowered)


def test_scatter_elements_duplicate_indices_add_up_with_the_data():
    # ONNX's own case (test_scatter_elements_with_duplicate_indices): both updates land on [0, 1].
    model = lt.one_node_model(
        "ScatterElements",
        [("data", FLOAT, (1, 5)), ("indices", INT64, (1, 2)), ("updates", FLOAT, (1, 2))],
        [("y", FLOAT, (1, 5))],
        axis=1,
        reduction="add",
    )
    feeds = {
        "data": np.array([[1, 2, 3, 4, 5]], np.float32),
        "indices": np.array([[1, 1]], np.int64),
        "updates": np.array([[1.1, 2.1]], np.float32),
    }
    lowered = lt.lower_and_compare(model, feeds)
    (y,) = run_ort(lowered, feeds).values()
    np.testing.assert_allclose(y, [[1, 5.2, 3, 4, 5]], rtol=1e-6)


def test_scatter_elements_max_leaves_positions_no_update_hits():
    # int64 data at its extremes: the max's identity (the lowest int64) never leaks into untouched cells,
    # and a hit cell keeps its value when every update is smaller.
    low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    model = lt.one_node_model(
        "ScatterElements",
        [("data", INT64, (2, 3)), ("indices", INT64, (2, 2)), ("updates", INT64, (2, 2))],
        [("y", INT64, (2, 3))],
        axis=0,
        reduction="max",
    )
    feeds = {
        "data": np.array([[low, 5, high], [low, 0, 7]], np.int64),
        "indices": np.array([[1, 1], [1, -1]], np.int64),
        "updates": np.array([[3, -2], [4, 1]], np.int64),
    }
    lowered = lt.lower_and_compare(model, feeds)
    (y,) = run_ort(lowered, feeds).values()
    np.testing.assert_array_equal(y, [[low, 5, high], [4, 1, 7]])


def test_scatter_elements_unknown_reduction_is_refused():
    model = lt.one_node_model(
        "ScatterElements",
        [("x", FLOAT, (4,)), ("i", INT64, (2,)), ("u", FLOAT, (2,))],
        [("y", FLOAT, (4,))],
        check=False,
        reduction="mean",
    )
    lt.assert_refused(model, "reduction='mean' is not one of ONNX's")
