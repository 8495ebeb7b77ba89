"""OneHot with integer values as a float32 OneHot and a Cast: the same integers, every axis, any depth;
float values, and integer values beyond float32's exact range, are left alone."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT64
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
