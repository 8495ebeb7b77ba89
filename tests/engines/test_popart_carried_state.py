"""Carried state (``engines.base.state_updates``) on the PopART engine, against the SDK double.

The double follows PopART at sdk-release-3.4 for this: ``constantWeights``, ``ai.graphcore``
CopyVarUpdate on Variables, ``writeWeights``/``weightsFromHost``/``weightsToHost``/``readWeights``, and
variables left undefined (NaN in the double, assumed) until ``weightsFromHost`` and after another engine
was loaded. Every run's outputs are compared with the host emulator on the same file, which keeps the state
in host memory: the reference for what a run must give.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from sdk_testing import calls, configure
from test_emulator_state import counter_graph

from optimum_ipu_backend.engines.base import CompileOptions, EngineContractError
from optimum_ipu_backend.engines.emulator import HostEmulatorEngine
from optimum_ipu_backend.engines.popart import PopARTEngine

B, H, M, D = 2, 3, 4, 5


def kv_cache_graph(path: Path) -> None:
    """A key-value cache in miniature: states K and V [B, H, M, D]. Each run gathers the rows ``rows``
    (beam reordering), appends the new position (``new`` for K, ``2 * new`` for V), keeps positions 1:
    as the new state, and returns the new position (read back out of the concatenation) and the sum of
    the new K and V over positions and features."""
    rng = np.random.default_rng(7)
    initializers = [
        numpy_helper.from_array(rng.standard_normal((B, H, M, D)).astype(np.float32), "K"),
        numpy_helper.from_array(rng.standard_normal((B, H, M, D)).astype(np.float32), "V"),
        numpy_helper.from_array(np.full((1,), 2.0, np.float32), "two"),
        # int32, as the compiler's int64_to_int32 pass leaves Slice's operands
        numpy_helper.from_array(np.array([1], np.int32), "keep_start"),
        numpy_helper.from_array(np.array([M + 1], np.int32), "keep_end"),
        numpy_helper.from_array(np.array([M], np.int32), "new_start"),
        numpy_helper.from_array(np.array([2], np.int32), "axis"),
    ]
    nodes = [
        # the updates first: readers after them must still see the old cache
        helper.make_node("CopyVarUpdate", ["K", "K_next"], ["K_alias"], domain="ai.graphcore"),
        helper.make_node("CopyVarUpdate", ["V", "V_next"], ["V_alias"], domain="ai.graphcore"),
        helper.make_node("Gather", ["K", "rows"], ["K_rows"], axis=0),
        helper.make_node("Gather", ["V", "rows"], ["V_rows"], axis=0),
        helper.make_node("Mul", ["new", "two"], ["new_v"]),
        helper.make_node("Concat", ["K_rows", "new"], ["K_all"], axis=2),
        helper.make_node("Concat", ["V_rows", "new_v"], ["V_all"], axis=2),
        helper.make_node("Slice", ["K_all", "keep_start", "keep_end", "axis"], ["K_next"]),
        helper.make_node("Slice", ["V_all", "keep_start", "keep_end", "axis"], ["V_next"]),
        helper.make_node("Slice", ["K_all", "new_start", "keep_end", "axis"], ["position"]),
        helper.make_node("Add", ["K_next", "V_next"], ["KV"]),
        helper.make_node("ReduceSum", ["KV"], ["total"], axes=[2, 3], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "kv_cache",
        [
            helper.make_tensor_value_info("rows", TensorProto.INT32, [B]),
            helper.make_tensor_value_info("new", TensorProto.FLOAT, [B, H, 1, D]),
        ],
        [
            helper.make_tensor_value_info("position", TensorProto.FLOAT, [B, H, 1, D]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, [B, H]),
        ],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 11), helper.make_opsetid("ai.graphcore", 1)]
    )
    onnx.save(model, path)


def _kv_feed(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "rows": rng.permutation(B).astype(np.int32),
        "new": rng.standard_normal((B, H, 1, D)).astype(np.float32),
    }


def _assert_same(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert not np.isnan(got[name]).any(), f"{name}: the device read undefined variables"
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


def _popart(double) -> PopARTEngine:
    """The PopART engine on the doubled IPUs (``double`` makes the worker see the double)."""
    return PopARTEngine("ipu")


def test_counter_persists_and_write_state_uploads_like_the_emulator(double, tmp_path):
    counter_graph(tmp_path / "g.onnx", external=True)
    ones = np.ones((2, 3), np.float32)
    with _popart(double) as engine, HostEmulatorEngine("emulator") as emulator:
        device = engine.compile(tmp_path / "g.onnx", CompileOptions(device="ipu"))
        host = emulator.compile(tmp_path / "g.onnx", CompileOptions())
        assert [(spec.name, spec.shape, spec.dtype) for spec in device.state] == [
            ("S", (2, 3), np.dtype(np.float32))
        ]
        assert [spec.name for spec in device.inputs] == ["x"]
        # the emulator starts from zeros, the device from the initializer: the runtime writes first
        device.write_state({"S": np.zeros((2, 3), np.float32)})
        for _ in range(3):
            _assert_same(device.run({"x": ones}), host.run({"x": ones}))  # 2, 6, 14
        for target in (device, host):
            target.write_state({"S": np.full((2, 3), 10.0, np.float32)})
        got = device.run({"x": ones})
        _assert_same(got, host.run({"x": ones}))
        np.testing.assert_array_equal(got["y"], 22.0)
        with pytest.raises(EngineContractError, match="float32\\[2, 3\\]"):
            device.write_state({"S": np.zeros((3, 2), np.float32)})
        with pytest.raises(EngineContractError, match="not state"):
            device.write_state({"two": np.zeros((2, 3), np.float32)})
    built = calls(double, "InferenceSession.__init__")
    assert built and all(entry["options"]["constantWeights"] is False for entry in built)
    assert len(calls(double, "InferenceSession.writeWeights")) == 2
    # one upload at build, one for each write_state
    assert len(calls(double, "InferenceSession.weightsFromHost")) == 3


def test_a_graph_without_state_keeps_constant_weights(double, tmp_path):
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Add", ["x", "w"], ["y"])],
            "plain",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
            [numpy_helper.from_array(np.ones(2, np.float32), "w")],
        ),
        opset_imports=[helper.make_opsetid("", 11)],
    )
    onnx.save(model, tmp_path / "plain.onnx")
    with _popart(double) as engine:
        executable = engine.compile(tmp_path / "plain.onnx", CompileOptions(device="ipu"))
        assert executable.state == ()
        np.testing.assert_array_equal(executable.run({"x": np.ones(2, np.float32)})["y"], 2.0)
        with pytest.raises(EngineContractError, match="keeps no state"):
            executable.write_state({"w": np.zeros(2, np.float32)})
    assert [entry["options"]["constantWeights"] for entry in calls(double, "InferenceSession.__init__")] == [
        True
    ]


def test_kv_cache_graph_matches_the_emulator_run_by_run(double, tmp_path):
    kv_cache_graph(tmp_path / "kv.onnx")
    rng = np.random.default_rng(0)
    start = {
        name: rng.standard_normal((B, H, M, D)).astype(np.float32) for name in ("K", "V")
    }  # the runtime's first upload
    with _popart(double) as engine, HostEmulatorEngine("emulator") as emulator:
        device = engine.compile(tmp_path / "kv.onnx", CompileOptions(device="ipu"))
        host = emulator.compile(tmp_path / "kv.onnx", CompileOptions())
        assert [spec.name for spec in device.state] == ["K", "V"]
        assert [spec.name for spec in device.inputs] == ["rows", "new"]
        for target in (device, host):
            target.write_state(start)
        history = []
        for _ in range(5):
            feed = _kv_feed(rng)
            got, expected = device.run(feed), host.run(feed)
            _assert_same(got, expected)
            np.testing.assert_array_equal(got["position"], feed["new"])
            history.append(got["total"])
        assert not np.allclose(history[0], history[1]), "the state moved on between runs"
        # writing only K must leave V as the runs left it (PopART's upload moves every variable)
        k = rng.standard_normal((B, H, M, D)).astype(np.float32)
        for target in (device, host):
            target.write_state({"K": k})
        for _ in range(3):
            feed = _kv_feed(rng)
            _assert_same(device.run(feed), host.run(feed))
    assert len(calls(double, "InferenceSession.weightsToHost")) == 1  # the partial write read V back


def test_an_engine_switch_reuploads_and_changes_the_state_epoch(double, tmp_path):
    configure(double, ipus=1)  # both executables share one IPU
    counter_graph(tmp_path / "g.onnx", external=False)
    ones = np.ones((2, 3), np.float32)
    with _popart(double) as engine, HostEmulatorEngine("emulator") as emulator:
        first = engine.compile(tmp_path / "g.onnx", CompileOptions(device="ipu"))
        second = engine.compile(tmp_path / "g.onnx", CompileOptions(device="ipu"))
        host = emulator.compile(tmp_path / "g.onnx", CompileOptions())
        zeros = np.zeros((2, 3), np.float32)
        for target in (first, second, host):
            target.write_state({"S": zeros})
        _assert_same(first.run({"x": ones}), host.run({"x": ones}))
        _assert_same(first.run({"x": ones}), host.run({"x": ones}))
        epoch, switches = first.state_epoch, first.switches
        second.run({"x": ones})  # loads the other engine: first's variables are gone
        got = first.run({"x": ones})
        assert first.switches == switches + 1 and first.state_epoch != epoch
        # the backend put every variable back (no NaN): the state is the last one written, not the last run's
        np.testing.assert_array_equal(got["y"], 2.0)
        # the runtime, seeing the epoch change, writes the state again; runs then agree with the emulator
        host.write_state({"S": zeros})
        first.write_state({"S": zeros})
        for _ in range(2):
            _assert_same(first.run({"x": ones}), host.run({"x": ones}))
    loads = [entry["call"] for entry in calls(double, "InferenceSession.loadEngineAndConnectStreams")]
    uploads = calls(double, "InferenceSession.weightsFromHost")
    assert len(loads) >= 4 and len(uploads) >= len(loads)


def test_state_with_replicas_is_refused(double, tmp_path):
    counter_graph(tmp_path / "g.onnx", external=False)
    with _popart(double) as engine:
        with pytest.raises(EngineContractError, match="replication"):
            engine.compile(tmp_path / "g.onnx", CompileOptions(device="ipu", replicas=2))


# -- the double itself, as PopART at sdk-release-3.4 behaves -------------------------------------------------

_DOUBLE_CHECKS = """
import json
import numpy as np
import popart

graphs = json.loads({GRAPHS})
manager = popart.DeviceManager()
device = manager.acquireAvailableDevice(1)
x = np.ones((2, 3), np.float32)
result = {}


def session(path, constant):
    options = popart.SessionOptions()
    options.constantWeights = constant
    return popart.InferenceSession(path, popart.DataFlow(1, {"y": popart.AnchorReturnType("All")}), device,
                                   userOptions=options)


def run(s):
    anchors = s.initAnchorArrays()
    s.run(popart.PyStepIO({"x": x}, anchors))
    return anchors["y"].tolist()


def error(action):
    try:
        action()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


result["constant_update"] = error(lambda: session(graphs["counter"], True))
a = session(graphs["counter"], False)
a.prepareDevice()
result["before_upload"] = run(a)
a.weightsFromHost()
result["runs"] = [run(a), run(a)]
a.writeWeights(popart.PyWeightsIO({"S": np.full((2, 3), 10.0, np.float32)}))
result["written_not_uploaded"] = run(a)
a.weightsFromHost()
result["uploaded"] = run(a)
a.weightsToHost()
read = {"S": np.zeros((2, 3), np.float32)}
a.readWeights(popart.PyWeightsIO(read))
result["read"] = read["S"].tolist()
b = session(graphs["counter"], False)
b.prepareDevice()
b.weightsFromHost()
run(b)
result["after_other_engine"] = run(a)
plain = session(graphs["counter_plain"], True)
plain.prepareDevice()
result["write_constant"] = error(lambda: plain.writeWeights(popart.PyWeightsIO({"w": x})))
result["no_buffers_from_host"] = not hasattr(a, "buffersFromHost")
for kind in ("int64", "float64"):
    s = session(graphs[kind], False)
    result[kind] = error(s.prepareDevice)
print(json.dumps(result))
"""


def _typed_counter(path: Path, dtype: type) -> None:
    state = numpy_helper.from_array(np.zeros((2, 3), dtype), "S")
    nodes = [
        helper.make_node("CopyVarUpdate", ["S", "s2"], ["S_updated"], domain="ai.graphcore"),
        helper.make_node("Add", ["S", "S"], ["s2"]),
        helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "typed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [state],
    )
    onnx.save(
        helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 11), helper.make_opsetid("ai.graphcore", 1)]
        ),
        path,
    )


def test_the_double_models_variables_as_popart_does(double, tmp_path):
    from subprocess_env import python_json

    graphs = {"counter": str(tmp_path / "g.onnx"), "counter_plain": str(tmp_path / "plain.onnx")}
    counter_graph(tmp_path / "g.onnx", external=False)
    plain = helper.make_model(
        helper.make_graph(
            [helper.make_node("Add", ["x", "w"], ["y"])],
            "plain",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
            [numpy_helper.from_array(np.ones((2, 3), np.float32), "w")],
        ),
        opset_imports=[helper.make_opsetid("", 11)],
    )
    onnx.save(plain, tmp_path / "plain.onnx")
    for kind, dtype in (("int64", np.int64), ("float64", np.float64)):
        graphs[kind] = str(tmp_path / f"{kind}.onnx")
        _typed_counter(tmp_path / f"{kind}.onnx", dtype)
    result = python_json(_DOUBLE_CHECKS.replace("{GRAPHS}", repr(json.dumps(graphs))), env=double)
    # a Const cannot be updated (assumed: PopART has no check)
    assert "constant because constantWeights is set" in result["constant_update"]
    # Variables are undefined until weightsFromHost (assumed, NaN in the double)
    assert np.isnan(result["before_upload"]).all()
    assert result["runs"] == [np.full((2, 3), 2.0).tolist(), np.full((2, 3), 6.0).tolist()]
    # writeWeights changes only the host copy: the run reads the device's 6 and leaves 14
    assert result["written_not_uploaded"] == np.full((2, 3), 14.0).tolist()
    assert result["uploaded"] == np.full((2, 3), 22.0).tolist()  # (10 + 1) * 2
    assert result["read"] == np.full((2, 3), 22.0).tolist()
    # another session's engine was loaded: a's variables are undefined until it uploads again
    assert np.isnan(result["after_other_engine"]).all()
    assert result["write_constant"].startswith(
        "popart_runtime_error: Cannot call writeWeights when constantWeights"
    )
    assert result["no_buffers_from_host"]
    assert result["int64"] == "popart_exception: The data type INT64 is not supported in Poplar"
    assert result["float64"] == "popart_exception: The data type DOUBLE is not supported in Poplar"
