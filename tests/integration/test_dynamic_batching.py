"""The dynamic batcher through a real session on the emulator: many threads, each call its own result.

Calls from several threads are gathered into shared device steps (``runtime.batched_serving``), packed
into shared rows where the packing proof holds (``runtime.packing``). Every caller must get exactly what
its own call gives on CPU (real positions; masked positions of a packed call are zeros, as with
``trim_padding``), an invalid call fails alone, and closing the session releases queued calls.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from emulator_sessions import emulator_session

from optimum_ipu_backend.errors import DeviceError, InvalidFeedError

# Few compiled sizes keep the number of packed executables small (rows of 32..128 tokens, 1..8 rows).
SIZES = {"sequence_lengths": "32,64,128", "batch_size": "1,2,4,8"}
ATOL = 1e-5
THREADS, CALLS = 16, 50


@pytest.fixture(scope="module")
def bert_text(zoo) -> Path:
    return zoo.onnx("bert", "text-classification")


@pytest.fixture(scope="module")
def bert_tokens(zoo) -> Path:
    return zoo.onnx("bert", "token-classification")


def _call(rng: np.random.Generator, rows: int, width: int, vocab: int) -> dict[str, np.ndarray]:
    """A tokenizer-like call: ``rows`` sequences of random lengths, right-padded to ``width``."""
    lengths = rng.integers(2, width + 1, rows)
    lengths[rng.integers(rows)] = width  # padded to its longest row, as a tokenizer pads
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(5, vocab, (rows, width)) * mask
    types = rng.integers(0, 2, (rows, width)) * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def _expected(cpu: ort.InferenceSession, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return cpu.run(None, feed)


def _check(got: list[np.ndarray], want: list[np.ndarray], mask: np.ndarray) -> None:
    for result, reference in zip(got, want, strict=True):
        assert result.shape == reference.shape
        if result.ndim >= 2 and result.shape[:2] == mask.shape:  # token outputs: the real positions
            real = mask.astype(bool)
            np.testing.assert_allclose(result[real], reference[real], atol=ATOL, rtol=0)
        else:
            np.testing.assert_allclose(result, reference, atol=ATOL, rtol=0)


def _packed_steps(session) -> int:
    return sum(entry["calls"] for entry in session.compiled_executables() if entry.get("packed"))


# A pooled head (classification) at the full count, a token head (token classification) at a few calls.
@pytest.mark.parametrize(("onnx_dir", "calls"), [("bert_text", CALLS), ("bert_tokens", 10)])
def test_many_threads_each_get_their_own_result(onnx_dir, calls, request, tmp_path):
    """16 threads x 50 calls of mixed sizes (one sequence or several, padded or not): every caller gets
    its own call's CPU result, and calls share packed device steps."""
    onnx_dir = request.getfixturevalue(onnx_dir)
    vocab = 100
    cpu = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    session = emulator_session(onnx_dir, tmp_path, dynamic_batching="1", max_queue_delay_ms="5", **SIZES)
    assert session.packing_verdict().startswith("packed rows (proven)")
    barrier = threading.Barrier(THREADS)

    def client(thread: int) -> int:
        rng = np.random.default_rng(thread)
        feeds = [
            _call(rng, int(rng.choice([1, 1, 1, 3, 8])), int(rng.integers(4, 128)), vocab)
            for _ in range(calls)
        ]
        barrier.wait()
        for feed in feeds:
            _check(session.run(None, feed), _expected(cpu, feed), feed["attention_mask"])
        return len(feeds)

    with ThreadPoolExecutor(THREADS) as pool:
        assert sum(pool.map(client, range(THREADS))) == THREADS * calls
    steps = _packed_steps(session)
    assert 0 < steps < THREADS * calls / 2, f"{steps} packed steps for {THREADS * calls} calls"
    session.close()


def test_an_invalid_call_fails_alone(bert_text, tmp_path):
    """A token id outside the vocabulary (refused before queueing) and a sequence longer than the
    longest row (refused when its group runs) each raise in their own call; the calls beside them get
    their results."""
    cpu = ort.InferenceSession(str(bert_text / "model.onnx"), providers=["CPUExecutionProvider"])
    session = emulator_session(bert_text, tmp_path, dynamic_batching="1", max_queue_delay_ms="50", **SIZES)
    rng = np.random.default_rng(0)
    good = [_call(rng, 2, 20, 100) for _ in range(6)]
    out_of_vocabulary = {**good[0], "input_ids": good[0]["input_ids"] + 10_000}
    too_long = _call(rng, 1, 200, 100)
    feeds = [*good[:3], out_of_vocabulary, too_long, *good[3:]]
    barrier = threading.Barrier(len(feeds))

    def client(feed):
        barrier.wait()
        try:
            return session.run(None, feed)
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(len(feeds)) as pool:
        results = list(pool.map(client, feeds))
    assert isinstance(results[3], InvalidFeedError) and "input_ids" in str(results[3])
    assert isinstance(results[4], Exception) and "128" in str(results[4])
    for feed, result in zip(feeds, results, strict=True):
        if feed is not out_of_vocabulary and feed is not too_long:
            _check(result, _expected(cpu, feed), feed["attention_mask"])
    session.close()


def test_closing_releases_queued_calls(bert_text, tmp_path):
    """Calls waiting in the batcher when the session closes fail with a clear error; none stays blocked."""
    session = emulator_session(bert_text, tmp_path, dynamic_batching="1", max_queue_delay_ms="60000", **SIZES)
    rng = np.random.default_rng(1)
    feeds = [_call(rng, 1, 10, 100) for _ in range(4)]
    errors: list[BaseException] = []

    def client(feed):
        try:
            session.run(None, feed)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(feed,)) for feed in feeds]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # the calls are queued: a full minute of delay and far from a full step
    started = time.monotonic()
    session.close()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert time.monotonic() - started < 30
    assert len(errors) == len(feeds)
    assert all(isinstance(error, DeviceError) and "closed" in str(error) for error in errors)


def test_a_refused_model_is_batched_unpacked_and_says_why(zoo, tmp_path):
    """ConvBERT's convolution reads neighbouring positions: packing is refused naming the node, and
    calls of one shape are still batched together, each with its own CPU result."""
    onnx_dir = zoo.onnx("convbert", "token-classification")
    session = emulator_session(onnx_dir, tmp_path, dynamic_batching="1", max_queue_delay_ms="200", **SIZES)
    verdict = session.packing_verdict()
    assert verdict.startswith("not packed") and "Conv" in verdict
    assert all(entry["packing"] == verdict for entry in session.compiled_executables())
    cpu = ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    feeds = [{**_call(rng, 1, 24, 100), "attention_mask": np.ones((1, 24), dtype=np.int64)} for _ in range(8)]
    barrier = threading.Barrier(len(feeds))

    def client(feed):
        barrier.wait()
        return session.run(None, feed)

    with ThreadPoolExecutor(len(feeds)) as pool:
        results = list(pool.map(client, feeds))
    for feed, result in zip(feeds, results, strict=True):
        _check(result, _expected(cpu, feed), feed["attention_mask"])
    calls = sum(entry["calls"] for entry in session.compiled_executables())
    assert calls < len(feeds), f"{calls} device steps for {len(feeds)} calls of one shape"
    session.close()


def test_max_executables_bounds_the_packed_layouts(bert_text, tmp_path):
    """Packed groups choose among the executables already compiled once ``max_executables`` is reached,
    and every call still gets its own result."""
    cpu = ort.InferenceSession(str(bert_text / "model.onnx"), providers=["CPUExecutionProvider"])
    session = emulator_session(
        bert_text, tmp_path, dynamic_batching="1", max_queue_delay_ms="20", max_executables="2", **SIZES
    )
    rng = np.random.default_rng(3)
    first = _call(rng, 8, 128, 100)  # 8 rows of 128: the largest layout, compiled first
    _check(session.run(None, first), _expected(cpu, first), first["attention_mask"])
    feeds = [_call(rng, int(rng.integers(1, 4)), int(rng.integers(4, 128)), 100) for _ in range(24)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda feed: session.run(None, feed), feeds))
    for feed, result in zip(feeds, results, strict=True):
        _check(result, _expected(cpu, feed), feed["attention_mask"])
    assert len(session.compiled_executables()) <= 2
    session.close()


def test_the_serving_plans_first_layout_computes_only_the_rows_a_group_fills(bert_tokens, tmp_path):
    """serving_plan="cost": until the plan exists, groups run on the first layout, the longest rows at
    one row per step, so a group computes the rows it fills as consecutive steps, never a step of 8 rows
    it cannot fill; every caller gets its CPU result."""
    cpu = ort.InferenceSession(str(bert_tokens / "model.onnx"), providers=["CPUExecutionProvider"])
    session = emulator_session(bert_tokens, tmp_path, dynamic_batching="1", serving_plan="cost", **SIZES)
    barrier = threading.Barrier(8)

    def client(thread: int) -> int:
        rng = np.random.default_rng(thread)
        feeds = [_call(rng, 1, int(rng.integers(4, 60)), 100) for _ in range(3)]
        barrier.wait()
        for feed in feeds:
            _check(session.run(None, feed), _expected(cpu, feed), feed["attention_mask"])
        return len(feeds)

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(client, range(8))) == 24
    packed = {tuple(e["shapes"]["input_ids"]): e for e in session.compiled_executables() if e.get("packed")}
    planned = {(micro, tokens) for tokens, micro in session.serving_plan()["packed"]["plan"]}
    assert packed[(1, 128)]["calls"] > 0  # the first layout served the groups before the plan
    assert not {shape for shape in packed if shape[0] > 1} - planned
    session.close()
