"""Dimensions compiled at exact sizes (issue 19): no size plan bounds them, and the session says what they
cost.

A dimension whose padding the proof does not show invisible is compiled at the size each call brings. Its
plan's largest size must not refuse a call (only the model's own limit may), while a padded dimension past
its plan is still refused naming the option that raises it. Where an axis is compiled per length, the
session logs one WARNING naming the node that forces it and what to do about it. Every served call is
compared with onnxruntime CPU on the same export.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from audio_zoo import audio_inputs, real_size_zoo
from emulator_sessions import cpu_outputs, emulator_session
from onnx import TensorProto, helper

from optimum_ipu_backend.conformance.zoo import preprocessed_inputs
from optimum_ipu_backend.runtime.buckets import InputTooLargeError
from optimum_ipu_backend.session import create_session

ATOL = 1e-5
DECISIONS_LOGGER = "optimum_ipu_backend.runtime.padding"


@pytest.fixture(scope="module")
def w2v_group(zoo) -> Path:
    """wav2vec2-base's convolution stack with its group norm (tests/audio_zoo.py): the first
    convolution's output is normalised over time, so the samples axis stays exact."""
    return real_size_zoo(zoo).onnx("wav2vec2-group-ctc")


@pytest.fixture(scope="module")
def bert_task() -> str:
    return "token-classification"


@pytest.mark.parametrize("samples", [16_000, 480_000])
def test_an_exact_samples_axis_past_the_old_text_limit_is_served_and_matches_cpu(
    w2v_group, tmp_path, samples
):
    """1 s and 30 s of 16 kHz audio with default provider options (main refused anything over 512)."""
    session = emulator_session(w2v_group, tmp_path)
    feed = audio_inputs(samples, seed=samples)
    (got,) = session.run(None, feed)
    (expected,) = cpu_outputs(w2v_group, feed)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=ATOL)
    assert session.padding_verdicts()["sequence_length"].startswith("exact sizes:")
    # compiled at the size it came in, not padded to a plan size
    assert [tuple(entry["shapes"]["input_values"]) for entry in session.compiled_executables()] == [
        (1, samples)
    ]


def test_a_padded_dimension_past_its_plan_is_refused_naming_the_option(bert, tmp_path):
    model_dir, onnx_dir = bert
    session = emulator_session(onnx_dir, tmp_path, sequence_lengths="8,16")
    with pytest.raises(InputTooLargeError) as info:
        session.run(None, preprocessed_inputs(model_dir, batch=1, seq=40))
    message = str(info.value)
    assert "sequence_length 40" in message and "largest compiled sequence length is 16" in message
    assert "raise it with provider_options={'sequence_lengths': '8,16," in message
    assert session.padding_verdicts()["sequence_length"] == "padded (proven)"


def _centred_graph(path: Path, extra_dim: str) -> Path:
    """y = x - mean(x over the sequence): every output position reads the mean over all positions, so
    padding the sequence changes every real element and the sequence is compiled exactly. ``extra_dim``:
    a third axis no plan sizes, whose size only a call gives."""
    shape = ["batch_size", "sequence_length", extra_dim]
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["mean"], axes=[1], keepdims=1, name="sequence_mean"),
            helper.make_node("Sub", ["x", "mean"], ["y"]),
        ],
        "centred",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return path


def _exact_warnings(caplog) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == DECISIONS_LOGGER
        and record.levelno == logging.WARNING
        and "compiled at the exact size" in record.getMessage()
    ]


def test_an_exact_audio_axis_is_reported_once_at_session_creation(w2v_group, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=DECISIONS_LOGGER)
    session = emulator_session(w2v_group, tmp_path)
    (warning,) = _exact_warnings(caplog)  # at creation, before any call
    assert "input 'input_values' axis 1 (sequence_length)" in warning
    assert "InstanceNormalization" in warning  # the node that forces it
    assert "every distinct length compiles its own executable" in warning
    assert "chunk_length_s" in warning and "max_executables" in warning
    for samples in (1_600, 2_000):
        session.run(None, audio_inputs(samples, seed=samples))
    assert len(_exact_warnings(caplog)) == 1  # once per session


def test_a_padded_text_model_logs_no_exact_warning(bert, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=DECISIONS_LOGGER)
    model_dir, onnx_dir = bert
    session = emulator_session(onnx_dir, tmp_path, sequence_lengths="8,16")
    session.run(None, preprocessed_inputs(model_dir, batch=1, seq=5))
    assert _exact_warnings(caplog) == []


def test_an_exact_axis_beside_an_unplanned_one_is_reported_at_its_first_call(tmp_path, caplog):
    """With an axis no plan sizes (its size only a call gives), the verdict waits for the first call."""
    caplog.set_level(logging.WARNING, logger=DECISIONS_LOGGER)
    path = _centred_graph(tmp_path / "model.onnx", extra_dim="width")
    session = create_session(
        str(path),
        providers=["ipu"],
        provider_options={"device": "emulator", "executable_cache_dir": str(tmp_path / "cache")},
    )
    assert _exact_warnings(caplog) == []
    x = np.random.default_rng(0).standard_normal((1, 5, 3)).astype(np.float32)
    (got,) = session.run(None, {"x": x})
    np.testing.assert_allclose(got, x - x.mean(axis=1, keepdims=True), atol=ATOL)
    (warning,) = _exact_warnings(caplog)
    assert "input 'x' axis 1 (sequence_length)" in warning and "sequence_mean" in warning
    session.run(None, {"x": x[:, :3]})
    assert len(_exact_warnings(caplog)) == 1


def test_the_samples_axis_gets_the_audio_plan_at_the_feature_extractors_rate(w2v_group, tmp_path):
    from optimum_ipu_backend.runtime.buckets import audio_sample_sizes
    from optimum_ipu_backend.runtime.open import sampling_rate

    session = emulator_session(w2v_group, tmp_path)
    assert session._runner.plan.sizes["sequence_length"] == audio_sample_sizes(16000)
    assert session._runner.plan.limits["sequence_length"] is None
    (tmp_path / "preprocessor_config.json").write_text('{"sampling_rate": 8000}')
    assert sampling_rate(tmp_path) == 8000
    assert sampling_rate(tmp_path / "missing") == 16000
