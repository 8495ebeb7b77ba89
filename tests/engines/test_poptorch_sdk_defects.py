"""The PopTorch engine against what PopTorch's source does (tests/sdk_double/poptorch follows
graphcore/poptorch at sdk-release-3.4): each test here failed before the engine was fixed.

* PopTorch traces ``forward`` on the IPU device, where no value can be read on the host: graphs whose
  operators need operands at compile time (Reshape, Slice, Pad, TopK, ...) are served all the same.
* ``poptorch.Options()`` turns PopTorch's own executable cache on from ``POPTORCH_CACHE_DIR`` (and
  ``POPTORCH_DEFAULT_OPTIONS``); ``POPTORCH_IPU_MODEL`` moves a session to the IPU Model. Neither decides.
* Under PopRun the options are PopDist's (``popdist.poptorch.Options``); without popdist, a clear refusal.
* A compile-time out-of-memory arrives as a ``popart_exception``, and over 80 lines its text is only
  "See poptorch_error.log for details": it is still recognised.
* A recoverable error's ``recovery_action`` is reduced to its bare name, whatever its form.
"""

from __future__ import annotations

import enum
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sdk_testing import DOUBLE_DIR, IPUS, calls, configure
from tiny_models import feed, reference

from optimum_ipu_backend.engines.worker import IPUOutOfMemoryError
from optimum_ipu_backend.errors import InstallationError
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession


@pytest.fixture(scope="module")
def sdk_worker_idle_seconds() -> str:
    """The tests share one worker, but for those that ask for ``fresh_worker`` (tests/engines/conftest.py):
    each of those changes what the worker reads when it starts, or counts a fault in it."""
    return "600"


def _session(model, cache="disabled", device="ipu", **options) -> IPUInferenceSession:
    raw = {"device": device, "engine": "poptorch", "executable_cache_dir": str(cache), **options}
    return IPUInferenceSession(str(model), options=IPUProviderOptions.parse(raw))


def _check(session, model, batch=3, seed=0) -> None:
    inputs = feed(batch=batch, seed=seed)
    got, expected = session.run(None, inputs), reference(model, inputs)
    np.testing.assert_allclose(got[0], expected[0], atol=1e-6)
    np.testing.assert_array_equal(got[1], expected[1])


# -- operands PopART needs at compile time ----------------------------------------------------------------


def _static_operand_model(path) -> str:
    """Reshape, Slice, Pad, Tile, CumSum, TopK and Expand, each with its operand from an initializer."""
    ints = {
        "flat": np.array([0, -1], np.int64),
        "starts": np.array([1], np.int64),
        "ends": np.array([9], np.int64),
        "axes": np.array([1], np.int64),
        "steps": np.array([2], np.int64),
        "pads": np.array([0, 1, 0, 2], np.int64),
        "repeats": np.array([1, 2], np.int64),
        "axis": np.array(1, np.int64),
        "k": np.array([3], np.int64),
        "wide": np.array([1, 16], np.int64),
    }
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["flat_x"], name="reshape"),
        helper.make_node("Slice", ["flat_x", "starts", "ends", "axes", "steps"], ["sliced"], name="slice"),
        helper.make_node("Pad", ["sliced", "pads"], ["padded"], name="pad"),
        helper.make_node("Tile", ["padded", "repeats"], ["tiled"], name="tile"),
        helper.make_node("CumSum", ["tiled", "axis"], ["summed"], name="cumsum"),
        helper.make_node("TopK", ["summed", "k"], ["top", "top_indices"], name="topk"),
        helper.make_node("ReduceSum", ["top"], ["total"], axes=[1], keepdims=1, name="reduce"),
        helper.make_node("Expand", ["total", "wide"], ["y"], name="expand"),
    ]
    graph = helper.make_graph(
        nodes,
        "static_operands",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch_size", 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", 16])],
        [numpy_helper.from_array(value, name) for name, value in ints.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=7), path)
    return str(path)


@pytest.mark.parametrize("device", ["ipu", "ipu-model"])
def test_a_graph_with_compile_time_operands_is_served(double, tmp_path, device):
    path = _static_operand_model(tmp_path / "static.onnx")
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    import onnxruntime as ort

    (expected,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with _session(path, device=device, batch_size="2") as session:
        (got,) = session.run(None, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert calls(double, "poptorch.compile")


def test_the_double_refuses_a_host_read_while_tracing_as_poptorch_does(double):
    """What made every graph with a shape operand fail on an IPU: the double now traces as PopTorch."""
    import poptorch
    import torch

    class ReadsAValue(torch.nn.Module):
        def forward(self, x):
            return x.reshape(int(x.shape[0]), -1) * float(x.sum())

    executor = poptorch.inferenceModel(ReadsAValue(), poptorch.Options().useIpuModel(True))
    with pytest.raises(poptorch.Error, match="aten::item is only supported in eager mode") as info:
        executor.compile(torch.ones(2, 3))
    assert info.value.type == "poptorch_cpp_error"


# -- the environment decides nothing ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "variable, value",
    [
        ("POPTORCH_CACHE_DIR", "{dir}"),
        ("POPTORCH_DEFAULT_OPTIONS", '{{"enableExecutableCaching": "{dir}"}}'),
    ],
)
@pytest.mark.parametrize("device", ["ipu", "ipu-model"])
def test_poptorchs_own_cache_stays_off_whatever_the_environment_says(
    double, fresh_worker, model, tmp_path, monkeypatch, variable, value, device
):
    """Our cache off (or the IPU Model): a cache chosen by the environment, keyed without the weights'
    values, must not be used."""
    theirs = tmp_path / "poptorch-cache"
    monkeypatch.setenv(variable, value.format(dir=theirs))
    with _session(model, device=device) as session:
        _check(session, model)
    (compiled,) = calls(double, "poptorch.compile")
    assert compiled["cachePath"] is None
    assert not calls(double, "poptorch.cache_write") and not theirs.exists()


def test_our_cache_entry_still_holds_poptorchs_executable(double, fresh_worker, model, tmp_path, monkeypatch):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path / "poptorch-cache"))
    with _session(model, cache=tmp_path / "ours") as session:
        _check(session, model)
    (written,) = calls(double, "poptorch.cache_write")
    assert written["path"].startswith(str(tmp_path / "ours"))


def test_poptorch_ipu_model_variable_does_not_move_an_ipu_session(
    double, fresh_worker, model, tmp_path, monkeypatch
):
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    with _session(model) as session:
        _check(session, model)
    (compiled,) = calls(double, "poptorch.compile")
    assert compiled["ipuModel"] is False and calls(double, "poptorch.attach")


# -- PopRun -----------------------------------------------------------------------------------------------


def _poprun(monkeypatch, offset: int) -> None:
    """poprun --num-instances 2 --num-replicas 4: this is the instance from replica ``offset``."""
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "4")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "2")
    monkeypatch.setenv("POPDIST_NUM_IPUS_PER_REPLICA", "1")
    monkeypatch.setenv("POPDIST_REPLICA_INDEX_OFFSET", str(offset))
    monkeypatch.setenv("POPDIST_LOCAL_INSTANCE_INDEX", str(offset // 2))


@pytest.mark.parametrize("offset", [0, 2])
def test_under_poprun_poptorch_takes_popdists_options_and_device(
    double, fresh_worker, model, tmp_path, monkeypatch, offset
):
    _poprun(monkeypatch, offset)
    with _session(model, batch_size="1,2") as session:
        _check(session, model, batch=5)
    assert calls(double, "popdist.poptorch.Options")
    for compiled in calls(double, "poptorch.compile"):
        assert compiled["replicationFactor"] == 2
        assert compiled["processes"] == [offset // 2, 2]
        assert compiled["ipuId"] is not None  # PopDist's device, not a plain acquisition


def test_under_poprun_without_popdist_poptorch_is_refused_clearly(
    double, fresh_worker, model, tmp_path, monkeypatch
):
    _poprun(monkeypatch, 0)
    shadow = tmp_path / "no-popdist" / "popdist"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'popdist'\")\n")
    # The worker finds this stand-in for a missing popdist first; this process keeps the double's.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shadow.parent), str(DOUBLE_DIR)]))
    with _session(model, batch_size="1") as session:
        with pytest.raises(InstallationError, match=r"PopRun.*popdist\.poptorch\.Options.*popdist wheel"):
            session.run(None, feed(batch=2))


# -- errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("report_lines", [0, 120])
def test_a_compile_out_of_memory_is_recognised_even_when_its_text_went_to_the_log(
    double, fresh_worker, model, tmp_path, monkeypatch, report_lines
):
    monkeypatch.chdir(tmp_path)  # PopTorch writes poptorch_error.log into the current directory
    configure(double, ipus=IPUS, memory_bytes_per_ipu=8, memory_report_lines=report_lines)
    with _session(model) as session:
        with pytest.raises(IPUOutOfMemoryError, match="optimum-ipu check") as info:
            session.run(None, feed())
    assert "popart_exception" in str(info.value)
    if report_lines:
        assert "See poptorch_error.log for details" in str(info.value)
        assert "Out of memory" in (tmp_path / "poptorch_error.log").read_text()


class _RecoveryAction(enum.Enum):  # a pybind11 enum's shape: str() is "RecoveryAction.IPU_RESET"
    IPU_RESET = 0
    LINK_RESET = 1

    def __str__(self) -> str:
        return f"RecoveryAction.{self.name}"


@pytest.mark.parametrize(
    "action, name",
    [
        ("IPU_RESET", "IPU_RESET"),
        ("RecoveryAction.LINK_RESET", "LINK_RESET"),
        (_RecoveryAction.IPU_RESET, "IPU_RESET"),
        (" PARTITION_RESET\n", "PARTITION_RESET"),
    ],
)
def test_a_recoverable_errors_action_is_classified_by_its_bare_name(sdk, action, name):
    import poptorch

    from optimum_ipu_backend.engines.poptorch import PopTorchBackend

    error = poptorch.RecoverableError("In unknown:0: 'poplar_recoverable_runtime_error': lost")
    error.recovery_action = action
    assert PopTorchBackend().classify(error) == {"kind": "recoverable", "recovery_action": name}


def test_a_recoverable_error_on_poptorch_is_reset_and_retried_once(double, fresh_worker, model, tmp_path):
    with _session(model) as session:
        _check(session, model)
        configure(
            double, ipus=IPUS, faults=[{"id": "reset", "at": "run", "error": "recoverable", "times": 1}]
        )
        _check(session, model, seed=1)
    assert calls(double, "poptorch.detachFromDevice") and calls(double, "poptorch.attachToDevice")


def test_the_double_follows_poptorchs_device_and_batch_rules(double, monkeypatch):
    """The rules the engine meets on a real SDK (tests/sdk_double/poptorch cites where each comes from)."""
    import poptorch
    import torch

    assert poptorch.ipuHardwareIsAvailable(4) and not poptorch.ipuHardwareIsAvailable(3)
    assert poptorch.ipuHardwareVersion() == 2
    module = torch.nn.Linear(2, 2).eval()
    three = poptorch.inferenceModel(module, poptorch.Options().replicationFactor(3))
    with pytest.raises(poptorch.Error, match="must reserve a minimum of 4") as info:
        three.compile(torch.zeros(3, 2))
    assert info.value.type == "poptorch_cpp_error"
    batched = poptorch.inferenceModel(module, poptorch.Options().deviceIterations(2))
    with pytest.raises(AssertionError, match=r"Invalid batch dimension.*must be a multiple"):
        batched.compile(torch.zeros(3, 2))
    executor = poptorch.inferenceModel(module)
    executor.compile(torch.zeros(1, 2))
    with pytest.raises(poptorch.Error, match="Device is already attached"):
        executor.attachToDevice()
    executor.detachFromDevice()
    with pytest.raises(poptorch.Error, match="Device is not attached"):
        executor.detachFromDevice()
    executor.destroy()
    monkeypatch.setenv("POPTORCH_IPU_MODEL", "1")
    assert not poptorch.ipuHardwareIsAvailable(1)
