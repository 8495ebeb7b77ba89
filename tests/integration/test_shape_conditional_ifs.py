"""Ifs that torch's TorchScript exporter writes for shape-conditional code, served through the ipu provider.

``x.squeeze(1)`` on a dimension the exporter cannot prove is 1 becomes ``If(Equal(Shape(x)[1], 1))``, one
branch squeezing, the other not. At the static sizes of a call the condition is fixed, and the If is folded
into the branch taken (``compiler/passes/fold_static_ifs.py``); two squeezes in a row make the second If
read the first one's shape, which is known only once the first is folded. An If chosen by the data of a
call whose branches differ in shape is refused naming the node, as the compiler's error, never as a
problem of the call's sizes.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from emulator_sessions import cpu_outputs, emulator_session

from optimum_ipu_backend.compiler import LegalizationError, legalize
from optimum_ipu_backend.compiler.errors import PATTERN_RUNTIME_BRANCH, SHAPE_INDEPENDENT_PATTERNS
from optimum_ipu_backend.compiler.passes.fold_static_ifs import FoldStaticIfs
from optimum_ipu_backend.session.failures import UnsupportedShapeError

HIDDEN = 32
SEQUENCE = 512
BATCH = 3


class SqueezedQueryAttention(torch.nn.Module):
    """Attention of a query, squeezed twice (``[batch, 1, m, hidden] -> [batch, m, hidden]`` when ``m`` is
    not 1, ``[batch, hidden]`` when it is), over a 512-token sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, 16)

    def forward(self, x: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        keys = self.proj(x)
        q = self.proj(query).squeeze(1).squeeze(1)
        scores = torch.softmax(q @ keys.transpose(-1, -2) / 4.0, dim=-1)
        return scores @ keys


def _pooled_when_positive(h: torch.Tensor) -> torch.Tensor:
    if bool(h.sum() > 0):
        return h.sum(1)
    return h


with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch.jit.script is deprecated; it is what writes a data-chosen If
    _pooled_when_positive = torch.jit.script(_pooled_when_positive)


class DataChosenPooling(torch.nn.Module):
    """Pools over the sequence or not depending on the sign of the projected values' sum."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _pooled_when_positive(self.proj(x))


def _export(module: torch.nn.Module, args: tuple, directory, names: list[str], axes: dict) -> None:
    torch.manual_seed(0)
    directory.mkdir()
    with warnings.catch_warnings():
        # the TorchScript exporter is deprecated, and it is the one that writes these Ifs
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(),
            args,
            str(directory / "model.onnx"),
            input_names=names,
            output_names=["out"],
            dynamic_axes=axes,
            dynamo=False,
            opset_version=14,
        )


@pytest.fixture(scope="module")
def squeezed_export(tmp_path_factory):
    directory = tmp_path_factory.mktemp("squeeze") / "export"
    torch.manual_seed(0)
    axes = {"x": {0: "batch_size", 1: "sequence_length"}, "query": {0: "batch_size", 1: "n", 2: "m"}}
    args = (torch.randn(2, 7, HIDDEN), torch.randn(2, 1, 1, HIDDEN))
    _export(SqueezedQueryAttention(), args, directory, ["x", "query"], axes)
    ifs = [node for node in onnx.load(directory / "model.onnx").graph.node if node.op_type == "If"]
    assert len(ifs) == 2, "the exporter no longer writes the conditional squeezes as If"
    return directory


def test_shape_conditional_ifs_fold_into_the_branch_taken_and_match_cpu(squeezed_export, tmp_path):
    session = emulator_session(squeezed_export, tmp_path / "cache")
    rng = np.random.default_rng(0)
    # m == 1 takes both squeezing branches (the output is [batch, batch, 16] by broadcasting), m == 4 the
    # second If's other branch
    for m in (1, 4):
        feed = {
            "x": rng.standard_normal((BATCH, SEQUENCE, HIDDEN), dtype=np.float32),
            "query": rng.standard_normal((BATCH, 1, m, HIDDEN), dtype=np.float32),
        }
        (served,) = session.run(None, feed)
        (expected,) = cpu_outputs(squeezed_export, feed)
        assert served.shape == expected.shape
        np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5)


def test_the_legalized_graph_holds_no_if_and_passes_the_onnx_checker(squeezed_export):
    model = onnx.load(squeezed_export / "model.onnx")
    legalized = legalize(model, {"x": (BATCH, SEQUENCE, HIDDEN), "query": (BATCH, 1, 1, HIDDEN)})
    assert not [node for node in legalized.model.graph.node if node.op_type == "If"]
    onnx.checker.check_model(legalized.model, full_check=True)
    report = next(report for report in legalized.reports if report.name == "fold_static_ifs")
    assert "inlined 2 If" in report.summary


def test_an_if_chosen_by_the_data_is_refused_naming_the_node(tmp_path):
    directory = tmp_path / "export"
    axes = {"x": {0: "batch_size", 1: "sequence_length"}}
    _export(DataChosenPooling(), (torch.randn(2, 7, HIDDEN),), directory, ["x"], axes)
    (if_node,) = [node for node in onnx.load(directory / "model.onnx").graph.node if node.op_type == "If"]
    session = emulator_session(directory, tmp_path / "cache")
    feed = {"x": np.random.default_rng(1).standard_normal((BATCH, SEQUENCE, HIDDEN), dtype=np.float32)}
    with pytest.raises(LegalizationError) as raised:
        session.run(None, feed)
    error = raised.value
    assert not isinstance(error, UnsupportedShapeError)  # the sizes are not the cause
    assert [(node.name, node.pattern) for node in error.nodes] == [(if_node.name, PATTERN_RUNTIME_BRANCH)]
    text = str(error)
    assert f"its condition {if_node.input[0]!r} is computed at run time from input(s) ['x']" in text
    assert "depends on the branch taken" in text and "torch.where" in text
    assert "input dimension" not in text  # no advice about sizes


def test_a_failure_not_caused_by_the_sizes_is_not_reported_as_the_calls_sizes(
    squeezed_export, tmp_path, monkeypatch
):
    """Without the folding, the Ifs' outputs stay dynamic and the checker finds their untyped branch
    outputs: faults of the graph at the static sizes of a call that chose them, not of those sizes."""
    monkeypatch.setattr(FoldStaticIfs, "run", lambda self, model, ctx: model)
    session = emulator_session(squeezed_export, tmp_path / "cache")
    # sizes no other test compiles: the process keeps the graphs it legalized, by graph and sizes
    feed = {
        "x": np.zeros((BATCH - 1, SEQUENCE, HIDDEN), np.float32),
        "query": np.zeros((BATCH - 1, 1, 1, HIDDEN), np.float32),
    }
    with pytest.raises(LegalizationError, match="has a dynamic shape") as raised:
        session.run(None, feed)
    assert not isinstance(raised.value, UnsupportedShapeError)
    assert {node.pattern for node in raised.value.nodes} <= SHAPE_INDEPENDENT_PATTERNS
    assert "input dimension" not in str(raised.value)  # no advice about sizes
