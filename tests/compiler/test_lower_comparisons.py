"""LessOrEqual/GreaterOrEqual as opset-11 comparisons: exactly the same booleans, NaN included."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import BOOL, FLOAT, INT32, INT64
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

_SPECIAL_FLOATS = st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 1e-30])
_FLOATS = st.one_of(_SPECIAL_FLOATS, st.floats(-3, 3, width=32))


def _comparison(op_type, elem_type, a_shape, b_shape):
    return lt.one_node_model(
        op_type, [("a", elem_type, a_shape), ("b", elem_type, b_shape)], [("y", BOOL, None)]
    )


def test_nan_compares_false_like_the_original():
    model = _comparison("LessOrEqual", FLOAT, (4,), (4,))
    a = np.array([np.nan, 1.0, np.nan, 2.0], np.float32)
    b = np.array([1.0, np.nan, np.nan, 2.0], np.float32)
    lowered = lt.lower_and_compare(model, {"a": a, "b": b})
    assert "LessOrEqual" not in lt.op_types(lowered)


def test_integers_use_the_negated_strict_comparison():
    lowered = lt.lower_and_compare(
        _comparison("GreaterOrEqual", INT64, (3,), (3,)),
        {"a": np.array([1, 2, 3], np.int64), "b": np.array([2, 2, 2], np.int64)},
    )
    assert lt.op_types(lowered) == {"Less", "Not"}


@lt.property_test(
    op_type=st.sampled_from(["LessOrEqual", "GreaterOrEqual"]),
    shapes_=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4),
    data=st.data(),
)
def test_float_comparisons_match(op_type, shapes_, data):
    a_shape, b_shape = shapes_.input_shapes
    a = data.draw(hnp.arrays(np.float32, a_shape, elements=_FLOATS))
    b = data.draw(hnp.arrays(np.float32, b_shape, elements=_FLOATS))
    lt.lower_and_compare(_comparison(op_type, FLOAT, a_shape, b_shape), {"a": a, "b": b})


@lt.property_test(
    op_type=st.sampled_from(["LessOrEqual", "GreaterOrEqual"]),
    elem_type=st.sampled_from([INT32, INT64]),
    shapes_=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4),
    data=st.data(),
)
def test_integer_comparisons_match(op_type, elem_type, shapes_, data):
    dtype = np.int32 if elem_type == INT32 else np.int64
    a_shape, b_shape = shapes_.input_shapes
    values = st.integers(-3, 3)
    a = data.draw(hnp.arrays(dtype, a_shape, elements=values))
    b = data.draw(hnp.arrays(dtype, b_shape, elements=values))
    lt.lower_and_compare(_comparison(op_type, elem_type, a_shape, b_shape), {"a": a, "b": b})
