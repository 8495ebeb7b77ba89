"""VerifyPopartReady: accepts exactly what PopART can compile and names every offending node otherwise."""

from __future__ import annotations

import numpy as np
import pytest
from graph_testing import BOOL, FLOAT, INT32, INT64, make_model, tensor_info
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from optimum_ipu_backend.compiler import LegalizationError, find_unsupported_nodes
from optimum_ipu_backend.compiler.op_table import POPART_OPSET11_OPS
from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.verify import VerifyPopartReady

CTX = PassContext({})


def _ready_model():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Reshape", ["h", "shape"], ["r"], name="reshape"),
        helper.make_node("Softmax", ["r"], ["y"], name="softmax", axis=-1),
    ]
    return make_model(
        nodes,
        [tensor_info("x", FLOAT, [2, 4])],
        [tensor_info("y", FLOAT, [4, 2])],
        {"w": np.ones((4, 4), np.float32), "shape": np.array([4, 2], np.int64)},
        opset=11,
    )


def test_a_ready_graph_passes():
    model = _ready_model()
    assert find_unsupported_nodes(model) == []
    VerifyPopartReady().run(model, CTX)


def test_opset_above_11_is_reported():
    model = _ready_model()
    model.opset_import[0].version = 13
    problems = find_unsupported_nodes(model)
    assert [p.op_type for p in problems] == ["opset_import"]
    assert "13" in problems[0].reason


def test_every_offending_node_is_listed_with_name_op_and_reason():
    nodes = [
        helper.make_node("LayerNormalization", ["x", "scale"], ["n"], name="ln", axis=-1),
        helper.make_node("Gelu", ["n"], ["g"], name="ms_gelu", domain="com.microsoft"),
        helper.make_node("NonZero", ["g"], ["nz"], name="nonzero"),
        helper.make_node("Cast", ["nz"], ["y"], name="to_float", to=FLOAT),
    ]
    model = make_model(
        nodes,
        [tensor_info("x", FLOAT, [2, 4])],
        [tensor_info("y", FLOAT, [2, None])],
        {"scale": np.ones(4, np.float32)},
        opset=17,
        extra_opsets={"com.microsoft": 1},
        check=False,
    )
    with pytest.raises(LegalizationError) as error:
        VerifyPopartReady().run(model, CTX)
    by_name: dict[str, list[str]] = {}
    for problem in error.value.nodes:
        by_name.setdefault(problem.name, []).append(problem.reason)
    assert any("not an operator of opset 11" in r for r in by_name["ln"])
    assert any("com.microsoft" in r for r in by_name["ms_gelu"])
    assert any("does not implement" in r for r in by_name["nonzero"])
    message = str(error.value)
    for name in ("ln", "ms_gelu", "nonzero", "LayerNormalization", "What you can do"):
        assert name in message
    assert any(p.op_type == "opset_import" and p.domain == "com.microsoft" for p in error.value.nodes)


def test_dynamic_dims_and_int64_inputs_are_reported():
    model = make_model(
        [helper.make_node("Add", ["ids", "one"], ["y"], name="add")],
        [tensor_info("ids", INT64, ["batch", 4])],
        [tensor_info("y", INT64, ["batch", 4])],
        {"one": np.array(1, np.int64)},
        opset=11,
    )
    reasons = " | ".join(p.reason for p in find_unsupported_nodes(model))
    assert "dynamic shape" in reasons
    assert "INT64" in reasons
    assert "initializer is INT64" in reasons


def test_runtime_computed_shape_operand_is_reported():
    nodes = [
        helper.make_node("Cast", ["dims"], ["dims64"], name="cast", to=INT64),
        helper.make_node("Reshape", ["x", "dims64"], ["y"], name="reshape"),
    ]
    model = make_model(
        nodes,
        [tensor_info("x", FLOAT, [2, 6]), tensor_info("dims", INT32, [2])],
        [tensor_info("y", FLOAT, [3, 4])],
        opset=11,
    )
    problems = {p.name: p.reason for p in find_unsupported_nodes(model)}
    assert "computed at run time" in problems["reshape"]


def test_nodes_inside_if_branches_are_checked():
    bad_branch = helper.make_graph(
        [helper.make_node("Trilu", ["x"], ["t"], name="inner_trilu")],
        "then",
        [],
        [tensor_info("t", FLOAT, [3, 3])],
    )
    good_branch = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="inner_relu")],
        "else",
        [],
        [tensor_info("r", FLOAT, [3, 3])],
    )
    model = make_model(
        [helper.make_node("If", ["c"], ["y"], name="if", then_branch=bad_branch, else_branch=good_branch)],
        [tensor_info("c", BOOL, []), tensor_info("x", FLOAT, [3, 3])],
        [tensor_info("y", FLOAT, [3, 3])],
        opset=14,
    )
    model.opset_import[0].version = 11  # Trilu does not exist at 11: the checker complains too
    names = {p.name for p in find_unsupported_nodes(model)}
    assert "inner_trilu" in names and "inner_relu" not in names


def test_model_local_functions_are_reported():
    model = _ready_model()
    function = helper.make_function("local", "f", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], [])
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    kinds = {p.op_type for p in find_unsupported_nodes(model)}
    assert "model-local function" in kinds


unary_ops = st.sampled_from(
    ["Relu", "Sigmoid", "Tanh", "Abs", "Neg", "Exp", "Erf", "Celu", "Mish", "HardSwish"]
)


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(unary_ops, min_size=1, max_size=5), rows=st.integers(1, 4))
def test_property_exactly_the_ops_outside_the_table_are_reported(ops, rows):
    nodes = []
    previous = "x"
    for index, op in enumerate(ops):
        nodes.append(helper.make_node(op, [previous], [f"t{index}"], name=f"n{index}"))
        previous = f"t{index}"
    model = make_model(nodes, [tensor_info("x", FLOAT, [rows, 3])], [tensor_info(previous, FLOAT, [rows, 3])])
    model.opset_import[0].version = 11
    reported = {p.name for p in find_unsupported_nodes(model) if p.name.startswith("n")}
    expected = {f"n{i}" for i, op in enumerate(ops) if op not in POPART_OPSET11_OPS}
    assert reported == expected
