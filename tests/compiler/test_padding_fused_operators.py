"""Padding rules for onnxruntime's fused operators (SkipLayerNormalization, SkipSimplifiedLayerNormalization,
SimplifiedLayerNormalization, Gelu, FastGelu, BiasGelu, QuickGelu), each on a one-node graph at
a hidden size of 64: the proof of padding the sequence axis is checked against onnxruntime, which runs
the node at the padded and at the caller's sizes, and padding the axis a node normalizes over, or
following a statistics output, is refused."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.padding import PaddedInput, PaddingAnalyzer

BATCH, REAL, PADDED, HIDDEN = 2, 5, 8, 64
RNG = np.random.default_rng(0)
WEIGHTS = {name: RNG.normal(size=HIDDEN).astype(np.float32) for name in ("gamma", "beta", "bias")}

#: op type, domain, its inputs (x and skip are the padded data; the others weights), its outputs
MS = "com.microsoft"
WITH_SUM = ["y", "", "", "sum"]  # the output and input_skip_bias_sum; mean and inv_std_var left out
CASES = {
    "skip-layer-norm": ("SkipLayerNormalization", MS, ["x", "skip", "gamma", "beta", "bias"], WITH_SUM),
    "skip-layer-norm-no-bias": ("SkipLayerNormalization", MS, ["x", "skip", "gamma"], ["y"]),
    "skip-rms-norm": ("SkipSimplifiedLayerNormalization", MS, ["x", "skip", "gamma", "bias"], WITH_SUM),
    "rms-norm": ("SimplifiedLayerNormalization", "", ["x", "gamma"], ["y"]),  # onnxruntime's, ONNX domain
    "gelu": ("Gelu", MS, ["x"], ["y"]),
    "fast-gelu": ("FastGelu", MS, ["x", "bias"], ["y"]),
    "bias-gelu": ("BiasGelu", MS, ["x", "bias"], ["y"]),
    "quick-gelu": ("QuickGelu", MS, ["x"], ["y"]),
}


def _model(op_type: str, domain: str, inputs: list[str], outputs: list[str], **attrs) -> onnx.ModelProto:
    data = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "sequence", HIDDEN])
        for name in ("x", "skip")
        if name in inputs
    ]
    node = helper.make_node(op_type, inputs, outputs, domain=domain, name="fused", **attrs)
    graph = helper.make_graph(
        [node],
        "one",
        data,
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs if name],
        [numpy_helper.from_array(WEIGHTS[name], name) for name in inputs if name in WEIGHTS],
    )
    opsets = [helper.make_operatorsetid("", 17), helper.make_operatorsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _proof(model: onnx.ModelProto, padded_axis: int):
    """The proof of padding ``padded_axis`` of the data inputs (1: the sequence, 2: the hidden size)."""
    shape, real = [BATCH, REAL, HIDDEN], [BATCH, REAL, HIDDEN]
    shape[padded_axis] = PADDED if padded_axis == 1 else HIDDEN + 3
    maps = [None, None, None]
    positions = np.arange(shape[padded_axis])
    maps[padded_axis] = np.where(positions < real[padded_axis], positions, -1)
    inputs = {i.name: PaddedInput(tuple(shape), tuple(real), tuple(maps), 0) for i in model.graph.input}
    return PaddingAnalyzer(model).prove(inputs)


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


@pytest.mark.parametrize("case", CASES)
def test_padding_the_sequence_of_a_fused_operator_is_proven_and_onnxruntime_agrees(case):
    model = _model(*CASES[case])
    proof = _proof(model, padded_axis=1)
    assert proof.exact, proof.problems
    names = [i.name for i in model.graph.input]
    real = {name: RNG.normal(size=(BATCH, REAL, HIDDEN)).astype(np.float32) for name in names}
    padded = {name: np.pad(value, ((0, 0), (0, PADDED - REAL), (0, 0))) for name, value in real.items()}
    outputs = [o.name for o in model.graph.output]
    for name, got, want in zip(outputs, _run(model, padded), _run(model, real), strict=True):
        assert got.shape == (BATCH, PADDED, HIDDEN)
        padded_axes = [axis_map is not None for axis_map in proof.output_maps[name]]
        assert padded_axes == [False, True, False], proof.output_maps[name]
        np.testing.assert_allclose(got[:, :REAL], want, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("skip-layer-norm-no-bias", "normalizes over axis 2, which has padding"),
        ("rms-norm", "normalizes over axis 2, which has padding"),
        ("skip-layer-norm", "broadcasts operands"),  # its bias is not padded: no padded call can run
        ("skip-rms-norm", "broadcasts operands"),
    ],
)
def test_padding_the_axis_a_fused_normalization_reduces_over_is_refused(case, why):
    proof = _proof(_model(*CASES[case]), padded_axis=2)
    assert not proof.exact
    assert f"node 'fused ({CASES[case][0]})'" in proof.problems[0], proof.problems
    assert why in proof.problems[0], proof.problems


@pytest.mark.parametrize(("case", "statistic"), [("skip-layer-norm", 1), ("skip-rms-norm", 2)])
def test_a_followed_statistics_output_of_a_fused_normalization_is_refused(case, statistic):
    op_type, domain, inputs, outputs = CASES[case]
    outputs = [*outputs[:statistic], "statistic", *outputs[statistic + 1 :]]
    proof = _proof(_model(op_type, domain, inputs, outputs), padded_axis=1)
    assert not proof.exact
    assert "statistics outputs are not followed" in " ".join(proof.problems), proof.problems


def test_onnxruntimes_fused_attention_still_stops_the_proof():
    """Attention has no rule: the graph is compiled at each call's sizes, as before."""
    weights = numpy_helper.from_array(RNG.normal(size=(HIDDEN, 3 * HIDDEN)).astype(np.float32), "weights")
    node = helper.make_node("Attention", ["x", "weights"], ["y"], domain="com.microsoft", num_heads=4)
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [weights],
    )
    opsets = [helper.make_operatorsetid("", 17), helper.make_operatorsetid("com.microsoft", 1)]
    proof = _proof(helper.make_model(graph, opset_imports=opsets), padded_axis=1)
    assert not proof.exact
    assert "com.microsoft::Attention, which the padding proof has no rule for" in proof.problems[0]
