"""Dimension names are labels, not sizes (issue 11, pattern 3).

optimum's image-to-text export declares its decoder-with-past ``logits`` as ``['batch_size', '1', vocab]``
and names the new tokens ``decoder_sequence_length`` beside a past called ``past_sequence_length``. The
runtime must (1) size a ``dim_param`` that reads as a number from the feed, as onnxruntime does, and (2) run
each one-token generation step unpadded, whatever its dimensions are called. Each test runs a minimal
decoder-with-past graph through ``IPUInferenceSession`` on the emulator against onnxruntime CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.runtime.buckets import BucketPlan
from optimum_ipu_backend.runtime.dim_expressions import DimExpression
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.runtime.padding import infer_dims
from optimum_ipu_backend.runtime.roles import generation_step_dims
from optimum_ipu_backend.session import IPUInferenceSession

ATOL = 1e-5
VOCAB = 11
HIDDEN = 4


def decoder_with_past(path: Path, new: str, past: str, logits_new: str, present_new: str) -> Path:
    """A one-layer decoder step with a cache, its axes named as an exporter might name them: ``new`` on
    ``input_ids``, ``past`` on the cache, and the new tokens called ``logits_new`` / ``present_new`` on the
    outputs (optimum writes '1' and 'sequence_length' there). ``logits`` mixes the mean of the past into
    every new token, so a wrong past or a padded token shows in it."""
    rng = np.random.default_rng(0)
    embedding = numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "embedding")
    head = numpy_helper.from_array(rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32), "head")
    nodes = [
        helper.make_node("Gather", ["embedding", "input_ids"], ["embedded"]),
        helper.make_node("ReduceMean", ["past_key_values.0.key"], ["past_mean"], axes=[1], keepdims=1),
        helper.make_node("Add", ["embedded", "past_mean"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "head"], ["logits"]),
        helper.make_node("Concat", ["past_key_values.0.key", "embedded"], ["present.0.key"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "decoder_with_past",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", new]),
            helper.make_tensor_value_info(
                "past_key_values.0.key", TensorProto.FLOAT, ["batch_size", past, HIDDEN]
            ),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", logits_new, VOCAB]),
            helper.make_tensor_value_info(
                "present.0.key", TensorProto.FLOAT, ["batch_size", f"{past} + {present_new}", HIDDEN]
            ),
        ],
        [embedding, head],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _feed(batch: int, new: int, past: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, VOCAB, (batch, new)),
        "past_key_values.0.key": rng.standard_normal((batch, past, HIDDEN)).astype(np.float32),
    }


def _compare(path: Path, cache: Path, feeds: list[dict[str, np.ndarray]]) -> IPUInferenceSession:
    options = IPUProviderOptions.parse(
        {"device": "emulator", "executable_cache_dir": str(cache), "sequence_lengths": "8,16"}, path.parent
    )
    session = IPUInferenceSession(str(path), options=options)
    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for feed in feeds:
        expected = reference.run(None, feed)
        got = session.run(None, feed)
        for want, have in zip(expected, got, strict=True):
            assert have.shape == want.shape
            np.testing.assert_allclose(have, want, atol=ATOL, rtol=0)
    return session


def test_a_bare_number_dim_param_is_a_name_sized_by_the_feed() -> None:
    expression = DimExpression.parse("1")
    assert expression.symbols == {"1"} and expression.is_single_name
    assert expression.evaluate({"1": 3}) == 3
    assert DimExpression.parse("past_sequence_length + 1").evaluate({"past_sequence_length": 4}) == 5
    shapes = {"input_ids": ("batch_size", "1")}
    assert infer_dims({"input_ids": np.zeros((2, 3), np.int64)}, shapes) == {"batch_size": 2, "1": 3}


def test_an_input_axis_labelled_1_takes_any_size_onnxruntime_takes(tmp_path: Path) -> None:
    """Fails on a runtime that reads '1' as a size: it refuses the 3-token feed onnxruntime runs."""
    path = decoder_with_past(tmp_path / "model.onnx", "1", "past_sequence_length", "1", "1")
    _compare(path, tmp_path / "cache", [_feed(2, 1, 5), _feed(2, 3, 5)])


def test_the_image_to_text_decoder_step_runs_unpadded(tmp_path: Path) -> None:
    """optimum's image-to-text names: the new tokens ``decoder_sequence_length``, the past
    ``past_sequence_length``, ``logits`` ``['batch_size', '1', vocab]``. A one-token step must compile at
    one token, not at the smallest sequence bucket."""
    path = decoder_with_past(
        tmp_path / "model.onnx", "decoder_sequence_length", "past_sequence_length", "1", "sequence_length"
    )
    session = _compare(path, tmp_path / "cache", [_feed(2, 1, 5), _feed(2, 1, 6), _feed(1, 3, 4)])
    new_tokens = sorted({c["shapes"]["input_ids"][1] for c in session.compiled_executables()})
    assert new_tokens == [1, 8]  # the steps unpadded; the 3-token call in the smallest bucket
    assert session.bucket_sizes()["decoder_sequence_length"][:2] == [1, 8]


def test_generation_step_dims_come_from_input_roles_not_dimension_names() -> None:
    assert generation_step_dims(
        {"input_ids": ("batch_size", "decoder_sequence_length"), "past_key_values.0.key": ("b", "p")}
    ) == {"decoder_sequence_length"}
    assert generation_step_dims(
        {
            "input_ids": ("batch_size", "whatever"),
            "position_ids": ("batch_size", "n"),
            "past_key_values.0.value": ("p",),
        }
    ) == {"whatever", "n"}
    # without a cache there is no generation step: an encoder's one-token call pads like any other
    assert generation_step_dims({"input_ids": ("batch_size", "sequence_length")}) == frozenset()
    plan = BucketPlan.for_dims({}, ["batch_size", "sequence_length"])
    assert 1 not in plan.sizes["sequence_length"]


# Labels an exporter could give the new tokens: identifiers, and names that read as numbers.
_LABELS = st.one_of(
    st.from_regex(r"[a-z][a-z_]{0,12}", fullmatch=True),
    st.integers(1, 9).map(str),
).filter(
    lambda label: label not in ("batch_size", "past_sequence_length") and not label.endswith("_batch_size")
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    new=_LABELS,
    logits_new=_LABELS,
    batch=st.integers(1, 3),
    past=st.integers(1, 9),
    steps=st.integers(1, 3),
)
def test_one_token_steps_match_cpu_and_are_never_padded_whatever_the_labels(
    tmp_path_factory: pytest.TempPathFactory, new: str, logits_new: str, batch: int, past: int, steps: int
) -> None:
    directory = tmp_path_factory.mktemp("labels")
    path = decoder_with_past(directory / "model.onnx", new, "past_sequence_length", logits_new, logits_new)
    feeds = [_feed(batch, 1, past + step, seed=step) for step in range(steps)]
    session = _compare(path, directory / "cache", feeds)
    assert {c["shapes"]["input_ids"][1] for c in session.compiled_executables()} == {1}
