"""Trilu as Where(mask, x, 0) on static shapes: exactly the same values (a selection, no arithmetic)."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import BOOL, FLOAT, INT64
from hypothesis import strategies as st


def test_constant_k_becomes_a_constant_mask():
    model = lt.one_node_model(
        "Trilu", [("x", FLOAT, (3, 4))], [("y", FLOAT, (3, 4))], {"k": np.array(1, np.int64)}, upper=1
    )
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(0, (3, 4), np.float32)})
    assert lt.op_types(lowered) == {"Where"}


def test_infinities_are_masked_to_zero_not_nan():
    model = lt.one_node_model("Trilu", [("x", FLOAT, (2, 2))], [("y", FLOAT, (2, 2))], upper=0)
    lt.lower_and_compare(model, {"x": np.array([[np.inf, -np.inf], [np.nan, np.inf]], np.float32)})


def test_dynamic_shape_is_refused():
    model = lt.one_node_model("Trilu", [("x", FLOAT, ("n", 4))], [("y", FLOAT, ("n", 4))])
    lt.assert_refused(model, "the_Trilu.*static shape")


@lt.property_test(
    shape=lt.shapes(2, 4, 1, 6),
    upper=st.integers(0, 1),
    k=st.one_of(st.none(), st.integers(-7, 7)),
    runtime_k=st.booleans(),
    elem=st.sampled_from([(FLOAT, np.float32), (INT64, np.int64), (BOOL, np.bool_)]),
    seed=lt.seeds,
)
def test_same_values_as_trilu(shape, upper, k, runtime_k, elem, seed):
    elem_type, dtype = elem
    inputs = [("x", elem_type, shape)]
    feeds = {"x": lt.random_array(seed, shape, dtype)}
    initializers = {}
    if k is not None and runtime_k:
        inputs.append(("k", INT64, ()))
        feeds["k"] = np.array(k, np.int64)
    elif k is not None:
        initializers["k"] = np.array(k, np.int64)
    model = lt.one_node_model("Trilu", inputs, [("y", elem_type, shape)], initializers, upper=upper)
    lowered = lt.lower_and_compare(model, feeds)
    assert "Trilu" not in lt.op_types(lowered)
