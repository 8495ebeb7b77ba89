"""com.microsoft Gelu, BiasGelu, FastGelu, QuickGelu and BiasAdd lowered to opset-11 element-wise nodes.

The one-node com.microsoft models run on onnxruntime CPU against the lowered graphs: float32 within
atol 1e-5 / rtol 1e-4 on values in [-10, 10]. float16 is lowered as onnxruntime's float32 kernels compute
it, rounded once: within one float16 ulp (rtol 2**-10) of the float32 kernel run on the widened inputs.
onnxruntime's own float16 runs (Gelu and FastGelu inline a function body whose constants are rounded to
float16 first, 1/sqrt(2) as 0.70703125) are matched within four ulps or the smallest normal float16.
BiasAdd has no CPU kernel in onnxruntime: its oracle is (X + bias) + skip in numpy, in the element type,
the order of onnxruntime's CUDA kernel, and the lowered graph must match it exactly.
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from graph_testing import FLOAT, FLOAT16, assert_same_outputs, copy_model, make_model, run_ort, tensor_info
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.lower_opset11 import LowerToOpset11

MS = "com.microsoft"
ATOL, RTOL = 1e-5, 1e-4
FLOAT16_ATOL, FLOAT16_RTOL = 1e-6, 2**-10
#: Against onnxruntime's float16 function bodies, whose constants carry float16 rounding (see above).
ORT_FLOAT16_ATOL, ORT_FLOAT16_RTOL = 2**-14, 2**-8
TRANSFORMER_SHAPE = (2, 16, 768)
NP_TYPES = {FLOAT: np.float32, FLOAT16: np.float16}

#: (operator, has a bias input): every input form of the Gelu family.
GELU_FORMS = [
    ("Gelu", False),
    ("BiasGelu", True),
    ("FastGelu", False),
    ("FastGelu", True),
    ("QuickGelu", False),
]


def _ms_model(op_type, inputs, output, elem_type=FLOAT, node_inputs=None, **attributes):
    """A one-node com.microsoft model; ``inputs`` are (name, shape) graph inputs of ``elem_type``."""
    node = helper.make_node(
        op_type,
        node_inputs or [name for name, _ in inputs],
        [output[0]],
        name=f"the_{op_type}",
        domain=MS,
        **attributes,
    )
    return make_model(
        [node],
        [tensor_info(name, elem_type, shape) for name, shape in inputs],
        [tensor_info(output[0], elem_type, output[1])],
        extra_opsets={MS: 1},
        check=False,
    )


def _gelu_model(op_type, with_bias, shape, elem_type=FLOAT, **attributes):
    inputs = [("x", shape)] + ([("bias", shape[-1:])] if with_bias else [])
    return _ms_model(op_type, inputs, ("y", shape), elem_type, **attributes)


def _feeds(seed, shape, with_bias, dtype=np.float32):
    feeds = {"x": lt.random_array(seed, shape, dtype)}
    if with_bias:
        feeds["bias"] = lt.random_array(seed + 1, shape[-1:], dtype, low=-2, high=2)
    return feeds


def _compare(model, feeds, elem_type=FLOAT, float32_model=None):
    """Lower ``model`` and check it is PopART opset 11 computing what onnxruntime computes (see above);
    a float16 ``model`` needs its float32 twin."""
    if elem_type == FLOAT:
        return lt.lower_and_compare(model, feeds, atol=ATOL, rtol=RTOL)
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    got = run_ort(lowered, feeds)
    widened = run_ort(float32_model, {k: v.astype(np.float32) for k, v in feeds.items()})
    assert_same_outputs(
        {k: v.astype(np.float16) for k, v in widened.items()}, got, atol=FLOAT16_ATOL, rtol=FLOAT16_RTOL
    )
    assert_same_outputs(run_ort(model, feeds), got, atol=ORT_FLOAT16_ATOL, rtol=ORT_FLOAT16_RTOL)
    return lowered


def _quick_gelu_alpha(draw_alpha):
    """QuickGelu's alpha: absent (1.702), 1 (SiLU, no scaling) or any other value."""
    return {} if draw_alpha is None else {"alpha": draw_alpha}


@lt.property_test(
    form=st.sampled_from(GELU_FORMS),
    shape=lt.shapes(1, 4, 1, 6),
    elem_type=st.sampled_from([FLOAT, FLOAT16]),
    alpha=st.one_of(st.none(), st.just(1.0), st.floats(-4.0, 4.0, width=32)),
    seed=lt.seeds,
)
def test_same_outputs_as_onnxruntime(form, shape, elem_type, alpha, seed):
    op_type, with_bias = form
    attributes = _quick_gelu_alpha(alpha) if op_type == "QuickGelu" else {}
    model = _gelu_model(op_type, with_bias, shape, elem_type, **attributes)
    feeds = _feeds(seed % 2**31, shape, with_bias, NP_TYPES[elem_type])
    float32_model = _gelu_model(op_type, with_bias, shape, FLOAT, **attributes)
    lowered = _compare(model, feeds, elem_type, float32_model)
    assert not {n.domain for n in lowered.graph.node} - {""}
    assert not any(o.domain == MS for o in lowered.opset_import)


@pytest.mark.parametrize("op_type, with_bias", GELU_FORMS)
def test_transformer_sized_input(op_type, with_bias):
    _compare(_gelu_model(op_type, with_bias, TRANSFORMER_SHAPE), _feeds(0, TRANSFORMER_SHAPE, with_bias))


@pytest.mark.parametrize("op_type, with_bias", GELU_FORMS)
def test_extreme_inputs_stay_finite_as_onnxruntime(op_type, with_bias):
    x = np.array([-1e30, -100.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 100.0, 1e30], np.float32)
    feeds = {"x": x, **({"bias": np.zeros_like(x)} if with_bias else {})}
    _compare(_gelu_model(op_type, with_bias, x.shape), feeds)


def test_float16_is_computed_in_float32_and_rounded_once():
    lowered = lt.lower(_gelu_model("FastGelu", True, (2, 8), FLOAT16))
    ops = [n.op_type for n in lowered.graph.node]
    assert ops.count("Cast") == 3 and ops[-1] == "Cast"  # x and bias up, the result down
    x = lt.random_array(3, (2, 8), np.float16)
    np.testing.assert_array_equal(
        run_ort(lowered, {"x": x, "bias": np.zeros(8, np.float16)})["y"],
        run_ort(_gelu_model("FastGelu", False, (2, 8), FLOAT16), {"x": x})["y"],
    )


def test_quick_gelu_alpha_one_is_silu_without_scaling():
    lowered = lt.lower(_gelu_model("QuickGelu", False, (3, 4), alpha=1.0))
    assert [n.op_type for n in lowered.graph.node] == ["Sigmoid", "Mul"]


@pytest.mark.parametrize("bias_shape", [(1,), (3,), (2, 4)])
def test_a_bias_onnxruntime_would_reject_is_refused(bias_shape):
    model = _ms_model("BiasGelu", [("x", (2, 4)), ("bias", bias_shape)], ("y", (2, 4)))
    lt.assert_refused(model, r"the_BiasGelu.*bias 'bias' of shape .* is not 1-D and as long")


def test_double_is_refused():
    model = _gelu_model("FastGelu", False, (2, 3), TensorProto.DOUBLE)
    lt.assert_refused(model, "the_FastGelu.*DOUBLE: PopART computes float32 and float16 only")


# -- BiasAdd -------------------------------------------------------------------------------------------


def _bias_add_model(shape, elem_type=FLOAT, bias_shape=None, skip_shape=None):
    inputs = [("x", shape), ("bias", bias_shape or shape[-1:]), ("skip", skip_shape or shape)]
    return _ms_model("BiasAdd", inputs, ("y", shape), elem_type)


@lt.property_test(
    batch=st.integers(1, 3),
    sequence=st.integers(1, 8),
    channels=st.integers(1, 40),
    elem_type=st.sampled_from([FLOAT, FLOAT16]),
    seed=lt.seeds,
)
def test_bias_add_is_input_plus_bias_plus_skip(batch, sequence, channels, elem_type, seed):
    shape = (batch, sequence, channels)
    dtype = NP_TYPES[elem_type]
    x, skip = lt.random_array(seed, shape, dtype), lt.random_array(seed + 1, shape, dtype)
    bias = lt.random_array(seed + 2, (channels,), dtype)
    lowered = lt.lower(_bias_add_model(shape, elem_type))
    lt.assert_lowered(lowered)
    feeds = {"x": x, "bias": bias, "skip": skip}
    # ONNX's reference rounds after each Add, as the IPU does; onnxruntime CPU runs a float16 Add chain in
    # float32 and rounds once, so it checks the float32 graphs only.
    (got,) = ReferenceEvaluator(lowered).run(None, feeds)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, (x + bias) + skip)
    if elem_type == FLOAT:
        np.testing.assert_array_equal(run_ort(lowered, feeds)["y"], got)


@pytest.mark.parametrize(
    "shape, bias_shape, skip_shape, match",
    [
        ((2, 3), (3,), (2, 3), r"input and skip of one shape .*got input \[2, 3\]"),
        ((2, 3, 4), (4,), (1, 3, 4), r"got input \[2, 3, 4\] and skip \[1, 3, 4\]"),
        ((2, 3, 4), (1,), (2, 3, 4), r"bias 'bias' of shape \[1\] is not 1-D"),
    ],
)
def test_bias_add_of_other_shapes_is_refused(shape, bias_shape, skip_shape, match):
    lt.assert_refused(_bias_add_model(shape, FLOAT, bias_shape, skip_shape), f"the_BiasAdd.*{match}")


def test_onnx_and_com_microsoft_gelu_are_counted_apart():
    node = helper.make_node("Gelu", ["x"], ["g"], name="onnx_gelu")
    fused = helper.make_node("Gelu", ["g"], ["y"], name="ms_gelu", domain=MS)
    model = make_model(
        [node, fused],
        [tensor_info("x", FLOAT, (2, 3))],
        [tensor_info("y", FLOAT, (2, 3))],
        opset=20,
        extra_opsets={MS: 1},
        check=False,
    )
    lowering = LowerToOpset11()
    lowered = lowering.run(copy_model(model), PassContext(input_shapes={}))
    assert lowering.rewritten == {"Gelu": 1, "com.microsoft::Gelu": 1}
    lt.assert_lowered(lowered)
    lt.assert_equivalent(model, lowered, {"x": lt.random_array(5, (2, 3), np.float32)}, atol=ATOL, rtol=RTOL)


def _dense_gelu(form):
    """MatMul, bias Add and the Gelu subgraph (exact, or the tanh form) a BERT export has."""
    rng = np.random.default_rng(0)
    constants = {
        "W": rng.standard_normal((8, 16)).astype(np.float32),
        "B": rng.standard_normal(16).astype(np.float32),
        "one": np.float32(1.0),
        "half": np.float32(0.5),
    }
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "B"], ["a"])]
    if form == "erf":
        constants["sqrt2"] = np.float32(np.sqrt(2.0))
        nodes += [
            helper.make_node("Div", ["a", "sqrt2"], ["d"]),
            helper.make_node("Erf", ["d"], ["phi"]),
        ]
    else:
        constants |= {"three": np.float32(3), "k": np.float32(0.044715), "s": np.float32(np.sqrt(2 / np.pi))}
        nodes += [
            helper.make_node("Pow", ["a", "three"], ["cube"]),
            helper.make_node("Mul", ["cube", "k"], ["cubic"]),
            helper.make_node("Add", ["a", "cubic"], ["inner"]),
            helper.make_node("Mul", ["inner", "s"], ["scaled"]),
            helper.make_node("Tanh", ["scaled"], ["phi"]),
        ]
    nodes += [
        helper.make_node("Add", ["phi", "one"], ["one_plus"]),
        helper.make_node("Mul", ["a", "half"], ["half_a"]),
        helper.make_node("Mul", ["half_a", "one_plus"], ["y"]),
    ]
    shape_in, shape_out = (2, 4, 8), (2, 4, 16)
    return make_model(
        nodes, [tensor_info("x", FLOAT, shape_in)], [tensor_info("y", FLOAT, shape_out)], constants
    )


@pytest.mark.parametrize("form, fused", [("erf", "BiasGelu"), ("tanh", "FastGelu")])
def test_what_onnxruntimes_optimizer_fuses_lowers_to_the_unfused_outputs(form, fused):
    from onnxruntime.transformers.optimizer import optimize_model

    model = _dense_gelu(form)
    optimized = optimize_model(copy_model(model), model_type="bert", num_heads=0, hidden_size=0, opt_level=0)
    assert [(n.op_type, n.domain) for n in optimized.model.graph.node] == [("MatMul", ""), (fused, MS)]
    # The import the saved model carries (save_model_to_file adds it; the in-memory model lacks it).
    if not any(o.domain == MS for o in optimized.model.opset_import):
        optimized.model.opset_import.append(helper.make_opsetid(MS, 1))
    lowered = lt.lower(optimized.model)
    lt.assert_lowered(lowered)
    lt.assert_equivalent(model, lowered, {"x": lt.random_array(1, (2, 4, 8), np.float32, -2, 2)}, ATOL, RTOL)
