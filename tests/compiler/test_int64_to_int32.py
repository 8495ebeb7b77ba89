"""Int64ToInt32: no int64 left for the device, same integer results, and only marker values clipped."""

from __future__ import annotations

import numpy as np
import pytest
from graph_testing import (
    BOOL,
    FLOAT,
    INT32,
    INT64,
    assert_pass_preserves,
    copy_model,
    elem_types,
    make_model,
    tensor_info,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler import LegalizationError, find_unsupported_nodes
from optimum_ipu_backend.compiler.graphs import iter_graphs
from optimum_ipu_backend.compiler.passes.base import PassContext
from optimum_ipu_backend.compiler.passes.int64_to_int32 import Int64ToInt32

INT64_MAX = np.iinfo(np.int64).max
CTX = PassContext({})


def _convert(model):
    return Int64ToInt32().run(copy_model(model), CTX)


def _int64_names(model):
    names = set()
    for graph in iter_graphs(model.graph):
        names |= {i.name for i in graph.initializer if i.data_type == INT64}
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            if vi.type.tensor_type.elem_type == INT64:
                names.add(vi.name)
    return names


def _position_model():
    """ids (int64) -> Gather embeddings, positions = Cast(CumSum(mask)) -1, Slice with INT64_MAX end."""
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["embedded"], axis=0),
        helper.make_node("CumSum", ["mask", "axis1"], ["cumsum"]),
        helper.make_node("Sub", ["cumsum", "one"], ["positions"]),
        helper.make_node("Cast", ["embedded"], ["embedded_i"], to=INT64),
        helper.make_node("Slice", ["positions", "start", "end", "axes1"], ["tail"]),
        helper.make_node("Mul", ["tail", "scale"], ["scaled"]),
        helper.make_node("Cast", ["scaled"], ["scaled_f"], to=FLOAT),
    ]
    return make_model(
        nodes,
        [tensor_info("ids", INT64, [2, 5]), tensor_info("mask", INT64, [2, 5])],
        [tensor_info("embedded_i", INT64, [2, 5, 3]), tensor_info("scaled_f", FLOAT, [2, 4])],
        {
            "table": np.arange(30, dtype=np.float32).reshape(10, 3),
            "axis1": np.array(1, np.int64),
            "one": np.array(1, np.int64),
            "start": np.array([1], np.int64),
            "end": np.array([INT64_MAX], np.int64),
            "axes1": np.array([1], np.int64),
            "scale": np.array(1000, np.int64),
        },
    )


def test_inputs_outputs_initializers_and_casts_become_int32():
    converted = _convert(_position_model())
    assert _int64_names(converted) == set()
    assert {i.name: i.type.tensor_type.elem_type for i in converted.graph.input} == {
        "ids": INT32,
        "mask": INT32,
    }
    assert elem_types(converted)["embedded_i"] == INT32
    casts = [n for n in converted.graph.node if n.op_type == "Cast"]
    assert {helper.get_attribute_value(c.attribute[0]) for c in casts} == {INT32, FLOAT}
    end = next(i for i in converted.graph.initializer if i.name == "end")
    assert numpy_helper.to_array(end).tolist() == [np.iinfo(np.int32).max]


def test_results_are_exactly_the_same():
    model = _position_model()
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 10, (2, 5)), "mask": rng.integers(0, 2, (2, 5))}
    assert_pass_preserves(model, _convert(model), feeds, atol=0.0)


def test_values_that_do_not_fit_are_an_error_naming_the_tensor():
    model = make_model(
        [helper.make_node("Add", ["x", "huge"], ["y"])],
        [tensor_info("x", INT64, [2])],
        [tensor_info("y", INT64, [2])],
        {"huge": np.array([1, 2**40], np.int64)},
    )
    with pytest.raises(LegalizationError) as error:
        _convert(model)
    assert error.value.nodes[0].name == "huge"
    assert "1099511627776" in str(error.value)


def test_reshape_shape_constant_stays_int64_and_verify_accepts_it():
    model = make_model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [tensor_info("x", FLOAT, [2, 6])],
        [tensor_info("y", FLOAT, [3, 4])],
        {"shape": np.array([3, 4], np.int64)},
        opset=11,
    )
    converted = _convert(model)
    assert elem_types(converted)["shape"] == INT64
    assert find_unsupported_nodes(converted) == []


def test_shared_shape_constant_used_as_data_too():
    """A constant read both as a Reshape shape and as data (onnxslim merges equal constants): the data reader
    gets int32 values and the shape operand an int64 constant of its own, so nothing is left to run time."""
    model = make_model(
        [
            helper.make_node("Reshape", ["x", "shape"], ["y"]),
            helper.make_node("Add", ["shape", "offset"], ["shifted"]),
        ],
        [tensor_info("x", FLOAT, [2, 6]), tensor_info("offset", INT64, [2])],
        [tensor_info("y", FLOAT, [3, 4]), tensor_info("shifted", INT64, [2])],
        {"shape": np.array([3, 4], np.int64)},
        opset=11,
    )
    converted = _convert(model)
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(2, 6), "offset": np.array([5, -5])}
    assert_pass_preserves(model, converted, feeds, atol=0.0)
    assert find_unsupported_nodes(converted) == []
    reshape = next(n for n in converted.graph.node if n.op_type == "Reshape")
    shape = next(i for i in converted.graph.initializer if i.name == reshape.input[1])
    assert shape.data_type == INT64 and numpy_helper.to_array(shape).tolist() == [3, 4]
    assert "Cast" not in {n.op_type for n in converted.graph.node}


def test_computed_shape_operand_is_cast_back_and_reported():
    """A shape computed at run time stays a run-time value: verify names it rather than guessing."""
    model = make_model(
        [
            helper.make_node("Add", ["base", "offset"], ["shape"]),
            helper.make_node("Reshape", ["x", "shape"], ["y"]),
        ],
        [tensor_info("x", FLOAT, [2, 6]), tensor_info("offset", INT64, [2])],
        [tensor_info("y", FLOAT, [3, 4])],
        {"base": np.array([3, 4], np.int64)},
        opset=11,
    )
    problems = find_unsupported_nodes(_convert(model))
    assert any("computed at run time" in p.reason for p in problems)


def test_shape_gets_a_cast_to_int32():
    model = make_model(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Mul", ["s", "k"], ["y"])],
        [tensor_info("x", FLOAT, [2, 3])],
        [tensor_info("y", INT64, [2])],
        {"k": np.array(3, np.int64)},
    )
    converted = _convert(model)
    assert [n.op_type for n in converted.graph.node] == ["Shape", "Cast", "Mul"]
    assert elem_types(converted)["y"] == INT32
    assert_pass_preserves(model, converted, {"x": np.zeros((2, 3), np.float32)}, atol=0.0)


def test_constant_nodes_constant_of_shape_and_if_subgraphs():
    def branch(name, value):
        return helper.make_graph(
            [
                helper.make_node(
                    "Constant", [], [f"{name}_c"], value=numpy_helper.from_array(np.array(value))
                ),
                helper.make_node(
                    "ConstantOfShape",
                    ["dims"],
                    [f"{name}_fill"],
                    value=helper.make_tensor("v", TensorProto.INT64, [1], [value]),
                ),
                helper.make_node("Add", [f"{name}_fill", f"{name}_c"], [f"{name}_sum"]),
                helper.make_node("Add", [f"{name}_sum", "ids"], [f"{name}_out"]),
            ],
            name,
            [],
            [tensor_info(f"{name}_out", INT64, [2, 3])],
        )

    model = make_model(
        [
            helper.make_node(
                "If", ["flag"], ["y"], then_branch=branch("then", 7), else_branch=branch("else", -9)
            )
        ],
        [tensor_info("flag", BOOL, []), tensor_info("ids", INT64, [2, 3])],
        [tensor_info("y", INT64, [2, 3])],
        {"dims": np.array([2, 3], np.int64)},
    )
    converted = _convert(model)
    assert _int64_names(converted) == {"dims"}  # only the ConstantOfShape shape operand
    ids = np.arange(6).reshape(2, 3)
    for flag in (True, False):
        assert_pass_preserves(model, converted, {"flag": np.array(flag), "ids": ids}, atol=0.0)


int32_values = st.integers(-(2**20), 2**20)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 6),
    factor=int32_values,
    offset=int32_values,
    seed=st.integers(0, 2**16),
)
def test_property_integer_arithmetic_gather_and_where_match(rows, cols, factor, offset, seed):
    nodes = [
        helper.make_node("Mul", ["ids", "factor"], ["scaled"]),
        helper.make_node("Add", ["scaled", "offset"], ["shifted"]),
        helper.make_node("Less", ["ids", "half"], ["low"]),
        helper.make_node("Where", ["low", "shifted", "ids"], ["picked"]),
        helper.make_node("Gather", ["table", "ids"], ["rows_out"], axis=0),
        helper.make_node("Cast", ["rows_out"], ["rows_int"], to=INT64),
        helper.make_node("Slice", ["picked", "start", "end", "axes"], ["sliced"]),
    ]
    model = make_model(
        nodes,
        [tensor_info("ids", INT64, [rows, cols])],
        [tensor_info("sliced", INT64, [rows, cols]), tensor_info("rows_int", INT64, [rows, cols, 4])],
        {
            "factor": np.array(factor % 1000, np.int64),
            "offset": np.array(offset, np.int64),
            "half": np.array(5, np.int64),
            "table": (np.arange(40, dtype=np.float32).reshape(10, 4) * 3.5),
            "start": np.array([0], np.int64),
            "end": np.array([INT64_MAX], np.int64),
            "axes": np.array([1], np.int64),
        },
    )
    converted = _convert(model)
    assert _int64_names(converted) == set()
    ids = np.random.default_rng(seed).integers(0, 10, (rows, cols))
    assert_pass_preserves(model, converted, {"ids": ids}, atol=0.0)
