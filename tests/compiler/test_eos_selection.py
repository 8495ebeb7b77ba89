"""The end-of-sentence selection of BART's and MBart's classification heads, served densely.

The rewrite (``compiler.graph_rewrites.eos_selection``) is checked against the exported graph itself on
CPU onnxruntime, for feeds that meet the condition the PyTorch head checks (every row holds the same
number, at least one, of end-of-sentence tokens); the served graph must legalize for PopART's opset 11;
any other selection stays refused, naming its node; and the padding proof follows the dense form along
a right-padded sequence (with its own unit tests of the two rules it needs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.graph_rewrites.eos_selection import SameTokenCount, select_last_eos
from optimum_ipu_backend.compiler.op_table import POPART_OPSET11_OPS
from optimum_ipu_backend.compiler.padding import PaddedInput, PaddingAnalyzer
from optimum_ipu_backend.compiler.pipeline import legalize
from optimum_ipu_backend.compiler.served_graph import served_graph

EOS = 2  # the zoo's BART and MBart tokenizers: <s>=0, <pad>=1, </s>=2
PAD = 1
MODELS = ("bart", "mbart")


@pytest.fixture(scope="session")
def classification_exports(zoo) -> dict[str, Path]:
    return {name: zoo.onnx(name, "text-classification") / "model.onnx" for name in MODELS}


@pytest.fixture(scope="module")
def exported(classification_exports: dict[str, Path]) -> dict[str, onnx.ModelProto]:
    return {name: onnx.load(path) for name, path in classification_exports.items()}


@pytest.fixture(scope="module")
def rewritten(exported: dict[str, onnx.ModelProto]):
    return {name: select_last_eos(model) for name, model in exported.items()}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feed(positions: list[list[int]], length: int, seed: int, real: list[int] | None = None) -> dict:
    """Token ids in 5..99 (no special token) with ``</s>`` at the given positions of each row; rows
    shorter than ``length`` (``real``) are right-padded with <pad> and a zero attention mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 100, size=(len(positions), length)).astype(np.int64)
    mask = np.ones_like(ids)
    for row, row_positions in enumerate(positions):
        ids[row, row_positions] = EOS
        if real is not None:
            ids[row, real[row] :] = PAD
            mask[row, real[row] :] = 0
    return {"input_ids": ids, "attention_mask": mask}


# Several rows each, with one or three </s> per row, at the end, in the middle, first, and before padding.
FEEDS = {
    "one_per_row": ([[11], [4], [0], [7]], 12, None),
    "three_per_row": ([[1, 5, 11], [0, 1, 2], [3, 9, 10], [2, 6, 8]], 12, None),
    "right_padded": ([[8, 9], [3, 5], [10, 11]], 12, [10, 6, 12]),
    "one_row": ([[5]], 6, None),
}


@pytest.mark.parametrize("name", MODELS)
def test_the_rewrite_equals_the_export_where_every_row_has_as_many_eos(rewritten, exported, name):
    rewrite = rewritten[name]
    assert rewrite is not None
    original, dense = _session(exported[name]), _session(rewrite.model)
    for seed, (positions, length, real) in enumerate(FEEDS.values()):
        feed = _feed(positions, length, seed, real)
        (expected,) = original.run(["logits"], feed)
        (found,) = dense.run(["logits"], feed)
        np.testing.assert_allclose(found, expected, rtol=0, atol=1e-6)
        if len(positions) > 1:  # the rows differ: the comparison is not between constant outputs
            assert np.ptp(expected[:, 0]) > 1e-4


@pytest.mark.parametrize("name", MODELS)
def test_the_served_graph_has_no_selection_and_records_the_condition(rewritten, exported, name):
    rewrite = rewritten[name]
    ops = {node.op_type for node in rewrite.model.graph.node}
    assert not ops & {"NonZero", "GatherND"}
    assert rewrite.nodes == ["/NonZero"]
    assert rewrite.preconditions == [
        SameTokenCount("input_ids", EOS, (("attention_mask", 0, 0), ("attention_mask", 1, 1)))
    ]
    assert SameTokenCount.from_json(rewrite.preconditions[0].to_json()) == rewrite.preconditions[0]
    served = served_graph(exported[name])
    assert not served.unsupported and served.token_counts == rewrite.preconditions
    assert any("end-of-sentence selection '/NonZero' computed densely" in note for note in served.notes)
    # The export itself is not modified.
    assert any(node.op_type == "NonZero" for node in exported[name].graph.node)


def test_the_served_graph_legalizes_for_popart(rewritten):
    legalized = legalize(rewritten["bart"].model, {"input_ids": (2, 16), "attention_mask": (2, 16)})
    ops = {node.op_type for node in legalized.model.graph.node}
    assert ops <= set(POPART_OPSET11_OPS), ops - set(POPART_OPSET11_OPS)
    assert "CumSum" in ops and "NonZero" not in ops


def _sequence_proof(model: onnx.ModelProto, fill: int):
    """Padding the sequence from 9 to 16 on the right with token ``fill`` (and mask 0)."""
    axis_map = np.where(np.arange(16) < 9, np.arange(16), -1)
    inputs = {
        "input_ids": PaddedInput((2, 16), (2, 9), (None, axis_map), fill),
        "attention_mask": PaddedInput((2, 16), (2, 9), (None, axis_map), 0),
    }
    return PaddingAnalyzer(model).prove(inputs)


def test_the_padding_proof_pads_bart_sequences_where_pad_is_not_eos(rewritten):
    model = rewritten["bart"].model
    proof = _sequence_proof(model, PAD)
    assert proof.exact, proof.problems
    # Were padding the end-of-sentence id itself, the last </s> of each row would move into the padding.
    proof = _sequence_proof(model, EOS)
    assert not proof.exact
    assert "dense_after" in proof.problems[0]


def _with_last_index(model: onnx.ModelProto, index: int) -> onnx.ModelProto:
    """The export with its final Gather taking selected state ``index`` of each row instead of the last."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    gather = next(
        node for node in changed.graph.node if node.op_type == "Gather" and node.name == "/Gather_1"
    )
    constant = helper.make_node(
        "Constant", [], ["first_state"], value=numpy_helper.from_array(np.array(index, np.int64))
    )
    gather.input[1] = "first_state"
    changed.graph.node.insert(0, constant)
    return changed


def test_a_selection_of_another_state_is_refused_naming_the_node(exported):
    model = _with_last_index(exported["bart"], 0)
    with pytest.raises(
        ValueError, match=r"NonZero node '/NonZero' selects the positions of token 2 in 'input_ids'"
    ):
        select_last_eos(model)
    served = served_graph(model)
    assert [entry[:2] for entry in served.unsupported] == [["/NonZero", "NonZero"]]
    assert "index -1" in served.unsupported[0][3]


def test_a_selection_not_over_input_tokens_is_left_to_the_refusal():
    """NonZero over a mask computed from a float input: not this pattern, refused as before."""
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Greater", ["x", "zero"], ["positive"], name="/head/Greater"),
                helper.make_node("NonZero", ["positive"], ["where"], name="/head/NonZero"),
                helper.make_node("Transpose", ["where"], ["pairs"], name="/head/Transpose", perm=[1, 0]),
            ],
            "selection",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", "sequence_length"])],
            [helper.make_tensor_value_info("pairs", TensorProto.INT64, [None, 2])],
            [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
        ),
        opset_imports=[helper.make_opsetid("", 13)],
    )
    assert select_last_eos(model) is None
    served = served_graph(model)
    assert [entry[:2] for entry in served.unsupported] == [["/head/NonZero", "NonZero"]]
    assert "nor the end-of-sentence selection" in served.unsupported[0][3]


def test_the_condition_survives_the_stored_description(classification_exports, tmp_path):
    from optimum_ipu_backend.runtime.graph_source import GraphSource

    first = GraphSource(classification_exports["bart"], tmp_path)
    second = GraphSource(classification_exports["bart"], tmp_path)  # a warm load: read back, not parsed
    assert second._model is None
    expected = [SameTokenCount("input_ids", EOS, (("attention_mask", 0, 0), ("attention_mask", 1, 1)))]
    assert first.description.token_count_checks() == second.description.token_count_checks() == expected


def test_the_runtime_checks_each_feed_against_the_condition():
    from optimum_ipu_backend.errors import InvalidFeedError
    from optimum_ipu_backend.runtime.feed_preconditions import TokenCountError, check_token_counts

    checks = [SameTokenCount("input_ids", EOS, (("attention_mask", 1, 1),))]
    ids = np.array([[5, 2, 2, 1], [2, 7, 2, 1], [6, 6, 2, 2]])
    check_token_counts(checks, {"input_ids": ids, "attention_mask": np.ones((3, 4))})  # 2, 2, 2: served
    uneven = ids.copy()
    uneven[1, 1] = EOS
    with pytest.raises(TokenCountError, match=r"'input_ids': its rows hold \[2, 3, 2\] tokens of id 2"):
        check_token_counts(checks, {"input_ids": uneven})
    with pytest.raises(TokenCountError, match="at least one"):
        check_token_counts(checks, {"input_ids": np.full((2, 4), 5)})
    with pytest.raises(InvalidFeedError, match="'attention_mask' has 3 elements along axis 1"):
        check_token_counts(checks, {"input_ids": ids, "attention_mask": np.ones((3, 3))})
