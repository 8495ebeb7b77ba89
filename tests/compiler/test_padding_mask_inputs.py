"""Which inputs the padding proof takes as the mask of a softmax: an integer input that reaches the scores
only through Cos or Sin (rotary positions, as Llama's ``position_ids``) is finite data, not a mask, so a
padded key axis masked by one attention mask is proven; an integer input that reaches them through a
comparison does decide masking, and two such inputs are refused."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.padding import PaddedInput, PaddingAnalyzer

REAL, PADDED = 4, 6


def attention(positions_path: str) -> onnx.ModelProto:
    """Scores of one query against keys padded on their axis, minus 1e9 where ``mask`` is 0; the query is
    scaled by cos(p) ("rotary") or the scores are also masked where p > 0 ("comparison")."""
    constants = [
        numpy_helper.from_array(np.array(0.0, np.float32), "zero_f"),
        numpy_helper.from_array(np.array(-1e9, np.float32), "minus_big"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
    ]
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("Equal", ["mask", "zero"], ["hidden"]),
        helper.make_node("Unsqueeze", ["hidden"], ["hidden3"], axes=[1]),
        helper.make_node("Where", ["hidden3", "minus_big", "zero_f"], ["bias"]),
    ]
    if positions_path == "rotary":
        nodes += [
            helper.make_node("Cast", ["p"], ["p_f"], to=TensorProto.FLOAT),
            helper.make_node("Cos", ["p_f"], ["cos"]),
            helper.make_node("Unsqueeze", ["cos"], ["cos3"], axes=[2]),
            helper.make_node("Mul", ["q", "cos3"], ["q_rotated"]),
            helper.make_node("MatMul", ["q_rotated", "kt"], ["scores"]),
            helper.make_node("Add", ["scores", "bias"], ["masked"]),
        ]
    else:
        nodes += [
            helper.make_node("MatMul", ["q", "kt"], ["scores"]),
            helper.make_node("Greater", ["p", "zero"], ["late"]),
            helper.make_node("Cast", ["late"], ["late_f"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["late_f"], ["late3"], axes=[2]),
            helper.make_node("Mul", ["late3", "minus_big"], ["late_bias"]),
            helper.make_node("Add", ["scores", "bias"], ["masked_once"]),
            helper.make_node("Add", ["masked_once", "late_bias"], ["masked"]),
        ]
    nodes += [
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "k"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 1, 4]),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, "keys", 4]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, [2, "keys"]),
            helper.make_tensor_value_info("p", TensorProto.INT64, [2, 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1, 4])],
        constants,
    )
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 11)])


def padded_keys() -> dict[str, PaddedInput]:
    keys = np.where(np.arange(PADDED) < REAL, np.arange(PADDED), -1)
    return {
        "q": PaddedInput((2, 1, 4), (2, 1, 4), (None, None, None)),
        "k": PaddedInput((2, PADDED, 4), (2, REAL, 4), (None, keys, None)),
        "mask": PaddedInput((2, PADDED), (2, REAL), (None, keys)),
        "p": PaddedInput((2, 1), (2, 1), (None, None)),
    }


def test_positions_through_a_cosine_are_not_a_mask():
    proof = PaddingAnalyzer(attention("rotary")).prove(padded_keys())
    assert proof.exact, proof.problems
    assert [obligation.input for obligation in proof.obligations] == ["mask"]
    assert proof.binary_inputs == ()


def test_positions_through_a_comparison_are_a_second_mask():
    proof = PaddingAnalyzer(attention("comparison")).prove(padded_keys())
    assert not proof.exact, "a second input that can hide positions must not be ignored"
