"""Rules of the padding proof that BART's dense end-of-sentence selection needs, each checked on a
one-node graph: comparisons of padded tokens with a constant id, a reverse CumSum over a right-padded
axis, and the shape of a gather whose indices come from data."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.padding import PaddedInput, PaddingAnalyzer
from optimum_ipu_backend.compiler.padding import classes as C


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _one_node_proof(node: onnx.NodeProto, elem_type: int, fill, padded=6, real=4, extra=()):
    x = helper.make_tensor_value_info("x", elem_type, ["batch", "length"])
    y = helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)
    graph = helper.make_graph([*extra, node], "one", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 18)])
    axis_map = np.where(np.arange(padded) < real, np.arange(padded), -1)
    proof_inputs = {"x": PaddedInput((2, padded), (2, real), (None, axis_map), fill)}
    analyzer = PaddingAnalyzer(model)
    env, _ = analyzer._run(proof_inputs)
    return env["y"], analyzer.prove(proof_inputs)


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


@pytest.mark.parametrize(("fill", "padded_class"), [(1, "FALSE"), (0, "FALSE"), (2, "BOOL")])
def test_comparing_a_padded_token_with_a_constant_id_is_known(fill, padded_class):
    """A padded element of class ONE (id 1) or ZERO compared with the constant 2 is known to be FALSE;
    padding of another id (class SMALL: some integer) stays unknown, and so do real tokens."""
    eos = _constant("eos", np.array(2, np.int64))
    y, _ = _one_node_proof(
        helper.make_node("Equal", ["x", "eos"], ["y"]), TensorProto.INT64, fill, extra=[eos]
    )
    classes = np.broadcast_to(y.classes, y.shape)
    assert set(classes[:, 4:].reshape(-1)) == {getattr(C, padded_class)}
    assert set(classes[:, :4].reshape(-1)) == {C.BOOL}


def test_less_with_the_constant_first_compares_in_order():
    two = _constant("two", np.array(2, np.int64))
    y, _ = _one_node_proof(helper.make_node("Less", ["two", "x"], ["y"]), TensorProto.INT64, 1, extra=[two])
    assert set(np.broadcast_to(y.classes, y.shape)[:, 4:].reshape(-1)) == {C.FALSE}  # 2 < 1 is false


@pytest.mark.parametrize(
    ("fill", "exclusive", "exact"),
    [(0, 1, True), (0, 0, True), (3, 1, False)],
)
def test_a_reverse_cumsum_over_right_padding_is_exact_where_the_padding_holds_zero(fill, exclusive, exact):
    """Summed from the end, a right-padded axis meets the padding first: the real elements' sums hold
    only real elements plus the padding, exact where that is zero."""
    axis = _constant("axis", np.array(1, np.int64))
    node = helper.make_node("CumSum", ["x", "axis"], ["y"], reverse=1, exclusive=exclusive)
    _, proof = _one_node_proof(node, TensorProto.INT32, fill, extra=[axis])
    assert proof.exact is exact, proof.problems
    # Checked against onnxruntime at the padded and the caller's sizes.
    x = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
    padded = np.concatenate([x, np.full((2, 2), fill, np.int32)], axis=1)
    graph = helper.make_graph(
        [axis, node],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.INT32, ["b", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
    )
    session = _session(helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 18)]))
    same = np.array_equal(session.run(None, {"x": padded})[0][:, :4], session.run(None, {"x": x})[0])
    assert same is exact


def test_a_forward_cumsum_over_right_padding_stays_exact():
    axis = _constant("axis", np.array(1, np.int64))
    node = helper.make_node("CumSum", ["x", "axis"], ["y"])
    _, proof = _one_node_proof(node, TensorProto.INT32, 7, extra=[axis])
    assert proof.exact, proof.problems


def test_a_gather_at_positions_from_data_has_its_indices_shape():
    """GatherElements with indices computed from data: not followed, but of the indices' shape [2, 1]
    (the proof used to give it the data's shape, and broke on what followed)."""
    nodes = [
        _constant("one", np.array([1], np.int64)),
        helper.make_node("ReduceSum", ["x", "one"], ["count"], keepdims=1),
        helper.make_node("GatherElements", ["x", "count"], ["y"], axis=1),
    ]
    y, _ = _one_node_proof(nodes[-1], TensorProto.INT64, 1, extra=nodes[:-1])
    assert y.shape == (2, 1) and y.real_shape == (2, 1)


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_a_scatter_that_reduces_is_not_followed_as_a_move(reduction):
    """Run on element ids, a reducing scatter adds (or multiplies) ids into other ids: with add, data id 1
    plus update id 13 is 14, update 1's id, a fake source. The proof treats its result as unknown."""
    indices = _constant("indices", np.array([[0], [1]], np.int64))
    updates = _constant("updates", np.array([[5], [7]], np.int64))
    node = helper.make_node(
        "ScatterElements", ["x", "indices", "updates"], ["y"], axis=1, reduction=reduction
    )
    y, proof = _one_node_proof(node, TensorProto.INT64, 0, extra=[indices, updates])
    assert not np.any(y.exact)
    assert not proof.exact
    assert any(f"combines elements (reduction {reduction})" in str(problem) for problem in proof.problems)
