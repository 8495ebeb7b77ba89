"""Dropout-12+ in inference: Identity (and an all-true mask when used); training mode refused."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import BOOL, FLOAT
from hypothesis import strategies as st


def test_training_mode_is_refused():
    model = lt.one_node_model(
        "Dropout",
        [("x", FLOAT, (2,))],
        [("y", FLOAT, (2,))],
        {"ratio": np.array(0.1, np.float32), "training": np.array(True)},
    )
    lt.assert_refused(model, "the_Dropout.*training_mode is true")


@lt.property_test(
    shape=lt.shapes(1, 3), with_mask=st.booleans(), ratio=st.sampled_from([None, 0.0, 0.3]), seed=lt.seeds
)
def test_inference_dropout_matches(shape, with_mask, ratio, seed):
    initializers = {} if ratio is None else {"ratio": np.array(ratio, np.float32)}
    if ratio is not None and seed % 2:
        initializers["training_mode"] = np.array(False)
    outputs = [("y", FLOAT, shape)] + ([("mask", BOOL, shape)] if with_mask else [])
    model = lt.one_node_model("Dropout", [("x", FLOAT, shape)], outputs, initializers)
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)})
    assert lt.op_types(lowered) == ({"Identity", "Shape", "ConstantOfShape"} if with_mask else {"Identity"})
