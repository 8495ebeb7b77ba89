"""Resize-13/18 becomes Resize-11 (roi and scales always given, axes expanded): the same pixels.

The opset-11 and opset-13+ Resize kernels are one implementation in onnxruntime, so float outputs are
compared at atol 1e-6 (bit-identical in practice).
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT
from hypothesis import strategies as st


def test_antialias_is_refused():
    model = lt.one_node_model(
        "Resize",
        [("x", FLOAT, (1, 1, 4, 4))],
        [("y", FLOAT, (1, 1, 2, 2))],
        {"scales": np.array([1, 1, 0.5, 0.5], np.float32)},
        node_inputs=["x", "", "scales"],
        antialias=1,
        mode="linear",
    )
    lt.assert_refused(model, "antialias")


@lt.property_test(
    mode=st.sampled_from(["nearest", "linear", "cubic"]),
    coordinates=st.sampled_from(["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"]),
    by_sizes=st.booleans(),
    with_axes=st.booleans(),
    factors=st.tuples(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), st.sampled_from([0.5, 1.0, 2.0, 2.5])),
    opset=st.sampled_from([13, 18]),
    seed=lt.seeds,
)
def test_resize_matches(mode, coordinates, by_sizes, with_axes, factors, opset, seed):
    shape = (1, 2, 4, 6)
    with_axes = with_axes and opset >= 18
    scales = np.array([1.0, 1.0, *factors], np.float32)
    sizes = np.floor(np.array(shape) * scales).astype(np.int64)
    attributes = {"mode": mode, "coordinate_transformation_mode": coordinates}
    if with_axes:
        attributes["axes"] = [2, 3]
    initializers = {}
    if by_sizes:
        initializers["sizes"] = sizes[2:] if with_axes else sizes
        node_inputs = ["x", "", "", "sizes"]
    else:
        initializers["scales"] = scales[2:] if with_axes else scales
        node_inputs = ["x", "", "scales"]
    model = lt.one_node_model(
        "Resize",
        [("x", FLOAT, shape)],
        [("y", FLOAT, None)],
        initializers,
        opset=opset,
        node_inputs=node_inputs,
        **attributes,
    )
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)})
