"""The padding proof on windows (Conv, MaxPool) along a right-padded axis.

Each case builds a one-node graph, asks the proof about padding its spatial axis on the right, and
checks the verdict against onnxruntime: where the proof says exact, the padded run's output at every
position the output map calls real equals the unpadded run's output there; where it says not exact, the
case is built so that padding does change a real output, so a rule that passed it would be wrong.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.padding import PaddedInput, PaddingAnalyzer

CHANNELS = 3
ATOL = 1e-5


def _window_model(
    op_type: str, *, kernel: int, stride: int, dilation: int, pads: tuple[int, int]
) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", CHANNELS, "length"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    attributes = {"kernel_shape": [kernel], "strides": [stride], "pads": list(pads), "dilations": [dilation]}
    initializers = []
    inputs = ["x"]
    if op_type == "Conv":
        weight = np.random.default_rng(1).normal(size=(2, CHANNELS, kernel)).astype(np.float32)
        initializers.append(numpy_helper.from_array(weight, "w"))
        inputs.append("w")
    node = helper.make_node(op_type, inputs, ["y"], name=f"the_{op_type.lower()}", **attributes)
    graph = helper.make_graph([node], "window", [x], [y], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])
    model.ir_version = 8
    return model


def _right_map(padded: int, real: int) -> np.ndarray:
    return np.where(np.arange(padded) < real, np.arange(padded), -1)


def _left_map(padded: int, real: int) -> np.ndarray:
    return np.where(np.arange(padded) >= padded - real, np.arange(padded) - (padded - real), -1)


def _prove(model: onnx.ModelProto, batch: int, padded: int, real: int, fill: float, axis_map: np.ndarray):
    inputs = {
        "x": PaddedInput((batch, CHANNELS, padded), (batch, CHANNELS, real), (None, None, axis_map), fill)
    }
    return PaddingAnalyzer(model).prove(inputs)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _largest_real_difference(
    model: onnx.ModelProto, batch: int, padded: int, real: int, fill: float, axis_map: np.ndarray, out_map
) -> float:
    """Max |padded - unpadded| over the outputs that exist at the caller's size, with ``out_map`` locating
    them in the padded output (padding placed by ``axis_map``, filled with ``fill``)."""
    rng = np.random.default_rng(0)
    # Negative values, so a MaxPool that lets a 0 in changes its result.
    x = (-1.0 - np.abs(rng.normal(size=(batch, CHANNELS, real)))).astype(np.float32)
    padded_x = np.full((batch, CHANNELS, padded), fill, np.float32)
    padded_x[:, :, axis_map >= 0] = x[:, :, axis_map[axis_map >= 0]]
    expected = _run(model, x)
    actual = _run(model, padded_x)
    if out_map is None:
        out_map = np.arange(actual.shape[2])
    kept = actual[:, :, out_map >= 0]
    order = out_map[out_map >= 0]
    assert sorted(order.tolist()) == list(range(expected.shape[2]))
    return float(np.max(np.abs(kept[:, :, np.argsort(order)] - expected)))


# (kernel, stride, dilation, pads): feature-encoder style (no pads), strided, dilated, "same" padding.
WINDOWS = [
    (3, 1, 1, (0, 0)),
    (10, 5, 1, (0, 0)),
    (3, 2, 1, (0, 0)),
    (3, 1, 2, (0, 0)),
    (5, 1, 1, (2, 2)),
    (4, 2, 1, (1, 2)),
    (3, 2, 2, (2, 1)),
]


@pytest.mark.parametrize("padded,real", [(40, 29), (41, 40), (64, 33)])
@pytest.mark.parametrize("kernel,stride,dilation,pads", WINDOWS)
def test_conv_over_zero_right_padding_is_exact_with_the_unpadded_frames(
    kernel, stride, dilation, pads, padded, real
):
    model = _window_model("Conv", kernel=kernel, stride=stride, dilation=dilation, pads=pads)
    axis_map = _right_map(padded, real)
    proof = _prove(model, 2, padded, real, 0.0, axis_map)
    assert proof.exact, proof.problems
    out_map = proof.output_maps["y"][2]
    span = dilation * (kernel - 1) + 1
    out_u = (real + sum(pads) - span) // stride + 1
    out_p = (padded + sum(pads) - span) // stride + 1
    if out_p == out_u:
        assert out_map is None  # the padding changes no output's existence
    else:
        np.testing.assert_array_equal(out_map, _right_map(out_p, out_u))
    assert _largest_real_difference(model, 2, padded, real, 0.0, axis_map, out_map) <= ATOL


@pytest.mark.parametrize("kernel,stride,dilation,pads", [w for w in WINDOWS if w[3] == (0, 0)])
def test_conv_without_pads_never_reads_the_padding(kernel, stride, dilation, pads):
    model = _window_model("Conv", kernel=kernel, stride=stride, dilation=dilation, pads=pads)
    axis_map = _right_map(50, 37)
    proof = _prove(model, 1, 50, 37, 1.5, axis_map)  # padding that is not zero
    assert proof.exact, proof.problems
    assert _largest_real_difference(model, 1, 50, 37, 1.5, axis_map, proof.output_maps["y"][2]) <= ATOL


@pytest.mark.parametrize("kernel,stride,dilation,pads", [w for w in WINDOWS if w[3][1] > 0])
def test_conv_reading_nonzero_padding_is_not_exact(kernel, stride, dilation, pads):
    model = _window_model("Conv", kernel=kernel, stride=stride, dilation=dilation, pads=pads)
    axis_map = _right_map(40, 30)
    proof = _prove(model, 1, 40, 30, 1.5, axis_map)
    assert not proof.exact
    assert "the_conv" in proof.problems[0] and "not zero" in proof.problems[0], proof.problems
    # And padding does change a real output: the verdict is needed.
    out_map = _right_map(
        (40 + sum(pads) - dilation * (kernel - 1) - 1) // stride + 1,
        (30 + sum(pads) - dilation * (kernel - 1) - 1) // stride + 1,
    )
    assert _largest_real_difference(model, 1, 40, 30, 1.5, axis_map, out_map) > 1e-3


@pytest.mark.parametrize("kernel", [16, 15])
def test_positional_conv_is_exact_only_over_zero_padding(kernel):
    """wav2vec2's positional convolution: pads kernel//2 on both sides, stride 1."""
    model = _window_model("Conv", kernel=kernel, stride=1, dilation=1, pads=(kernel // 2, kernel // 2))
    axis_map = _right_map(48, 31)
    zero = _prove(model, 2, 48, 31, 0.0, axis_map)
    assert zero.exact, zero.problems
    assert _largest_real_difference(model, 2, 48, 31, 0.0, axis_map, zero.output_maps["y"][2]) <= ATOL
    nonzero = _prove(model, 2, 48, 31, 0.25, axis_map)
    assert not nonzero.exact
    out_map = zero.output_maps["y"][2]
    assert _largest_real_difference(model, 2, 48, 31, 0.25, axis_map, out_map) > 1e-3


def test_conv_over_left_padding_stays_inexact():
    model = _window_model("Conv", kernel=3, stride=1, dilation=1, pads=(0, 0))
    proof = _prove(model, 1, 40, 29, 0.0, _left_map(40, 29))
    assert not proof.exact
    assert "mixes neighbouring positions along axis 2" in proof.problems[0], proof.problems


def test_conv_reading_real_positions_is_exact_even_when_the_map_starts_shorter():
    """No padding at all (padded == real): the rule keeps the identity map."""
    model = _window_model("Conv", kernel=4, stride=2, dilation=1, pads=(1, 2))
    proof = _prove(model, 1, 30, 30, 0.0, None)
    assert proof.exact and proof.output_maps["y"][2] is None


@pytest.mark.parametrize("kernel,stride,pads", [(3, 1, (0, 0)), (3, 2, (0, 0)), (2, 2, (0, 0))])
def test_maxpool_without_pads_is_exact(kernel, stride, pads):
    model = _window_model("MaxPool", kernel=kernel, stride=stride, dilation=1, pads=pads)
    axis_map = _right_map(40, 29)
    proof = _prove(model, 2, 40, 29, 0.0, axis_map)
    assert proof.exact, proof.problems
    assert _largest_real_difference(model, 2, 40, 29, 0.0, axis_map, proof.output_maps["y"][2]) <= ATOL


def test_maxpool_reading_zero_padding_is_not_exact():
    """MaxPool ignores its own pads; a padded 0 is a value it takes, so even zero padding is visible."""
    model = _window_model("MaxPool", kernel=3, stride=1, dilation=1, pads=(1, 1))
    axis_map = _right_map(40, 29)
    proof = _prove(model, 1, 40, 29, 0.0, axis_map)
    assert not proof.exact
    assert "the_maxpool" in proof.problems[0], proof.problems
    assert _largest_real_difference(model, 1, 40, 29, 0.0, axis_map, _right_map(40, 29)) > 1e-3


@pytest.mark.parametrize(
    ("kernel", "stride", "pads"),
    [(10, 5, [0, 0]), (3, 2, [0, 0]), (4, 1, [2, 2]), (5, 3, [1, 3]), (16, 1, [8, 8]), (2, 2, [0, 1])],
)
def test_the_proofs_numpy_max_pool_computes_what_onnxruntime_does(kernel, stride, pads) -> None:
    """The frame masks' MaxPool is evaluated by a numpy path of the proof's evaluator (the reference one
    loops in Python); it must agree with onnxruntime exactly, pads included."""
    from optimum_ipu_backend.compiler.padding.evaluate import Evaluator

    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[kernel], strides=[stride], pads=pads)
    graph = helper.make_graph(
        [node],
        "pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 101])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(kernel).standard_normal((2, 3, 101)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    np.testing.assert_array_equal(Evaluator(model).run(node, [x])[0], expected)
