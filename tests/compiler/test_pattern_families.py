"""The graph patterns of issue 11 on tiny models of the families they came from, built from configs and
exported by optimum: each legalizes at static shapes, and the legalized graph on the emulator engine
computes what the export computes on onnxruntime CPU (atol 1e-5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from class_zoo import class_inputs, class_zoo
from family_zoo import falcon_feeds, family_export, family_root
from graph_testing import run_ort
from matrix_testing import assert_popart_ready, executable_feed

from optimum_ipu_backend.compiler import legalize
from optimum_ipu_backend.engines import load_engine
from optimum_ipu_backend.engines.base import CompileOptions

ATOL = 1e-5


@pytest.fixture(scope="module")
def families(zoo):
    return family_root(zoo.root.parent)


def _legalize_and_compare(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], label: str, directory: Path
) -> onnx.ModelProto:
    legalized = legalize(model, {name: value.shape for name, value in feeds.items()})
    assert_popart_ready(legalized.model, label)
    expected = run_ort(model, feeds)
    onnx.save(legalized.model, directory / "legalized.onnx")
    executable = load_engine("emulator").compile(directory / "legalized.onnx", CompileOptions())
    actual = executable.run(executable_feed(executable, feeds))
    assert set(actual) == set(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(actual[name], want, atol=ATOL, rtol=0, err_msg=f"{label}: {name}")
    return legalized.model


def test_clip_text_tower_pooled_at_the_argmax_of_input_ids(zoo, tmp_path):
    """CLIP pools its text tower at ArgMax(input_ids == eos): int64 indices feeding a Gather."""
    zoo = class_zoo(zoo)
    model = onnx.load(zoo.class_onnx("clip") / "model.onnx")
    assert "ArgMax" in {node.op_type for node in model.graph.node}
    feeds = class_inputs("clip", zoo.class_model("clip"), batch=2)
    legalized = _legalize_and_compare(model, feeds, "clip", tmp_path)
    (argmax,) = [node for node in legalized.graph.node if node.op_type == "ArgMax"]
    readers = [node for node in legalized.graph.node if argmax.output[0] in node.input]
    assert [node.op_type for node in readers] == ["Cast"]


def test_falcon_causal_mask_built_by_slice_assignment(families, tmp_path):
    """Falcon writes mask[:, :, :, :n] = mask[:, :, :, :n].masked_fill(...): a ScatterND of computed
    updates into the constant causal mask."""
    model = onnx.load(family_export("falcon", families) / "model.onnx")
    assert "ScatterND" in {node.op_type for node in model.graph.node}
    legalized = _legalize_and_compare(model, falcon_feeds(), "falcon", tmp_path)
    assert "ScatterND" not in {node.op_type for node in legalized.graph.node}
