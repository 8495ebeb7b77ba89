"""The sharding pass: optimum-graphcore's layers_per_ipu rules, layers found from exporter names, a
placement PopART accepts (every node on one IPU, stages never decreasing along an edge), and
`optimum-ipu check --ipus N` reporting each IPU's memory."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from large_model_helper import LAYERS, external_bert, placement, sample_feed

from optimum_ipu_backend.cli.check import main as check_main
from optimum_ipu_backend.compiler.errors import LegalizationError
from optimum_ipu_backend.compiler.external_data import load_graph
from optimum_ipu_backend.compiler.passes.shard_over_ipus import (
    PIPELINE_STAGE_ATTRIBUTE,
    VIRTUAL_GRAPH_ATTRIBUTE,
    Sharding,
    assign_ipus,
    layer_ipus,
    layer_of,
    placement_problems,
)
from optimum_ipu_backend.compiler.pipeline import legalize

SHAPES = {"input_ids": (1, 16), "attention_mask": (1, 16), "token_type_ids": (1, 16)}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return external_bert(tmp_path_factory)


@pytest.mark.parametrize(
    "layers_per_ipu, ipus, layers, expected",
    [
        ([-1], 4, 10, [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]),  # even split, remainder on the last IPU
        ([-1, -1], 2, 5, [0, 0, 1, 1, 1]),
        ([0, 4, 4, 4], 4, 12, [1] * 4 + [2] * 4 + [3] * 4),  # IPU 0 keeps only the embeddings
        ([1, -1, -1], 3, 6, [0, 1, 1, 2, 2, 2]),  # the rest shared over the -1 slots, remainder last
    ],
)
def test_layers_per_ipu_follows_optimum_graphcore(layers_per_ipu, ipus, layers, expected):
    assert layer_ipus(layers_per_ipu, ipus, layers) == expected


@pytest.mark.parametrize(
    "layers_per_ipu, ipus, layers, message",
    [
        ([2, 2], 3, 4, "2 entries for ipus_per_replica=3"),
        ([2, 1], 2, 4, "places 3 layers and the model has 4"),
        ([5, -1], 2, 4, "places 5 layers and the model has 4"),
    ],
)
def test_a_layers_per_ipu_that_does_not_fit_is_an_error(layers_per_ipu, ipus, layers, message):
    with pytest.raises(LegalizationError, match=message) as info:
        layer_ipus(layers_per_ipu, ipus, layers)
    assert "layers_per_ipu" in str(info.value)


def test_layers_come_from_exporter_names():
    assert layer_of("/bert/encoder/layer.3/attention/self/query/MatMul") == 3
    assert layer_of("/transformer/h.11/attn/c_attn/Gemm") == 11
    assert layer_of("/model/decoder/layers.2/self_attn/k_proj/MatMul") == 2
    assert (
        layer_of("/encoder/block.1/layer.0/SelfAttention/q/MatMul") == 1
    )  # T5: the block, not its sub-layer
    assert layer_of("/bert/embeddings/word_embeddings/Gather") is None
    assert layer_of("/classifier/MatMul__2") is None


def _legalized(export, sharding):
    model = load_graph(export / "model.onnx")
    return legalize(model, SHAPES, weights_dir=export, sharding=sharding)


def _cpu(model_path, feed):
    return ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run(None, feed)[0]


@pytest.mark.parametrize("layers_per_ipu", [(1, 1), (-1,), None])
def test_every_node_has_one_ipu_and_stages_never_decrease(export, tmp_path, layers_per_ipu):
    legalized = _legalized(export, Sharding(2, layers_per_ipu))
    model = legalized.model
    assert placement_problems(model, 2) == []
    places = placement(model)
    assert len(places) == len(model.graph.node)
    assert {ipu for ipu, _ in places.values()} == {0, 1} and {stage for _, stage in places.values()} == {0, 1}
    for node in model.graph.node:
        names = [attribute.name for attribute in node.attribute]
        assert names.count(VIRTUAL_GRAPH_ATTRIBUTE) == 1 and names.count(PIPELINE_STAGE_ATTRIBUTE) == 1
        if layers_per_ipu is not None and layer_of(node.name) is not None:
            assert places[node.name][0] == layer_of(node.name)  # one layer per IPU, in order
    # the annotated graph runs unchanged on the CPU and computes the same as the export
    from optimum_ipu_backend.compiler.external_data import save_graph

    saved = save_graph(model, tmp_path / "sharded.onnx", legalized.weights_dir, legalized.weight_names)
    onnx.checker.check_model(str(saved))
    feed = sample_feed(1, 16)
    device_feed = {name: array.astype(np.int32) for name, array in feed.items()}
    np.testing.assert_allclose(_cpu(saved, device_feed), _cpu(export / "model.onnx", feed), atol=1e-5)


def test_layers_per_ipu_must_add_up_to_the_model(export):
    with pytest.raises(LegalizationError, match=f"places 3 layers and the model has {LAYERS}"):
        _legalized(export, Sharding(2, (2, 1)))


def test_check_reports_memory_per_ipu(export, capsys):
    status = check_main([str(export), "--dim", "sequence_length=16", "--ipus", "2", "--json"])
    document = json.loads(capsys.readouterr().out)
    assert status == 0 and document["ready"] is True
    (result,) = document["files"]
    per_ipu = result["memory_per_ipu"]
    assert len(per_ipu) == 2 and all(item["weights_bytes"] > 0 for item in per_ipu)
    whole = result["memory"]["weights_bytes"]
    # every weight is on some IPU; balanced by memory, neither IPU holds nearly all of them
    assert sum(item["weights_bytes"] for item in per_ipu) >= whole
    assert max(item["weights_bytes"] for item in per_ipu) < 0.8 * whole
    assert (
        check_main([str(export), "--dim", "sequence_length=16", "--ipus", "2", "--layers-per-ipu", "1,1"])
        == 0
    )
    text = capsys.readouterr().out
    assert "IPU 0: weights" in text and "IPU 1: weights" in text and "fits" in text


def test_check_names_the_ipu_that_overflows(export, capsys, monkeypatch):
    from optimum_ipu_backend.compiler import memory

    defaults = memory.estimate_memory_per_ipu.__defaults__
    monkeypatch.setattr(memory.estimate_memory_per_ipu, "__defaults__", (400_000, *defaults[1:]))
    assert (
        check_main([str(export), "--dim", "sequence_length=16", "--ipus", "2", "--layers-per-ipu", "2,0"])
        == 0
    )
    text = capsys.readouterr().out
    assert "IPU 0: weights" in text and "OVERFLOWS" in text
    assert "IPU(s) 0 overflow: move layers off them with layers_per_ipu" in text


def test_an_omitted_optional_name_ties_no_node_to_another_ipu():
    """A node's omitted output ("") and a later node's omitted input ("") are no tensor: the layer-0 Clip
    stays on IPU 0 after a layer-1 Dropout whose mask output is omitted."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="/encoder/layer.0/Relu"),
        helper.make_node("Dropout", ["x"], ["b", ""], name="/encoder/layer.1/Dropout"),
        helper.make_node("Clip", ["a", "", "high"], ["c"], name="/encoder/layer.0/Clip"),
    ]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "g",
        [value("x", TensorProto.FLOAT, [2])],
        [value("b", TensorProto.FLOAT, [2]), value("c", TensorProto.FLOAT, [2])],
        [helper.make_tensor("high", TensorProto.FLOAT, [], [1.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    assert assign_ipus(model, Sharding(2, (1, 1)), {"x"}) == [0, 1, 0]


def test_check_refuses_an_ipu_count_the_sdk_cannot_acquire(export, capsys):
    # The Poplar SDK acquires IPUs in groups of a power of two: --ipus 3 is refused, naming 2 and 4.
    status = check_main([str(export), "--dim", "sequence_length=16", "--ipus", "3"])
    error = capsys.readouterr().err
    assert status != 0
    assert "--ipus must be a power of two" in error and "use 2 or 4" in error
