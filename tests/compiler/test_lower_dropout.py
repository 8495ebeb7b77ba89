"""Dropout-12+ in inference: Identity (and an all-true mask when used); training mode refused."""

from __future__ import annotations

import numpy as np
import pytest
from graph_testing import BOOL, FLOAT
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering_testing import (
    PROPERTY_SETTINGS,
    lower,
    lower_and_compare,
    one_node_model,
    op_types,
    random_array,
    seeds,
    shapes,
)

from optimum_ipu_backend.compiler.errors import LegalizationError


def test_training_mode_is_refused():
    model = one_node_model(
        "Dropout",
        [("x", FLOAT, (2,))],
        [("y", FLOAT, (2,))],
        {"ratio": np.array(0.1, np.float32), "training": np.array(True)},
    )
    with pytest.raises(LegalizationError, match="the_Dropout.*training_mode is true"):
        lower(model)


@given(shape=shapes(1, 3), with_mask=st.booleans(), ratio=st.sampled_from([None, 0.0, 0.3]), seed=seeds)
@settings(**PROPERTY_SETTINGS)
def test_inference_dropout_matches(shape, with_mask, ratio, seed):
    initializers = {} if ratio is None else {"ratio": np.array(ratio, np.float32)}
    if ratio is not None and seed % 2:
        initializers["training_mode"] = np.array(False)
    outputs = [("y", FLOAT, shape)] + ([("mask", BOOL, shape)] if with_mask else [])
    model = one_node_model("Dropout", [("x", FLOAT, shape)], outputs, initializers)
    lowered = lower_and_compare(model, {"x": random_array(seed, shape, np.float32)})
    assert op_types(lowered) == ({"Identity", "Shape", "ConstantOfShape"} if with_mask else {"Identity"})
