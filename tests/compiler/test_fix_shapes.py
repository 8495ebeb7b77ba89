"""FixShapes: requested static sizes land on the inputs and propagate; bad requests fail with clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from graph_testing import FLOAT, INT64, assert_pass_preserves, copy_model, make_model, shape_of, tensor_info
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from optimum_ipu_backend.compiler import LegalizationError
from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.fix_shapes import FixShapes, is_static


def _reshape_by_shape_graph():
    """y = Reshape(x, Concat(Shape(x)[0], -1)) * 2: the exported shape chain on a (batch, seq, 4) input."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes0"], ["batch_1d"]),
        helper.make_node("Concat", ["batch_1d", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Mul", ["flat", "two"], ["y"]),
    ]
    return make_model(
        nodes,
        [tensor_info("x", FLOAT, ["batch_size", "sequence_length", 4])],
        [tensor_info("y", FLOAT, ["batch_size", "flat_size"])],
        {
            "zero": np.array(0, np.int64),
            "axes0": np.array([0], np.int64),
            "minus_one": np.array([-1], np.int64),
            "two": np.array(2.0, np.float32),
        },
    )


def test_dynamic_dims_become_static_and_reach_outputs_and_intermediates():
    model = _reshape_by_shape_graph()
    fixed = FixShapes().run(copy_model(model), PassContext({"x": (3, 5, 4)}))
    assert shape_of(fixed.graph.input[0]) == [3, 5, 4]
    assert shape_of(fixed.graph.output[0]) == [3, 20]
    assert all(is_static(vi) for vi in fixed.graph.value_info)


def test_original_model_is_untouched_and_results_are_equal():
    model = _reshape_by_shape_graph()
    before = model.SerializeToString()
    fixed = FixShapes().run(copy_model(model), PassContext({"x": (2, 3, 4)}))
    assert model.SerializeToString() == before
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    assert_pass_preserves(model, fixed, {"x": x})


def test_missing_input_names_the_input_and_its_symbolic_dims():
    with pytest.raises(LegalizationError) as error:
        FixShapes().run(_reshape_by_shape_graph(), PassContext({}))
    message = str(error.value)
    assert "x" in message and "batch_size" in message and "sequence_length" in message
    assert error.value.nodes[0].name == "x"


def test_conflict_with_a_static_dim_is_an_error():
    with pytest.raises(LegalizationError, match="axis 2 is fixed to 4"):
        FixShapes().run(_reshape_by_shape_graph(), PassContext({"x": (1, 8, 5)}))


def test_rank_mismatch_and_unknown_names_are_all_reported():
    with pytest.raises(LegalizationError) as error:
        FixShapes().run(_reshape_by_shape_graph(), PassContext({"x": (1, 8), "input_idz": (1, 8)}))
    names = {node.name for node in error.value.nodes}
    assert names == {"x", "input_idz"}
    assert "rank 2" in str(error.value)


def test_negative_size_is_rejected():
    with pytest.raises(LegalizationError, match="negative size"):
        FixShapes().run(_reshape_by_shape_graph(), PassContext({"x": (1, -1, 4)}))


def test_static_inputs_need_no_request():
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [tensor_info("x", FLOAT, [2, 3])],
        [tensor_info("y", FLOAT, [2, 3])],
    )
    fixed = FixShapes().run(copy_model(model), PassContext({}))
    assert shape_of(fixed.graph.output[0]) == [2, 3]


def _merged_style_if_model():
    """Both If branches name an intermediate "shape", of different tensors, as merged decoders do."""

    def branch(source: str, rank_name: str) -> object:
        return helper.make_graph(
            [
                helper.make_node("Shape", [source], ["shape"]),
                helper.make_node(
                    "ConstantOfShape", ["shape"], ["ones"], value=helper.make_tensor("v", FLOAT, [1], [1.0])
                ),
                helper.make_node("Add", ["ones", source], ["sum"]),
                helper.make_node("ReduceSum", ["sum"], ["out"], keepdims=0),
            ],
            rank_name,
            [],
            [tensor_info("out", FLOAT, [])],
        )

    node = helper.make_node(
        "If", ["cond"], ["total"], then_branch=branch("a", "then"), else_branch=branch("b", "else")
    )
    return make_model(
        [node],
        [
            tensor_info("cond", 9, [1]),
            tensor_info("a", FLOAT, ["batch", "seq"]),
            tensor_info("b", FLOAT, ["batch", "seq", 3]),
        ],
        [tensor_info("total", FLOAT, [])],
    )


@pytest.mark.parametrize("cond", [True, False])
def test_if_branches_with_reused_names_still_infer_and_run(cond):
    model = _merged_style_if_model()
    fixed = FixShapes().run(copy_model(model), PassContext({"a": (2, 5), "b": (2, 5, 3), "cond": (1,)}))
    rng = np.random.default_rng(1)
    feeds = {
        "cond": np.array([cond]),
        "a": rng.standard_normal((2, 5)).astype(np.float32),
        "b": rng.standard_normal((2, 5, 3)).astype(np.float32),
    }
    assert_pass_preserves(model, fixed, feeds)
    branches = {attr.name: attr.g for attr in fixed.graph.node[0].attribute}
    for name, want in (("then_branch", [2, 5]), ("else_branch", [2, 5, 3])):
        inferred = {vi.name: shape_of(vi) for vi in branches[name].value_info}.get("ones", want)
        # Unknown sizes are fine (folding settles them); a size taken from the other branch is not.
        assert len(inferred) == len(want) and all(
            not isinstance(d, int) or d == w for d, w in zip(inferred, want, strict=True)
        )


def test_int_inputs_keep_their_type():
    model = make_model(
        [helper.make_node("Identity", ["ids"], ["out"])],
        [tensor_info("ids", INT64, ["b", "s"])],
        [tensor_info("out", INT64, ["b", "s"])],
    )
    fixed = FixShapes().run(copy_model(model), PassContext({"ids": [1, 7]}))
    assert fixed.graph.input[0].type.tensor_type.elem_type == INT64
    assert shape_of(fixed.graph.output[0]) == [1, 7]


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 4), seq=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_property_fixed_graph_computes_the_same(batch, seq, seed):
    model = _reshape_by_shape_graph()
    fixed = FixShapes().run(copy_model(model), PassContext({"x": (batch, seq, 4)}))
    assert shape_of(fixed.graph.output[0]) == [batch, seq * 4]
    x = np.random.default_rng(seed).standard_normal((batch, seq, 4)).astype(np.float32)
    assert_pass_preserves(model, fixed, {"x": x})
