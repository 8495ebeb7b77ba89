"""GroupNormalization-18/21, RMSNormalization-23, MeanVarianceNormalization-13 and LpNormalization-22
lowered to opset-11 reductions and arithmetic: same outputs as onnxruntime CPU.

float32 within atol 1e-5 (normalized values within a few units; the decompositions round in a different
order than onnxruntime's kernels or function bodies, which compute the variance as E[x^2] - E[x]^2, so
GroupNormalization's groups are drawn well conditioned); float16 with statistics in float32 (stash_type=1)
within one float16 ulp at the output magnitude (2**-7 for |y| < 16).
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from graph_testing import FLOAT, FLOAT16, run_ort
from hypothesis import strategies as st

ATOL = 1e-5
FLOAT16_ATOL = 2**-7
TRANSFORMER_SHAPE = (2, 128, 768)


def _affine(count, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {"scale": rng.uniform(-2, 2, count).astype(dtype), "bias": rng.uniform(-2, 2, count).astype(dtype)}


def _group_norm(shape, groups, opset, elem_type=FLOAT, **attributes):
    dtype = np.float16 if elem_type == FLOAT16 else np.float32
    # GroupNormalization-18 scales per group, -21 per channel.
    affine = _affine(groups if opset < 21 else shape[1], dtype)
    return lt.one_node_model(
        "GroupNormalization",
        [("x", elem_type, shape)],
        [("y", elem_type, shape)],
        affine,
        opset=opset,
        check=opset >= 21,  # onnx's checker calls GroupNormalization-18 deprecated; onnxruntime runs it
        num_groups=groups,
        **attributes,
    )


def _conditioned_groups(seed, shape, groups):
    """Each group centred within [-1, 1] with a standard deviation in [1, 5].

    onnxruntime computes a group's variance as E[x^2] - E[x]^2 (GroupNormalization's function body), which
    loses all accuracy on a group whose spread is small against its mean; such draws would compare
    onnxruntime's rounding, not the lowering.
    """
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((shape[0], groups, int(np.prod(shape[1:])) // groups))
    if z.shape[-1] > 1:
        z = (z - z.mean(axis=-1, keepdims=True)) / z.std(axis=-1, keepdims=True)
    centre = rng.uniform(-1, 1, (*z.shape[:2], 1))
    spread = rng.uniform(1, 5, (*z.shape[:2], 1))
    return (centre + spread * z).reshape(shape).astype(np.float32)


def _unary(op_type, shape, opset, elem_type=FLOAT, initializers=None, check=True, **attributes):
    inputs, outputs = [("x", elem_type, shape)], [("y", elem_type, shape)]
    return lt.one_node_model(op_type, inputs, outputs, initializers, opset=opset, check=check, **attributes)


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize(
    "shape, groups", [((2, 128, 768), 32), ((2, 8, 4, 4), 4), ((3, 6), 3), ((1, 4, 5), 1)]
)
def test_group_normalization_equals_onnxruntime(opset, shape, groups):
    x = _conditioned_groups(opset, shape, groups)
    lowered = lt.lower_and_compare(_group_norm(shape, groups, opset, epsilon=1e-3), {"x": x}, atol=ATOL)
    assert "GroupNormalization" not in lt.op_types(lowered)


@lt.property_test(
    opset=st.sampled_from([18, 21]),
    batch=st.integers(1, 3),
    groups=st.integers(1, 4),
    per_group=st.integers(1, 3),
    spatial=lt.shapes(0, 2, 1, 4),
    seed=lt.seeds,
)
def test_same_outputs_as_group_normalization(opset, batch, groups, per_group, spatial, seed):
    shape = (batch, groups * per_group, *spatial)
    lt.lower_and_compare(
        _group_norm(shape, groups, opset), {"x": _conditioned_groups(seed, shape, groups)}, atol=ATOL
    )


def test_float16_group_normalization_21_computes_statistics_in_float32():
    shape = (2, 8, 16)
    x = lt.random_array(3, shape, np.float16, low=-4, high=4)
    lt.lower_and_compare(_group_norm(shape, 4, 21, FLOAT16, stash_type=1), {"x": x}, atol=FLOAT16_ATOL)


@pytest.mark.parametrize(
    "affine_size, groups, match",
    [
        (6, 4, "num_groups=4 does not divide"),
        # the opset-18 layout (one scale per group) under opset 21 would broadcast wrongly, or not at all
        (2, 2, "does not hold 6 values"),
    ],
)
def test_group_normalization_that_cannot_be_lowered_is_refused(affine_size, groups, match):
    model = lt.one_node_model(
        "GroupNormalization",
        [("x", FLOAT, [2, 6, 4])],
        [("y", FLOAT, [2, 6, 4])],
        _affine(affine_size),
        opset=21,
        check=False,
        num_groups=groups,
    )
    lt.assert_refused(model, f"the_GroupNormalization.*{match}")


@pytest.mark.parametrize("axis", [-1, -2, 1, 0])
def test_rms_normalization_equals_onnxruntime(axis):
    normalized = TRANSFORMER_SHAPE[axis:]
    scale = {"scale": np.random.default_rng(1).uniform(-2, 2, normalized).astype(np.float32)}
    model = _unary("RMSNormalization", TRANSFORMER_SHAPE, 23, initializers=scale, axis=axis, epsilon=1e-6)
    x = lt.random_array(2, TRANSFORMER_SHAPE, np.float32)
    assert "RMSNormalization" not in lt.op_types(lt.lower_and_compare(model, {"x": x}, atol=ATOL))


def test_float16_rms_normalization_computes_statistics_in_float32():
    scale = {"scale": np.random.default_rng(1).uniform(-2, 2, 64).astype(np.float16)}
    model = _unary("RMSNormalization", (4, 64), 23, FLOAT16, scale, stash_type=1)
    x = lt.random_array(4, (4, 64), np.float16, low=-4, high=4)
    lt.lower_and_compare(model, {"x": x}, atol=FLOAT16_ATOL)


@pytest.mark.parametrize(
    "shape, axes",
    [((2, 3, 4, 5), None), (TRANSFORMER_SHAPE, [-1]), (TRANSFORMER_SHAPE, [1, 2]), ((4, 6), [0])],
)
def test_mean_variance_normalization_equals_onnxruntime(shape, axes):
    attributes = {} if axes is None else {"axes": axes}
    # onnx's checker cannot infer the function body without an explicit axes attribute; onnxruntime can.
    model = _unary("MeanVarianceNormalization", shape, 13, check=axes is not None, **attributes)
    x = lt.random_array(5, shape, np.float32)
    lowered = lt.lower_and_compare(model, {"x": x}, atol=ATOL)
    assert "MeanVarianceNormalization" not in lt.op_types(lowered)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_lp_normalization_equals_onnxruntime(p, axis):
    x = lt.random_array(6, TRANSFORMER_SHAPE, np.float32)
    model = _unary("LpNormalization", TRANSFORMER_SHAPE, 22, p=p, axis=axis)
    assert "LpNormalization" not in lt.op_types(lt.lower_and_compare(model, {"x": x}, atol=ATOL))


@pytest.mark.parametrize("p", [1, 2])
def test_an_all_zero_slice_stays_zero_as_onnxruntime_writes_it(p):
    x = np.array([[0, 0, 0], [3, -4, 0]], np.float32)
    lowered = lt.lower_and_compare(_unary("LpNormalization", x.shape, 22, p=p, axis=1), {"x": x}, atol=ATOL)
    assert np.array_equal(run_ort(lowered, {"x": x})["y"][0], np.zeros(3, np.float32))


def test_lp_normalization_with_p_3_is_refused():
    model = lt.one_node_model(
        "LpNormalization", [("x", FLOAT, [2, 3])], [("y", FLOAT, [2, 3])], opset=22, check=False, p=3
    )
    lt.assert_refused(model, "the_LpNormalization.*p=3")
