"""OneHot with integer values as a float32 OneHot and a Cast: the same integers, every axis, any depth;
float values, and integer values beyond float32's exact range, are left alone."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT32, INT64, run_ort
from hypothesis import strategies as st


@lt.property_test(
    shape=lt.shapes(max_rank=3),
    depth=st.integers(1, 6),
    off=st.integers(-5, 5),
    on=st.integers(-5, 5),
    data=st.data(),
)
def test_integer_one_hot_matches(shape, depth, off, on, data):
    axis = data.draw(st.integers(-len(shape) - 1, len(shape)))
    indices = data.draw(
        st.lists(st.integers(-depth, depth - 1), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))
    )
    model = lt.one_node_model(
        "OneHot",
        [("indices", INT64, shape)],
        [("y", INT64, None)],
        {"depth": np.array(depth, np.int64), "values": np.array([off, on], np.int64)},
        opset=11,
        axis=axis,
    )
    lowered = lt.lower_and_compare(model, {"indices": np.array(indices, np.int64).reshape(shape)})
    assert lt.op_types(lowered) == {"OneHot", "Cast"}


def test_float_one_hot_is_left_alone():
    model = lt.one_node_model(
        "OneHot",
        [("indices", INT64, (3,))],
        [("y", FLOAT, None)],
        {"depth": np.array(4, np.int64), "values": np.array([0, 1], np.float32)},
        opset=11,
    )
    assert lt.op_types(lt.lower(model)) == {"OneHot"}


def test_values_beyond_float32s_exact_integers_are_left_alone():
    model = lt.one_node_model(
        "OneHot",
        [("indices", INT64, (3,))],
        [("y", INT64, None)],
        {"depth": np.array(4, np.int64), "values": np.array([0, 2**24 + 1], np.int64)},
        opset=11,
    )
    assert lt.op_types(lt.lower(model)) == {"OneHot"}


@lt.property_test(
    shape=lt.shapes(max_rank=3),
    depth=st.integers(1, 6),
    values=st.tuples(st.integers(-(2**40), 2**40), st.integers(-(2**40), 2**40)),
    data=st.data(),
)
def test_integer_values_fed_at_run_time_match(shape, depth, values, data):
    # Any integers, even beyond float32's exact range: the values are chosen, never converted.
    axis = data.draw(st.integers(-len(shape) - 1, len(shape)))
    indices = data.draw(
        st.lists(st.integers(-depth, depth - 1), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))
    )
    model = lt.one_node_model(
        "OneHot",
        [("indices", INT64, shape), ("values", INT64, (2,))],
        [("y", INT64, None)],
        {"depth": np.array(depth, np.int64)},
        opset=11,
        node_inputs=["indices", "depth", "values"],
        axis=axis,
    )
    feeds = {"indices": np.array(indices, np.int64).reshape(shape), "values": np.array(values, np.int64)}
    lowered = lt.lower_and_compare(model, feeds)
    assert lt.op_types(lowered) == {"OneHot", "Cast", "Slice", "Where"}


def test_int32_values_fed_at_run_time_run_where_onnxruntime_has_no_kernel():
    # After Int64ToInt32 the values are int32, for which onnxruntime (the emulator) has no OneHot kernel.
    model = lt.one_node_model(
        "OneHot",
        [("indices", INT64, (3,)), ("values", INT32, (2,))],
        [("y", INT32, None)],
        {"depth": np.array(4, np.int64)},
        opset=28,
        node_inputs=["indices", "depth", "values"],
    )
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    feeds = {"indices": np.array([0, 3, -1], np.int64), "values": np.array([-7, 2**30], np.int32)}
    expected = np.full((3, 4), -7, np.int32)
    expected[[0, 1, 2], [0, 3, 3]] = 2**30
    np.testing.assert_array_equal(run_ort(lowered, feeds)["y"], expected)
