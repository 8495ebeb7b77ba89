"""Attributes added after opset 11 at their neutral value are dropped (same outputs); others are refused."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT


def _attribute_names(model):
    return {a.name for node in model.graph.node for a in node.attribute}


def test_reshape_allowzero_zero_is_dropped():
    model = lt.one_node_model(
        "Reshape", [("x", FLOAT, (2, 6))], [("y", FLOAT, (3, 4))], {"shape": np.array([3, 4])}, allowzero=0
    )
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(0, (2, 6), np.float32)})
    assert "allowzero" not in _attribute_names(lowered)


def test_reshape_allowzero_one_without_zero_dims_is_harmless():
    model = lt.one_node_model(
        "Reshape", [("x", FLOAT, (2, 6))], [("y", FLOAT, (4, 3))], {"shape": np.array([4, -1])}, allowzero=1
    )
    lt.lower_and_compare(model, {"x": lt.random_array(1, (2, 6), np.float32)})


def test_reshape_allowzero_one_with_a_zero_is_refused():
    model = lt.one_node_model(
        "Reshape", [("x", FLOAT, (0, 6))], [("y", FLOAT, (6, 0))], {"shape": np.array([6, 0])}, allowzero=1
    )
    lt.assert_refused(model, "the_Reshape.*allowzero=1")


@lt.property_test(shape=lt.shapes(1, 4), seed=lt.seeds)
def test_reshape_allowzero_zero_matches(shape, seed):
    target = np.array([-1, *shape[1:]][::-1], np.int64)
    model = lt.one_node_model(
        "Reshape", [("x", FLOAT, shape)], [("y", FLOAT, None)], {"shape": target}, allowzero=0
    )
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)})
