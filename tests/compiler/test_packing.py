"""Packing of encoders (compiler.graph_rewrites.packing) and its proof (compiler.analysis.segments).

Each packed graph runs on onnxruntime CPU and every real output element is compared with the ORIGINAL
export run on that sequence alone (batch 1, no padding). Refusals name the node that stops packing, and a
deliberately broken rewrite is caught by the proof.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from full_matrix import Matrix
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.graph_rewrites import packing
from optimum_ipu_backend.compiler.graph_rewrites.packing import (
    POSITION_IDS,
    SEGMENT_IDS,
    SEGMENT_STARTS,
    PackedEncoder,
    PackingRefused,
    pack_encoder,
)

ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "electra", "minilm")
HEADS = ("text-classification", "token-classification", "question-answering", "feature-extraction")
# The real all-MiniLM-L6-v2 with a head costs a 90 MB export per head: CI packs its feature extraction
# (the tiny BERT covers the same graph with every head), the release check every head.
MATRIX = Matrix(
    "packing",
    product=[(name, task) for name in ENCODERS for task in HEADS],
    share=lambda case: case[0] != "minilm" or case[1] == "feature-extraction",
    covers={"encoder": lambda case: case[0], "head": lambda case: case[1]},
    why="the real all-MiniLM-L6-v2 costs a 90 MB export per head",
)
CASES = list(MATRIX.cases)
TOLERANCE = 1e-5
ROW_TOKENS = 24


class _Case:
    """One export, packed once, with sessions for the packed graph and the original."""

    def __init__(self, onnx_dir: Path) -> None:
        self.original = onnx.load(onnx_dir / "model.onnx")
        config = json.loads((onnx_dir / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self.pad = int(config.get("pad_token_id") or 0)
        self.packed = pack_encoder(self.original)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.unpacked_session = ort.InferenceSession(
            self.original.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        if isinstance(self.packed, PackedEncoder):
            self.packed_session = ort.InferenceSession(
                self.packed.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )


@pytest.fixture(scope="module")
def cases(zoo):
    built: dict[tuple[str, str], _Case] = {}

    def get(name: str, task: str) -> _Case:
        if (name, task) not in built:
            built[(name, task)] = _Case(zoo.onnx(name, task))
        return built[(name, task)]

    return get


def _rows(draw, tokens: int, max_rows: int = 3, max_length: int | None = None) -> list[list[int]]:
    """Sequence lengths per row: several per row, some rows filled exactly, some with empty slots, and
    empty rows."""
    max_length = min(max_length or tokens, tokens)
    rows = []
    for _ in range(draw(st.integers(1, max_rows))):
        lengths: list[int] = []
        for length in draw(st.lists(st.integers(1, max_length), max_size=5)):
            if sum(lengths) + length <= tokens:
                lengths.append(length)
        if lengths and draw(st.booleans()) and tokens - sum(lengths) <= max_length and sum(lengths) < tokens:
            lengths.append(tokens - sum(lengths))  # fill the row exactly
        rows.append(lengths)
    return rows


def _check(case: _Case, rows: list[list[int]], tokens: int, seed: int) -> float:
    """Run the packed graph on ``rows`` and each sequence alone; return the largest difference."""
    packed = case.packed
    assert isinstance(packed, PackedEncoder), str(packed)
    rng = np.random.default_rng(seed)
    count, segments = len(rows), max(1, max(len(r) for r in rows))
    seg = np.zeros((count, tokens), np.int64)
    pos = np.zeros((count, tokens), np.int64)
    starts = np.zeros((count, segments), np.int64)
    ids = np.full((count, tokens), case.pad, np.int64)
    types = np.zeros((count, tokens), np.int64)
    for r, lengths in enumerate(rows):
        at = 0
        for j, length in enumerate(lengths):
            seg[r, at : at + length] = j + 1
            pos[r, at : at + length] = np.arange(length)
            starts[r, j] = at
            ids[r, at : at + length] = rng.integers(5, case.vocab, size=length)
            # Pad tokens inside a real sequence: RoBERTa's positions skip them (the segmented CumSum).
            inside = rng.random(length) < 0.2
            inside[0] = False
            ids[r, at : at + length][inside] = case.pad
            types[r, at + length // 2 : at + length] = 1
            at += length
    by_name = {SEGMENT_IDS: seg, POSITION_IDS: pos, SEGMENT_STARTS: starts, "token_type_ids": types}
    feeds = {i.name: by_name.get(i.name, ids) for i in case.packed_session.get_inputs()}
    names = [o.name for o in case.packed_session.get_outputs()]
    outputs = dict(zip(names, case.packed_session.run(names, feeds), strict=True))
    worst = 0.0
    for r, lengths in enumerate(rows):
        for j in range(len(lengths)):
            where = np.flatnonzero(seg[r] == j + 1)
            alone = {
                "input_ids": ids[r : r + 1, where],
                "token_type_ids": types[r : r + 1, where],
                packed.mask_input: np.ones((1, len(where)), np.int64),
            }
            inputs = {i.name: alone[i.name] for i in case.unpacked_session.get_inputs()}
            unames = [o.name for o in case.unpacked_session.get_outputs()]
            expected = dict(zip(unames, case.unpacked_session.run(unames, inputs), strict=True))
            for name, axis in packed.token_outputs.items():
                got = np.take(outputs[name][r], where, axis=axis - 1)
                worst = max(worst, float(np.abs(got - expected[name][0]).max()))
            for name, axis in packed.pooled_outputs.items():
                got = np.take(outputs[name][r], j, axis=axis - 1)
                worst = max(worst, float(np.abs(got - expected[name][0]).max()))
    return worst


@pytest.mark.parametrize(("name", "task"), CASES)
def test_packed_segments_equal_unpacked_sequences(cases, name: str, task: str) -> None:
    case = cases(name, task)
    assert isinstance(case.packed, PackedEncoder), str(case.packed)
    assert case.packed.mask_input == "attention_mask"
    assert all(i.name != "attention_mask" for i in case.packed.model.graph.input)
    # The proof found the outputs' axes by execution: per-token outputs for every head but sequence
    # classification, which is pooled at the segment starts.
    if task == "text-classification":
        assert case.packed.pooled_outputs == {"logits": 1} and not case.packed.token_outputs
    else:
        assert case.packed.token_outputs and not case.packed.pooled_outputs

    @settings(max_examples=3, deadline=None, derandomize=True, database=None)
    @given(st.data())
    def property_holds(data) -> None:
        rows = _rows(data.draw, ROW_TOKENS)
        if not any(rows):
            rows[0] = [1]
        assert _check(case, rows, ROW_TOKENS, seed=len(rows)) <= TOLERANCE

    property_holds()


def test_bert_packs_many_sequences_in_long_rows(cases) -> None:
    """A realistic row: 512 tokens holding a dozen sequences of up to 100 tokens (the tiny BERT's
    positions stop at 128)."""
    case = cases("bert", "text-classification")
    rng = np.random.default_rng(3)
    rows = []
    for _ in range(2):
        lengths: list[int] = []
        while sum(lengths) < 480:
            lengths.append(int(rng.integers(1, 100)))
        lengths[-1] = 512 - sum(lengths[:-1]) if 512 - sum(lengths[:-1]) <= 100 else lengths[-1]
        while sum(lengths) > 512:
            lengths.pop()
        rows.append(lengths)
    assert sum(len(r) for r in rows) >= 10
    assert _check(case, rows, 512, seed=5) <= TOLERANCE


# ----------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------


def test_convbert_is_refused_at_its_convolution(cases) -> None:
    refused = cases("convbert", "token-classification").packed
    assert isinstance(refused, PackingRefused)
    assert refused.op_type == "Conv" and "conv" in refused.node.lower()
    assert refused.node in str(refused)


def _tiny_attention(pool_over_tokens: bool, absolute_positions: bool) -> onnx.ModelProto:
    """One masked self-attention over embedded ids: optionally mean-pooled over the sequence, optionally
    with the raw token index (an absolute position, no table) added to the embeddings."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["x0"], name="embed"),
    ]
    x = "x0"
    if absolute_positions:
        nodes += [
            helper.make_node("Shape", ["input_ids"], ["shape"], name="shape"),
            helper.make_node("Gather", ["shape", "one"], ["length"], name="length", axis=0),
            helper.make_node("Range", ["zero", "length", "one"], ["range"], name="range"),
            helper.make_node("Unsqueeze", ["range", "axes_0_2"], ["range3"], name="range3"),
            helper.make_node("Cast", ["range3"], ["rangef"], name="rangef", to=TensorProto.FLOAT),
            helper.make_node("Add", ["x0", "rangef"], ["x1"], name="add_position"),
        ]
        x = "x1"
    nodes += [
        helper.make_node("Unsqueeze", [x, "axes_1"], ["xu"], name="xu"),
        helper.make_node("Transpose", ["xu"], ["xt"], name="xt", perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["xu", "xt"], ["scores"], name="scores"),
        helper.make_node("Unsqueeze", ["attention_mask", "axes_1_2"], ["m4"], name="m4"),
        helper.make_node("Cast", ["m4"], ["mf"], name="mf", to=TensorProto.FLOAT),
        helper.make_node("Sub", ["onef", "mf"], ["inv"], name="inv"),
        helper.make_node("Mul", ["inv", "minf"], ["bias"], name="bias"),
        helper.make_node("Add", ["scores", "bias"], ["masked"], name="masked"),
        helper.make_node("Softmax", ["masked"], ["probs"], name="probs", axis=-1),
        helper.make_node("MatMul", ["probs", "xu"], ["ctx"], name="ctx"),
    ]
    if pool_over_tokens:
        nodes.append(helper.make_node("ReduceMean", ["ctx"], ["out"], name="mean_pool", axes=[2], keepdims=0))
        out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch_size", 1, 8])
    else:
        nodes.append(helper.make_node("Squeeze", ["ctx", "axes_1"], ["out"], name="out"))
        out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch_size", "sequence_length", 8])
    initializers = [
        numpy_helper.from_array(rng.standard_normal((20, 8)).astype(np.float32), "table"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0, 2], np.int64), "axes_0_2"),
        numpy_helper.from_array(np.array([1], np.int64), "axes_1"),
        numpy_helper.from_array(np.array([1, 2], np.int64), "axes_1_2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "onef"),
        numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "minf"),
    ]
    inputs = [
        helper.make_tensor_value_info(name, TensorProto.INT64, ["batch_size", "sequence_length"])
        for name in ("input_ids", "attention_mask")
    ]
    graph = helper.make_graph(nodes, "tiny", inputs, [out], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_tiny_attention_packs() -> None:
    """The hand-made graph itself packs when it neither pools nor adds raw positions, so the refusals
    below are about those two nodes."""
    packed = pack_encoder(_tiny_attention(pool_over_tokens=False, absolute_positions=False))
    assert isinstance(packed, PackedEncoder), str(packed)
    assert packed.token_outputs == {"out": 1}


def test_mean_pooling_over_the_sequence_is_refused() -> None:
    refused = pack_encoder(_tiny_attention(pool_over_tokens=True, absolute_positions=False))
    assert isinstance(refused, PackingRefused)
    assert (refused.node, refused.op_type) == ("mean_pool", "ReduceMean")
    assert "token axis" in refused.reason


def test_an_unreplaced_absolute_position_is_refused() -> None:
    refused = pack_encoder(_tiny_attention(pool_over_tokens=False, absolute_positions=True))
    assert isinstance(refused, PackingRefused)
    assert (refused.node, refused.op_type) == ("add_position", "Add")
    assert "absolute position" in refused.reason


def test_the_proof_catches_a_broken_mask(cases, monkeypatch) -> None:
    """A rewrite whose block mask is inverted (each token attends to the OTHER sequences) is refused by
    the proof at the Softmax that the wrong mask reaches."""
    original = packing._Rewrite.replace_mask

    def inverted(self) -> None:
        original(self)
        for node in self.graph.node:
            if node.doc_string.endswith(packing.BLOCK_MASK):
                self.graph.node.append(
                    helper.make_node(
                        "Not", [node.input[0]], ["inverted_block"], name="ipu_packing/broken/not"
                    )
                )
                node.input[0] = "inverted_block"

    monkeypatch.setattr(packing._Rewrite, "replace_mask", inverted)
    refused = pack_encoder(cases("bert", "feature-extraction").original)
    assert isinstance(refused, PackingRefused)
    assert refused.op_type == "Softmax", str(refused)


def test_the_proof_catches_an_unsegmented_cumsum(cases, monkeypatch) -> None:
    """Without the segmented CumSum, RoBERTa's positions count across the row: refused at the CumSum."""
    monkeypatch.setattr(packing._Rewrite, "segment_cumsums", lambda self: None)
    refused = pack_encoder(cases("roberta", "token-classification").original)
    assert isinstance(refused, PackingRefused)
    assert refused.op_type == "CumSum" and "CumSum" in refused.reason


def test_the_proof_catches_an_unpooled_read(cases, monkeypatch) -> None:
    """Without the pooled gather, the classifier reads token 0 of the row: refused at that Gather."""
    monkeypatch.setattr(packing._Rewrite, "pool", lambda self: set())
    refused = pack_encoder(cases("distilbert", "text-classification").original)
    assert isinstance(refused, PackingRefused)
    assert refused.op_type == "Gather" and "fixed positions" in refused.reason


def test_mixing_the_rows_is_refused() -> None:
    """Rows hold unrelated sequences: an operator along the rows (a softmax over the batch) is refused,
    though the unpacked graph would compute it the same for any one sequence's row."""
    model = _tiny_attention(pool_over_tokens=False, absolute_positions=False)
    last = model.graph.node[-1]
    last.output[0] = "per_token"
    model.graph.node.append(helper.make_node("Softmax", ["per_token"], ["out"], name="over_rows", axis=0))
    refused = pack_encoder(model)
    assert isinstance(refused, PackingRefused)
    assert (refused.node, refused.op_type) == ("over_rows", "Softmax")
    assert "rows" in refused.reason
