"""Resize-13/18 becomes Resize-11 (roi and scales always given, axes expanded): the same pixels.

The opset-11 and opset-13+ Resize kernels are one implementation in onnxruntime, so float outputs are
compared at atol 1e-6 (bit-identical in practice).
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT
from hypothesis import strategies as st

from optimum_ipu_backend.compiler.errors import LegalizationError


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


@lt.property_test(
    policy=st.sampled_from(["not_larger", "not_smaller"]),
    mode=st.sampled_from(["nearest", "linear", "cubic"]),
    coordinates=st.sampled_from(["half_pixel", "pytorch_half_pixel", "asymmetric", "align_corners"]),
    with_axes=st.booleans(),
    sizes=st.tuples(st.integers(1, 13), st.integers(1, 13)),
    seed=lt.seeds,
)
def test_keep_aspect_ratio_policy_matches(policy, mode, coordinates, with_axes, sizes, seed):
    shape = (1, 2, 4, 6)
    attributes = {
        "mode": mode,
        "coordinate_transformation_mode": coordinates,
        "keep_aspect_ratio_policy": policy,
    }
    if with_axes:
        attributes["axes"] = [2, 3]  # onnxruntime and the reference misread negative axes here
        given = np.array(sizes, np.int64)
    else:
        # Without axes the one scale applies to batch and channels too, which onnxruntime resizes
        # only in nearest mode.
        attributes["mode"] = "nearest"
        given = np.array([1, 2, *sizes], np.int64)
    model = lt.one_node_model(
        "Resize",
        [("x", FLOAT, shape)],
        [("y", FLOAT, None)],
        {"sizes": given},
        opset=18,
        node_inputs=["x", "", "", "sizes"],
        **attributes,
    )
    try:
        lowered = lt.lower(model)
    except LegalizationError as refusal:
        # Only where Resize-11 makes one element too few and the coordinates depend on the input length.
        assert coordinates == "align_corners", refusal
        assert "the_Resize" in str(refusal) and "keep_aspect_ratio_policy" in str(refusal)
        return
    lt.assert_lowered(lowered)
    lt.assert_equivalent(model, lowered, {"x": lt.random_array(seed, shape, np.float32)}, atol=1e-5)


def test_policy_length_rounded_up_extends_the_input_by_its_edge():
    # not_smaller picks scale 0.75: round(0.75 * 2) = 2 rows, where Resize-11 at 0.75 makes 1.
    model = lt.one_node_model(
        "Resize",
        [("x", FLOAT, (1, 1, 2, 4))],
        [("y", FLOAT, None)],
        {"sizes": np.array([1, 3], np.int64)},
        opset=18,
        node_inputs=["x", "", "", "sizes"],
        mode="nearest",
        axes=[2, 3],
        keep_aspect_ratio_policy="not_smaller",
    )
    lowered = lt.lower_and_compare(model, {"x": np.arange(8, dtype=np.float32).reshape(1, 1, 2, 4)})
    assert [n.op_type for n in lowered.graph.node] == ["Pad", "Resize", "Slice"]
