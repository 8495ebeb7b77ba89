"""Every ORTModel class the emulator serves, unchanged, with device="ipu" and device="ipu-model" on the
PopART and on the PopTorch engine (the SDK double on the path, a doubled system of 4 IPUs): outputs
match CPUExecutionProvider within the emulator's tolerance and generation is token-identical.

One fresh interpreter per engine (so the two run in parallel under xdist); each serves every model of
both devices from one shared worker process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from integration.test_ortmodels import ATOL, FORWARD, GENERATE, _onnx_dir
from model_zoo import session_zoo
from sdk_testing import call_log, sdk_environment
from subprocess_env import python

DEVICES = ("ipu", "ipu-model")


def _cases(zoo) -> dict:
    cases = {}
    for name, (cls, model, task) in FORWARD.items():
        cases[name] = {
            "kind": "forward",
            "class": cls,
            "model": model,
            "model_dir": str(zoo.model(model, task)),
            "onnx_dir": str(_onnx_dir(zoo, model, task)),
        }
    for name, (cls, model, task, load_kwargs) in GENERATE.items():
        cases[name] = {
            "kind": "generate",
            "class": cls,
            "model": model,
            "load_kwargs": load_kwargs,
            "model_dir": str(zoo.model(model, "text2text-generation" if task == "merged" else task)),
            "onnx_dir": str(_onnx_dir(zoo, model, task)),
        }
    return cases


def _run(tmp_path_factory, engine: str) -> tuple[dict, list[dict]]:
    zoo = session_zoo(tmp_path_factory)
    scratch = tmp_path_factory.mktemp(f"matrix-{engine}")
    environment = sdk_environment(scratch, ipus=4)
    spec = scratch / "spec.json"
    spec.write_text(json.dumps({"combos": [[device, engine] for device in DEVICES], "cases": _cases(zoo)}))
    script = Path(__file__).with_name("ortmodel_matrix.py")
    completed = python(
        f"import runpy, sys; sys.argv = ['matrix', {str(spec)!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')",
        env={**environment, "OPTIMUM_IPU_CACHE": str(scratch / "cache")},
    )
    assert completed.returncode == 0, completed.stderr[-5000:]
    return json.loads(completed.stdout.strip().splitlines()[-1]), call_log(environment)


@pytest.fixture(scope="module")
def popart_results(tmp_path_factory):
    return _run(tmp_path_factory, "popart")


@pytest.fixture(scope="module")
def poptorch_results(tmp_path_factory):
    return _run(tmp_path_factory, "poptorch")


def _results(request, engine: str):
    return request.getfixturevalue(f"{engine}_results")


def _check_sessions(result: dict, device: str, engine: str) -> None:
    assert "error" not in result, result.get("error")
    assert result["provider"] == "IPUExecutionProvider"
    assert result["sessions"], "no session found on the model"
    for session in result["sessions"]:
        options = session["options"]
        assert (options["device"], options["engine"], options["emulated"]) == (device, engine, "0")
        assert options["sdk_version"] == f"{engine} 3.4.0"
    assert result["fallback_warnings"] == []


@pytest.mark.parametrize("engine", ["popart", "poptorch"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(FORWARD))
def test_forward_matches_cpu(request, engine, device, name):
    results, _ = _results(request, engine)
    result = results[f"{device}/{engine}/{name}"]
    _check_sessions(result, device, engine)
    assert result["max_abs_diff"] <= ATOL


@pytest.mark.parametrize("engine", ["popart", "poptorch"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(GENERATE))
def test_generate_matches_cpu_tokens(request, engine, device, name):
    results, _ = _results(request, engine)
    result = results[f"{device}/{engine}/{name}"]
    _check_sessions(result, device, engine)
    assert result["tokens_equal"], result["expected_tokens"]
    assert result["distinct_tokens"] >= 3


def test_popart_call_log_follows_the_documented_order(popart_results):
    """graphcore-sdk-api.md §1.1: GraphTransformer(path).convertINT64ToINT32(clip=True), DataFlow with All
    anchors, a new SessionOptions, the device, InferenceSession(bytes, ...), prepareDevice, weightsFromHost,
    initAnchorArrays, then PyStepIO runs with C-contiguous arrays."""
    _, log = popart_results
    calls = [entry["call"] for entry in log]
    sessions = [index for index, call in enumerate(calls) if call == "InferenceSession.__init__"]
    assert sessions, "no PopART session was created"
    for index in sessions:
        before = calls[max(0, index - 6) : index]
        assert before[-2:] == ["GraphTransformer.__init__", "GraphTransformer.convertINT64ToINT32"], before
        assert calls[index + 1 : index + 2] == ["InferenceSession.prepareDevice"]
        after = [c for c in calls[index + 1 : index + 8] if c.startswith("InferenceSession.")]
        wanted = (
            "InferenceSession.prepareDevice",
            "InferenceSession.weightsFromHost",
            "InferenceSession.initAnchorArrays",
        )
        order = [c for c in after if c in wanted]
        assert order[:3] == [
            "InferenceSession.prepareDevice",
            "InferenceSession.weightsFromHost",
            "InferenceSession.initAnchorArrays",
        ]
    for entry in log:
        if entry["call"] == "GraphTransformer.__init__":
            assert entry["arg_type"] == "str" and entry["is_path"]
        if entry["call"] == "GraphTransformer.convertINT64ToINT32":
            assert entry["clip"] is True
        if entry["call"] == "InferenceSession.__init__":
            assert entry["fnModel_type"] == "bytes" and entry["deviceInfo_type"] == "DeviceInfo"
            assert entry["default_options"] is False, "the import-time default SessionOptions was used"
            assert set(entry["anchors"].values()) == {"All"}
            assert entry["options"]["partialsTypeMatMuls"] == "float"
            assert entry["options"]["enableEngineCaching"] is (entry["device"]["type"] == "Ipu")
            if entry["device"]["type"] == "IpuModel":
                assert entry["device"]["tilesPerIPU"] == 1472
        if entry["call"] == "InferenceSession.run":
            assert all(arg["c_contiguous"] for arg in entry["inputs"].values())
        if entry["call"] == "DeviceManager.createIpuModelDevice":
            assert entry["options"] == {"numIPUs": 1, "tilesPerIPU": 1472}
            assert entry["types"] == {"numIPUs": "int", "tilesPerIPU": "int"}
    assert "DeviceManager.enumerateDevices" in calls
    assert "DeviceInfo.detach" in calls


def test_poptorch_options_map_from_provider_options(poptorch_results):
    _, log = poptorch_results
    compiles = [entry for entry in log if entry["call"] == "poptorch.compile"]
    assert compiles
    for entry in compiles:
        assert entry["outputMode"] == "All" and entry["partials"] == "torch.float32"
        assert (entry["deviceIterations"], entry["replicationFactor"]) == (1, 1)
        assert entry["ipuModel"] is (entry["cachePath"] is None)
