"""ToFloat16: float16 compute that stays close to float32, with masks and variances that cannot overflow."""

from __future__ import annotations

import numpy as np
from graph_testing import (
    FLOAT,
    FLOAT16,
    copy_model,
    elem_types,
    feeds_for_types,
    make_model,
    run_ort,
    tensor_info,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.precision_fp16 import FP16_TINY, MASK_MAGNITUDE, ToFloat16

CTX = PassContext({}, precision="fp16")
F32_MIN = float(np.finfo(np.float32).min)


def _to_fp16(model):
    return ToFloat16().run(copy_model(model), CTX)


def _run_both(model, converted, feeds):
    """(float32 reference, float16 result as float32) for the first output."""
    expected = run_ort(model, feeds)
    types = {i.name: i.type.tensor_type.elem_type for i in converted.graph.input}
    actual = run_ort(converted, feeds_for_types(feeds, types))
    name = model.graph.output[0].name
    return expected[name], actual[name].astype(np.float32)


def _attention_model(seq=6):
    """softmax(q k^T / sqrt(d) + (1 - mask) * finfo(float32).min) v, the HF encoder pattern."""
    nodes = [
        helper.make_node("Cast", ["mask"], ["mask_f"], to=FLOAT),
        helper.make_node("Sub", ["one", "mask_f"], ["inverted"]),
        helper.make_node("Mul", ["inverted", "f32_min"], ["bias"]),
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x", "xt"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "bias"], ["biased"]),
        helper.make_node("Softmax", ["biased"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "x"], ["y"]),
    ]
    return make_model(
        nodes,
        [tensor_info("x", FLOAT, [2, seq, 8]), tensor_info("mask", 7, [2, 1, seq])],
        [tensor_info("y", FLOAT, [2, seq, 8])],
        {
            "one": np.array(1.0, np.float32),
            "f32_min": np.array(F32_MIN, np.float32),
            "scale": np.float32(8**-0.5),
        },
    )


def test_boundary_weights_and_casts_become_float16():
    converted = _to_fp16(_attention_model())
    types = elem_types(converted)
    assert types["x"] == FLOAT16 and types["y"] == FLOAT16
    assert types["mask"] == 7  # integers untouched
    assert all(init.data_type == FLOAT16 for init in converted.graph.initializer)
    cast = next(n for n in converted.graph.node if n.op_type == "Cast")
    assert helper.get_attribute_value(cast.attribute[0]) == FLOAT16


def test_finfo_min_mask_is_clamped_and_softmax_has_no_nan_even_for_a_fully_masked_row():
    model = _attention_model()
    converted = _to_fp16(model)
    f32_min = next(i for i in converted.graph.initializer if i.name == "f32_min")
    assert numpy_helper.to_array(f32_min).item() == -MASK_MAGNITUDE
    rng = np.random.default_rng(0)
    mask = np.ones((2, 1, 6), np.int64)
    mask[0, 0, 3:] = 0
    mask[1, 0, :5] = 0
    feeds = {"x": rng.standard_normal((2, 6, 8)).astype(np.float32), "mask": mask}
    expected, actual = _run_both(model, converted, feeds)
    np.testing.assert_allclose(actual, expected, atol=2e-2, rtol=2e-2)
    # Every key masked: the result is meaningless either way, but float16 must not produce NaN.
    feeds["mask"] = np.zeros_like(mask)
    _, actual = _run_both(model, converted, feeds)
    assert np.isfinite(actual).all()


def _layer_norm_model(width=16):
    """LayerNorm as exported at opset 11: ReduceMean, Sub, Pow 2, ReduceMean, Add eps, Sqrt, Div."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
        helper.make_node("Sub", ["x", "mean"], ["centred"]),
        helper.make_node("Pow", ["centred", "two"], ["squared"]),
        helper.make_node("ReduceMean", ["squared"], ["variance"], axes=[-1]),
        helper.make_node("Add", ["variance", "eps"], ["variance_eps"]),
        helper.make_node("Sqrt", ["variance_eps"], ["std"]),
        helper.make_node("Div", ["centred", "std"], ["normed"]),
        helper.make_node("Mul", ["normed", "gamma"], ["y"]),
    ]
    return make_model(
        nodes,
        [tensor_info("x", FLOAT, [3, width])],
        [tensor_info("y", FLOAT, [3, width])],
        {
            "two": np.array(2.0, np.float32),
            "eps": np.array(1e-12, np.float32),
            "gamma": np.linspace(0.5, 1.5, width, dtype=np.float32),
        },
        opset=11,
    )


def test_variance_runs_in_float32_so_large_activations_do_not_overflow():
    model = _layer_norm_model()
    converted = _to_fp16(model)
    casts = [n for n in converted.graph.node if n.op_type == "Cast"]
    assert [helper.get_attribute_value(c.attribute[0]) for c in casts] == [FLOAT, FLOAT16]
    # Activations of a few thousand (GPT-2 has such outliers): their squares overflow float16.
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32) * 3000
    expected, actual = _run_both(model, converted, {"x": x})
    assert np.isfinite(actual).all()
    np.testing.assert_allclose(actual, expected, atol=1e-2, rtol=1e-2)


def test_tiny_epsilon_stays_non_zero():
    converted = _to_fp16(_layer_norm_model())
    eps = next(i for i in converted.graph.initializer if i.name.startswith("eps") and i.data_type == FLOAT16)
    assert numpy_helper.to_array(eps).item() == np.float16(FP16_TINY)
    # A constant row has zero variance: without epsilon, 0/0 would be NaN.
    _, actual = _run_both(_layer_norm_model(), converted, {"x": np.full((3, 16), 7.0, np.float32)})
    assert np.isfinite(actual).all()


def test_resize_scales_stay_float32():
    model = make_model(
        [helper.make_node("Resize", ["x", "roi", "scales"], ["y"], mode="nearest")],
        [tensor_info("x", FLOAT, [1, 1, 2, 2])],
        [tensor_info("y", FLOAT, [1, 1, 4, 4])],
        {"roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)},
        opset=11,
    )
    converted = _to_fp16(model)
    assert elem_types(converted)["scales"] == FLOAT
    x = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
    expected, actual = _run_both(model, converted, {"x": x})
    np.testing.assert_array_equal(actual, expected)


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(2, 24),
    scale=st.floats(0.01, 50.0),
    seed=st.integers(0, 2**16),
)
def test_property_mlp_and_layer_norm_stay_close_to_float32(rows, width, scale, seed):
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Tanh", ["hb"], ["t"]),
        helper.make_node("ReduceMean", ["t"], ["mean"], axes=[-1]),
        helper.make_node("Sub", ["t", "mean"], ["centred"]),
        helper.make_node("Mul", ["centred", "centred"], ["squared"]),
        helper.make_node("ReduceMean", ["squared"], ["variance"], axes=[-1]),
        helper.make_node("Add", ["variance", "eps"], ["variance_eps"]),
        helper.make_node("Sqrt", ["variance_eps"], ["std"]),
        helper.make_node("Div", ["centred", "std"], ["y"]),
    ]
    model = make_model(
        nodes,
        [tensor_info("x", FLOAT, [rows, width])],
        [tensor_info("y", FLOAT, [rows, width])],
        {
            "w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
            "b": rng.standard_normal(width).astype(np.float32),
            "eps": np.array(1e-5, np.float32),
        },
        opset=11,
    )
    x = (rng.standard_normal((rows, width)) * scale).astype(np.float32)
    expected, actual = _run_both(model, _to_fp16(model), {"x": x})
    assert np.isfinite(actual).all()
    # Normalised outputs are O(1); float16 keeps ~3 decimal digits, and near-flat rows amplify rounding.
    np.testing.assert_allclose(actual, expected, atol=5e-2 + 2e-3 * np.abs(expected).max())
