"""Hardmax lowered to ArgMax and OneHot: the same one-hot of the first maximum as onnxruntime CPU, exactly."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from graph_testing import FLOAT, FLOAT16
from hypothesis import strategies as st


def _hardmax(shape, opset, elem_type=FLOAT, **attributes):
    return lt.one_node_model(
        "Hardmax", [("x", elem_type, shape)], [("y", elem_type, shape)], opset=opset, **attributes
    )


def _with_ties(seed, shape, dtype=np.float32):
    """Small integers, so that most rows hold their maximum more than once (the first one wins)."""
    return lt.random_array(seed, shape, np.int32, low=-3, high=3).astype(dtype)


@lt.property_test(
    shape=lt.shapes(1, 4, 1, 5),
    axis_choice=st.integers(-4, 3),
    opset=st.sampled_from([11, 13]),
    seed=lt.seeds,
)
def test_same_outputs_as_hardmax(shape, axis_choice, opset, seed):
    axis = axis_choice % len(shape) - (len(shape) if axis_choice < 0 else 0)
    lowered = lt.lower_and_compare(_hardmax(shape, opset, axis=axis), {"x": _with_ties(seed, shape)}, atol=0)
    assert "Hardmax" not in lt.op_types(lowered)


@pytest.mark.parametrize("opset", [11, 13])
def test_default_axis_on_a_transformer_sized_input(opset):
    shape = (2, 128, 768)
    lt.lower_and_compare(_hardmax(shape, opset), {"x": lt.random_array(0, shape, np.float32)}, atol=0)


def test_float16_hardmax():
    shape = (3, 7)
    lt.lower_and_compare(_hardmax(shape, 13, FLOAT16), {"x": _with_ties(1, shape, np.float16)}, atol=0)


def test_a_dynamic_axis_size_is_refused():
    model = lt.one_node_model(
        "Hardmax", [("x", FLOAT, ["n", 4])], [("y", FLOAT, ["n", 4])], opset=13, check=False
    )
    lt.assert_refused(model, "the_Hardmax.*no static shape")
