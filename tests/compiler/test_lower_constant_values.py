"""Constant nodes written with value_float(s)/value_int(s) become Constant(value=tensor) with equal values."""

from __future__ import annotations

import lowering_testing as lt
import pytest
from graph_testing import make_model, tensor_info
from hypothesis import strategies as st
from onnx import TensorProto, helper


def _constant_model(attribute, value, elem_type, shape):
    node = helper.make_node("Constant", [], ["y"], name="the_Constant", **{attribute: value})
    return make_model([node], [], [tensor_info("y", elem_type, shape)])


@pytest.mark.parametrize(
    ("attribute", "value", "elem_type", "shape"),
    [
        ("value_float", 2.5, TensorProto.FLOAT, ()),
        ("value_floats", [1.0, -2.0], TensorProto.FLOAT, (2,)),
        ("value_int", 7, TensorProto.INT64, ()),
        ("value_ints", [3, 4, 5], TensorProto.INT64, (3,)),
    ],
)
def test_value_attributes_become_a_tensor(attribute, value, elem_type, shape):
    lowered = lt.lower_and_compare(_constant_model(attribute, value, elem_type, shape), {})
    (node,) = lowered.graph.node
    assert [a.name for a in node.attribute] == ["value"]


@lt.property_test(
    ints=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=6),
    floats=st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=6),
)
def test_values_are_preserved(ints, floats):
    lt.lower_and_compare(_constant_model("value_ints", ints, TensorProto.INT64, (len(ints),)), {})
    lt.lower_and_compare(_constant_model("value_floats", floats, TensorProto.FLOAT, (len(floats),)), {})
