"""Size of a static tensor becomes the constant element count."""

from __future__ import annotations

import numpy as np
from graph_testing import FLOAT, INT64
from lowering_testing import assert_refused, lower_and_compare, one_node_model, property_test, shapes


@property_test(shape=shapes(0, 4, 0, 5))
def test_size_matches(shape):
    model = one_node_model("Size", [("x", FLOAT, shape)], [("y", INT64, ())])
    lowered = lower_and_compare(model, {"x": np.zeros(shape, np.float32)})
    assert not lowered.graph.node


def test_dynamic_size_is_refused():
    model = one_node_model("Size", [("x", FLOAT, ("n", 2))], [("y", INT64, ())])
    assert_refused(model, "the_Size")
