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

from optimum_ipu_backend.compiler import LegalizationError, find_unsupported_nodes, legalize
from optimum_ipu_backend.compiler.graphs import iter_graphs, iter_nodes
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


# -- Index producers whose int64 output ONNX fixes (issue 11, pattern 1) --------------------------------


def _pooled_at_argmax(op_type="ArgMax", batch=2, seq=7, hidden=4, route="gather", keepdims=0):
    """A text tower's pooling: the hidden state at the position ArgMax finds in input_ids, gathered from
    the states flattened to rows (what torch exports for ``hidden[arange(batch), ids.argmax(-1)]``).

    ``route`` says where the index flows: straight into the Gather, through an If branch that reads it
    from the enclosing graph, or also out of the graph as an output of its own.
    """
    found_shape = [batch, 1] if keepdims else [batch]
    nodes = [
        helper.make_node(
            op_type, ["input_ids"], ["position"], name="/text_model/ArgMax", axis=-1, keepdims=keepdims
        ),
        helper.make_node("Mul", ["row_numbers", "seq"], ["row_starts"]),
        helper.make_node("Add", ["row_starts", "position"], ["rows"]),
        helper.make_node("Reshape", ["hidden", "flat_shape"], ["flat_hidden"]),
    ]
    outputs = [tensor_info("pooled", FLOAT, [*found_shape, hidden])]
    if route == "subgraph":
        branch = helper.make_graph(
            [helper.make_node("Gather", ["flat_hidden", "rows"], ["branch_pooled"], axis=0)],
            "pool",
            [],
            [tensor_info("branch_pooled", FLOAT, [*found_shape, hidden])],
        )
        nodes.append(helper.make_node("If", ["flag"], ["pooled"], then_branch=branch, else_branch=branch))
    else:
        nodes.append(helper.make_node("Gather", ["flat_hidden", "rows"], ["pooled"], axis=0))
    if route == "output":
        outputs.append(tensor_info("position", INT64, found_shape))
    inputs = [
        tensor_info("input_ids", INT64, [batch, seq]),
        tensor_info("hidden", FLOAT, [batch, seq, hidden]),
    ]
    if route == "subgraph":
        inputs.append(tensor_info("flag", BOOL, []))
    row_numbers = np.arange(batch, dtype=np.int64).reshape(found_shape)
    initializers = {
        "row_numbers": row_numbers,
        "seq": np.array(seq, np.int64),
        "flat_shape": np.array([-1, hidden], np.int64),
    }
    return make_model(nodes, inputs, outputs, initializers)


def _pooling_feeds(batch, seq, hidden, seed):
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, 50, (batch, seq)),
        "hidden": rng.standard_normal((batch, seq, hidden)).astype(np.float32),
        "flag": np.array(bool(seed % 2)),
    }


def assert_narrowed_where_produced(model, op_type):
    """The one ``op_type`` node's output is read by exactly one node: a Cast to int32 in the same graph."""
    (producer,) = [n for n in model.graph.node if n.op_type == op_type]
    readers = [n for n in iter_nodes(model.graph) if producer.output[0] in n.input]
    assert [(n.op_type, n.attribute[0].i) for n in readers] == [("Cast", INT32)]
    return producer


def test_argmax_feeding_a_gather_is_narrowed_where_it_is_produced():
    model = _pooled_at_argmax()
    legalized = legalize(model, {})
    assert find_unsupported_nodes(legalized.model) == []
    argmax = assert_narrowed_where_produced(legalized.model, "ArgMax")
    assert argmax.name == "/text_model/ArgMax"  # the exported name survives for error reports
    assert_pass_preserves(model, legalized.model, _pooling_feeds(2, 7, 4, 0), atol=0.0)


def test_topk_indices_feeding_a_gather_are_narrowed_where_they_are_produced():
    """PopART's TopK sets up its indices as INT32 (like ArgMax/ArgMin): the Cast after it is free, the
    graph is legal, and the gathered values are unchanged (a mixture-of-experts router's pattern)."""
    model = make_model(
        [
            helper.make_node("TopK", ["x", "k"], ["values", "indices"], name="/mlp/TopK", axis=-1),
            helper.make_node("Gather", ["x", "indices"], ["picked"], axis=0),
        ],
        [tensor_info("x", FLOAT, [5])],
        [tensor_info("picked", FLOAT, [2])],
        {"k": np.array([2], np.int64)},
    )
    legalized = legalize(model, {})
    assert find_unsupported_nodes(legalized.model) == []
    (topk,) = [n for n in legalized.model.graph.node if n.op_type == "TopK"]
    readers = [n for n in iter_nodes(legalized.model.graph) if topk.output[1] in n.input]
    assert [(n.op_type, n.attribute[0].i) for n in readers] == [("Cast", INT32)]
    x = np.random.default_rng(0).standard_normal(5).astype(np.float32)
    assert_pass_preserves(model, legalized.model, {"x": x}, atol=0.0)


def test_an_int64_output_popart_does_not_compute_as_int32_is_refused_with_the_tensor_named():
    """MaxPool's indices have no INT32 form in PopART: verify names the int64 tensor."""
    model = make_model(
        [
            helper.make_node("MaxPool", ["x"], ["pooled", "where"], kernel_shape=[2]),
            helper.make_node("Cast", ["where"], ["where_float"], to=FLOAT),
        ],
        [tensor_info("x", FLOAT, [1, 1, 4])],
        [tensor_info("where_float", FLOAT, [1, 1, 3])],
        {},
    )
    with pytest.raises(LegalizationError, match="where__int64' is INT64"):
        legalize(model, {})


@settings(max_examples=12, deadline=None)
@given(
    op_type=st.sampled_from(["ArgMax", "ArgMin"]),
    batch=st.integers(1, 3),
    seq=st.integers(1, 6),
    hidden=st.integers(1, 3),
    route=st.sampled_from(["gather", "subgraph", "output"]),
    keepdims=st.integers(0, 1),
    seed=st.integers(0, 2**16),
)
def test_property_index_producers_are_narrowed_wherever_they_flow(
    op_type, batch, seq, hidden, route, keepdims, seed
):
    model = _pooled_at_argmax(op_type, batch, seq, hidden, route, keepdims)
    legalized = legalize(model, {})  # verify passed: no int64 value is left for the device
    assert_narrowed_where_produced(legalized.model, op_type)
    assert_pass_preserves(model, legalized.model, _pooling_feeds(batch, seq, hidden, seed), atol=0.0)


# -- Constants shared by an int64-only operand and a device reader (issue 11, pattern 2) -----------------


def _slice_assigned_mask(batch=2, new=3, total=5, assigned=4):
    """``mask[:, :, :, :n] = mask[:, :, :, :n].masked_fill(padding, min)`` as torch exports it: a ScatterND of
    the filled slice into the constant causal mask. The lowering writes it as ScatterElements on flattened
    data with a ``[-1]`` Reshape shape, and folding merges that with the ``[-1]`` a Gather reads elsewhere."""
    causal = np.triu(np.full((new, total), -1e9, np.float32), 1 + total - new)[None, None].repeat(batch, 0)
    grid = np.meshgrid(np.arange(batch), np.arange(1), np.arange(new), np.arange(assigned), indexing="ij")
    nodes = [
        helper.make_node("Unsqueeze", ["attention_mask", "axes12"], ["mask4"]),
        helper.make_node("Slice", ["mask4", "zero", "assigned", "three"], ["mask_n"]),
        helper.make_node("Cast", ["mask_n"], ["mask_f"], to=FLOAT),
        helper.make_node("Slice", ["causal", "zero", "assigned", "three"], ["causal_n"]),
        helper.make_node("Add", ["causal_n", "mask_f"], ["summed"]),
        helper.make_node("Equal", ["summed", "float_zero"], ["padded"]),
        helper.make_node("Where", ["padded", "minimum", "causal_n"], ["filled"]),
        helper.make_node(
            "ScatterND", ["causal", "indices", "filled"], ["mask_out"], name="/transformer/ScatterND"
        ),
        helper.make_node("Gather", ["attention_mask", "last"], ["last_token"], axis=1),
    ]
    return make_model(
        nodes,
        [tensor_info("attention_mask", INT64, [batch, total])],
        [
            tensor_info("mask_out", FLOAT, [batch, 1, new, total]),
            tensor_info("last_token", INT64, [batch, 1]),
        ],
        {
            "causal": causal,
            "indices": np.stack(grid, -1).astype(np.int64),
            "axes12": np.array([1, 2], np.int64),
            "zero": np.array([0], np.int64),
            "assigned": np.array([assigned], np.int64),
            "three": np.array([3], np.int64),
            "float_zero": np.array(0, np.float32),
            "minimum": np.array(-1e9, np.float32),
            "last": np.array([-1], np.int64),
        },
    )


def test_slice_assigned_causal_mask_folds_to_constant_shapes():
    model = _slice_assigned_mask()
    legalized = legalize(model, {})
    reshapes = [n for n in legalized.model.graph.node if n.op_type == "Reshape"]
    initializers = {i.name: i for i in legalized.model.graph.initializer}
    assert reshapes and all(initializers[n.input[1]].data_type == INT64 for n in reshapes)
    assert "Cast" not in {n.op_type for n in legalized.model.graph.node if n.output[0].endswith("int64")}
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    assert_pass_preserves(model, legalized.model, {"attention_mask": mask}, atol=0.0)


@settings(max_examples=15, deadline=None)
@given(
    values=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    int64_only=st.sampled_from(["Tile", "Reshape", "Expand"]),
    reader=st.sampled_from(["Add", "Gather"]),
    seed=st.integers(0, 2**16),
)
def test_property_a_constant_shared_with_an_int64_only_operand_stays_constant(
    values, int64_only, reader, seed
):
    """Whatever reads a constant besides an int64-only operand, that operand keeps a constant int64 value."""
    rank = len(values)
    shared = np.array(values, np.int64)
    if int64_only == "Tile":
        first = helper.make_node("Tile", ["x", "shared"], ["shaped"])
        x_shape, shaped = [2] * rank, [2 * v for v in values]
    elif int64_only == "Reshape":
        first = helper.make_node("Reshape", ["x", "shared"], ["shaped"])
        x_shape, shaped = [int(np.prod(values))], values
    else:
        first = helper.make_node("Expand", ["x", "shared"], ["shaped"])
        x_shape, shaped = [1] * rank, values
    second = helper.make_node(reader, ["ids", "shared"], ["read"])
    ids_shape = [rank] if reader == "Add" else [4]
    model = make_model(
        [first, second],
        [tensor_info("x", FLOAT, x_shape), tensor_info("ids", INT64, ids_shape)],
        [tensor_info("shaped", FLOAT, shaped), tensor_info("read", INT64, [rank])],
        {"shared": shared},
        opset=13,
    )
    legalized = legalize(model, {})  # verify passed: no shape operand left to compute at run time
    assert "Cast" not in {n.op_type for n in legalized.model.graph.node}
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32), "ids": rng.integers(0, 4, ids_shape)}
    assert_pass_preserves(model, legalized.model, feeds, atol=0.0)
