"""Pow-12+ with mixed operand types (or an integer base) in Pow-7's single-type form."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT32, INT64
from hypothesis import strategies as st


def test_float_pow_with_float_exponent_is_kept():
    model = lt.one_node_model(
        "Pow", [("x", FLOAT, (3,))], [("y", FLOAT, (3,))], {"e": np.array(2.0, np.float32)}
    )
    assert lt.op_types(lt.lower(model)) == {"Pow"}


def test_integer_base_with_runtime_exponent_is_refused():
    model = lt.one_node_model("Pow", [("x", INT64, (3,)), ("e", INT64, ())], [("y", INT64, (3,))])
    lt.assert_refused(model, "the_Pow.*integer base")


@lt.property_test(
    shape=lt.shapes(0, 3),
    exponent_type=st.sampled_from([INT32, INT64]),
    exponent=st.integers(-3, 4),
    runtime=st.booleans(),
    seed=lt.seeds,
)
def test_float_base_integer_exponent_matches(shape, exponent_type, exponent, runtime, seed):
    dtype = np.int32 if exponent_type == INT32 else np.int64
    if runtime:
        model = lt.one_node_model(
            "Pow", [("x", FLOAT, shape), ("e", exponent_type, ())], [("y", FLOAT, shape)]
        )
        feeds = {"e": np.array(exponent, dtype)}
    else:
        model = lt.one_node_model(
            "Pow", [("x", FLOAT, shape)], [("y", FLOAT, shape)], {"e": np.array(exponent, dtype)}
        )
        feeds = {}
    feeds["x"] = lt.random_array(seed, shape, np.float32, 0.5, 3)
    lowered = lt.lower_and_compare(model, feeds)
    assert lt.op_types(lowered) <= {"Pow", "Cast"}


@lt.property_test(
    shape=lt.shapes(0, 3), exponent=st.integers(0, 8), elem=st.sampled_from([INT32, INT64]), seed=lt.seeds
)
def test_integer_base_small_exponent_matches(shape, exponent, elem, seed):
    dtype = np.int32 if elem == INT32 else np.int64
    model = lt.one_node_model(
        "Pow", [("x", elem, shape)], [("y", elem, shape)], {"e": np.array(exponent, dtype)}
    )
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, dtype, -6, 6)})
    assert "Pow" not in lt.op_types(lowered)
