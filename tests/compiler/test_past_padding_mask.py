"""add_past_padding_mask: a seq2seq decoder-with-past gives the same results on a left-padded past.

Every comparison is against onnxruntime CPU runs of the ORIGINAL exported graph on the unpadded past:
logits and the real part (last real_past + 1 positions) of every present output within FP32_ATOL. The
pasts are realistic: the encoder and the no-past decoder run on the zoo's sample inputs first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from graph_testing import feeds_for_types, make_model, run_ort, tensor_info
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from optimum_ipu_backend.compiler import legalize
from optimum_ipu_backend.compiler.graph_rewrites.past_padding_mask import (
    MASK_INPUT,
    PastPaddingRewrite,
    add_past_padding_mask,
)
from optimum_ipu_backend.conformance.zoo import preprocessed_inputs

FP32_ATOL = 1e-5
# float16 keeps ~3 decimal digits; the zoo's logits are O(1), and an unmasked padded past moves them by
# more than 0.1 (checked below), so this tolerance still tells masked from unmasked.
FP16_ATOL = 2e-2
BATCH, SEQ = 2, 8
GENERATED_TOKENS = 16
BUCKETS = (4, 8, 16)

SEQ2SEQ = [
    ("t5", "text2text-generation-with-past"),
    ("bart", "text2text-generation-with-past"),
    ("whisper", "automatic-speech-recognition-with-past"),
]


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    wanted = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted}), strict=True))


def _pasts(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k.replace("present", "past_key_values"): v for k, v in outputs.items() if k.startswith("present")}


def _left_pad(past: Mapping[str, np.ndarray], padded_length: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Self-attention pasts zero-padded on the left to ``padded_length``, and the mask saying so."""
    real = {v.shape[2] for k, v in past.items() if ".decoder." in k}
    assert len(real) == 1, real
    real_length = real.pop()
    pad = padded_length - real_length
    padded = {
        k: np.pad(v, ((0, 0), (0, 0), (pad, 0), (0, 0))) if ".decoder." in k else v for k, v in past.items()
    }
    batch = next(iter(past.values())).shape[0]
    mask = np.concatenate([np.zeros((batch, pad), np.int64), np.ones((batch, real_length), np.int64)], axis=1)
    return padded, mask


def _real_part(outputs: Mapping[str, np.ndarray], like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each output of a padded run cut to the shape of the unpadded run's (presents keep their tail)."""
    return {k: v[:, :, -like[k].shape[2] :] if k.startswith("present") else v for k, v in outputs.items()}


def _assert_close(
    actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], atol: float, label: str
):
    assert set(expected) <= set(actual), (label, sorted(actual))
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, (label, name, got.shape, want.shape)
        np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=f"{label}: {name}")


@dataclass
class _Seq2Seq:
    """One zoo model's graphs, sessions, and a realistic step: pasts of length real_length, next tokens."""

    name: str
    config: object
    original: onnx.ModelProto
    rewrite: PastPaddingRewrite
    encoder: ort.InferenceSession
    decoder: ort.InferenceSession
    with_past: ort.InferenceSession
    rewritten: ort.InferenceSession
    encoder_feeds: dict[str, np.ndarray]
    cross: dict[str, np.ndarray]  # encoder_hidden_states (and encoder_attention_mask)
    past: dict[str, np.ndarray]
    next_ids: np.ndarray

    @property
    def real_length(self) -> int:
        return self.sample_past_length(self.past)

    @staticmethod
    def sample_past_length(past: Mapping[str, np.ndarray]) -> int:
        return next(v.shape[2] for k, v in past.items() if ".decoder." in k)


_CASES: dict[str, _Seq2Seq] = {}


def _case(zoo, name: str, task: str) -> _Seq2Seq:
    if name in _CASES:
        return _CASES[name]
    import transformers

    export_dir: Path = zoo.onnx(name, task)
    graphs = {f: onnx.load(export_dir / f"{f}.onnx") for f in ("encoder_model", "decoder_model")}
    original = onnx.load(export_dir / "decoder_with_past_model.onnx")
    rewrite = add_past_padding_mask(original)
    assert rewrite is not None
    encoder, decoder = _session(graphs["encoder_model"]), _session(graphs["decoder_model"])
    sample = preprocessed_inputs(zoo.model(name, task), batch=BATCH, seq=SEQ)
    hidden = _run(encoder, sample)["last_hidden_state"]
    cross = {"encoder_hidden_states": hidden}
    if "attention_mask" in sample:
        cross["encoder_attention_mask"] = sample["attention_mask"]
    first = _run(decoder, {"input_ids": sample["decoder_input_ids"], **cross})
    case = _Seq2Seq(
        name=name,
        config=transformers.AutoConfig.from_pretrained(export_dir),
        original=original,
        rewrite=rewrite,
        encoder=encoder,
        decoder=decoder,
        with_past=_session(original),
        rewritten=_session(rewrite.model),
        encoder_feeds=sample,
        cross=cross,
        past=_pasts(first),
        next_ids=np.argmax(first["logits"][:, -1:], axis=-1).astype(np.int64),
    )
    _CASES[name] = case
    return case


@pytest.mark.parametrize(("name", "task"), SEQ2SEQ, ids=[n for n, _ in SEQ2SEQ])
def test_the_rewrite_masks_each_self_attention_layer_and_adds_one_input(zoo, name, task):
    case = _case(zoo, name, task)
    rewrite = case.rewrite
    layers = getattr(case.config, "num_decoder_layers", None) or case.config.decoder_layers
    assert rewrite.mask_input == MASK_INPUT and rewrite.padding_side == "left"
    assert rewrite.past_dim == "past_decoder_sequence_length"
    assert len(rewrite.masked_softmaxes) == layers
    assert all("SelfAttention" in s or "self_attn" in s for s in rewrite.masked_softmaxes), rewrite
    # T5's positions are relative (exact under left padding); BART and Whisper look up a learned table.
    assert len(rewrite.shifted_position_lookups) == (0 if name == "t5" else 1), rewrite
    before = [(i.name, i.type) for i in case.original.graph.input]
    after = [(i.name, i.type) for i in rewrite.model.graph.input]
    assert after[:-1] == before
    mask = rewrite.model.graph.input[-1]
    assert mask.name == MASK_INPUT and mask.type.tensor_type.elem_type == TensorProto.INT64
    assert [d.dim_param for d in mask.type.tensor_type.shape.dim] == ["batch_size", rewrite.past_dim]
    assert [o.name for o in rewrite.model.graph.output] == [o.name for o in case.original.graph.output]
    onnx.checker.check_model(rewrite.model, full_check=True)
    # A graph that already takes the mask needs nothing more.
    assert add_past_padding_mask(rewrite.model) is None


@pytest.mark.parametrize(("name", "task"), SEQ2SEQ, ids=[n for n, _ in SEQ2SEQ])
def test_a_left_padded_past_gives_the_unpadded_results(zoo, name, task):
    case = _case(zoo, name, task)
    step = {"input_ids": case.next_ids, **case.cross}
    expected = _run(case.with_past, {**step, **case.past})
    real = case.real_length
    for padded_length in (real, real + 1, real + 5, 16):
        padded, mask = _left_pad(case.past, padded_length)
        actual = _run(case.rewritten, {**step, **padded, MASK_INPUT: mask})
        _assert_close(
            _real_part(actual, expected), expected, FP32_ATOL, f"{name} past {real}->{padded_length}"
        )
        if padded_length > real:
            # The comparison means something: the original graph is wrong on the same padded past.
            unmasked = _run(case.with_past, {**step, **padded})
            assert np.abs(unmasked["logits"] - expected["logits"]).max() > 0.1, padded_length


@pytest.mark.parametrize(("name", "task"), SEQ2SEQ, ids=[n for n, _ in SEQ2SEQ])
def test_greedy_generation_with_bucketed_past_is_token_identical(zoo, name, task):
    case = _case(zoo, name, task)
    start = np.full((BATCH, 1), case.config.decoder_start_token_id, np.int64)
    first = _run(case.decoder, {"input_ids": start, **case.cross})
    tokens = np.argmax(first["logits"][:, -1:], axis=-1).astype(np.int64)
    plain_past = bucketed_past = _pasts(first)
    plain, bucketed = [tokens], [tokens]
    used_buckets = set()
    for _ in range(GENERATED_TOKENS - 1):
        out = _run(case.with_past, {"input_ids": plain[-1], **case.cross, **plain_past})
        plain.append(np.argmax(out["logits"][:, -1:], axis=-1).astype(np.int64))
        plain_past = {**plain_past, **_pasts(out)}  # the cross-attention pasts come from the first call only

        real = _Seq2Seq.sample_past_length(bucketed_past)
        bucket = next(b for b in BUCKETS if b >= real)
        used_buckets.add(bucket)
        padded, mask = _left_pad(bucketed_past, bucket)
        out = _run(case.rewritten, {"input_ids": bucketed[-1], **case.cross, **padded, MASK_INPUT: mask})
        bucketed.append(np.argmax(out["logits"][:, -1:], axis=-1).astype(np.int64))
        # What the runtime keeps between steps: the real tail of each present, the cross-attention as is.
        tails = {k: v[:, :, -(real + 1) :] for k, v in _pasts(out).items() if ".decoder." in k}
        bucketed_past = {**bucketed_past, **tails}
    plain_tokens, bucketed_tokens = np.concatenate(plain, axis=1), np.concatenate(bucketed, axis=1)
    np.testing.assert_array_equal(bucketed_tokens, plain_tokens)
    assert len(np.unique(plain_tokens)) >= 3, plain_tokens
    assert used_buckets == set(BUCKETS)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(("name", "task"), SEQ2SEQ, ids=[n for n, _ in SEQ2SEQ])
def test_the_rewritten_graph_legalizes_and_stays_exact(zoo, name, task, precision):
    case = _case(zoo, name, task)
    step = {"input_ids": case.next_ids, **case.cross}
    expected = _run(case.with_past, {**step, **case.past})
    padded, mask = _left_pad(case.past, 16)
    feeds = {**step, **padded, MASK_INPUT: mask}
    names = {i.name for i in case.rewrite.model.graph.input}
    feeds = {k: v for k, v in feeds.items() if k in names}
    legalized = legalize(case.rewrite.model, {k: v.shape for k, v in feeds.items()}, precision=precision)
    assert MASK_INPUT in legalized.input_types
    actual = run_ort(legalized.model, feeds_for_types(feeds, legalized.input_types))
    actual = {k: v.astype(np.float32) for k, v in actual.items()}
    atol = FP32_ATOL if precision == "fp32" else FP16_ATOL
    _assert_close(_real_part(actual, expected), expected, atol, f"{name} legalized {precision}")


def test_graphs_that_need_no_mask_are_left_alone(zoo):
    gpt2 = onnx.load(zoo.onnx("gpt2", "text-generation-with-past") / "model.onnx")
    assert add_past_padding_mask(gpt2) is None
    t5_dir = zoo.onnx("t5", "text2text-generation-with-past")
    assert add_past_padding_mask(onnx.load(t5_dir / "decoder_model.onnx")) is None
    assert add_past_padding_mask(onnx.load(t5_dir / "encoder_model.onnx")) is None


def test_the_argument_is_not_modified(zoo):
    original = onnx.load(zoo.onnx("bart", "text2text-generation-with-past") / "decoder_with_past_model.onnx")
    snapshot = original.SerializeToString()
    add_past_padding_mask(original)
    assert original.SerializeToString() == snapshot


# ----------------------------------------------------------------------------------------------------
# Hand-built one-layer decoders: the patterns the pass must refuse
# ----------------------------------------------------------------------------------------------------

_HEADS, _HEAD_DIM, _TABLE = 2, 4, 16
_PAST_KEY, _PAST_VALUE = "past_key_values.0.decoder.key", "past_key_values.0.decoder.value"


def _attention(
    extra_nodes: Sequence[onnx.NodeProto] = (),
    query_nodes: Sequence[onnx.NodeProto] = (),
    scores: str = "scores",
    softmax_axis: int = -1,
    query: str = "query",
    past_axis: str | int = "past_decoder_sequence_length",
) -> onnx.ModelProto:
    """``softmax(query @ concat(past, key)^T) @ concat(past, value)``; ``query_nodes`` run first and
    ``extra_nodes`` between the scores and the Softmax."""
    shape = ["batch_size", _HEADS, past_axis, _HEAD_DIM]
    current = ["batch_size", _HEADS, 1, _HEAD_DIM]
    nodes = [
        *query_nodes,
        helper.make_node("Concat", [_PAST_KEY, "key"], ["present.0.decoder.key"], axis=-2),
        helper.make_node("Concat", [_PAST_VALUE, "value"], ["present.0.decoder.value"], axis=-2),
        helper.make_node("Transpose", ["present.0.decoder.key"], ["key_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", [query, "key_t"], ["scores"]),
        *extra_nodes,
        helper.make_node("Softmax", [scores], ["probs"], axis=softmax_axis),
        helper.make_node("MatMul", ["probs", "present.0.decoder.value"], ["context"]),
    ]
    inputs = [
        tensor_info(_PAST_KEY, TensorProto.FLOAT, shape),
        tensor_info(_PAST_VALUE, TensorProto.FLOAT, shape),
        tensor_info("query", TensorProto.FLOAT, current),
        tensor_info("key", TensorProto.FLOAT, current),
        tensor_info("value", TensorProto.FLOAT, current),
    ]
    total = ["batch_size", _HEADS, "past_decoder_sequence_length + 1", _HEAD_DIM]
    outputs = [
        tensor_info("context", TensorProto.FLOAT, current),
        tensor_info("present.0.decoder.key", TensorProto.FLOAT, total),
        tensor_info("present.0.decoder.value", TensorProto.FLOAT, total),
    ]
    table = np.random.default_rng(0).standard_normal((_TABLE, _HEAD_DIM)).astype(np.float32)
    initializers = {"decoder.embed_positions.weight": table, "two": np.array([2], np.int64)}
    return make_model(nodes, inputs, outputs, initializers)


def _attention_feeds(real: int, padded: int, seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)

    def tensor(length: int) -> np.ndarray:
        return rng.standard_normal((BATCH, _HEADS, length, _HEAD_DIM)).astype(np.float32)

    step = {"query": tensor(1), "key": tensor(1), "value": tensor(1)}
    past = {_PAST_KEY: tensor(real), _PAST_VALUE: tensor(real)}
    padded_past, mask = _left_pad(past, padded)
    return {**step, **past}, {**step, **padded_past, MASK_INPUT: mask}


def test_a_hand_built_attention_is_masked_exactly():
    model = _attention()
    rewrite = add_past_padding_mask(model)
    assert rewrite is not None and rewrite.shifted_position_lookups == ()
    unpadded, padded = _attention_feeds(real=3, padded=8)
    expected = run_ort(model, unpadded)
    _assert_close(_real_part(run_ort(rewrite.model, padded), expected), expected, FP32_ATOL, "hand-built")
    # The padded keys get no weight at all, not merely a small one.
    with_probs = onnx.ModelProto()
    with_probs.CopyFrom(rewrite.model)
    with_probs.graph.output.append(tensor_info("probs", TensorProto.FLOAT, None))
    probs = run_ort(with_probs, padded)["probs"]
    assert probs.shape[-1] == 8 + 1 and np.all(probs[..., :5] == 0.0) and np.all(probs[..., 5:] > 0.0)


def test_an_unknown_op_between_the_keys_and_the_softmax_is_refused():
    model = _attention([helper.make_node("Relu", ["scores"], ["relu_scores"])], scores="relu_scores")
    with pytest.raises(ValueError, match="Relu node .* cannot prove where the key positions go"):
        add_past_padding_mask(model)


def test_a_softmax_over_another_axis_is_refused():
    with pytest.raises(ValueError, match="runs over axis 2 .* expected the keys last"):
        add_past_padding_mask(_attention(softmax_axis=2))


def test_a_past_with_a_static_length_is_refused():
    with pytest.raises(ValueError, match="not a named dynamic axis"):
        add_past_padding_mask(_attention(past_axis=5))


def test_a_position_table_sliced_at_the_past_length_is_refused():
    # Older exports read positions as table[past_len : past_len + 1], which this pass does not rewrite.
    positions = [
        helper.make_node(
            "Constant", [], ["one"], value=helper.make_tensor("one", TensorProto.INT64, [1], [1])
        ),
        helper.make_node("Shape", [_PAST_KEY], ["past_shape"]),
        helper.make_node("Gather", ["past_shape", "two"], ["past_length"], axis=0),
        helper.make_node("Add", ["past_length", "one"], ["past_end"]),
        helper.make_node(
            "Slice", ["decoder.embed_positions.weight", "past_length", "past_end"], ["position"]
        ),
        helper.make_node("Add", ["query", "position"], ["positioned_query"]),
    ]
    model = _attention(query_nodes=positions, query="positioned_query")
    with pytest.raises(ValueError, match="position table 'decoder.embed_positions.weight'"):
        add_past_padding_mask(model)


def test_a_merged_decoder_is_refused():
    past_shape = ["batch_size", _HEADS, "past_decoder_sequence_length", _HEAD_DIM]
    branch_output = [tensor_info("branch_key", TensorProto.FLOAT, past_shape)]
    branch = helper.make_graph(
        [helper.make_node("Identity", [_PAST_KEY], ["branch_key"])], "branch", [], branch_output
    )
    model = _attention()
    model.graph.node.insert(
        0,
        helper.make_node("If", ["use_cache"], ["cached_key"], then_branch=branch, else_branch=branch),
    )
    model.graph.input.append(tensor_info("use_cache", TensorProto.BOOL, []))
    model.graph.output.append(tensor_info("cached_key", TensorProto.FLOAT, past_shape))
    # The main graph reads the past only through the If: point at the unmerged decoder.
    model.graph.node[1].input[0] = "cached_key"
    with pytest.raises(ValueError, match="merged decoder"):
        add_past_padding_mask(model)


@settings(max_examples=30, deadline=None)
@given(real=st.integers(0, 12), extra=st.integers(0, 12), seed=st.integers(0, 2**16))
def test_property_any_left_padding_gives_the_unpadded_attention(real, extra, seed):
    """For random real past lengths (empty included) and any amount of left padding, the rewritten
    graph's outputs equal the original graph's on the unpadded past."""
    model = _attention()
    rewrite = add_past_padding_mask(model)
    unpadded, padded = _attention_feeds(real=real, padded=real + extra, seed=seed)
    expected = run_ort(model, unpadded)
    _assert_close(_real_part(run_ort(rewrite.model, padded), expected), expected, FP32_ATOL, "property")
