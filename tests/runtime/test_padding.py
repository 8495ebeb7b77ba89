"""Padding to bucket sizes, where the padding proof allows it, must not change any result.

Every comparison runs the original graph on onnxruntime's CPU provider twice, once on the caller's
feed and once on the padded feed, and compares the outputs, cut where the proof located their real
elements, with the unpadded ones (atol 1e-5: only the summation order of exactly-zero attention weights
differs). The graphs are a hand-built BERT-like encoder, a hand-built decoder with a key/value cache
(composite ``past_sequence_length + sequence_length`` axes), and the zoo's tiny BERT and GPT-2 exports.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.padding import PaddingAnalyzer
from optimum_ipu_backend.runtime.buckets import BucketPlan
from optimum_ipu_backend.runtime.dim_expressions import DimExpression, DimExpressionError
from optimum_ipu_backend.runtime.padding import (
    DimensionMismatchError,
    axis_maps,
    cut_output,
    infer_dims,
    inputs_for_dims,
    output_cuts,
    pad_feed,
    padded_inputs,
)
from optimum_ipu_backend.runtime.roles import CONTINUE, fill_value

ATOL = 1e-5

# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def symbolic_shapes(values: list[onnx.ValueInfoProto]) -> dict[str, tuple[str | int | None, ...]]:
    shapes = {}
    for value in values:
        dims = []
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dims.append(dim.dim_param)
            elif dim.HasField("dim_value"):
                dims.append(dim.dim_value)
            else:
                dims.append(None)
        shapes[value.name] = tuple(dims)
    return shapes


class Graph:
    """An ONNX model on ORT CPU with its declared symbolic input and output shapes."""

    def __init__(self, model: onnx.ModelProto | Path) -> None:
        model_proto = onnx.load(str(model), load_external_data=False) if isinstance(model, Path) else model
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        source = str(model) if isinstance(model, Path) else model.SerializeToString()
        self.session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        initializers = {init.name for init in model_proto.graph.initializer}
        self.input_shapes = symbolic_shapes(
            [v for v in model_proto.graph.input if v.name not in initializers]
        )
        self.output_names = [output.name for output in model_proto.graph.output]
        self.analyzer = PaddingAnalyzer(model_proto)

    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(self.output_names, dict(feed)), strict=True))

    def run_padded(
        self,
        feed: Mapping[str, np.ndarray],
        padded_dims: Mapping[str, int],
        *,
        pad_token_id: int = 0,
        left_padded_dims: tuple[str, ...] = (),
        **kwargs,
    ) -> dict | None:
        """The outputs of a padded run, cut to their real elements; None when the proof's conditions on
        the caller's data fail (the runtime then runs that call unpadded)."""
        actual = infer_dims(feed, self.input_shapes)
        fills = {name: fill_value(name, pad_token_id) for name in self.input_shapes}
        inputs = padded_inputs(
            self.input_shapes, fills, actual, padded_dims, left_padded_dims=left_padded_dims
        )
        proof = self.analyzer.prove(inputs)
        assert proof.exact, proof.problems
        if not proof.holds_for(feed):
            return None
        padded = pad_feed(
            feed,
            self.input_shapes,
            padded_dims,
            pad_token_id=pad_token_id,
            left_padded_dims=left_padded_dims,
            **kwargs,
        )
        for name, array in padded.feed.items():
            assert array.dtype == feed[name].dtype, name
        cuts = output_cuts(proof.output_maps)
        return {name: cut_output(array, cuts.get(name, ())) for name, array in self.run(padded.feed).items()}


def assert_same_outputs(expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]) -> None:
    assert expected.keys() == actual.keys()
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        np.testing.assert_allclose(actual[name], expected[name], atol=ATOL, rtol=0, err_msg=name)


def _float(rng: np.random.Generator, *shape: int, scale: float = 0.5) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _const(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


# ----------------------------------------------------------------------------------------------------------
# Hand-built graphs
# ----------------------------------------------------------------------------------------------------------

VOCAB, HIDDEN, MAX_POSITIONS = 50, 8, 64
PAD_TOKEN_ID = 0


def bert_like_graph() -> onnx.ModelProto:
    """Embeddings (word + token type + in-graph positions), one masked attention layer with a residual,
    per-token hidden states and the attention-mask-weighted mean."""
    rng = np.random.default_rng(1)
    initializers = [
        _const("word_embeddings", _float(rng, VOCAB, HIDDEN)),
        _const("type_embeddings", _float(rng, 2, HIDDEN)),
        _const("position_embeddings", _float(rng, MAX_POSITIONS, HIDDEN)),
        _const("wq", _float(rng, HIDDEN, HIDDEN)),
        _const("wk", _float(rng, HIDDEN, HIDDEN)),
        _const("wv", _float(rng, HIDDEN, HIDDEN)),
        _const("scale", np.array(1 / np.sqrt(HIDDEN), dtype=np.float32)),
        _const("one", np.array(1.0, dtype=np.float32)),
        _const("neg_big", np.array(-1e9, dtype=np.float32)),
        _const("zero_i", np.array(0, dtype=np.int64)),
        _const("one_i", np.array(1, dtype=np.int64)),
        _const("axis1", np.array([1], dtype=np.int64)),
        _const("axis2", np.array([2], dtype=np.int64)),
    ]
    nodes = [
        helper.make_node("Gather", ["word_embeddings", "input_ids"], ["words"]),
        helper.make_node("Gather", ["type_embeddings", "token_type_ids"], ["types"]),
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Gather", ["ids_shape", "one_i"], ["seq_len"]),
        helper.make_node("Range", ["zero_i", "seq_len", "one_i"], ["positions"]),
        helper.make_node("Gather", ["position_embeddings", "positions"], ["pos_emb"]),
        helper.make_node("Add", ["words", "types"], ["emb0"]),
        helper.make_node("Add", ["emb0", "pos_emb"], ["x"]),
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("MatMul", ["x", "wv"], ["v"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["raw_scores"]),
        helper.make_node("Mul", ["raw_scores", "scale"], ["scores"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "axis1"], ["mask3"]),
        helper.make_node("Sub", ["one", "mask3"], ["inverted"]),
        helper.make_node("Mul", ["inverted", "neg_big"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked_scores"]),
        helper.make_node("Softmax", ["masked_scores"], ["weights"], axis=-1),
        helper.make_node("MatMul", ["weights", "v"], ["context"]),
        helper.make_node("Add", ["context", "x"], ["residual"]),
        helper.make_node("Tanh", ["residual"], ["last_hidden_state"]),
        helper.make_node("Unsqueeze", ["mask_f", "axis2"], ["mask_col"]),
        helper.make_node("Mul", ["last_hidden_state", "mask_col"], ["kept"]),
        helper.make_node("ReduceSum", ["kept", "axis1"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask_col", "axis1"], ["count"], keepdims=0),
        helper.make_node("Div", ["summed", "count"], ["mean_pooled"]),
    ]
    text = ["batch_size", "sequence_length"]
    graph = helper.make_graph(
        nodes,
        "bert_like",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, text),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, text),
            helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, text),
        ],
        [
            helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [*text, HIDDEN]),
            helper.make_tensor_value_info("mean_pooled", TensorProto.FLOAT, ["batch_size", HIDDEN]),
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    return model


def cached_decoder_graph() -> onnx.ModelProto:
    """A one-layer decoder with a key/value cache laid out like optimum's exports: the attention mask and
    the present caches span ``past_sequence_length + sequence_length``, positions come as an input, and
    the causal mask is derived from the cache length in the graph."""
    rng = np.random.default_rng(2)
    initializers = [
        _const("word_embeddings", _float(rng, VOCAB, HIDDEN)),
        _const("position_embeddings", _float(rng, MAX_POSITIONS, HIDDEN)),
        _const("wq", _float(rng, HIDDEN, HIDDEN)),
        _const("wk", _float(rng, HIDDEN, HIDDEN)),
        _const("wv", _float(rng, HIDDEN, HIDDEN)),
        _const("w_out", _float(rng, HIDDEN, VOCAB)),
        _const("scale", np.array(1 / np.sqrt(HIDDEN), dtype=np.float32)),
        _const("neg_big", np.array(-1e9, dtype=np.float32)),
        _const("zero_i", np.array(0, dtype=np.int64)),
        _const("one_i", np.array(1, dtype=np.int64)),
        _const("axis0", np.array([0], dtype=np.int64)),
        _const("axis1", np.array([1], dtype=np.int64)),
    ]
    nodes = [
        helper.make_node("Gather", ["word_embeddings", "input_ids"], ["words"]),
        helper.make_node("Gather", ["position_embeddings", "position_ids"], ["pos_emb"]),
        helper.make_node("Add", ["words", "pos_emb"], ["x"]),
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k_new"]),
        helper.make_node("MatMul", ["x", "wv"], ["v_new"]),
        helper.make_node("Concat", ["past_key", "k_new"], ["present_key"], axis=1),
        helper.make_node("Concat", ["past_value", "v_new"], ["present_value"], axis=1),
        helper.make_node("Transpose", ["present_key"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["raw_scores"]),
        helper.make_node("Mul", ["raw_scores", "scale"], ["scores"]),
        # Causal mask: key j is visible to query i when j <= (cache length - new length) + i.
        helper.make_node("Shape", ["present_key"], ["kv_shape"]),
        helper.make_node("Gather", ["kv_shape", "one_i"], ["kv_len"]),
        helper.make_node("Shape", ["q"], ["q_shape"]),
        helper.make_node("Gather", ["q_shape", "one_i"], ["q_len"]),
        helper.make_node("Sub", ["kv_len", "q_len"], ["offset"]),
        helper.make_node("Range", ["zero_i", "q_len", "one_i"], ["q_range"]),
        helper.make_node("Add", ["q_range", "offset"], ["q_pos"]),
        helper.make_node("Unsqueeze", ["q_pos", "axis1"], ["q_col"]),
        helper.make_node("Range", ["zero_i", "kv_len", "one_i"], ["k_range"]),
        helper.make_node("Unsqueeze", ["k_range", "axis0"], ["k_row"]),
        helper.make_node("LessOrEqual", ["k_row", "q_col"], ["causal"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_b"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["mask_b", "axis1"], ["mask3"]),
        helper.make_node("And", ["causal", "mask3"], ["visible"]),
        helper.make_node("Where", ["visible", "scores", "neg_big"], ["masked_scores"]),
        helper.make_node("Softmax", ["masked_scores"], ["weights"], axis=-1),
        helper.make_node("MatMul", ["weights", "present_value"], ["context"]),
        helper.make_node("Add", ["context", "x"], ["residual"]),
        helper.make_node("Tanh", ["residual"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "w_out"], ["logits"]),
    ]
    total = "past_sequence_length + sequence_length"
    graph = helper.make_graph(
        nodes,
        "cached_decoder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", total]),
            helper.make_tensor_value_info(
                "position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]
            ),
            helper.make_tensor_value_info(
                "past_key", TensorProto.FLOAT, ["batch_size", "past_sequence_length", HIDDEN]
            ),
            helper.make_tensor_value_info(
                "past_value", TensorProto.FLOAT, ["batch_size", "past_sequence_length", HIDDEN]
            ),
        ],
        [
            helper.make_tensor_value_info(
                "logits", TensorProto.FLOAT, ["batch_size", "sequence_length", VOCAB]
            ),
            helper.make_tensor_value_info("present_key", TensorProto.FLOAT, ["batch_size", total, HIDDEN]),
            helper.make_tensor_value_info("present_value", TensorProto.FLOAT, ["batch_size", total, HIDDEN]),
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def bert_like() -> Graph:
    return Graph(bert_like_graph())


@pytest.fixture(scope="module")
def cached_decoder() -> Graph:
    return Graph(cached_decoder_graph())


def text_feed(rng: np.random.Generator, batch: int, length: int, left_padded: bool = False) -> dict:
    """Token ids with a tokenizer-style mask: every row has at least one real token, some have padding."""
    ids = rng.integers(1, VOCAB, size=(batch, length), dtype=np.int64)
    real = rng.integers(1, length + 1, size=batch)
    columns = np.arange(length)[None, :]
    mask = (columns >= length - real[:, None]) if left_padded else (columns < real[:, None])
    mask = mask.astype(np.int64)
    ids = np.where(mask == 1, ids, PAD_TOKEN_ID)
    types = (rng.random((batch, length)) < 0.3).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


# ----------------------------------------------------------------------------------------------------------
# Dimension expressions
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "sizes", "value", "segments"),
    [
        ("batch_size", {"batch_size": 3}, 3, ("batch_size",)),
        (
            "past_sequence_length + sequence_length",
            {"past_sequence_length": 4, "sequence_length": 2},
            6,
            ("past_sequence_length", "sequence_length"),
        ),
        ("past_sequence_length + 1", {"past_sequence_length": 4}, 5, ("past_sequence_length", 1)),
        ("1", {"1": 3}, 3, ("1",)),  # a bare number is a name: its size comes from the feed
        ("batch_size * num_heads", {"batch_size": 2, "num_heads": 3}, 6, None),
        ("2 * (a + b) - 1", {"a": 2, "b": 3}, 9, None),
        ("sequence_length - 1", {"sequence_length": 7}, 6, None),
    ],
)
def test_dim_expression_evaluates_and_splits(
    text: str, sizes: dict, value: int, segments: tuple | None
) -> None:
    expression = DimExpression.parse(text)
    assert expression.evaluate(sizes) == value
    assert expression.segments == segments


@pytest.mark.parametrize(
    "text", ["__import__('os').system('true')", "a / b", "a +", "(a", "a b", "", "   ", "a ** 2", "len(x)"]
)
def test_dim_expression_rejects_anything_outside_its_grammar(text: str) -> None:
    with pytest.raises(DimExpressionError):
        DimExpression.parse(text)


def test_dim_expression_solves_for_one_unknown() -> None:
    expression = DimExpression.parse("past_sequence_length + sequence_length")
    assert expression.solve_for("past_sequence_length", 9, {"sequence_length": 4}) == 5
    assert expression.solve_for("past_sequence_length", 3, {"sequence_length": 4}) is None  # negative
    assert DimExpression.parse("2 * a").solve_for("a", 7, {}) is None  # not an integer
    assert DimExpression.parse("a * a").solve_for("a", 9, {}) is None  # not linear


# ----------------------------------------------------------------------------------------------------------
# Inferring sizes
# ----------------------------------------------------------------------------------------------------------

DECODER_SHAPES = {
    "input_ids": ("batch_size", "sequence_length"),
    "attention_mask": ("batch_size", "past_sequence_length + sequence_length"),
    "past_key": ("batch_size", "past_sequence_length", HIDDEN),
}


def test_infer_dims_solves_composite_axes() -> None:
    feed = {"input_ids": np.zeros((2, 3), np.int64), "attention_mask": np.ones((2, 8), np.int64)}
    assert infer_dims(feed, DECODER_SHAPES) == {
        "batch_size": 2,
        "sequence_length": 3,
        "past_sequence_length": 5,
    }
    feed["past_key"] = np.zeros((2, 5, HIDDEN), np.float32)
    assert infer_dims(feed, DECODER_SHAPES)["past_sequence_length"] == 5


@pytest.mark.parametrize(
    ("feed", "message"),
    [
        (
            {
                "input_ids": np.zeros((2, 3)),
                "attention_mask": np.ones((2, 8)),
                "past_key": np.zeros((2, 4, 8)),
            },
            "attention_mask",
        ),
        ({"input_ids": np.zeros((2, 3)), "attention_mask": np.ones((3, 8))}, "batch_size"),
        ({"input_ids": np.zeros((2, 3)), "attention_mask": np.ones((2, 2))}, "past_sequence_length"),
        ({"past_key": np.zeros((2, 4, 7))}, "fixes it to 8"),
        ({"input_ids": np.zeros((2, 3, 1))}, "rank"),
    ],
)
def test_infer_dims_rejects_inconsistent_feeds(feed: dict, message: str) -> None:
    with pytest.raises(DimensionMismatchError, match=message):
        infer_dims(feed, DECODER_SHAPES)


def test_inputs_for_dims_names_a_carrier_per_dimension() -> None:
    assert inputs_for_dims(DECODER_SHAPES) == {
        "batch_size": "input_ids",
        "sequence_length": "input_ids",
        "past_sequence_length": "past_key",
    }


# ----------------------------------------------------------------------------------------------------------
# Fill values
# ----------------------------------------------------------------------------------------------------------


def test_pad_feed_fills_each_input_the_way_the_model_expects() -> None:
    shapes = {
        "input_ids": ("batch_size", "sequence_length"),
        "attention_mask": ("batch_size", "past_sequence_length + sequence_length"),
        "token_type_ids": ("batch_size", "sequence_length"),
        "position_ids": ("batch_size", "sequence_length"),
        "past_key": ("batch_size", "past_sequence_length", 2),
    }
    feed = {
        "input_ids": np.array([[11, 12, 13], [21, 22, 23]]),
        "attention_mask": np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
        "token_type_ids": np.array([[1, 1, 1], [0, 0, 1]]),
        "position_ids": np.array([[1, 2, 3], [2, 3, 4]]),
        "past_key": np.arange(2 * 2 * 2, dtype=np.float32).reshape(2, 2, 2) + 1,
    }
    padded = pad_feed(
        feed, shapes, {"batch_size": 3, "sequence_length": 5, "past_sequence_length": 4}, pad_token_id=99
    )
    out = padded.feed
    assert padded.actual_dims == {"batch_size": 2, "sequence_length": 3, "past_sequence_length": 2}
    np.testing.assert_array_equal(out["input_ids"][:2], [[11, 12, 13, 99, 99], [21, 22, 23, 99, 99]])
    # Past segment (2 real + 2 padding), then the new segment (3 real + 2 padding).
    np.testing.assert_array_equal(
        out["attention_mask"][:2], [[0, 1, 0, 0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 1, 1, 0, 0]]
    )
    np.testing.assert_array_equal(out["token_type_ids"][:2], [[1, 1, 1, 0, 0], [0, 0, 1, 0, 0]])
    np.testing.assert_array_equal(out["position_ids"][:2], [[1, 2, 3, 4, 5], [2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(out["past_key"][:2, :2], feed["past_key"])
    assert not out["past_key"][:, 2:].any()
    # The padded batch row repeats the first real row.
    for name in out:
        np.testing.assert_array_equal(out[name][2], out[name][0])


def test_pad_feed_options_left_padding_zero_rows_position_cap_and_overrides() -> None:
    shapes = {
        "attention_mask": ("batch_size", "past_sequence_length + sequence_length"),
        "position_ids": ("batch_size", "sequence_length"),
        "custom": ("batch_size", "sequence_length"),
        "untouched": ("whatever",),
    }
    feed = {
        "attention_mask": np.array([[1, 1, 1]], dtype=bool),
        "position_ids": np.array([[6, 7]]),
        "custom": np.array([[5.0, 5.0]], dtype=np.float16),
        "untouched": np.array([1, 2, 3]),
        "not_declared": np.array([[1]]),
    }
    padded = pad_feed(
        feed,
        shapes,
        {"batch_size": 2, "sequence_length": 4, "past_sequence_length": 3},
        left_padded_dims=["past_sequence_length"],
        batch_fill="zeros",
        max_position_id=8,
        fill_values={"custom": -1},
    )
    out = padded.feed
    np.testing.assert_array_equal(out["attention_mask"], [[0, 0, 1, 1, 1, 0, 0], [0] * 7])
    assert out["attention_mask"].dtype == bool
    np.testing.assert_array_equal(out["position_ids"], [[6, 7, 8, 8], [0, 0, 0, 0]])
    np.testing.assert_array_equal(out["custom"], [[5, 5, -1, -1], [-1, -1, -1, -1]])
    assert out["custom"].dtype == np.float16
    assert out["untouched"] is feed["untouched"] and out["not_declared"] is feed["not_declared"]
    assert padded.padded_dims == {
        "batch_size": 2,
        "sequence_length": 4,
        "past_sequence_length": 3,
        "whatever": 3,
    }


def test_pad_feed_never_writes_to_the_callers_arrays() -> None:
    shapes = {
        "position_ids": ("batch_size", "sequence_length"),
        "input_ids": ("batch_size", "sequence_length"),
    }
    positions = np.array([[60, 61, 62]])
    ids = np.array([[1, 2, 3]])
    unchanged = pad_feed({"position_ids": positions, "input_ids": ids}, shapes, {}, max_position_id=10)
    assert unchanged.feed["position_ids"] is positions
    grown = pad_feed(
        {"position_ids": positions, "input_ids": ids}, shapes, {"sequence_length": 5}, max_position_id=63
    )
    # Real ids are kept as given (even above the cap); only the continued padding is capped.
    np.testing.assert_array_equal(grown.feed["position_ids"], [[60, 61, 62, 63, 63]])
    np.testing.assert_array_equal(positions, [[60, 61, 62]])
    np.testing.assert_array_equal(ids, [[1, 2, 3]])


def test_pad_feed_refuses_to_shrink() -> None:
    with pytest.raises(ValueError, match="cannot pad sequence_length from 5 down to 4"):
        pad_feed(
            {"input_ids": np.zeros((1, 5), np.int64)},
            {"input_ids": ("batch_size", "sequence_length")},
            {"sequence_length": 4},
        )


# ----------------------------------------------------------------------------------------------------------
# Round trip without a model: the maps the proof reasons about describe where pad_feed put every element
# ----------------------------------------------------------------------------------------------------------

AXIS_CHOICES = [
    "batch_size",
    "sequence_length",
    "past_sequence_length",
    "past_sequence_length + sequence_length",
    "past_sequence_length + 1",
    "batch_size * num_heads",
    3,
    None,
]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_axis_maps_locate_every_element_pad_feed_moved(data: st.DataObject) -> None:
    actual = {
        "batch_size": data.draw(st.integers(1, 3)),
        "sequence_length": data.draw(st.integers(0, 4)),
        "past_sequence_length": data.draw(st.integers(0, 4)),
        "num_heads": 2,
    }
    padded = {
        name: size + data.draw(st.integers(0, 3)) for name, size in actual.items() if name != "num_heads"
    }
    left = data.draw(st.sets(st.sampled_from(["sequence_length", "past_sequence_length"])))
    shape = tuple(data.draw(st.lists(st.sampled_from(AXIS_CHOICES), min_size=1, max_size=3)))
    concrete = tuple(
        2 if dim is None else dim if isinstance(dim, int) else DimExpression.parse(dim).evaluate(actual)
        for dim in shape
    )
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    original = rng.integers(1, 100, size=concrete).astype(np.int32)
    fill = data.draw(st.sampled_from([0, -7, CONTINUE]))
    result = pad_feed(
        {"x": original},
        {"x": shape},
        padded,
        actual_dims=actual,
        fill_values={"x": fill},
        left_padded_dims=left,
        batch_fill=data.draw(st.sampled_from(["repeat", "zeros"])),
    )
    grown = result.feed["x"]
    expected_shape = tuple(
        size
        if isinstance(dim, int) or dim is None
        else DimExpression.parse(dim).evaluate({**actual, **padded})
        for dim, size in zip(shape, concrete, strict=True)
    )
    assert grown.shape == expected_shape
    maps = axis_maps(shape, actual, {**actual, **padded}, left)
    back = cut_output(grown, output_cuts({"x": maps})["x"])
    np.testing.assert_array_equal(back, original)
    if fill == -7 and "batch_size" not in shape:
        # Every added element holds the fill value.
        assert (grown == -7).sum() == grown.size - original.size


# ----------------------------------------------------------------------------------------------------------
# Hand-built graphs: padded runs equal unpadded runs
# ----------------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 12),
    extra_rows=st.integers(0, 3),
    extra_columns=st.integers(0, 9),
    left_padded=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_padding_does_not_change_a_bert_like_encoder(
    bert_like: Graph,
    batch: int,
    length: int,
    extra_rows: int,
    extra_columns: int,
    left_padded: bool,
    seed: int,
) -> None:
    feed = text_feed(np.random.default_rng(seed), batch, length, left_padded)
    expected = bert_like.run(feed)
    padded_dims = {"batch_size": batch + extra_rows, "sequence_length": length + extra_columns}
    assert_same_outputs(expected, bert_like.run_padded(feed, padded_dims, pad_token_id=PAD_TOKEN_ID))


def test_bert_like_padding_through_a_default_bucket_plan(bert_like: Graph) -> None:
    plan = BucketPlan.for_dims({"max_position_embeddings": MAX_POSITIONS}, ["batch_size", "sequence_length"])
    plan = BucketPlan({**plan.sizes, "batch_size": (4,)}, plan.limits, plan.limit_sources)
    feed = text_feed(np.random.default_rng(7), 3, 21)
    actual = infer_dims(feed, bert_like.input_shapes)
    padded_dims = plan.padded_dims(actual, inputs_for_dims(bert_like.input_shapes))
    assert padded_dims["sequence_length"] > 21 and padded_dims["batch_size"] == 4
    assert_same_outputs(
        bert_like.run(feed), bert_like.run_padded(feed, padded_dims, pad_token_id=PAD_TOKEN_ID)
    )


def decoder_feed(rng: np.random.Generator, batch: int, past: int, new: int) -> dict:
    """A generation step: a cache of ``past`` positions (some rows left-padded by the tokenizer) and
    ``new`` real tokens whose positions follow the real past positions."""
    real_past = rng.integers(0, past + 1, size=batch)
    past_mask = (np.arange(past)[None, :] >= past - real_past[:, None]).astype(np.int64)
    mask = np.concatenate([past_mask, np.ones((batch, new), np.int64)], axis=1)
    positions = real_past[:, None] + np.arange(new)[None, :]
    return {
        "input_ids": rng.integers(1, VOCAB, size=(batch, new), dtype=np.int64),
        "attention_mask": mask,
        "position_ids": positions.astype(np.int64),
        "past_key": _float(rng, batch, past, HIDDEN),
        "past_value": _float(rng, batch, past, HIDDEN),
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 3),
    past=st.integers(0, 8),
    new=st.integers(1, 5),
    extra=st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(0, 4)),
    left_padded_past=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_padding_does_not_change_a_cached_decoder(
    cached_decoder: Graph,
    batch: int,
    past: int,
    new: int,
    extra: tuple[int, int, int],
    left_padded_past: bool,
    seed: int,
) -> None:
    feed = decoder_feed(np.random.default_rng(seed), batch, past, new)
    expected = cached_decoder.run(feed)
    padded_dims = {
        "batch_size": batch + extra[0],
        "past_sequence_length": past + extra[1],
        "sequence_length": new + extra[2],
    }
    actual = cached_decoder.run_padded(
        feed,
        padded_dims,
        pad_token_id=PAD_TOKEN_ID,
        max_position_id=MAX_POSITIONS - 1,
        left_padded_dims=("past_sequence_length",) if left_padded_past else (),
    )
    if actual is not None:
        assert_same_outputs(expected, actual)


def test_a_padded_generation_loop_matches_an_unpadded_one(cached_decoder: Graph) -> None:
    """Greedy decoding where every step's cache comes from the previous step's sliced present."""
    rng = np.random.default_rng(3)
    plan = BucketPlan({"batch_size": (4,), "sequence_length": (1, 8), "past_sequence_length": (8, 16, 32)})
    prompt = decoder_feed(rng, batch=2, past=0, new=5)
    states = {"plain": dict(prompt), "padded": dict(prompt)}
    tokens: dict[str, list[np.ndarray]] = {"plain": [], "padded": []}
    for _ in range(12):
        for mode, feed in states.items():
            if mode == "plain":
                outputs = cached_decoder.run(feed)
            else:
                actual = infer_dims(feed, cached_decoder.input_shapes)
                outputs = cached_decoder.run_padded(
                    feed, plan.padded_dims(actual), pad_token_id=0, max_position_id=MAX_POSITIONS - 1
                )
                if outputs is None:  # the runtime would run this step unpadded
                    outputs = cached_decoder.run(feed)
            next_token = outputs["logits"][:, -1].argmax(-1)
            tokens[mode].append(next_token)
            feed.update(
                input_ids=next_token[:, None].astype(np.int64),
                position_ids=feed["position_ids"][:, -1:] + 1,
                attention_mask=np.concatenate([feed["attention_mask"], np.ones((2, 1), np.int64)], axis=1),
                past_key=outputs["present_key"],
                past_value=outputs["present_value"],
            )
        np.testing.assert_allclose(states["padded"]["past_key"], states["plain"]["past_key"], atol=ATOL)
    np.testing.assert_array_equal(np.stack(tokens["padded"]), np.stack(tokens["plain"]))


# ----------------------------------------------------------------------------------------------------------
# Real exports from the model zoo
# ----------------------------------------------------------------------------------------------------------


def _config(onnx_dir: Path) -> dict:
    return json.loads((onnx_dir / "config.json").read_text(encoding="utf-8"))


def test_padding_does_not_change_the_zoo_bert(zoo) -> None:
    onnx_dir = zoo.onnx("bert", "feature-extraction")
    graph = Graph(onnx_dir / "model.onnx")
    config = _config(onnx_dir)
    rng = np.random.default_rng(11)
    plan = BucketPlan.for_dims(config, ["batch_size", "sequence_length"])
    plan = BucketPlan({**plan.sizes, "batch_size": (4,)}, plan.limits, plan.limit_sources)
    for batch, length in [(1, 1), (2, 7), (3, 13)]:
        feed = text_feed(rng, batch, length)
        words = rng.integers(5, config["vocab_size"], (batch, length))
        feed["input_ids"] = np.where(feed["attention_mask"] == 1, words, config["pad_token_id"])
        feed = {name: feed[name] for name in graph.input_shapes}
        padded_dims = plan.padded_dims(infer_dims(feed, graph.input_shapes))
        assert padded_dims["sequence_length"] > length
        actual = graph.run_padded(feed, padded_dims, pad_token_id=config["pad_token_id"])
        assert_same_outputs(graph.run(feed), actual)


def test_padding_does_not_change_the_zoo_gpt2_with_a_cache(zoo) -> None:
    onnx_dir = zoo.onnx("gpt2", "text-generation-with-past")
    graph = Graph(onnx_dir / "model.onnx")
    config = _config(onnx_dir)
    heads, head_dim = config["n_head"], config["n_embd"] // config["n_head"]
    rng = np.random.default_rng(5)
    batch, prompt_length = 2, 6
    # A left-padded prompt, as generate() feeds a batch, with position ids computed from the mask.
    mask = np.ones((batch, prompt_length), np.int64)
    mask[1, :2] = 0
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)
    past_names = [name for name in graph.input_shapes if name.startswith("past_key_values")]
    feed = {
        "input_ids": rng.integers(0, config["vocab_size"], (batch, prompt_length), dtype=np.int64),
        "attention_mask": mask,
        "position_ids": positions.astype(np.int64),
        **{name: np.zeros((batch, heads, 0, head_dim), np.float32) for name in past_names},
    }
    plan = BucketPlan({"batch_size": (3,), "sequence_length": (1, 8), "past_sequence_length": (4, 16)})
    limit = config["n_positions"] - 1
    checked = []
    for step in range(3):
        expected = graph.run(feed)
        actual_dims = infer_dims(feed, graph.input_shapes)
        padded_dims = plan.padded_dims(actual_dims)
        assert any(padded_dims[dim] > actual_dims[dim] for dim in actual_dims), step
        actual = graph.run_padded(
            feed, padded_dims, pad_token_id=config["eos_token_id"], max_position_id=limit
        )
        if actual is not None:
            assert_same_outputs(expected, actual)
            checked.append(step)
        next_token = expected["logits"][:, -1].argmax(-1)
        feed = {
            "input_ids": next_token[:, None].astype(np.int64),
            "attention_mask": np.concatenate([feed["attention_mask"], np.ones((batch, 1), np.int64)], axis=1),
            "position_ids": feed["position_ids"][:, -1:] + 1,
            **{name: expected[name.replace("past_key_values", "present")] for name in past_names},
        }
    # The left-padded prompt has rows whose first real query sees no unmasked key: its sequence cannot be
    # padded (the proof's condition on the mask fails); every generated step is padded and checked.
    assert checked == [1, 2]
