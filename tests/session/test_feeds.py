"""Bad feeds get a clear error before anything reaches the device (issue 12), checked on zoo models
against CPU onnxruntime: empty batches and sequences, token ids outside their table, masks that
padding cannot serve, and failures below the session that name the call."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession
from optimum_ipu_backend.session.inference_session import InvalidFeedError


@pytest.fixture(scope="module")
def bert(zoo):
    return zoo.onnx("bert", "text-classification")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("executables")


def _session(onnx_dir, cache, **options) -> IPUInferenceSession:
    options = {"device": "emulator", "executable_cache_dir": str(cache), **options}
    return IPUInferenceSession(
        str(onnx_dir / "model.onnx"), options=IPUProviderOptions.parse(options, onnx_dir)
    )


@pytest.fixture(scope="module")
def session(bert, cache):
    return _session(bert, cache, batch_size="2", sequence_lengths="8,16")


def _cpu(onnx_dir):
    return ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])


def _text_feed(ids: np.ndarray, token_type: int = 0) -> dict[str, np.ndarray]:
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.full_like(ids, token_type),
    }


@pytest.fixture()
def device_never_runs(session, monkeypatch):
    """Fails the test if a device step is run."""

    def refuse(*args, **kwargs):
        raise AssertionError("the feed reached the device")

    monkeypatch.setattr(session._runner._table, "run_step", refuse)


# -- the three cases of issue 12 --------------------------------------------------------------------


def test_an_empty_batch_is_a_clear_error(session, device_never_runs):
    with pytest.raises(
        InvalidFeedError, match=r"input 'input_ids' is empty: size 0 on axis 0 \(batch_size\)"
    ):
        session.run(None, _text_feed(np.ones((0, 10), np.int64)))


def test_a_zero_length_sequence_is_refused_as_cpu_onnxruntime_refuses_it(session, bert, device_never_runs):
    feed = _text_feed(np.ones((1, 0), np.int64))
    with pytest.raises(Exception, match="Gather"):  # CPU onnxruntime: the pooler's Gather has nothing to read
        _cpu(bert).run(None, feed)
    with pytest.raises(
        InvalidFeedError, match=r"input 'input_ids' is empty: size 0 on axis 1 \(sequence_length\)"
    ):
        session.run(None, feed)


def test_a_token_id_outside_the_vocabulary_never_reaches_the_device(session, bert, device_never_runs):
    vocab = json.loads((bert / "config.json").read_text())["vocab_size"]
    ids = np.full((1, 4), 7, np.int64)
    ids[0, 2] = 10**6
    with pytest.raises(ValueError) as info:
        session.run(None, _text_feed(ids))
    message = str(info.value)
    assert isinstance(info.value, InvalidFeedError)
    assert "input 'input_ids' holds 1000000 at position [0, 2]" in message
    assert f"the {vocab} entries of 'bert.embeddings.word_embeddings.weight'" in message
    assert f"[{-vocab}, {vocab - 1}]" in message


# -- index ranges ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, value, table",
    [
        ("input_ids", None, "word_embeddings"),  # one past the start counted from the end: -(vocab + 1)
        ("token_type_ids", 2, "token_type_embeddings"),
        ("token_type_ids", -3, "token_type_embeddings"),
    ],
)
def test_every_index_input_is_checked_against_its_own_table(
    session, bert, device_never_runs, name, value, table
):
    if value is None:
        value = -json.loads((bert / "config.json").read_text())["vocab_size"] - 1
    feed = _text_feed(np.full((2, 5), 3, np.int64))
    feed[name][1, 4] = value
    with pytest.raises(
        InvalidFeedError, match=rf"input '{name}' holds {value} at position \[1, 4\].*{table}"
    ):
        session.run(None, feed)


def test_the_checked_inputs_come_from_the_graph(session):
    assert set(session._validate_feed.index_checked_inputs) == {"input_ids", "token_type_ids"}


@pytest.mark.parametrize("token_type", [1, -1])
def test_ids_at_both_ends_of_their_tables_are_served_like_cpu(session, bert, token_type):
    # negative ids count from the end of the table, as onnxruntime counts them
    vocab = json.loads((bert / "config.json").read_text())["vocab_size"]
    ids = np.array([[0, vocab - 1, 5, -1], [vocab - 1, 0, 9, -vocab]], np.int64)
    feed = _text_feed(ids, token_type=token_type)
    np.testing.assert_allclose(session.run(None, feed)[0], _cpu(bert).run(None, feed)[0], atol=1e-5)


# -- masks padding relies on (the fuzzing's first finding) ------------------------------------------


@pytest.mark.parametrize("value", [0, -1, 2])
def test_a_row_that_hides_every_position_is_served_like_cpu(session, bert, value):
    # Padded to 8 positions, a row whose mask hides all its own positions would attend to the padding;
    # the runtime must notice (the padding proof assumes 0/1 masks with something visible) and not pad.
    feed = _text_feed(np.full((2, 3), 5, np.int64))
    feed["attention_mask"][1] = value
    np.testing.assert_allclose(session.run(None, feed)[0], _cpu(bert).run(None, feed)[0], atol=1e-5)


def test_unusual_memory_layouts_are_served_like_cpu(session, bert):
    rng = np.random.default_rng(0)
    feed = _text_feed(rng.integers(0, 100, size=(2, 6)), token_type=1)
    feed["attention_mask"][1, 4:] = 0
    expected = _cpu(bert).run(None, feed)[0]
    readonly = feed["token_type_ids"].copy()
    readonly.flags.writeable = False
    layouts = {
        "input_ids": np.asfortranarray(feed["input_ids"]),
        "attention_mask": np.repeat(feed["attention_mask"], 2, axis=1)[:, ::2],
        "token_type_ids": readonly,
    }
    np.testing.assert_allclose(session.run(None, layouts)[0], expected, atol=1e-5)
    rows = {name: np.broadcast_to(array[:1], array.shape) for name, array in feed.items()}  # zero strides
    np.testing.assert_allclose(
        session.run(None, rows)[0], _cpu(bert).run(None, {k: v.copy() for k, v in rows.items()})[0], atol=1e-5
    )


# -- failures below the session name the call -------------------------------------------------------


@pytest.fixture(scope="module")
def vit(zoo, cache):
    onnx_dir = zoo.onnx("vit", "image-classification")
    return onnx_dir, _session(onnx_dir, cache, batch_size="1")


def test_an_image_size_the_graph_cannot_take_names_the_input(vit):
    from optimum_ipu_backend.errors import UnsupportedModelError

    onnx_dir, session = vit
    pixels = np.zeros((1, 3, 16, 16), np.float32)
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's own error type
        _cpu(onnx_dir).run(None, {"pixel_values": pixels})
    with pytest.raises(UnsupportedModelError, match=r"input 'pixel_values' float32\[1, 3, 16, 16\]"):
        session.run(None, {"pixel_values": pixels})


def test_an_engine_failure_is_a_device_error_naming_the_call(vit):
    from optimum_ipu_backend.errors import DeviceError

    onnx_dir, session = vit
    pixels = np.zeros((1, 1, 32, 32), np.float32)  # one channel where the patch embedding takes three
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's own error type
        _cpu(onnx_dir).run(None, {"pixel_values": pixels})
    with pytest.raises(
        DeviceError, match=r"'emulator' engine failed on this call \(input 'pixel_values'"
    ) as info:
        session.run(None, {"pixel_values": pixels})
    assert isinstance(info.value, RuntimeError) and info.value.__cause__ is not None


def test_nan_and_inf_in_float_inputs_pass_through_as_on_cpu(vit):
    onnx_dir, session = vit
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    pixels[0, 1, 5, 7] = np.nan
    pixels[1, 0, 0, 0] = np.inf
    expected = _cpu(onnx_dir).run(None, {"pixel_values": pixels})[0]
    got = session.run(None, {"pixel_values": pixels})[0]
    assert np.isnan(expected).any()  # the feed is not trivially finite on CPU either
    np.testing.assert_allclose(got, expected, atol=1e-5, equal_nan=True)
