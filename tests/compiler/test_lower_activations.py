"""Gelu, Mish, HardSwish and Celu lowered to opset-11 element-wise nodes: same outputs as onnxruntime CPU.

float32 within atol 1e-5 on values in [-10, 10] (outputs up to 10, where one float32 ulp is ~1e-6: the
decompositions round each step, onnxruntime's kernels fewer times); float16 within two ulps at |y| < 16
(2**-6), float16 rounding each of the four to six steps of the decomposition.
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from graph_testing import FLOAT, FLOAT16
from hypothesis import strategies as st

ATOL = 1e-5
FLOAT16_ATOL = 2**-6
TRANSFORMER_SHAPE = (2, 128, 768)

#: (operator, opset, attributes): every version and attribute form the rewrite takes.
FORMS = [
    ("Gelu", 20, {}),
    ("Gelu", 20, {"approximate": "tanh"}),
    ("Mish", 18, {}),
    ("Mish", 22, {}),
    ("HardSwish", 14, {}),
    ("HardSwish", 22, {}),
    ("Celu", 12, {}),
    ("Celu", 12, {"alpha": 0.25}),
    ("Celu", 12, {"alpha": 3.0}),
    ("Celu", 28, {"alpha": 2.0}),  # Celu-28 added element types only
]


def _model(op_type, opset, shape, elem_type=FLOAT, **attributes):
    return lt.one_node_model(
        op_type, [("x", elem_type, shape)], [("y", elem_type, shape)], opset=opset, **attributes
    )


@pytest.mark.parametrize("op_type, opset, attributes", FORMS)
def test_transformer_sized_activation_equals_onnxruntime(op_type, opset, attributes):
    x = lt.random_array(0, TRANSFORMER_SHAPE, np.float32)
    lowered = lt.lower_and_compare(
        _model(op_type, opset, TRANSFORMER_SHAPE, **attributes), {"x": x}, atol=ATOL
    )
    assert op_type not in lt.op_types(lowered)


@lt.property_test(form=st.sampled_from(FORMS), shape=lt.shapes(1, 4, 1, 6), seed=lt.seeds)
def test_same_outputs_as_the_activation(form, shape, seed):
    op_type, opset, attributes = form
    x = lt.random_array(seed, shape, np.float32)
    x.flat[0] = 0.0  # the kinks of HardSwish and Celu
    lt.lower_and_compare(_model(op_type, opset, shape, **attributes), {"x": x}, atol=ATOL)


@pytest.mark.parametrize("op_type, opset, attributes", [f for f in FORMS if f[0] != "Celu"])
def test_float16_activation_is_computed_in_float16(op_type, opset, attributes):
    x = lt.random_array(1, (4, 64), np.float16, low=-8, high=8)
    model = _model(op_type, opset, (4, 64), elem_type=FLOAT16, **attributes)
    lt.lower_and_compare(model, {"x": x}, atol=FLOAT16_ATOL)


def test_extreme_inputs_stay_finite_as_onnxruntime():
    x = np.array([-1e30, -100.0, -20.0, 0.0, 20.0, 100.0, 1e30], np.float32)
    for op_type, opset, attributes in FORMS:
        lt.lower_and_compare(_model(op_type, opset, x.shape, **attributes), {"x": x}, atol=ATOL)


def test_unknown_gelu_approximation_is_refused():
    model = lt.one_node_model(
        "Gelu", [("x", FLOAT, [2, 3])], [("y", FLOAT, [2, 3])], opset=20, check=False, approximate="fast"
    )
    lt.assert_refused(model, "the_Gelu.*approximate='fast'")
