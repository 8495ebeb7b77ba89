"""CastLike becomes Cast to the like-tensor's type; Cast loses its float8-only attributes; Identity stays."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import BOOL, FLOAT, FLOAT16, INT32, INT64
from hypothesis import strategies as st

_TYPES = {FLOAT: np.float32, FLOAT16: np.float16, INT32: np.int32, INT64: np.int64, BOOL: np.bool_}


def test_identity_16_is_kept_as_identity_1():
    model = lt.one_node_model("Identity", [("x", FLOAT, (2,))], [("y", FLOAT, (2,))], opset=16)
    lowered = lt.lower_and_compare(model, {"x": np.array([1.5, -2.0], np.float32)})
    assert lt.op_types(lowered) == {"Identity"}


def test_cast_19_saturate_is_dropped():
    model = lt.one_node_model(
        "Cast", [("x", FLOAT, (2,))], [("y", INT32, (2,))], opset=19, to=INT32, saturate=1
    )
    lowered = lt.lower_and_compare(model, {"x": np.array([1.5, -2.0], np.float32)})
    (node,) = lowered.graph.node
    assert [a.name for a in node.attribute] == ["to"]


@lt.property_test(
    source=st.sampled_from(sorted(_TYPES)),
    target=st.sampled_from(sorted(_TYPES)),
    shape=lt.shapes(0, 3),
    seed=lt.seeds,
)
def test_castlike_matches(source, target, shape, seed):
    model = lt.one_node_model(
        "CastLike",
        [("x", source, shape)],
        [("y", target, shape)],
        {"like": np.zeros((1,), _TYPES[target])},
    )
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, _TYPES[source], -100, 100)})
    assert lt.op_types(lowered) == {"Cast"}
    assert all(i.name != "like" for i in lowered.graph.initializer), "the like-tensor only gave its type"
