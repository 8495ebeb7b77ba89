"""SpaceToDepth-28: DCR stays SpaceToDepth-1 without the attribute, CRD becomes Reshape/Transpose/Reshape;
both move exactly the same elements as onnxruntime's SpaceToDepth on the source graph."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT
from hypothesis import strategies as st


@lt.property_test(
    mode=st.sampled_from(["DCR", "CRD", None]),
    block=st.integers(1, 3),
    sides=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
    seed=lt.seeds,
)
def test_space_to_depth_28_matches(mode, block, sides, seed):
    n, c, h, w = sides
    shape = (n, c, h * block, w * block)
    attributes = {"blocksize": block} | ({"mode": mode} if mode else {})
    model = lt.one_node_model(
        "SpaceToDepth", [("x", FLOAT, shape)], [("y", FLOAT, None)], opset=28, **attributes
    )
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)}, atol=0.0)
    if mode == "CRD":
        assert lt.op_types(lowered) == {"Reshape", "Transpose"}
    else:
        (node,) = lowered.graph.node
        assert node.op_type == "SpaceToDepth" and [a.name for a in node.attribute] == ["blocksize"]


def test_crd_without_a_static_shape_is_refused():
    model = lt.one_node_model(
        "SpaceToDepth",
        [("x", FLOAT, ("n", 2, 4, 4))],
        [("y", FLOAT, None)],
        opset=28,
        blocksize=2,
        mode="CRD",
    )
    lt.assert_refused(model, "the_SpaceToDepth.*no static shape")
