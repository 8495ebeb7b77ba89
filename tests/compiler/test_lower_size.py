"""Size of a static tensor becomes the constant element count."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT64


@lt.property_test(shape=lt.shapes(0, 4, 0, 5))
def test_size_matches(shape):
    model = lt.one_node_model("Size", [("x", FLOAT, shape)], [("y", INT64, ())])
    lowered = lt.lower_and_compare(model, {"x": np.zeros(shape, np.float32)})
    assert not lowered.graph.node


def test_dynamic_size_is_refused():
    model = lt.one_node_model("Size", [("x", FLOAT, ("n", 2))], [("y", INT64, ())])
    lt.assert_refused(model, "the_Size")
