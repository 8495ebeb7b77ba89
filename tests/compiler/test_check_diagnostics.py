"""Diagnosing a graph that does not legalize: errors that name the node, the pattern, the file and the
exported node it came from; `check --explain NODE`; `check --repro DIR`."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from graph_testing import FLOAT, INT64, make_model, tensor_info
from onnx import helper, numpy_helper

from optimum_ipu_backend.cli.check import main
from optimum_ipu_backend.compiler import LegalizationError, legalize
from optimum_ipu_backend.compiler.errors import PATTERN_CUSTOM_DOMAIN, PATTERN_RUNTIME_OPERAND
from optimum_ipu_backend.compiler.pipeline import origin_of


def _computed_shape_model():
    """A Reshape whose shape is computed from an input: the shape stays a run-time value."""
    return make_model(
        [
            helper.make_node("Add", ["base", "offset"], ["shape"], name="/model/shape_add"),
            helper.make_node("Reshape", ["x", "shape"], ["y"], name="/model/layers.0/Reshape"),
        ],
        [tensor_info("x", FLOAT, ["batch_size", 6]), tensor_info("offset", INT64, [2])],
        # Declared symbolic: a static declaration would let folding take the shape from it.
        [tensor_info("y", FLOAT, ["rows", "cols"])],
        {"base": np.array([3, 4], np.int64)},
    )


def _custom_op_model():
    return make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="fine_relu"),
            helper.make_node("FusedGelu", ["r"], ["y"], name="vendor_gelu", domain="com.microsoft"),
        ],
        [tensor_info("x", FLOAT, ["batch_size", 4])],
        [tensor_info("y", FLOAT, ["batch_size", 4])],
        opset=11,
        extra_opsets={"com.microsoft": 1},
        check=False,
    )


def test_the_error_names_node_pattern_file_and_exported_origin(tmp_path):
    with pytest.raises(LegalizationError) as raised:
        legalize(_computed_shape_model(), {"x": [2, 6]}, source=str(tmp_path / "model.onnx"))
    error = raised.value
    message = str(error)
    assert f"model file: {tmp_path / 'model.onnx'}" in message
    # int64_to_int32 cast the computed shape back to int64 with a node of its own: the report leads back
    # to the exported Reshape that reads it.
    cast = next(node for node in error.nodes if node.op_type == "Cast")
    assert cast.origin == "/model/layers.0/Reshape" and cast.name != cast.origin
    assert "from exported node /model/layers.0/Reshape" in message
    reshape = next(node for node in error.nodes if node.op_type == "Reshape")
    assert reshape.pattern == PATTERN_RUNTIME_OPERAND and reshape.origin == "/model/layers.0/Reshape"
    assert f"pattern: {PATTERN_RUNTIME_OPERAND}" in message


def test_origin_is_the_longest_exported_prefix():
    exported = {"/text_model/ArgMax", "/transformer/ScatterND", "x"}
    assert origin_of("/text_model/ArgMax__3", exported) == "/text_model/ArgMax"
    assert origin_of("/transformer/ScatterND/flat_updates__2", exported) == "/transformer/ScatterND"
    assert origin_of("x", exported) == "x"
    assert origin_of("made_up/node", exported) == ""


def test_check_json_carries_pattern_and_origin(tmp_path, capsys):
    onnx.save(_custom_op_model(), tmp_path / "model.onnx")
    assert main([str(tmp_path), "--dim", "batch_size=2", "--json"]) == 1
    (result,) = json.loads(capsys.readouterr().out)["files"]
    gelu = next(entry for entry in result["unsupported"] if entry["name"] == "vendor_gelu")
    assert gelu["pattern"] == PATTERN_CUSTOM_DOMAIN and gelu["origin"] == "vendor_gelu"


def test_explain_prints_the_neighbourhood_at_the_fixed_sizes(tmp_path, capsys):
    onnx.save(_custom_op_model(), tmp_path / "model.onnx")
    assert main([str(tmp_path), "--dim", "batch_size=3", "--explain", "vendor_gelu"]) == 1
    out = capsys.readouterr().out
    assert "node vendor_gelu (FusedGelu) in model.onnx (shapes after fixing the input sizes" in out
    assert "0: r  FLOAT[3x4]  from Relu fine_relu" in out
    assert "0: y" in out and "graph output" in out
    problem = "vendor_gelu (com.microsoft::FusedGelu): operators of domain 'com.microsoft' have no opset-11"
    assert f"{problem} lowering [pattern: {PATTERN_CUSTOM_DOMAIN}]" in out  # its own problem, below it


def test_explain_finds_nodes_a_pass_made_and_suggests_names(tmp_path, capsys):
    onnx.save(_computed_shape_model(), tmp_path / "model.onnx")
    assert (
        main([str(tmp_path / "model.onnx"), "--dim", "batch_size=2", "--explain", "/model/layers.0/Reshape"])
        == 1
    )
    out = capsys.readouterr().out
    assert "1: shape  INT64[2]  from Add /model/shape_add" in out
    assert (
        main([str(tmp_path), "--dim", "batch_size=2", "--explain", "/model/layers.0/Reshape/cast_input_1"])
        == 1
    )
    assert "(as the verify pass received it)" in capsys.readouterr().out
    assert main([str(tmp_path), "--dim", "batch_size=2", "--explain", "/model/layers.0/Reshap"]) == 1
    assert (
        "no node named '/model/layers.0/Reshap'; close names: /model/layers.0/Reshape"
        in capsys.readouterr().out
    )


def test_repro_writes_the_structure_with_random_weights(tmp_path, zoo, capsys):
    export = zoo.onnx("bert", "text-classification")
    repro = tmp_path / "repro"
    argv = ["--dim", "sequence_length=16", "--json"]
    assert main([str(export), "--repro", str(repro), *argv]) == 0
    original_report = json.loads(capsys.readouterr().out)["files"][0]
    assert sorted(p.name for p in repro.iterdir()) == ["config.json", "model.onnx"]
    original, copy = onnx.load(export / "model.onnx"), onnx.load(repro / "model.onnx")
    assert [(n.op_type, n.name, list(n.input)) for n in copy.graph.node] == [
        (n.op_type, n.name, list(n.input)) for n in original.graph.node
    ]
    weights = {init.name: numpy_helper.to_array(init) for init in original.graph.initializer}
    changed = 0
    for init in copy.graph.initializer:
        value = numpy_helper.to_array(init)
        assert value.shape == weights[init.name].shape and value.dtype == weights[init.name].dtype
        if np.issubdtype(value.dtype, np.floating) and value.size > 1:
            assert not np.array_equal(value, weights[init.name]), init.name
            changed += 1
        else:
            np.testing.assert_array_equal(value, weights[init.name])  # shapes, indices, scalars kept
    assert changed > 10
    # The reproduction legalizes the same way (node counts may differ: the zoo's LayerNorm scales of 1 and
    # biases of 0 fold away, random ones do not).
    assert main([str(repro), *argv]) == 0
    repro_report = json.loads(capsys.readouterr().out)["files"][0]
    assert repro_report["ready"] and repro_report["input_shapes"] == original_report["input_shapes"]
    assert [p["name"] for p in repro_report["passes"]] == [p["name"] for p in original_report["passes"]]
