"""QuantizeLinear/DequantizeLinear with constant scales, lowered to float32 arithmetic: bit-exact against
onnxruntime CPU (ties at .5, saturation, per-tensor and per-axis scales), and every form not lowered
refused with its reason."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import onnx
import pytest
from graph_testing import make_model, run_ort, tensor_info
from hypothesis import strategies as st
from onnx import TensorProto, helper

from optimum_ipu_backend.compiler.graphs import iter_nodes

_TYPES = {
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT16: np.int16,
    TensorProto.UINT16: np.uint16,
}


def _qdq_model(
    shape: tuple[int, ...],
    scale: np.ndarray,
    zero_point: np.ndarray | None,
    axis: int | None = None,
    opset: int = 21,
) -> onnx.ModelProto:
    """x -> QuantizeLinear -> DequantizeLinear -> y: y = (q - zp) * scale determines q, so comparing y
    exactly compares the quantized integers too."""
    operands = ["x", "scale"] + (["zero_point"] if zero_point is not None else [])
    attrs = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("QuantizeLinear", operands, ["q"], name="quantize", **attrs),
        helper.make_node("DequantizeLinear", ["q", *operands[1:]], ["y"], name="dequantize", **attrs),
    ]
    initializers = {"scale": scale} | ({} if zero_point is None else {"zero_point": zero_point})
    return make_model(
        nodes,
        [tensor_info("x", TensorProto.FLOAT, list(shape))],
        [tensor_info("y", TensorProto.FLOAT, list(shape))],
        initializers,
        opset=opset,
    )


def _lower_exactly(model: onnx.ModelProto, x: np.ndarray) -> None:
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    assert not {"QuantizeLinear", "DequantizeLinear", "Round"} & lt.op_types(lowered)
    assert all(
        v.type.tensor_type.elem_type not in _TYPES for v in (*lowered.graph.value_info, *lowered.graph.output)
    )
    expected, actual = run_ort(model, {"x": x})["y"], run_ort(lowered, {"x": x})["y"]
    np.testing.assert_array_equal(actual, expected)
    assert np.array_equal(np.signbit(actual), np.signbit(expected))  # bit-exact, zeros included


def _inputs(seed: int, shape: tuple[int, ...], scale: np.ndarray, zero: np.ndarray, axis: int) -> np.ndarray:
    """Random values, with exact rounding midpoints ((k + 0.5) * scale) and values far past saturation."""
    rng = np.random.default_rng(seed)
    broadcast = [1] * len(shape)
    if scale.ndim:
        broadcast[axis] = scale.size
    s = scale.reshape(broadcast).astype(np.float64)
    z = zero.reshape(broadcast).astype(np.float64)
    random = rng.uniform(-300, 300, size=shape) * s
    midpoints = (rng.integers(-200, 200, size=shape) + 0.5 - z) * s
    saturating = rng.choice([-1e6, 1e6], size=shape) * s
    pick = rng.integers(0, 3, size=shape)
    return np.choose(pick, [random, midpoints, saturating]).astype(np.float32)


@lt.property_test(
    seed=lt.seeds,
    shape=lt.shapes(min_rank=1, max_rank=3, max_side=6),
    elem_type=st.sampled_from(sorted(_TYPES)),
    per_axis=st.booleans(),
    power_of_two=st.booleans(),
    with_zero_point=st.booleans(),
)
def test_quantize_dequantize_is_bit_exact(seed, shape, elem_type, per_axis, power_of_two, with_zero_point):
    rng = np.random.default_rng(seed)
    axis = int(rng.integers(-len(shape), len(shape))) if per_axis else 1
    count = shape[axis] if per_axis else 1
    exponents = rng.uniform(-8, 2, size=count)
    # Power-of-two scales make (k + 0.5) * scale divide back to an exact midpoint; others test rounding
    # of the quotient itself.
    scale = np.exp2(np.round(exponents) if power_of_two else exponents).astype(np.float32)
    info = np.iinfo(_TYPES[elem_type])
    zero = rng.integers(info.min, info.max + 1, size=count).astype(_TYPES[elem_type])
    if not with_zero_point:
        zero = np.zeros(count, np.uint8)  # onnx's default: uint8, zero
        elem_type = TensorProto.UINT8
    if not per_axis:
        scale, zero = scale.reshape(()), zero.reshape(())
    model = _qdq_model(shape, scale, zero if with_zero_point else None, axis if per_axis else None)
    _lower_exactly(model, _inputs(seed, shape, scale, zero, axis))


@pytest.mark.parametrize("opset", [10, 13, 19, 21])
def test_ties_round_to_even_in_every_version(opset):
    x = np.array([[-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997, -0.49999997, 126.5, 127.5, 1e9, -1e9]])
    _lower_exactly(_qdq_model(x.shape, np.float32(1.0), np.int8(0), opset=opset), x.astype(np.float32))
    _lower_exactly(_qdq_model(x.shape, np.float32(0.25), np.uint8(3), opset=opset), x.astype(np.float32) / 4)


def test_constant_weights_and_int32_bias_are_dequantized_at_compile_time():
    rng = np.random.default_rng(0)
    weights = rng.integers(-128, 128, size=(6, 4)).astype(np.int8)
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["wf"], axis=1),
        helper.make_node("DequantizeLinear", ["b", "b_scale"], ["bf"]),
        helper.make_node("MatMul", ["x", "wf"], ["xw"]),
        helper.make_node("Add", ["xw", "bf"], ["y"]),
    ]
    initializers = {
        "w": weights,
        "w_scale": np.array([0.5, 0.01, 3.0, 1e-3], np.float32),
        "w_zero": np.array([0, 5, -3, 1], np.int8),
        "b": np.array([-(2**30), 7, 2**24 + 1, 123456789], np.int32),
        "b_scale": np.float32(1e-7),
    }
    model = make_model(
        nodes, [tensor_info("x", TensorProto.FLOAT, [3, 6])], [tensor_info("y", TensorProto.FLOAT, [3, 4])],
        initializers, opset=13,
    )  # fmt: skip
    x = rng.standard_normal((3, 6)).astype(np.float32)
    lowered = lt.lower_and_compare(model, {"x": x}, atol=0.0)
    assert lt.op_types(lowered) == {"MatMul", "Add"}


def test_a_one_element_scale_is_per_tensor_whatever_its_axis():
    """ORTQuantizer writes a [1] scale beside a scalar zero point, with axis=1, for the rank-1
    LayerNormalization biases it quantizes per channel: onnxruntime reads one scale as per-tensor, on a
    constant and on activations alike."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("DequantizeLinear", ["b", "b_scale", "b_zero"], ["bf"], axis=1),
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"], axis=1),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xf"], axis=1),
        helper.make_node("Add", ["xf", "bf"], ["y"]),
    ]
    initializers = {
        "b": rng.integers(-128, 128, size=8).astype(np.int8),
        "b_scale": np.array([0.02], np.float32),
        "b_zero": np.int8(0),
        "x_scale": np.array([0.05], np.float32),
        "x_zero": np.uint8(128),
    }
    model = make_model(
        nodes, [tensor_info("x", TensorProto.FLOAT, [8])], [tensor_info("y", TensorProto.FLOAT, [8])],
        initializers, opset=13,
    )  # fmt: skip
    x = rng.uniform(-8, 8, size=8).astype(np.float32)
    lowered = lt.lower_and_compare(model, {"x": x}, atol=0.0)
    assert not {"QuantizeLinear", "DequantizeLinear"} & lt.op_types(lowered)


def test_a_quantized_weight_too_large_to_dequantize_while_compiling_is_dequantized_on_the_device():
    """Weights of WEIGHT_MIN_BYTES or more are held without values while legalizing (a real model's
    quantized MatMul weights and embeddings): attached as float32 holding the same integers, and
    dequantized by the graph, exactly as onnxruntime dequantizes them."""
    from optimum_ipu_backend.compiler.graphs import WEIGHT_MIN_BYTES, tensor_bytes
    from optimum_ipu_backend.compiler.pipeline import legalize

    rng = np.random.default_rng(5)
    columns = WEIGHT_MIN_BYTES // 256
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["wf"], axis=1, name="weights"),
        helper.make_node("MatMul", ["x", "wf"], ["y"]),
        helper.make_node("DequantizeLinear", ["e", "e_scale", "e_zero"], ["ef"], name="table"),
        helper.make_node("Gather", ["ef", "ids"], ["rows"]),
    ]
    initializers = {
        "w": rng.integers(-128, 128, size=(256, columns)).astype(np.int8),
        "w_scale": rng.uniform(1e-3, 1e-2, size=columns).astype(np.float32),
        "w_zero": np.zeros(columns, np.int8),
        "e": rng.integers(0, 256, size=(columns, 256)).astype(np.uint8),
        "e_scale": np.float32(0.037),
        "e_zero": np.uint8(131),
    }
    model = make_model(
        nodes,
        [tensor_info("x", TensorProto.FLOAT, [2, 256]), tensor_info("ids", TensorProto.INT64, [2, 3])],
        [
            tensor_info("y", TensorProto.FLOAT, [2, columns]),
            tensor_info("rows", TensorProto.FLOAT, [2, 3, 256]),
        ],
        initializers, opset=13,
    )  # fmt: skip
    assert all(tensor_bytes(t) >= WEIGHT_MIN_BYTES for t in model.graph.initializer if t.name in ("w", "e"))
    legalized = legalize(model, {"x": (2, 256), "ids": (2, 3)})
    types = {t.name: t.data_type for t in legalized.model.graph.initializer}
    assert types["w"] == types["e"] == TensorProto.FLOAT
    assert not {"QuantizeLinear", "DequantizeLinear"} & lt.op_types(legalized.model)
    feed = {"x": rng.standard_normal((2, 256)).astype(np.float32), "ids": np.array([[0, 5, 9], [255, 1, 7]])}
    expected = run_ort(model, feed)
    got = run_ort(legalized.model, {"x": feed["x"], "ids": feed["ids"].astype(np.int32)})
    np.testing.assert_array_equal(got["rows"], expected["rows"])
    np.testing.assert_allclose(got["y"], expected["y"], rtol=0, atol=1e-5)  # MatMul's order of summation


def _refused(model: onnx.ModelProto, match: str) -> None:
    lt.assert_refused(model, match)


def test_block_quantization_is_refused():
    scale = np.full((2, 2), 0.1, np.float32)
    model = onnx.helper.make_model(
        helper.make_graph(
            [
                helper.make_node("QuantizeLinear", ["x", "s"], ["q"], axis=1, block_size=2),
                helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1, block_size=2),
            ],
            "g",
            [tensor_info("x", TensorProto.FLOAT, [2, 4])],
            [tensor_info("y", TensorProto.FLOAT, [2, 4])],
            [onnx.numpy_helper.from_array(scale, "s")],
        ),
        opset_imports=[helper.make_opsetid("", 21)],
    )
    _refused(model, "block quantization")


def test_a_scale_computed_at_run_time_is_refused():
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s"], ["y"]),
    ]
    model = make_model(
        nodes,
        [tensor_info("x", TensorProto.FLOAT, [4]), tensor_info("s", TensorProto.FLOAT, [])],
        [tensor_info("y", TensorProto.FLOAT, [4])],
        opset=13,
    )
    _refused(model, "scale 's' is computed at run time")


def test_float8_is_refused():
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    zero = helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0])
    model = make_model(
        nodes, [tensor_info("x", TensorProto.FLOAT, [4])], [tensor_info("y", TensorProto.FLOAT, [4])],
        {"s": np.float32(0.5)}, opset=19, check=False,
    )  # fmt: skip
    model.graph.initializer.append(zero)
    _refused(model, "float8e4m3fn is not lowered")


def test_an_integer_output_of_the_graph_is_refused():
    """The IPU holds no int8 tensor: a QuantizeLinear must feed DequantizeLinear nodes only."""
    model = lt.one_node_model(
        "QuantizeLinear",
        [("x", TensorProto.FLOAT, [4])],
        [("q", TensorProto.INT8, [4])],
        {"s": np.float32(0.5), "z": np.int8(0)},
        opset=13,
    )
    _refused(model, "integer output 'q' leaves the graph")


def test_float16_data_is_refused():
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s"], ["y"]),
    ]
    model = make_model(
        nodes, [tensor_info("x", TensorProto.FLOAT16, [4])], [tensor_info("y", TensorProto.FLOAT16, [4])],
        {"s": np.float16(0.5)}, opset=19,
    )  # fmt: skip
    _refused(model, "only float32 data is lowered")


def test_no_integer_tensor_survives():
    model = _qdq_model((2, 3), np.float32(0.1), np.int8(4), opset=13)
    lowered = lt.lower(model)
    for node in iter_nodes(lowered.graph):
        if node.op_type == "Cast":
            assert helper.get_attribute_value(node.attribute[0]) == TensorProto.FLOAT


def test_the_precheck_accepts_qdq_and_refuses_dynamic_quantization_once():
    from optimum_ipu_backend.compiler.precheck import precheck_operators
    from optimum_ipu_backend.compiler.refused_operators import DYNAMIC_QUANTIZATION_REASON

    assert precheck_operators(_qdq_model((2, 3), np.float32(0.1), np.int8(4), opset=13)) == []
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql"),
        helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["acc"], name="mmi"),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["accf", "xs"], ["y"]),
    ]
    model = make_model(
        nodes, [tensor_info("x", TensorProto.FLOAT, [2, 3])], [tensor_info("y", TensorProto.FLOAT, [2, 4])],
        {"w": np.ones((3, 4), np.uint8)}, opset=13,
    )  # fmt: skip
    (refused,) = precheck_operators(model)
    assert refused.reason.startswith(DYNAMIC_QUANTIZATION_REASON)
    assert "1 DynamicQuantizeLinear, 1 MatMulInteger" in refused.reason
