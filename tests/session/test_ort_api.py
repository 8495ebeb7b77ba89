"""The IPU session is an ``onnxruntime.InferenceSession``: every public name of onnxruntime's class is
either implemented (and gives what onnxruntime's CPU provider gives) or refused with an error naming the
method and what to use instead; nothing reaches onnxruntime's code that needs a native session."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_session import EMULATOR, _feed, _model

from optimum_ipu_backend.errors import DeviceError, InvalidFeedError
from optimum_ipu_backend.integration.patches import _make_io_binding
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession
from optimum_ipu_backend.session.io_binding import HostIOBinding
from optimum_ipu_backend.session.ort_surface import (
    REFUSED,
    NoNativeSessionError,
    UnsupportedSessionMethodError,
    is_refusal,
    refuse_unimplemented,
)

USER_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"
PUBLIC = sorted(name for name in dir(ort.InferenceSession) if not name.startswith("_"))
REFUSED_HERE = [name for name in PUBLIC if is_refusal(vars(IPUInferenceSession).get(name))]
IMPLEMENTED_HERE = [name for name in PUBLIC if name not in REFUSED_HERE]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ort-api") / "model.onnx"
    onnx.save(_model(), path)
    return str(path)


@pytest.fixture(scope="module")
def session(model_path) -> IPUInferenceSession:
    """One session for the module: every check below leaves it as it was."""
    with IPUInferenceSession(model_path, options=IPUProviderOptions.parse(EMULATOR)) as session:
        yield session


@pytest.fixture(scope="module")
def reference(model_path) -> ort.InferenceSession:
    return ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])


def _same_results(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert [g.dtype for g in got] == [e.dtype for e in expected]
    np.testing.assert_allclose(got[0], expected[0], atol=1e-6)
    np.testing.assert_array_equal(got[1], expected[1])


def _describe(args: list) -> list[tuple]:
    return [(arg.name, arg.shape, arg.type) for arg in args]


def _check_run_async(session: IPUInferenceSession, reference: ort.InferenceSession) -> None:
    done = threading.Event()
    received: dict[str, Any] = {}

    def callback(results: list[np.ndarray], user_data: Any, error: str) -> None:
        received.update(results=results, user_data=user_data, error=error)
        done.set()

    feed = _feed(batch=3, seq=6, seed=1)
    assert session.run_async(None, feed, callback, "mine") is None
    assert done.wait(60), "the callback was not called"
    assert received["user_data"] == "mine" and received["error"] == ""
    _same_results(received["results"], reference.run(None, feed))


def _check_run_with_ort_values(session: IPUInferenceSession, reference: ort.InferenceSession) -> None:
    feed = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in _feed(3, 6, seed=2).items()}
    got = session.run_with_ort_values(None, feed)
    expected = reference.run_with_ort_values(None, feed)
    assert all(isinstance(value, ort.OrtValue) and value.device_name() == "cpu" for value in got)
    _same_results([value.numpy() for value in got], [value.numpy() for value in expected])
    only_y = session.run_with_ort_values(["y"], feed)
    np.testing.assert_allclose(only_y[0].numpy(), expected[0].numpy(), atol=1e-6)


def _check_io_binding(session: IPUInferenceSession, reference: ort.InferenceSession) -> None:
    feed = _feed()
    binding = session.io_binding()
    for name, array in feed.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output("y")
    binding.bind_output("ids_plus_one")
    assert session.run_with_iobinding(binding) is None
    _same_results(binding.copy_outputs_to_cpu(), reference.run(None, feed))


def _check_modelmeta(session: IPUInferenceSession, reference: ort.InferenceSession) -> None:
    fields = ("producer_name", "graph_name", "domain", "description", "graph_description", "version")
    ours, theirs = session.get_modelmeta(), reference.get_modelmeta()
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    assert ours.custom_metadata_map == theirs.custom_metadata_map


def _check_disable_fallback(session: IPUInferenceSession, reference: ort.InferenceSession) -> None:
    assert session.disable_fallback() is None
    assert session._enable_fallback is False
    _same_results(session.run(None, _feed()), reference.run(None, _feed()))


def _equal(got: Any, expected: Any) -> None:
    assert got == expected, (got, expected)


# Each implemented public method of onnxruntime's class, called and compared with onnxruntime on the CPU.
CHECKS: dict[str, Callable[[IPUInferenceSession, ort.InferenceSession], None]] = {
    "get_inputs": lambda s, r: _equal(_describe(s.get_inputs()), _describe(r.get_inputs())),
    "get_outputs": lambda s, r: _equal(_describe(s.get_outputs()), _describe(r.get_outputs())),
    "get_overridable_initializers": lambda s, r: _equal(
        _describe(s.get_overridable_initializers()), _describe(r.get_overridable_initializers())
    ),
    "get_providers": lambda s, r: _equal(s.get_providers(), ["IPUExecutionProvider"]),
    "get_provider_options": lambda s, r: _equal(
        s.get_provider_options()["IPUExecutionProvider"]["device"], "emulator"
    ),
    "get_session_options": lambda s, r: _equal(type(s.get_session_options()), ort.SessionOptions),
    "get_modelmeta": _check_modelmeta,
    "run": lambda s, r: _same_results(s.run(None, _feed(3, 7)), r.run(None, _feed(3, 7))),
    "run_async": _check_run_async,
    "run_with_ort_values": _check_run_with_ort_values,
    "io_binding": _check_io_binding,
    "run_with_iobinding": _check_io_binding,
    "end_profiling": lambda s, r: _equal(s.end_profiling(), ""),
    "disable_fallback": _check_disable_fallback,
}


def test_every_public_name_of_onnxruntime_is_defined_by_the_ipu_session():
    """Defined by the IPU session itself, never inherited: onnxruntime's would reach for ``_sess``."""
    assert issubclass(IPUInferenceSession, ort.InferenceSession)
    assert PUBLIC, "onnxruntime.InferenceSession has no public names?"
    assert [name for name in PUBLIC if name not in vars(IPUInferenceSession)] == []
    # each name is checked below: every implemented one has a check, every refused one raises
    assert sorted(CHECKS) == IMPLEMENTED_HERE


@pytest.mark.parametrize("name", REFUSED_HERE)
def test_refused_methods_name_the_method_and_the_alternative(session, name):
    with pytest.raises(UnsupportedSessionMethodError) as info:
        getattr(session, name)()
    message = str(info.value)
    assert message.startswith(f"IPUInferenceSession.{name}() is not supported: "), message
    assert REFUSED.get(name, ort.__version__) in message
    # a NotImplementedError, as set_providers's refusal always was, and a documented category
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, DeviceError)


def test_set_providers_still_says_how_to_change_provider(session):
    with pytest.raises(NotImplementedError, match="load the model again with the provider you want"):
        session.set_providers(["CPUExecutionProvider"], None)


@pytest.mark.parametrize("name", IMPLEMENTED_HERE)
def test_implemented_methods_give_what_onnxruntime_gives(session, reference, name):
    CHECKS[name](session, reference)


def test_run_async_hands_failures_to_the_callback(session, monkeypatch):
    done = threading.Event()
    received: dict[str, Any] = {}

    def callback(results: list[np.ndarray], user_data: Any, error: str) -> None:
        received.update(results=results, user_data=user_data, error=error)
        done.set()

    class FailingRunner:
        def run(self, feed: dict, names: list) -> list:
            raise RuntimeError("the device went away")

    monkeypatch.setattr(session, "_runner", FailingRunner())
    session.run_async(None, _feed(), callback, 7)
    assert done.wait(60)
    assert received == {"results": [], "user_data": 7, "error": "RuntimeError: the device went away"}
    # a feed the session refuses is refused at the call, before any thread runs
    with pytest.raises(InvalidFeedError, match="missing \\['x'\\]"):
        session.run_async(None, {"input_ids": _feed()["input_ids"]}, callback, None)


def test_run_with_ort_values_refuses_values_off_the_host(session):
    class DeviceValue:  # an OrtValue on an accelerator, as far as the session can tell
        def device_name(self) -> str:
            return "cuda"

        def numpy(self) -> np.ndarray:
            raise AssertionError("a device value must not be read")

    feed: dict[str, Any] = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in _feed().items()}
    feed["x"] = DeviceValue()
    with pytest.raises(InvalidFeedError, match="input 'x' is an OrtValue on device 'cuda'.*host memory"):
        session.run_with_ort_values(None, feed)
    feed["x"] = _feed()["x"]
    with pytest.raises(InvalidFeedError, match="input 'x' is a ndarray; run_with_ort_values takes"):
        session.run_with_ort_values(None, feed)


def test_onnxruntime_iobinding_on_the_ipu_session_is_a_clear_error(session):
    assert isinstance(session, ort.InferenceSession)
    assert not hasattr(session, "_sess")
    with pytest.raises(NoNativeSessionError, match=re.escape("session.io_binding() gives its IO binding")):
        ort.IOBinding(session)
    # optimum-onnx's IOBinding, patched, hands out the session's own binding (and onnxruntime's elsewhere)
    assert isinstance(_make_io_binding(ort.IOBinding)(session), HostIOBinding)
    # the private state onnxruntime's code and optimum read
    assert session._model_path and session._model_bytes is None
    assert session._inputs_meta == session.get_inputs() and session._outputs_meta == session.get_outputs()
    assert session._providers == ["IPUExecutionProvider"]
    assert session._provider_options == session.get_provider_options()
    assert session._enable_fallback is False and session._from_model_package is False


def test_a_session_from_bytes_keeps_them(model_path):
    data = Path(model_path).read_bytes()
    with IPUInferenceSession(data, options=IPUProviderOptions.parse(EMULATOR)) as session:
        assert session._model_bytes is data and session._model_path is None


def test_a_method_a_later_onnxruntime_adds_is_refused():
    class LaterOnnxruntime(ort.InferenceSession):
        def run_everywhere(self, *args: Any) -> Any:
            return self._sess.run_everywhere(*args)

        @property
        def graph_id(self) -> int:
            return self._sess.graph_id

    class Probe(IPUInferenceSession, LaterOnnxruntime):
        pass

    probe = Probe.__new__(Probe)  # no engine needed: the stubs raise before touching the session
    with pytest.raises(NoNativeSessionError):  # what inheriting onnxruntime's method would do
        probe.run_everywhere()
    refuse_unimplemented(Probe, LaterOnnxruntime)
    assert is_refusal(vars(Probe)["run_everywhere"]) and is_refusal(vars(Probe)["graph_id"])
    version = re.escape(ort.__version__)
    with pytest.raises(UnsupportedSessionMethodError, match=f"Probe.run_everywhere\\(\\).*{version}"):
        probe.run_everywhere(1, 2)
    with pytest.raises(UnsupportedSessionMethodError, match=f"Probe.graph_id is not supported.*{version}"):
        probe.graph_id  # noqa: B018 - the read is the call under test
    # the implemented and already refused names are left as they were
    assert "run" not in vars(Probe) and "set_providers" not in vars(Probe)


def test_a_method_both_implemented_and_refused_is_an_error_at_class_creation():
    class Contradiction(IPUInferenceSession):
        def set_providers(self, providers: Any = None, provider_options: Any = None) -> None:
            pass

    with pytest.raises(TypeError, match="Contradiction implements \\['set_providers'\\]"):
        refuse_unimplemented(Contradiction, ort.InferenceSession)


def test_the_user_guide_lists_the_refused_methods():
    text = USER_GUIDE.read_text(encoding="utf-8")
    section = text[text.index("### The session is an `onnxruntime.InferenceSession`") :]
    section = section[: section.index("\n## ")]
    listed = set(re.findall(r"`(\w+)\(\)`", section))
    assert set(REFUSED) <= listed, sorted(set(REFUSED) - listed)
    assert "ort_surface.py" in section
