"""FoldConstants: shape and mask subgraphs of static graphs disappear, results stay bit-for-bit the same."""

from __future__ import annotations

import numpy as np
import pytest
from graph_testing import (
    BOOL,
    FLOAT,
    INT64,
    assert_pass_preserves,
    copy_model,
    make_model,
    run_ort,
    tensor_info,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from optimum_ipu_backend.compiler import bind_constant_inputs
from optimum_ipu_backend.compiler.graphs import count_ops
from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.fix_shapes import FixShapes
from optimum_ipu_backend.compiler.passes.fold_constants import FoldConstants
from optimum_ipu_backend.compiler.passes.fold_static_ifs import FoldStaticIfs

SHAPE_AND_MASK_OPS = {"Shape", "Range", "ConstantOfShape", "Expand", "Trilu", "ScatterND", "Equal", "Where"}


def _fold(model, shapes):
    ctx = PassContext(shapes)
    return FoldConstants().run(FixShapes().run(copy_model(model), ctx), ctx)


def _causal_mask_model(seq_dim="seq"):
    """scores (b, s, s) + causal mask built from Shape/Range/Trilu/Expand/Equal/Where, then Softmax.

    This is the mask construction HF models export: only the input's *shape* feeds the mask.
    """
    nodes = [
        helper.make_node("Shape", ["scores"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["s"], axis=0),
        helper.make_node("Range", ["zero", "s", "one"], ["positions"]),
        helper.make_node("Unsqueeze", ["s", "axes0"], ["s_1d"]),
        helper.make_node("Concat", ["s_1d", "s_1d"], ["square"], axis=0),
        helper.make_node(
            "ConstantOfShape", ["square"], ["ones"], value=helper.make_tensor("v", FLOAT, [1], [1.0])
        ),
        helper.make_node("Trilu", ["ones"], ["lower"], upper=0),
        helper.make_node("Equal", ["lower", "zero_f"], ["masked"]),
        helper.make_node("Where", ["masked", "minus_inf", "zero_f"], ["bias"]),
        helper.make_node("Expand", ["bias", "shape"], ["bias_b"]),
        helper.make_node("Add", ["scores", "bias_b"], ["biased"]),
        helper.make_node("Softmax", ["biased"], ["probs"], axis=-1),
        helper.make_node("Cast", ["positions"], ["positions_f"], to=FLOAT),
        helper.make_node("Add", ["probs", "positions_f"], ["out"]),
    ]
    return make_model(
        nodes,
        [tensor_info("scores", FLOAT, ["b", seq_dim, seq_dim])],
        [tensor_info("out", FLOAT, ["b", seq_dim, seq_dim])],
        {
            "two": np.array(2, np.int64),
            "zero": np.array(0, np.int64),
            "one": np.array(1, np.int64),
            "axes0": np.array([0], np.int64),
            "zero_f": np.array(0.0, np.float32),
            "minus_inf": np.array(np.finfo(np.float32).min, np.float32),
        },
    )


def test_causal_mask_subgraph_folds_away_and_results_are_identical():
    model = _causal_mask_model()
    folded = _fold(model, {"scores": (2, 5, 5)})
    ops = count_ops(folded.graph)
    assert not SHAPE_AND_MASK_OPS & set(ops), ops
    assert set(ops) <= {"Add", "Softmax"}
    x = np.random.default_rng(0).standard_normal((2, 5, 5)).astype(np.float32)
    assert_pass_preserves(model, folded, {"scores": x}, atol=0.0)


def test_interface_is_kept():
    model = _causal_mask_model()
    folded = _fold(model, {"scores": (1, 3, 3)})
    assert [i.name for i in folded.graph.input] == ["scores"]
    assert [o.name for o in folded.graph.output] == ["out"]


def test_scatter_nd_on_constants_folds():
    nodes = [
        helper.make_node("ScatterND", ["base", "indices", "updates"], ["table"]),
        helper.make_node("Add", ["x", "table"], ["y"]),
    ]
    model = make_model(
        nodes,
        [tensor_info("x", FLOAT, [2, 3])],
        [tensor_info("y", FLOAT, [2, 3])],
        {
            "base": np.zeros((2, 3), np.float32),
            "indices": np.array([[0, 1], [1, 2]], np.int64),
            "updates": np.array([5.0, -7.0], np.float32),
        },
    )
    folded = _fold(model, {})
    assert count_ops(folded.graph) == {"Add": 1}
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    assert_pass_preserves(model, folded, {"x": x}, atol=0.0)


@pytest.mark.parametrize(
    ("node", "values"),
    [
        (helper.make_node("EyeLike", ["x"], ["y"], k=1), {"x": np.zeros((3, 4), np.float32)}),
        (helper.make_node("NonZero", ["x"], ["y"]), {"x": np.array([[1, 0], [1, 1]], np.float32)}),
    ],
)
def test_a_graph_output_computed_from_constants_becomes_a_constant(node, values):
    # onnxslim keeps the node that makes a graph output; the pass evaluates it like any other.
    output = tensor_info("y", FLOAT, [3, 4]) if node.op_type == "EyeLike" else tensor_info("y", INT64, [2, 3])
    model = make_model([node], [], [output], values)
    folded = _fold(model, {})
    assert count_ops(folded.graph) == {"Constant": 1}
    np.testing.assert_array_equal(run_ort(folded, {})["y"], run_ort(model, {})["y"])


@pytest.mark.parametrize("op_type", ["Shape", "Size"])
def test_the_shape_of_a_static_input_as_a_graph_output_becomes_a_constant(op_type):
    node = helper.make_node(op_type, ["x"], ["y"], **({"start": 1} if op_type == "Shape" else {}))
    output = tensor_info("y", INT64, [2] if op_type == "Shape" else [])
    model = make_model([node], [tensor_info("x", FLOAT, ["batch", 4, 5])], [output])
    folded = _fold(model, {"x": (3, 4, 5)})
    assert count_ops(folded.graph) == {"Constant": 1}
    x = np.zeros((3, 4, 5), np.float32)
    np.testing.assert_array_equal(run_ort(folded, {"x": x})["y"], run_ort(model, {"x": x})["y"])


def test_shape_chains_around_a_scan_fold_at_the_top_level():
    """onnxslim cannot fold a graph holding control flow; the Shape -> Gather -> Concat -> Reshape chain
    beside a Scan still becomes constants, so no int64 shape is computed on the device."""
    body = helper.make_graph(
        [
            helper.make_node("Add", ["acc_in", "row"], ["acc_out"]),
            helper.make_node("Identity", ["acc_out"], ["seen"]),
        ],
        "body",
        [tensor_info("acc_in", FLOAT, [4]), tensor_info("row", FLOAT, [4])],
        [tensor_info("acc_out", FLOAT, [4]), tensor_info("seen", FLOAT, [4])],
    )
    nodes = [
        helper.make_node("Scan", ["zeros", "x"], ["total", "steps"], body=body, num_scan_inputs=1),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "first"], ["rows"], axis=0),
        helper.make_node("Concat", ["rows", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["steps", "target"], ["y"]),
    ]
    constants = {
        "zeros": np.zeros(4, np.float32),
        "first": np.array([0], np.int64),
        "minus_one": np.array([-1], np.int64),
    }
    model = make_model(
        nodes,
        [tensor_info("x", FLOAT, ["n", 4])],
        [tensor_info("total", FLOAT, [4]), tensor_info("y", FLOAT, ["n", 4])],
        constants,
    )
    folded = _fold(model, {"x": (3, 4)})
    ops = count_ops(folded.graph)
    assert "Shape" not in ops and "Gather" not in ops and "Concat" not in ops, ops
    assert ops["Scan"] == 1 and ops["Reshape"] == 1
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    assert_pass_preserves(model, folded, {"x": x}, atol=0.0)


def test_a_random_draw_is_not_fixed_by_folding():
    node = helper.make_node("RandomUniformLike", ["x"], ["y"])
    model = make_model([node], [], [tensor_info("y", FLOAT, [2, 3])], {"x": np.zeros((2, 3), np.float32)})
    assert count_ops(_fold(model, {}).graph) == {"RandomUniformLike": 1}


def test_nodes_reading_real_inputs_are_kept():
    nodes = [
        helper.make_node("Equal", ["ids", "pad"], ["is_pad"]),
        helper.make_node("Where", ["is_pad", "big_negative", "zero_f"], ["bias"]),
    ]
    model = make_model(
        nodes,
        [tensor_info("ids", INT64, ["b", "s"])],
        [tensor_info("bias", FLOAT, ["b", "s"])],
        {
            "pad": np.array(0, np.int64),
            "big_negative": np.array(-1e9, np.float32),
            "zero_f": np.array(0, np.float32),
        },
    )
    folded = _fold(model, {"ids": (2, 4)})
    assert count_ops(folded.graph) == {"Equal": 1, "Where": 1}
    ids = np.array([[1, 0, 3, 0], [0, 0, 2, 2]], np.int64)
    assert_pass_preserves(model, folded, {"ids": ids}, atol=0.0)


def test_a_graph_below_opset_7_folds():
    # onnxslim's shape inference gives no model at all below opset 7; the pass must not pass that on.
    model = make_model(
        [helper.make_node("Not", ["x"], ["y"])],
        [tensor_info("x", BOOL, (3, 4))],
        [tensor_info("y", BOOL, (3, 4))],
        opset=1,
    )
    folded = _fold(model, {})
    assert count_ops(folded.graph) == {"Not": 1}
    assert_pass_preserves(model, folded, {"x": np.arange(12).reshape(3, 4) % 3 == 0}, atol=0.0)


@pytest.mark.parametrize(
    ("operand", "value", "attributes", "shape"),
    [
        ("scales", np.array([2.0, 3.0], np.float32), {"axes": [2, 3]}, (1, 2, 4, 9)),
        (
            "sizes",
            np.array([7, 8], np.int64),
            {"axes": [3, 2], "keep_aspect_ratio_policy": "not_smaller"},
            (1, 2, 8, 12),
        ),
        ("sizes", np.array([1, 1, 3, 5], np.int64), {"keep_aspect_ratio_policy": "not_larger"}, (1, 1, 1, 2)),
    ],
)
def test_resize_18_with_axes_or_an_aspect_policy_folds(operand, value, attributes, shape):
    # onnxslim's shape inference takes a Resize's sizes as its whole output shape (IndexError here).
    node_inputs = ["x", "", "scales"] if operand == "scales" else ["x", "", "", "sizes"]
    node = helper.make_node("Resize", node_inputs, ["y"], mode="nearest", **attributes)
    model = make_model(
        [node], [tensor_info("x", FLOAT, (1, 2, 2, 3))], [tensor_info("y", FLOAT, shape)], {operand: value}
    )
    folded = _fold(model, {})
    assert count_ops(folded.graph) == {"Resize": 1}
    assert_pass_preserves(model, folded, {"x": np.arange(12, dtype=np.float32).reshape(1, 2, 2, 3)}, atol=0.0)


def _if_model():
    """A top-level If on a bool input (as in merged decoders), each branch with its own shape chain."""

    def branch(name, scale):
        return helper.make_graph(
            [
                helper.make_node("Shape", ["x"], [f"{name}_shape"]),
                helper.make_node(
                    "ConstantOfShape",
                    [f"{name}_shape"],
                    [f"{name}_fill"],
                    value=helper.make_tensor("v", FLOAT, [1], [scale]),
                ),
                helper.make_node("Mul", ["x", f"{name}_fill"], [f"{name}_out"]),
            ],
            name,
            [],
            [tensor_info(f"{name}_out", FLOAT, None)],
        )

    node = helper.make_node(
        "If", ["use_cache_branch"], ["y"], then_branch=branch("then", 2.0), else_branch=branch("else", -3.0)
    )
    return make_model(
        [node],
        [tensor_info("use_cache_branch", BOOL, [1]), tensor_info("x", FLOAT, ["b", "s"])],
        [tensor_info("y", FLOAT, ["b", "s"])],
    )


@pytest.mark.parametrize("use_cache", [True, False])
def test_if_branches_are_folded_and_the_if_is_kept(use_cache):
    model = _if_model()
    folded = _fold(model, {"use_cache_branch": (1,), "x": (2, 3)})
    ops = count_ops(folded.graph)
    assert ops == {"If": 1, "Mul": 2}, ops
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    assert_pass_preserves(model, folded, {"use_cache_branch": np.array([use_cache]), "x": x}, atol=0.0)


def test_original_model_is_not_mutated_through_the_pipeline_copy():
    model = _causal_mask_model()
    snapshot = model.SerializeToString()
    _fold(model, {"scores": (1, 2, 2)})
    assert model.SerializeToString() == snapshot


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_property_mask_folding_is_exact_for_any_static_shape(batch, seq, seed):
    model = _causal_mask_model()
    folded = _fold(model, {"scores": (batch, seq, seq)})
    assert not SHAPE_AND_MASK_OPS & set(count_ops(folded.graph))
    x = (np.random.default_rng(seed).standard_normal((batch, seq, seq)) * 10).astype(np.float32)
    expected = run_ort(model, {"scores": x})
    actual = run_ort(folded, {"scores": x})
    np.testing.assert_array_equal(actual["out"], expected["out"])


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_bound_branch_input_inlines_the_branch_taken(use_cache):
    model = _if_model()
    bound = bind_constant_inputs(model, {"use_cache_branch": [use_cache]})
    assert [i.name for i in bound.graph.input] == ["x"]
    ctx = PassContext({"x": (2, 3)})
    # as legalize runs them: fold_static_ifs inlines the branch, fold_constants folds what it holds
    folded = FoldConstants().run(FoldStaticIfs().run(FixShapes().run(copy_model(bound), ctx), ctx), ctx)
    assert count_ops(folded.graph) == {"Mul": 1}
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    expected = run_ort(model, {"use_cache_branch": np.array([use_cache]), "x": x})
    np.testing.assert_array_equal(run_ort(folded, {"x": x})["y"], expected["y"])


def test_binding_an_unknown_input_is_an_error():
    with pytest.raises(ValueError, match="not graph inputs"):
        bind_constant_inputs(_if_model(), {"use_cache": [True]})


def test_the_cleanup_folds_what_a_lowering_left_and_keeps_a_graph_with_nothing_to_fold(monkeypatch):
    """The cleanup after lowering (``only_if_foldable``) runs onnxslim only when a node computes from
    constants or reads a static shape: then it folds as the first fold does, else the graph is kept."""
    from optimum_ipu_backend.compiler.passes import fold_constants

    slims = []
    real_slim = fold_constants._slim
    monkeypatch.setattr(fold_constants, "_slim", lambda model: slims.append(1) or real_slim(model))
    cleanup = FoldConstants(name="fold_constants (cleanup)", only_if_foldable=True)
    model = _causal_mask_model()
    ctx = PassContext({"scores": (2, 5, 5)})
    fixed = FixShapes().run(copy_model(model), ctx)
    assert fold_constants.has_foldable_node(fixed.graph)
    folded = cleanup.run(fixed, ctx)  # a Shape chain is left: folded as by the first fold
    assert len(slims) == 1 and set(count_ops(folded.graph)) <= {"Add", "Softmax"}
    assert not fold_constants.has_foldable_node(folded.graph)
    kept = cleanup.run(copy_model(folded), ctx)  # nothing left to fold: onnxslim does not run again
    assert len(slims) == 1 and count_ops(kept.graph) == count_ops(folded.graph)
    x = np.random.default_rng(0).standard_normal((2, 5, 5)).astype(np.float32)
    assert_pass_preserves(model, kept, {"scores": x}, atol=0.0)
