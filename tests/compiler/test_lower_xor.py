"""Xor as Not(Equal): exactly the same booleans, with broadcasting."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import BOOL
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


@lt.property_test(
    shapes_=hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4), data=st.data()
)
def test_xor_matches(shapes_, data):
    a_shape, b_shape = shapes_.input_shapes
    a = data.draw(hnp.arrays(np.bool_, a_shape))
    b = data.draw(hnp.arrays(np.bool_, b_shape))
    model = lt.one_node_model("Xor", [("a", BOOL, a_shape), ("b", BOOL, b_shape)], [("y", BOOL, None)])
    lowered = lt.lower_and_compare(model, {"a": a, "b": b})
    assert lt.op_types(lowered) == {"Equal", "Not"}
