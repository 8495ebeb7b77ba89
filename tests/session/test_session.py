"""The InferenceSession surface of IPUInferenceSession, on a small opset-11 graph built here."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from optimum_ipu_backend.compiler.errors import LegalizationError
from optimum_ipu_backend.engines.probe import DeviceUnavailableError
from optimum_ipu_backend.runtime.boundary import BoundaryCastError
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions, ProviderOptionError
from optimum_ipu_backend.session import IPUInferenceSession, create_session
from optimum_ipu_backend.session.inference_session import InvalidFeedError

EMULATOR = {"device": "emulator"}


def _model(custom_op: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], rng.standard_normal(12).astype(np.float32))
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
        helper.make_node("Relu", ["xw"], ["y"], name="relu"),
        helper.make_node("Add", ["input_ids", "one"], ["ids_plus_one"], name="add"),
    ]
    if custom_op:
        nodes.append(helper.make_node("FusedGelu", ["y"], ["z"], domain="com.microsoft", name="fused"))
    graph = helper.make_graph(
        nodes,
        "tiny",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", 4]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", 3]),
            helper.make_tensor_value_info(
                "ids_plus_one", TensorProto.INT64, ["batch_size", "sequence_length"]
            ),
        ],
        [weight, one],
    )
    opsets = [helper.make_opsetid("", 11)] + ([helper.make_opsetid("com.microsoft", 1)] if custom_op else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=7)


@pytest.fixture()
def model_path(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(_model(), path)
    return str(path)


@pytest.fixture()
def session(model_path):
    return IPUInferenceSession(model_path, options=IPUProviderOptions.parse(EMULATOR))


def _feed(batch=2, seq=5, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, 1000, size=(batch, seq), dtype=np.int64),
        "x": rng.standard_normal((batch, 4)).astype(np.float32),
    }


def test_io_metadata_matches_onnxruntime(session, model_path):
    reference = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    for ours, theirs in (
        (session.get_inputs(), reference.get_inputs()),
        (session.get_outputs(), reference.get_outputs()),
    ):
        assert [(a.name, a.shape, a.type) for a in ours] == [(b.name, b.shape, b.type) for b in theirs]
    assert session._model_path == model_path


def test_run_matches_cpu_and_keeps_declared_dtypes(session, model_path):
    reference = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    for batch, seq in ((2, 5), (1, 7), (2, 5)):
        feed = _feed(batch, seq)
        expected = reference.run(None, feed)
        got = session.run(None, feed)
        assert [g.dtype for g in got] == [e.dtype for e in expected]
        np.testing.assert_allclose(got[0], expected[0], atol=1e-6)
        np.testing.assert_array_equal(got[1], expected[1])
    # Every output element is position-wise here, so the padding proof lets both dimensions be padded:
    # one executable per compiled shape (batch 1 or 2, sequence 8), reused for repeated shapes.
    calls = sorted((tuple(s["shapes"]["input_ids"]), s["calls"]) for s in session.compiled_executables())
    assert calls == [((1, 8), 1), ((2, 8), 2)]
    assert session.padding_verdicts() == {
        "batch_size": "padded (proven)",
        "sequence_length": "padded (proven)",
    }
    assert session.run(["ids_plus_one"], _feed())[0].shape == (2, 5)


def test_provider_reporting_says_emulation(session):
    providers = session.get_providers()
    assert providers == ["IPUExecutionProvider"]
    assert "emulat" in repr(providers)
    options = session.get_provider_options()["IPUExecutionProvider"]
    assert (
        options["device"] == "emulator"
        and options["emulated"] == "1"
        and "not IPU results" in options["note"]
    )
    assert all(isinstance(v, str) for v in options.values())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda f: f.pop("x"), "missing \\['x'\\]"),
        (lambda f: f.update(extra=np.zeros(1)), "unknown \\['extra'\\]"),
        (lambda f: f.update(x=f["x"].astype(np.float64)), "input 'x' has dtype float64"),
        (
            lambda f: f.update(input_ids=f["input_ids"].astype(np.float32)),
            "input 'input_ids' has dtype float32",
        ),
        (lambda f: f.update(x=f["x"][None]), "input 'x' has rank 3"),
        (lambda f: f.update(x=np.zeros((2, 5), np.float32)), "input 'x' has size 5 on axis 1"),
    ],
)
def test_bad_feeds_name_the_input(session, mutate, message):
    feed = _feed()
    mutate(feed)
    with pytest.raises(InvalidFeedError, match=message):
        session.run(None, feed)


def test_safe_casts_are_accepted(session, model_path):
    feed = _feed()
    feed["input_ids"] = feed["input_ids"].astype(np.int32)
    reference = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"]).run(None, _feed())
    np.testing.assert_array_equal(session.run(None, feed)[1], reference[1])


def test_int64_values_that_do_not_fit_the_device_are_refused(session):
    feed = _feed()
    feed["input_ids"][0, 0] = 2**40
    with pytest.raises(BoundaryCastError, match="input 'input_ids'.*int32"):
        session.run(None, feed)


def test_run_is_thread_safe(session, model_path):
    reference = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for step in range(10):
                feed = _feed(batch=1 + (seed + step) % 3, seq=3 + seed % 4, seed=seed * 100 + step)
                expected = reference.run(None, feed)
                got = session.run(None, feed)
                np.testing.assert_allclose(got[0], expected[0], atol=1e-6)
                np.testing.assert_array_equal(got[1], expected[1])
        except BaseException as exc:  # collected, re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    # concurrent first calls of one compiled shape compiled it once (batch 1, 2, 3 -> 1, 2, 4; sequence -> 8)
    compiled = [tuple(entry["shapes"]["input_ids"]) for entry in session.compiled_executables()]
    assert sorted(compiled) == [(1, 8), (2, 8), (4, 8)]


def test_io_binding_on_host_memory(session, model_path):
    feed = _feed()
    expected = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"]).run(None, feed)
    binding = session.io_binding()
    for name, array in feed.items():
        binding.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
    out = np.empty((2, 3), np.float32)
    binding.bind_output("y", "cpu", 0, np.float32, out.shape, out.ctypes.data)
    binding.bind_output("ids_plus_one")
    session.run_with_iobinding(binding)
    np.testing.assert_allclose(out, expected[0], atol=1e-6)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[1], expected[1])


def test_set_providers_refuses(session):
    with pytest.raises(NotImplementedError, match="load the model again"):
        session.set_providers(["CPUExecutionProvider"])


def test_unknown_or_bad_options_are_errors():
    with pytest.raises(ProviderOptionError, match="unknown IPUExecutionProvider option.*'devcie'"):
        IPUProviderOptions.parse({"devcie": "emulator"})
    with pytest.raises(ProviderOptionError, match="device 'gpu' is not one of"):
        IPUProviderOptions.parse({"device": "gpu"})
    with pytest.raises(ProviderOptionError, match="precision"):
        IPUProviderOptions.parse({"precision": "int8"})


def test_device_default_comes_from_environment(monkeypatch):
    monkeypatch.setenv("OPTIMUM_IPU_DEVICE", "emulator")
    assert IPUProviderOptions.parse(None).device == "emulator"
    monkeypatch.delenv("OPTIMUM_IPU_DEVICE")
    assert IPUProviderOptions.parse(None).device == "ipu"


@pytest.mark.parametrize("device", ["ipu", "ipu-model"])
def test_no_hardware_means_a_clear_error_not_the_cpu(model_path, monkeypatch, device):
    monkeypatch.delenv("OPTIMUM_IPU_DEVICE", raising=False)
    with pytest.raises(DeviceUnavailableError) as info:
        create_session(model_path, providers=["IPUExecutionProvider"], provider_options=[{"device": device}])
    message = str(info.value)
    assert "Python module popart: not found" in message  # what was probed
    assert "'device': 'emulator'" in message and "OPTIMUM_IPU_DEVICE=emulator" in message  # how to opt in


def test_cpu_listed_after_ipu_is_a_warned_fallback(model_path, monkeypatch):
    monkeypatch.delenv("OPTIMUM_IPU_DEVICE", raising=False)
    with pytest.warns(RuntimeWarning, match="(?s)Poplar SDK.*Falling back to \\[.CPUExecutionProvider.\\]"):
        fallback = create_session(model_path, providers=["ipu", "CPUExecutionProvider"])
    # onnxruntime's own session: the IPU session is an ort.InferenceSession too, so check the class
    assert isinstance(fallback, ort.InferenceSession) and not isinstance(fallback, IPUInferenceSession)
    assert fallback.get_providers() == ["CPUExecutionProvider"]


def test_unsupported_graph_raises_or_falls_back_with_the_node_named(tmp_path):
    path = tmp_path / "custom.onnx"
    onnx.save(_model(custom_op=True), path)
    with pytest.raises(LegalizationError, match="fused \\(com.microsoft::FusedGelu\\)"):
        create_session(str(path), providers=["ipu"], provider_options=[EMULATOR])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            create_session(
                str(path), providers=["ipu", "CPUExecutionProvider"], provider_options=[EMULATOR, {}]
            )
        except Exception:
            pass  # onnxruntime may not know this made-up contrib op; the warning is what is checked
    assert any("FusedGelu" in str(w.message) and "Falling back" in str(w.message) for w in caught)


def test_a_data_dependent_selection_that_is_not_top_k_experts_fails_at_creation(tmp_path):
    """A NonZero over values computed from the inputs cannot be static; it is not the top-k experts
    pattern that can be computed densely, so creating the session fails, naming the node and layer."""
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Greater", ["x", "zero"], ["positive"], name="/model/filter/Greater"),
                helper.make_node("NonZero", ["positive"], ["where"], name="/model/filter/NonZero"),
                helper.make_node("Transpose", ["where"], ["pairs"], name="/model/filter/Transpose"),
            ],
            "selection",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", "sequence_length"])],
            [helper.make_tensor_value_info("pairs", TensorProto.INT64, [None, 2])],
            [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
        ),
        opset_imports=[helper.make_opsetid("", 13)],
    )
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    with pytest.raises(LegalizationError) as raised:
        create_session(str(path), providers=["ipu"], provider_options={"device": "emulator"})
    message = str(raised.value)
    assert (
        "NonZero node '/model/filter/NonZero' in layer '/model/filter' selects elements at run time"
        in message
    )
    assert "not the top-k mixture-of-experts selection" in message
