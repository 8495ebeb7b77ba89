"""Pad-18 with axes becomes Pad-11 with pads over every axis; the padded values are exactly the same."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT64
from hypothesis import strategies as st


def test_wrap_mode_is_refused():
    model = lt.one_node_model(
        "Pad", [("x", FLOAT, (3,))], [("y", FLOAT, (5,))], {"pads": np.array([1, 1])}, opset=19, mode="wrap"
    )
    lt.assert_refused(model, "mode 'wrap'")


@lt.property_test(
    shape=lt.shapes(1, 4, 2, 4),
    data=st.data(),
    mode=st.sampled_from(["constant", "reflect", "edge"]),
    with_value=st.booleans(),
    seed=lt.seeds,
)
def test_pad_with_axes_matches(shape, data, mode, with_value, seed):
    rank = len(shape)
    axes = data.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    # reflect needs pads smaller than the padded dimension.
    pads = [data.draw(st.integers(0, shape[a] - 1 if mode == "reflect" else 3)) for a in axes * 2]
    use_axes = data.draw(st.booleans())
    if not use_axes:
        full = [0] * (2 * rank)
        for position, axis in enumerate(axes):
            full[axis], full[axis + rank] = pads[position], pads[position + len(axes)]
        pads = full
    axes_values = [a - rank if data.draw(st.booleans()) else a for a in axes]
    initializers = {"pads": np.array(pads, np.int64)}
    node_inputs = ["x", "pads"]
    if with_value and mode == "constant":
        initializers["value"] = np.array(1.5, np.float32)
        node_inputs.append("value")
    if use_axes:
        initializers["axes"] = np.array(axes_values, np.int64)
        node_inputs += ([""] if len(node_inputs) == 2 else []) + ["axes"]
    model = lt.one_node_model(
        "Pad", [("x", FLOAT, shape)], [("y", FLOAT, None)], initializers, node_inputs=node_inputs, mode=mode
    )
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)})


def test_int64_pad_keeps_its_type():
    model = lt.one_node_model("Pad", [("x", INT64, (2,))], [("y", INT64, (4,))], {"pads": np.array([1, 1])})
    lt.lower_and_compare(model, {"x": np.array([5, -3], np.int64)})
