"""The index-range analysis: which inputs index a table on the device, through which operators, and
which values they may hold; checked on small graphs against onnxruntime's own bounds check, and on
exported zoo models."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.analysis.index_ranges import IndexRanges, analyze_index_ranges
from optimum_ipu_backend.runtime import graph_source
from optimum_ipu_backend.runtime.graph_source import GraphSource

TABLE_ROWS = 10


def _model(nodes, inputs, outputs, initializers=(), opset=13) -> onnx.ModelProto:
    table = numpy_helper.from_array(
        np.arange(TABLE_ROWS * 2, dtype=np.float32).reshape(TABLE_ROWS, 2), "table"
    )
    graph = helper.make_graph(nodes, "g", inputs, outputs, [table, *initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _ids(name="ids", elem=TensorProto.INT64, shape=("batch", "seq")):
    return helper.make_tensor_value_info(name, elem, list(shape))


def _out(name="out"):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def _const(name, value, dtype=np.int64):
    return numpy_helper.from_array(np.array(value, dtype=dtype), name)


def _bound(model):
    (bound,) = analyze_index_ranges(model).bounds
    return bound


def _cpu_accepts(model, feed) -> bool:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    try:
        session.run(None, feed)
    except Exception:
        return False
    return True


def test_a_direct_gather_bounds_its_input_by_the_table():
    model = _model([helper.make_node("Gather", ["table", "ids"], ["out"], name="g")], [_ids()], [_out()])
    bound = _bound(model)
    assert (bound.input, bound.low, bound.high, bound.size, bound.table, bound.path) == (
        "ids",
        -TABLE_ROWS,
        TABLE_ROWS - 1,
        TABLE_ROWS,
        "table",
        "",
    )
    # onnxruntime agrees at both ends: it counts negative indices from the end, as the compiled graph does
    assert _cpu_accepts(model, {"ids": np.array([[-TABLE_ROWS, TABLE_ROWS - 1]], np.int64)})
    assert not _cpu_accepts(model, {"ids": np.array([[TABLE_ROWS]], np.int64)})
    assert not _cpu_accepts(model, {"ids": np.array([[-TABLE_ROWS - 1]], np.int64)})


def test_index_preserving_operators_and_a_constant_offset_are_followed():
    # RoBERTa-style: positions numbered from pad + 1, i.e. position_ids + 2 index the table
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
        helper.make_node("Unsqueeze", ["ids32", "axes"], ["ids3d"]),
        helper.make_node("Reshape", ["ids3d", "shape"], ["flat"]),
        helper.make_node("Cast", ["flat"], ["flat64"], to=TensorProto.INT64),
        helper.make_node("Add", ["flat64", "two"], ["shifted"]),
        helper.make_node("Gather", ["table", "shifted"], ["out"], name="positions"),
    ]
    model = _model(
        nodes,
        [_ids()],
        [_out()],
        [_const("axes", [0]), _const("shape", [-1]), _const("two", 2)],
    )
    bound = _bound(model)
    assert (bound.low, bound.high) == (-TABLE_ROWS - 2, TABLE_ROWS - 3)
    assert bound.path == "Cast(int32) -> Unsqueeze -> Reshape -> Cast(int64) -> Add(+2)"
    assert _cpu_accepts(model, {"ids": np.array([[-TABLE_ROWS - 2, TABLE_ROWS - 3]], np.int64)})
    assert not _cpu_accepts(model, {"ids": np.array([[TABLE_ROWS - 2]], np.int64)})


@pytest.mark.parametrize(
    "op, constant, first, expected",
    [
        ("Sub", 3, True, (3 - TABLE_ROWS, TABLE_ROWS + 2)),  # ids - 3
        ("Sub", 9, False, (10 - TABLE_ROWS, 9 + TABLE_ROWS)),  # 9 - ids
        ("Mul", 2, True, (-TABLE_ROWS // 2, (TABLE_ROWS - 1) // 2)),  # 2 * ids
        ("Mul", -1, True, (-(TABLE_ROWS - 1), TABLE_ROWS)),
    ],
)
def test_affine_relations_are_solved_for_the_input(op, constant, first, expected):
    operands = ["ids", "c"] if first else ["c", "ids"]
    nodes = [
        helper.make_node(op, operands, ["index"]),
        helper.make_node("Gather", ["table", "index"], ["out"]),
    ]
    bound = _bound(_model(nodes, [_ids()], [_out()], [_const("c", [constant, constant])]))
    assert (bound.low, bound.high) == expected


def test_a_narrowing_cast_cuts_the_range_to_the_target_type():
    big = numpy_helper.from_array(np.zeros((1000, 2), np.float32), "big")
    nodes = [
        helper.make_node("Cast", ["ids"], ["small"], to=TensorProto.INT8),
        helper.make_node("Gather", ["big", "small"], ["out"]),
    ]
    bound = _bound(_model(nodes, [_ids()], [_out()], [big]))
    assert (bound.low, bound.high, bound.size) == (-128, 127, 1000)  # 128 would wrap to -128


def test_other_index_operators_use_the_indexed_axis():
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, [4, 6])
    depth = _const("depth", 5)
    values = _const("values", [0.0, 1.0], np.float32)
    nodes = [
        helper.make_node("GatherElements", ["data", "ids"], ["a"], name="elements", axis=1),
        helper.make_node("OneHot", ["ids", "depth", "values"], ["b"], name="onehot"),
    ]
    model = _model(nodes, [_ids(shape=(4, 6)), data], [_out("a"), _out("b")], [depth, values])
    bounds = {b.node: (b.low, b.high, b.size) for b in analyze_index_ranges(model).bounds}
    # OneHot's indices are not counted from the end by the compiled graph
    assert bounds == {"elements": (-6, 5, 6), "onehot": (0, 4, 5)}


def _gather_nd(before=()):
    data = numpy_helper.from_array(np.zeros((3, 7, 2), np.float32), "data")
    nodes = [*before, helper.make_node("GatherND", ["data", "index"], ["out"], name="nd")]
    return _model(nodes, [_ids(shape=("n", 2))], [_out()], [data, _const("shape", [-1, 2])])


def test_each_column_of_a_gather_nd_index_is_bounded_by_the_axis_it_addresses():
    model = _gather_nd([helper.make_node("Identity", ["ids"], ["index"])])
    bounds = {b.column: (b.low, b.high, b.size) for b in analyze_index_ranges(model).bounds}
    assert bounds == {0: (-3, 2, 3), 1: (-7, 6, 7)}
    assert _cpu_accepts(model, {"ids": np.array([[2, 6], [-3, -7]], np.int64)})
    assert not _cpu_accepts(model, {"ids": np.array([[0, 7]], np.int64)})
    assert not _cpu_accepts(model, {"ids": np.array([[3, 0]], np.int64)})


def test_a_gather_nd_index_whose_columns_were_moved_is_bounded_by_its_smallest_axis():
    model = _gather_nd([helper.make_node("Reshape", ["ids", "shape"], ["index"])])
    bound = _bound(model)
    assert (bound.column, bound.low, bound.high, bound.size) == (None, -3, 2, 3)


def test_unmodelled_paths_are_reported_not_guessed():
    # RoBERTa's positions: a CumSum over (ids != pad) reaches the position table
    nodes = [
        helper.make_node("Equal", ["ids", "pad"], ["is_pad"]),
        helper.make_node("Not", ["is_pad"], ["real"]),
        helper.make_node("Cast", ["real"], ["real64"], to=TensorProto.INT64),
        helper.make_node("CumSum", ["real64", "axis"], ["positions"]),
        helper.make_node("Gather", ["table", "positions"], ["pos"], name="position_embeddings"),
        helper.make_node("Gather", ["table", "ids"], ["out"], name="word_embeddings"),
        helper.make_node("Shape", ["ids"], ["shape"]),  # shape uses are not value uses
    ]
    ranges = analyze_index_ranges(
        _model(nodes, [_ids()], [_out(), _out("pos"), _out("shape")], [_const("pad", 1), _const("axis", 1)])
    )
    assert [b.node for b in ranges.bounds] == ["word_embeddings"]
    (unchecked,) = ranges.unchecked
    assert (unchecked.input, unchecked.node) == ("ids", "position_embeddings")
    assert "Equal" in unchecked.reason


def test_a_table_without_a_static_size_is_reported():
    data = helper.make_tensor_value_info("data", TensorProto.FLOAT, ["rows", 2])
    nodes = [helper.make_node("Gather", ["data", "ids"], ["out"], name="dynamic")]
    ranges = analyze_index_ranges(_model(nodes, [_ids(), data], [_out()]))
    assert not ranges.bounds and [u.node for u in ranges.unchecked] == ["dynamic"]


def test_gathers_inside_a_branch_are_found():
    branch = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["inner"], name="in_branch")],
        "branch",
        [],
        [helper.make_tensor_value_info("inner", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["table"], ["other_out"])],
        "other",
        [],
        [helper.make_tensor_value_info("other_out", TensorProto.FLOAT, None)],
    )
    cond = helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])
    nodes = [helper.make_node("If", ["use_cache_branch"], ["out"], then_branch=branch, else_branch=other)]
    bound = _bound(_model(nodes, [_ids(), cond], [_out()]))
    assert (bound.input, bound.node, bound.high) == ("ids", "in_branch", TABLE_ROWS - 1)


def test_a_table_sized_by_inference_is_checked_whatever_the_weights_weigh(monkeypatch):
    # Shape inference runs on a weight-free copy: above protobuf's 2 GiB a model serialized with its
    # weights cannot be inferred at all. Too large to build here, that limit is stood in for by an
    # inference that refuses any model carrying a weight-sized (64 KiB) initializer.
    rows = 256
    weight = numpy_helper.from_array(np.zeros((rows, 64), np.float32), "weight")
    infer_shapes = onnx.shape_inference.infer_shapes

    def refusing_weights(model, *args, **kwargs):
        if any(init.ByteSize() >= 64 * 1024 for init in model.graph.initializer):
            raise ValueError("Message onnx.ModelProto exceeds maximum protobuf size of 2GB")
        return infer_shapes(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", refusing_weights)
    nodes = [
        helper.make_node("Identity", ["weight"], ["viewed"]),
        helper.make_node("Gather", ["viewed", "ids"], ["out"], name="g"),
    ]
    ranges = analyze_index_ranges(_model(nodes, [_ids()], [_out()], [weight]))
    assert ranges.unchecked == ()
    (bound,) = ranges.bounds
    assert (bound.table, bound.size, bound.low, bound.high) == ("viewed", rows, -rows, rows - 1)


def test_float_and_non_index_inputs_are_left_alone():
    mask = _ids("mask")
    nodes = [
        helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Gather", ["table", "ids"], ["gathered"]),
        helper.make_node("Mul", ["gathered", "maskf"], ["out"]),
    ]
    ranges = analyze_index_ranges(_model(nodes, [_ids(), mask], [_out()]))
    assert [b.input for b in ranges.bounds] == ["ids"] and not ranges.unchecked


def test_the_result_round_trips_through_json():
    model = _model([helper.make_node("Gather", ["table", "ids"], ["out"], name="g")], [_ids()], [_out()])
    ranges = analyze_index_ranges(model)
    assert IndexRanges.from_json(ranges.to_json()) == ranges


# -- exported models ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, task, bounded, unchecked",
    [
        ("bert", "text-classification", {"input_ids": 179, "token_type_ids": 1}, set()),
        ("gpt2", "text-generation-with-past", {"input_ids": 299, "position_ids": 127}, set()),
        # RoBERTa numbers positions with a CumSum over the ids: reported, not bounded
        ("roberta", "text-classification", {"input_ids": 299}, {"input_ids"}),
        ("vit", "image-classification", {}, set()),
    ],
)
def test_exported_models(zoo, model, task, bounded, unchecked):
    ranges = analyze_index_ranges(onnx.load(zoo.onnx(model, task) / "model.onnx"))
    assert {b.input: b.high for b in ranges.bounds} == bounded
    assert all(b.low == -b.size for b in ranges.bounds)  # every table is read by a Gather
    assert {u.input for u in ranges.unchecked} == unchecked


def test_the_ranges_are_part_of_the_cached_description(zoo, tmp_path, monkeypatch):
    source_dir = zoo.onnx("bert", "text-classification")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.onnx").write_bytes((source_dir / "model.onnx").read_bytes())
    cold = GraphSource(model_dir / "model.onnx", tmp_path / "cache").description
    assert {b["input"] for b in cold.index_ranges["bounds"]} == {"input_ids", "token_type_ids"}

    def refuse(*args, **kwargs):
        raise AssertionError("the graph was parsed on a warm start")

    monkeypatch.setattr(graph_source.onnx, "load", refuse)
    assert GraphSource(model_dir / "model.onnx", tmp_path / "cache").description == cold
