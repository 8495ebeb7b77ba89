"""Attributes added after opset 11 at their neutral value are dropped (same outputs); others are refused."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT64
from hypothesis import strategies as st


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


def test_argmax_select_last_index_is_refused():
    model = lt.one_node_model(
        "ArgMax", [("x", FLOAT, (2, 3))], [("y", INT64, (2, 1))], axis=1, select_last_index=1
    )
    lt.assert_refused(model, "select_last_index=1")


def test_scatter_elements_reduction_add_is_refused():
    model = lt.one_node_model(
        "ScatterElements",
        [("x", FLOAT, (4,)), ("i", INT64, (2,)), ("u", FLOAT, (2,))],
        [("y", FLOAT, (4,))],
        reduction="add",
    )
    lt.assert_refused(model, "reduction='add'")


def test_average_pool_unit_dilations_are_dropped():
    model = lt.one_node_model(
        "AveragePool",
        [("x", FLOAT, (1, 2, 5, 5))],
        [("y", FLOAT, (1, 2, 4, 4))],
        opset=19,
        kernel_shape=[2, 2],
        dilations=[1, 1],
    )
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(2, (1, 2, 5, 5), np.float32)})
    assert "dilations" not in _attribute_names(lowered)


@lt.property_test(shape=lt.shapes(1, 4), data=st.data(), seed=lt.seeds, last=st.booleans())
def test_argmax_argmin_with_neutral_select_last_index_match(shape, data, seed, last):
    op_type = data.draw(st.sampled_from(["ArgMax", "ArgMin"]))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    keepdims = data.draw(st.integers(0, 1))
    model = lt.one_node_model(
        op_type,
        [("x", FLOAT, shape)],
        [("y", INT64, None)],
        axis=axis,
        keepdims=keepdims,
        select_last_index=0,
    )
    # Few distinct values, so ties (where select_last_index would matter) are common.
    x = np.round(lt.random_array(seed, shape, np.float32, -2, 2))
    lt.lower_and_compare(model, {"x": x})


@lt.property_test(shape=lt.shapes(1, 4), seed=lt.seeds)
def test_reshape_allowzero_zero_matches(shape, seed):
    target = np.array([-1, *shape[1:]][::-1], np.int64)
    model = lt.one_node_model(
        "Reshape", [("x", FLOAT, shape)], [("y", FLOAT, None)], {"shape": target}, allowzero=0
    )
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)})
