"""Carried state (``engines.base.state_updates``) on the PopTorch engine, against the PopTorch double: each
state initializer is a module buffer updated in place, which PopTorch keeps on the device between calls.

Every run's outputs are compared with the host emulator running the same file (the reference
implementation of the contract). Also: the converter alone (no worker), ``write_state`` through the
worker, the state epoch after an engine switch and after a reset, and the double's
``updatableNamedBuffers`` / ``copyNamedBuffersToDevice`` as graphcore/poptorch sdk-release-3.4 has them.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sdk_testing import IPUS, calls, configure
from test_emulator_state import counter_graph

from optimum_ipu_backend.engines.base import CompileOptions, EngineContractError
from optimum_ipu_backend.engines.emulator import HostEmulatorEngine

B, H, M, D = 2, 3, 4, 5
RTOL = 1e-6


def kv_graph(path, seed: int = 0) -> np.ndarray:
    """A key/value-cache step: the cache K [B,H,M,D] is reordered by ``rows`` (beam search), the new
    position ``new`` is appended and positions 1: become the new cache. Outputs: the new cache's last
    position, a reduction over the cache as it was before the run, and a view of the old cache (its first
    position), which must not change when the cache is overwritten. Returns K's initial value."""
    initial = np.random.default_rng(seed).standard_normal((B, H, M, D)).astype(np.float32)
    ints = lambda name, values: numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("CopyVarUpdate", ["K", "next_K"], ["K_updated"], domain="ai.graphcore"),
        helper.make_node("Gather", ["K", "rows"], ["reordered"], axis=0),
        helper.make_node("Concat", ["reordered", "new"], ["grown"], axis=2),
        helper.make_node("Slice", ["grown", "one", "end", "axis2"], ["next_K"]),
        helper.make_node("Slice", ["next_K", "last_start", "end", "axis2"], ["last"]),
        helper.make_node("ReduceSum", ["K"], ["total"], axes=[2, 3], keepdims=0),
        helper.make_node("Slice", ["K", "zero", "one", "axis2"], ["first"]),
    ]
    graph = helper.make_graph(
        nodes,
        "kv",
        [
            helper.make_tensor_value_info("rows", TensorProto.INT32, [B]),
            helper.make_tensor_value_info("new", TensorProto.FLOAT, [B, H, 1, D]),
        ],
        [
            helper.make_tensor_value_info("last", TensorProto.FLOAT, [B, H, 1, D]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, [B, H]),
            helper.make_tensor_value_info("first", TensorProto.FLOAT, [B, H, 1, D]),
        ],
        [
            numpy_helper.from_array(initial, "K"),
            ints("zero", [0]),
            ints("one", [1]),
            ints("end", [M + 1]),
            ints("last_start", [M - 1]),
            ints("axis2", [2]),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 11), helper.make_opsetid("ai.graphcore", 1)]
    )
    onnx.save(model, path)
    return initial


def kv_feed(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    return {
        "rows": rng.integers(0, B, B).astype(np.int32),
        "new": rng.standard_normal((B, H, 1, D)).astype(np.float32),
    }


def assert_same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=RTOL, atol=1e-6, err_msg=name)


@pytest.fixture()
def emulator():
    with HostEmulatorEngine("emulator") as engine:
        yield engine


@pytest.fixture()
def poptorch_engine(double):
    from optimum_ipu_backend.engines.poptorch import PopTorchEngine

    with PopTorchEngine("ipu") as engine:
        yield engine


# -- the converter alone -----------------------------------------------------------------------------------


def test_converter_keeps_the_state_in_a_buffer_that_readers_see_before_the_update(tmp_path, emulator):
    import torch

    from optimum_ipu_backend.engines.onnx_torch import OnnxGraphModule

    initial = kv_graph(tmp_path / "kv.onnx")
    module = OnnxGraphModule(onnx.load(tmp_path / "kv.onnx")).eval()
    assert set(module.state_buffers) == {"K"}
    reference = emulator.compile(tmp_path / "kv.onnx", CompileOptions())
    reference.write_state({"K": initial})
    for seed in range(4):
        feed = kv_feed(seed)
        with torch.no_grad():
            got = module(*(torch.from_numpy(feed[name]) for name in module.input_names))
        outputs = dict(zip(module.output_names, (t.numpy() for t in got), strict=True))
        assert_same(outputs, reference.run(feed))


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_converter_refuses_a_state_dtype_poptorch_does_not_keep(tmp_path, dtype):
    """PopTorch turns integer buffers into constants, so even int32, which PopART's CopyVarUpdate takes, is
    refused (the runtime carries integer masks as float32 on this engine)."""
    from optimum_ipu_backend.engines.onnx_torch import OnnxGraphModule

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("CopyVarUpdate", ["S", "x"], ["S2"], domain="ai.graphcore")],
        "bad",
        [helper.make_tensor_value_info("x", elem, [2])],
        [helper.make_tensor_value_info("S2", elem, [2])],
        [numpy_helper.from_array(np.zeros(2, dtype), "S")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 11), helper.make_opsetid("ai.graphcore", 1)]
    )
    name = np.dtype(dtype).name
    with pytest.raises(EngineContractError, match=f"{name}; PopTorch keeps only float32 and float16 buffers"):
        OnnxGraphModule(model)


# -- the engine, through the worker --------------------------------------------------------------------------


def test_counter_state_persists_is_written_and_matches_the_emulator(
    tmp_path, emulator, poptorch_engine, double
):
    counter_graph(tmp_path / "g.onnx", external=False)
    executable = poptorch_engine.compile(tmp_path / "g.onnx", CompileOptions(device="ipu"))
    reference = emulator.compile(tmp_path / "g.onnx", CompileOptions())
    assert executable.state == reference.state
    assert [spec.name for spec in executable.inputs] == ["x"]
    epoch = executable.state_epoch
    ones = {"x": np.ones((2, 3), np.float32)}
    for expected in (2.0, 6.0, 14.0):  # readers see S before the run; it becomes y after
        got = executable.run(ones)
        assert_same(got, reference.run(ones))
        np.testing.assert_array_equal(got["y"], expected)
    ten = {"S": np.full((2, 3), 10.0, np.float32)}
    executable.write_state(ten)
    reference.write_state(ten)
    got = executable.run(ones)
    assert_same(got, reference.run(ones))
    np.testing.assert_array_equal(got["y"], 22.0)
    assert executable.state_epoch == epoch  # no switch, no reset
    (upload,) = calls(double, "poptorch.copyNamedBuffersToDevice")
    # PopTorch's name: the wrapper's named_buffers(); the counter counts the module's registrations
    assert upload["buffers"] == ["module.b000001_state"]  # after "two" (b000000)
    with pytest.raises(EngineContractError, match="float32\\[2, 3\\]"):
        executable.write_state({"S": np.zeros((3, 2), np.float32)})
    with pytest.raises(EngineContractError, match="not state"):
        executable.write_state({"two": np.zeros((2, 3), np.float32)})
    executable.close()


def test_kv_cache_step_matches_the_emulator_run_after_run(tmp_path, emulator, poptorch_engine):
    initial = kv_graph(tmp_path / "kv.onnx")
    executable = poptorch_engine.compile(tmp_path / "kv.onnx", CompileOptions(device="ipu"))
    reference = emulator.compile(tmp_path / "kv.onnx", CompileOptions())
    assert [(s.name, s.shape, s.dtype) for s in executable.state] == [("K", (B, H, M, D), np.float32)]
    reference.write_state({"K": initial})  # the emulator starts from zeros, the device from the initializer
    for seed in range(5):
        assert_same(executable.run(kv_feed(seed)), reference.run(kv_feed(seed)))
    fresh = np.random.default_rng(7).standard_normal((B, H, M, D)).astype(np.float32)
    executable.write_state({"K": fresh})
    reference.write_state({"K": fresh})
    for seed in range(5, 8):
        got = executable.run(kv_feed(seed))
        assert_same(got, reference.run(kv_feed(seed)))
    executable.close()


def test_a_switch_keeps_the_state_and_changes_the_epoch(tmp_path, emulator, poptorch_engine, double):
    """PopTorch's detach then attach uploads the host copies (_on_device_attach), so the worker downloads
    the state before it detaches (copyWeightsToHost): the runs continue from what the last run left. The
    epoch still changes (a reload), and a runtime that uploads again then gets the same answers."""
    counter_graph(tmp_path / "g.onnx", external=False)
    initial = kv_graph(tmp_path / "kv.onnx")
    executable = poptorch_engine.compile(tmp_path / "kv.onnx", CompileOptions(device="ipu"))
    # the other IPUs taken, one more executable shares the state's device
    others = [poptorch_engine.compile(tmp_path / "g.onnx", CompileOptions(device="ipu")) for _ in range(IPUS)]
    reference = emulator.compile(tmp_path / "kv.onnx", CompileOptions())
    written = initial + 1.0
    executable.write_state({"K": written})
    reference.write_state({"K": written})
    epoch, switches = executable.state_epoch, executable.switches
    for seed in (0, 1):
        assert_same(executable.run(kv_feed(seed)), reference.run(kv_feed(seed)))
    assert executable.state_epoch == epoch
    downloads = len(calls(double, "poptorch.copyWeightsToHost"))
    for other in others:
        other.run({"x": np.ones((2, 3), np.float32)})
    assert len(calls(double, "poptorch.copyWeightsToHost")) == downloads + 1  # only the one with state
    assert_same(executable.run(kv_feed(2)), reference.run(kv_feed(2)))
    assert executable.switches == switches + 1
    assert executable.state_epoch != epoch
    executable.write_state({"K": initial})
    reference.write_state({"K": initial})
    assert_same(executable.run(kv_feed(3)), reference.run(kv_feed(3)))
    for item in (executable, *others):
        item.close()


def test_a_reset_is_not_retried_and_changes_the_epoch(tmp_path, emulator, poptorch_engine, double):
    """A retry after a reset would read the state the reset put back (stale): the run fails instead, and
    the next one runs on a rebuilt executable, in a new epoch."""
    from optimum_ipu_backend.engines.worker import DeviceResetError

    counter_graph(tmp_path / "g.onnx", external=False)
    executable = poptorch_engine.compile(tmp_path / "g.onnx", CompileOptions(device="ipu"))
    ones = {"x": np.ones((2, 3), np.float32)}
    executable.run(ones)
    epoch = executable.state_epoch
    configure(double, ipus=IPUS, faults=[{"id": "reset", "at": "run", "error": "recoverable", "times": 1}])
    with pytest.raises(DeviceResetError, match="not retried"):
        executable.run(ones)
    configure(double, ipus=IPUS)
    got = executable.run(ones)
    assert executable.state_epoch != epoch
    np.testing.assert_array_equal(got["y"], 2.0)  # rebuilt from the initializer (zeros)
    executable.close()


def test_a_graph_without_state_keeps_none(tmp_path, poptorch_engine):
    # Static shapes, as the engine gets them: a symbolic dimension would reach PopTorch as 0, and PopTorch
    # refuses a zero-sized input (the double follows dispatch_tracer/Tensor.cpp, errorOnZeroSizedTensor).
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "stateless",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = tmp_path / "stateless.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=7), model)
    executable = poptorch_engine.compile(model, CompileOptions(device="ipu"))
    assert executable.state == ()
    with pytest.raises(EngineContractError, match="keeps no state"):
        executable.write_state({})
    executable.close()


# -- the double's named buffers (graphcore/poptorch sdk-release-3.4, tests/buffers_test.py) ---------------


def _two_buffers():
    import torch

    class UpdatableBuffer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("buffer_1", torch.ones(1))
            self.register_buffer("buffer_2", torch.ones(1))

        def forward(self, x):
            # PopTorch's test sums to a scalar; the double concatenates outputs on dim 0 and takes none
            return x + self.buffer_1 + self.buffer_2

    return UpdatableBuffer()


def test_double_uploads_only_the_named_buffers(double):
    import poptorch
    import torch

    options = poptorch.Options().updatableNamedBuffers(["buffer_1"])
    executor = poptorch.inferenceModel(_two_buffers(), options)
    x = torch.ones(3)
    try:
        assert executor(x).sum() == 9
        executor.buffer_1.copy_(executor.buffer_1 + 1)
        executor.copyNamedBuffersToDevice()
        assert executor(x).sum() == 12
        executor.buffer_2.copy_(executor.buffer_2 + 1)
        executor.copyNamedBuffersToDevice()
        assert executor(x).sum() == 12  # buffer_2 is not named: the device keeps its old value
    finally:
        executor.destroy()


def test_double_refuses_named_buffers_without_the_option_and_unknown_names(double):
    import poptorch
    import torch

    executor = poptorch.inferenceModel(_two_buffers(), poptorch.Options())
    try:
        assert executor(torch.ones(3)).sum() == 9
        with pytest.raises(poptorch.Error, match="No named buffers marked as updatable"):
            executor.copyNamedBuffersToDevice()
    finally:
        executor.destroy()
    options = poptorch.Options().updatableNamedBuffers(["non_existing_buffer"])
    executor = poptorch.inferenceModel(_two_buffers(), options)
    try:
        with pytest.raises(poptorch.Error, match="Invalid named buffer in updatableNamedBuffers"):
            executor(torch.ones(3))
    finally:
        executor.destroy()
