"""Same call, same outcome (issue 19): whether a call is served or refused, and what it returns, never
depends on what the cache or earlier calls stored, and never on the names an exporter gave dimensions.

Each call is made once with a fresh ``OPTIMUM_IPU_CACHE`` and once in a new session over a cache an
earlier session filled (with its padding proofs and verdicts), and compared with onnxruntime CPU. Inputs
that share a dimension name at different sizes are served where CPU onnxruntime serves them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from emulator_sessions import cpu_outputs, emulator_session
from onnx import TensorProto, helper

from optimum_ipu_backend.conformance.zoo import preprocessed_inputs
from optimum_ipu_backend.errors import InvalidFeedError
from optimum_ipu_backend.runtime.buckets import InputTooLargeError
from optimum_ipu_backend.session import IPUInferenceSession, create_session

ATOL = 1e-5


def _outcome(session: IPUInferenceSession, feed) -> tuple[str, object]:
    try:
        return "served", session.run(None, feed)
    except InvalidFeedError as exc:
        return "refused", f"{type(exc).__name__}: {exc}"


def _fresh_and_stored(onnx_dir: Path, tmp_path: Path, earlier, call, **options):
    """The outcome of ``call`` in a session over a fresh cache, and in a new session over a cache where
    an earlier session ran ``earlier`` (storing its proofs and verdicts)."""
    fresh = _outcome(emulator_session(onnx_dir, tmp_path / "fresh", **options), call)
    first = emulator_session(onnx_dir, tmp_path / "stored", **options)
    _outcome(first, earlier)
    first.close()
    assert any((tmp_path / "stored").rglob("padding-proofs/*/*.json")), "the earlier session stored proofs"
    stored = _outcome(emulator_session(onnx_dir, tmp_path / "stored", **options), call)
    return fresh, stored


def test_an_audio_call_is_served_alike_with_a_fresh_cache_and_with_stored_verdicts(zoo, tmp_path):
    """wav2vec2 exported with input_values alone, 1,600 samples (main refused it on a fresh cache and
    served it where an earlier run had stored the verdict "exact")."""
    onnx_dir = zoo.onnx("wav2vec2", "audio-frame-classification")
    rng = np.random.default_rng(0)
    earlier = {"input_values": (0.1 * rng.standard_normal((1, 400))).astype(np.float32)}
    call = {"input_values": (0.1 * rng.standard_normal((1, 1_600))).astype(np.float32)}
    fresh, stored = _fresh_and_stored(onnx_dir, tmp_path, earlier, call)
    assert fresh[0] == stored[0] == "served", (fresh, stored)
    (expected,) = cpu_outputs(onnx_dir, call)
    for outcome in (fresh, stored):
        (got,) = outcome[1]
        np.testing.assert_allclose(got, expected, atol=ATOL)
    np.testing.assert_array_equal(fresh[1][0], stored[1][0])


def test_a_convolution_text_model_past_its_plan_is_served_alike_in_both_cache_states(zoo, tmp_path):
    """ConvBERT's span convolution reads neighbouring positions: its sequence is compiled exactly, so a
    call past the plan's largest size is served (within the model's limit) whatever was stored."""
    model_dir = zoo.model("convbert", "token-classification")
    onnx_dir = zoo.onnx("convbert", "token-classification")
    earlier = preprocessed_inputs(model_dir, batch=1, seq=5)
    call = preprocessed_inputs(model_dir, batch=1, seq=40, seed=1)
    fresh, stored = _fresh_and_stored(onnx_dir, tmp_path, earlier, call, sequence_lengths="8,16")
    assert fresh[0] == stored[0] == "served", (fresh, stored)
    expected = cpu_outputs(onnx_dir, call)
    for outcome in (fresh, stored):
        np.testing.assert_allclose(outcome[1][0], expected[0], atol=ATOL)


def test_a_padded_dimension_past_its_plan_is_refused_alike_in_both_cache_states(zoo, tmp_path):
    model_dir = zoo.model("bert", "token-classification")
    onnx_dir = zoo.onnx("bert", "token-classification")
    earlier = preprocessed_inputs(model_dir, batch=1, seq=12)
    call = preprocessed_inputs(model_dir, batch=1, seq=40)
    fresh, stored = _fresh_and_stored(onnx_dir, tmp_path, earlier, call, sequence_lengths="8,16")
    assert fresh == stored
    assert fresh[0] == "refused" and fresh[1].startswith(InputTooLargeError.__name__)
    assert "provider_options={'sequence_lengths': '8,16," in fresh[1]


# -- inputs that share a dimension name ----------------------------------------------------------------


def _two_inputs(path: Path, combine: str) -> Path:
    """Two inputs both labelled [batch_size, sequence_length]. ``combine="separate"``: each is reduced over
    its own sequence, then the two are added (sizes may differ); ``"elementwise"``: they are added as they
    are, which requires the sizes to agree."""
    shape = ["batch_size", "sequence_length"]
    if combine == "separate":
        nodes = [
            helper.make_node("ReduceSum", ["a"], ["sum_a"], axes=[1], keepdims=0),
            helper.make_node("ReduceMax", ["b"], ["max_b"], axes=[1], keepdims=0),
            helper.make_node("Add", ["sum_a", "max_b"], ["y"]),
        ]
        output = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size"])
    else:
        nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
        output = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    graph = helper.make_graph(
        nodes,
        f"shared_label_{combine}",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, shape),
        ],
        [output],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]), path)
    return path


def _ipu(path: Path, cache: Path):
    return create_session(
        str(path),
        providers=["ipu"],
        provider_options={"device": "emulator", "executable_cache_dir": str(cache)},
    )


def test_inputs_sharing_a_dimension_name_at_different_sizes_get_cpu_outputs(tmp_path):
    path = _two_inputs(tmp_path / "separate.onnx", "separate")
    rng = np.random.default_rng(0)
    session = _ipu(path, tmp_path / "cache")
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, a_size, b_size in ((2, 25, 98), (3, 7, 5), (2, 9, 9)):
        feed = {
            "a": rng.standard_normal((batch, a_size)).astype(np.float32),
            "b": rng.standard_normal((batch, b_size)).astype(np.float32),
        }
        (expected,) = cpu.run(None, feed)  # CPU accepts the disagreeing sizes
        (got,) = session.run(None, feed)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=ATOL)


def test_inputs_whose_dataflow_requires_equal_sizes_are_refused_like_cpu(tmp_path):
    path = _two_inputs(tmp_path / "elementwise.onnx", "elementwise")
    rng = np.random.default_rng(0)
    feed = {
        "a": rng.standard_normal((1, 25)).astype(np.float32),
        "b": rng.standard_normal((1, 98)).astype(np.float32),
    }
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's own error type for a broadcast failure
        cpu.run(None, feed)
    session = _ipu(path, tmp_path / "cache")
    with pytest.raises(Exception) as info:  # noqa: B017 - any clear error, never a result
        session.run(None, feed)
    assert "25" in str(info.value) and "98" in str(info.value)
    # agreeing sizes still pad and serve as before
    same = {"a": feed["a"], "b": rng.standard_normal((1, 25)).astype(np.float32)}
    np.testing.assert_allclose(session.run(None, same)[0], cpu.run(None, same)[0], atol=ATOL)
