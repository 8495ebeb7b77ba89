"""LayerNormalization-17 decomposed into opset-11 arithmetic: same Y, Mean and InvStdDev as onnxruntime.

Tolerance: float32 outputs within atol 1e-6 plus rtol 1e-5 of onnxruntime's fused kernel, on inputs whose
normalized slices have a standard deviation of at least a tenth of their mean's magnitude. Any float32
evaluation loses about ulp(mean) / std in x - mean, and the fused kernel and the decomposition round in
different orders: on uniform [-10, 10] data, slices of two nearly equal values (std ~ 0.01) make the two
disagree by up to 3e-5 in Y (both are then ~1e-4 from the float64 value), so 1e-6 is not reachable
for every draw. On the conditioned draws below the largest disagreement measured in 400 random cases was
2.1e-6 at |y| = 3.8 (and 1.9e-6 in a Mean over 5808 values, where the summation orders differ), hence the
relative term. float16 inputs (statistics in float32 by stash_type=1) are compared within one float16 ulp
at the output magnitude.
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, FLOAT16
from hypothesis import strategies as st

ATOL, RTOL = 1e-6, 1e-5


def _layer_norm_model(shape, axis, elem_type=FLOAT, bias=True, statistics=False, **attributes):
    normalized = shape[axis:]
    dtype = np.float16 if elem_type == FLOAT16 else np.float32
    rng = np.random.default_rng(len(shape) + axis)
    initializers = {"scale": rng.uniform(-2, 2, normalized).astype(dtype)}
    if bias:
        initializers["bias"] = rng.uniform(-2, 2, normalized).astype(dtype)
    outputs = [("y", elem_type, shape)]
    if statistics:
        reduced = list(shape[:axis]) + [1] * len(normalized)
        outputs += [("mean", FLOAT, reduced), ("inv_std_dev", FLOAT, reduced)]
    return lt.one_node_model(
        "LayerNormalization",
        [("x", elem_type, shape)],
        outputs,
        initializers,
        opset=17,
        axis=axis,
        **attributes,
    )


def _conditioned(seed, shape, axis, dtype=np.float32):
    """Slices over axes [axis:] with std in [0.5, 5] and |mean| <= 5 (std >= |mean| / 10)."""
    rng = np.random.default_rng(seed)
    outer, inner = int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64))
    z = rng.standard_normal((outer, inner))
    if inner > 1:
        z = (z - z.mean(axis=1, keepdims=True)) / z.std(axis=1, keepdims=True)
    centre = rng.uniform(-5, 5, (outer, 1))
    spread = rng.uniform(0.5, 5, (outer, 1))
    return (centre + spread * z).reshape(shape).astype(dtype)


def test_layer_normalization_is_decomposed_into_popart_ops():
    lowered = lt.lower(_layer_norm_model((2, 3, 8), axis=-1))
    lt.assert_lowered(lowered)
    assert "LayerNormalization" not in lt.op_types(lowered)
    assert {"ReduceMean", "Sub", "Mul", "Sqrt", "Div", "Add"} <= lt.op_types(lowered)


def test_statistics_outputs_are_produced():
    model = _layer_norm_model((2, 3, 4), axis=1, statistics=True)
    x = lt.random_array(0, (2, 3, 4), np.float32)
    lowered = lt.lower_and_compare(model, {"x": x}, atol=ATOL, rtol=RTOL)
    assert [o.name for o in lowered.graph.output] == ["y", "mean", "inv_std_dev"]


def test_non_negative_axis_needs_a_known_rank():
    model = lt.one_node_model(
        "LayerNormalization",
        [("x", FLOAT, None)],
        [("y", FLOAT, None)],
        {"scale": np.ones(4, np.float32)},
        opset=17,
        axis=1,
        check=False,
    )
    lt.assert_refused(model, "the_LayerNormalization.*rank")


@lt.property_test(
    shape=lt.shapes(1, 4, 1, 6),
    axis_choice=st.integers(0, 3),
    negative_axis=st.booleans(),
    epsilon=st.sampled_from([1e-5, 1e-12, 0.1]),
    bias=st.booleans(),
    seed=lt.seeds,
)
def test_same_outputs_as_layer_normalization(shape, axis_choice, negative_axis, epsilon, bias, seed):
    axis = axis_choice % len(shape)
    axis_attribute = axis - len(shape) if negative_axis else axis
    model = _layer_norm_model(shape, axis_attribute, bias=bias, statistics=True, epsilon=epsilon)
    lt.lower_and_compare(model, {"x": _conditioned(seed, shape, axis)}, atol=ATOL, rtol=RTOL)


@lt.property_test(shape=lt.shapes(2, 3, 2, 6), seed=lt.seeds)
def test_float16_statistics_are_computed_in_float32(shape, seed):
    model = _layer_norm_model(shape, -1, elem_type=FLOAT16, stash_type=1)
    x = _conditioned(seed, shape, len(shape) - 1, np.float16)
    # float16 has 11 significant bits: one ulp at the largest |y| (|scale| * |x_hat| + |bias| < 16) is 2**-7.
    lt.lower_and_compare(model, {"x": x}, atol=2**-7, rtol=0)
