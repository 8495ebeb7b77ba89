"""Pow-12+ with mixed operand types (or an integer base) in Pow-7's single-type form."""

from __future__ import annotations

import numpy as np
from graph_testing import FLOAT, INT32, INT64
from hypothesis import strategies as st
from lowering_testing import (
    assert_refused,
    lower,
    lower_and_compare,
    one_node_model,
    op_types,
    property_test,
    random_array,
    seeds,
    shapes,
)


def test_float_pow_with_float_exponent_is_kept():
    model = one_node_model(
        "Pow", [("x", FLOAT, (3,))], [("y", FLOAT, (3,))], {"e": np.array(2.0, np.float32)}
    )
    assert op_types(lower(model)) == {"Pow"}


def test_integer_base_with_runtime_exponent_is_refused():
    model = one_node_model("Pow", [("x", INT64, (3,)), ("e", INT64, ())], [("y", INT64, (3,))])
    assert_refused(model, "the_Pow.*integer base")


@property_test(
    shape=shapes(0, 3),
    exponent_type=st.sampled_from([INT32, INT64]),
    exponent=st.integers(-3, 4),
    runtime=st.booleans(),
    seed=seeds,
)
def test_float_base_integer_exponent_matches(shape, exponent_type, exponent, runtime, seed):
    dtype = np.int32 if exponent_type == INT32 else np.int64
    if runtime:
        model = one_node_model("Pow", [("x", FLOAT, shape), ("e", exponent_type, ())], [("y", FLOAT, shape)])
        feeds = {"e": np.array(exponent, dtype)}
    else:
        model = one_node_model(
            "Pow", [("x", FLOAT, shape)], [("y", FLOAT, shape)], {"e": np.array(exponent, dtype)}
        )
        feeds = {}
    feeds["x"] = random_array(seed, shape, np.float32, 0.5, 3)
    lowered = lower_and_compare(model, feeds)
    assert op_types(lowered) <= {"Pow", "Cast"}


@property_test(
    shape=shapes(0, 3), exponent=st.integers(0, 8), elem=st.sampled_from([INT32, INT64]), seed=seeds
)
def test_integer_base_small_exponent_matches(shape, exponent, elem, seed):
    dtype = np.int32 if elem == INT32 else np.int64
    model = one_node_model(
        "Pow", [("x", elem, shape)], [("y", elem, shape)], {"e": np.array(exponent, dtype)}
    )
    lowered = lower_and_compare(model, {"x": random_array(seed, shape, dtype, -6, 6)})
    assert "Pow" not in op_types(lowered)
