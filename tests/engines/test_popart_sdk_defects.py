"""The PopART engine against behaviours of the real SDK that the first double hid (issue 18): the
type strings of ``TensorInfo.data_type_lcase()``, PopART's own cache switched on from the environment,
PopRun without ``popdist``, ``detach()`` on an offline device, a relative cache directory, and
``RecoveryAction`` values without ``name``.

Each runs a real worker process against the double in ``tests/sdk_double`` (which follows the PopART
source at sdk-release-3.4) and reads the double's call log.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sdk_testing import (
    DOUBLE_DIR,
    IPUS,
    calls,
    compile_offline,
    configure,
    sdk_environment,
    use_sdk_double,
)
from tiny_models import feed, reference, tiny_model

from optimum_ipu_backend.engines.base import EngineContractError
from optimum_ipu_backend.engines.worker import DeviceResetError
from optimum_ipu_backend.errors import InstallationError
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession


def _session(model: Path, cache: str | Path, device: str = "ipu", **options) -> IPUInferenceSession:
    raw = {"device": device, "engine": "popart", "executable_cache_dir": str(cache), **options}
    return IPUInferenceSession(str(model), options=IPUProviderOptions.parse(raw))


def _check(session: IPUInferenceSession, model: Path, seed: int = 0) -> None:
    inputs = feed(seed=seed)
    got, expected = session.run(None, inputs), reference(model, inputs)
    assert got[0].dtype == np.float32
    np.testing.assert_allclose(got[0], expected[0], atol=1e-6)
    np.testing.assert_array_equal(got[1], expected[1])


# -- defect 1: data_type_lcase() names FLOAT "float32" -----------------------------------------------------


@pytest.mark.parametrize("device", ["ipu", "ipu-model"])
def test_popart_float32_tensors_are_typed_from_data_type_lcase(double, tmp_path, device):
    model = tiny_model(tmp_path / "model" / "model.onnx")
    with _session(model, "disabled", device=device) as session:
        _check(session, model)
        assert session.get_outputs()[0].type == "tensor(float)"


def test_popart_type_the_engine_cannot_stream_is_refused_by_name():
    from optimum_ipu_backend.engines.popart import _numpy_type

    assert _numpy_type("float32", "x") == "float32"
    with pytest.raises(EngineContractError, match=r"tensor 'x'.*'float64'.*float32"):
        _numpy_type("float64", "x")


# -- defect 3: SessionOptions() turns PopART's cache on from POPART_CACHE_DIR / POPXL_CACHE_DIR ------------


@pytest.mark.parametrize("variable", ["POPART_CACHE_DIR", "POPXL_CACHE_DIR"])
def test_popart_own_cache_from_the_environment_is_off_when_ours_is(double, tmp_path, monkeypatch, variable):
    monkeypatch.setenv(variable, str(tmp_path / "sdk-cache"))  # the worker inherits it
    first = tiny_model(tmp_path / "a" / "model.onnx", seed=1)
    second = tiny_model(tmp_path / "b" / "model.onnx", seed=2)  # the same graph with other weights
    for model in (first, second):
        with _session(model, "disabled") as session:
            _check(session, model)  # PopART's key ignores weights: its cache would serve the first binary
    created = calls(double, "InferenceSession.__init__")
    assert len(created) == 2 and not any(entry["options"]["enableEngineCaching"] for entry in created)
    assert not calls(double, "cache_hit") and not calls(double, "cache_write")


# -- defect 8: PopART scans cachePath in the constructor and writes it in prepareDevice -------------------


def test_popart_relative_cache_directory_is_found_again(double, tmp_path, monkeypatch):
    model = tiny_model(tmp_path / "model" / "model.onnx")
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the second session loads what the first one wrote
        with _session(model, "relative-cache") as session:
            _check(session, model)
    (written,) = calls(double, "cache_write")
    (hit,) = calls(double, "cache_hit")
    # our cache writes into a staging directory and then moves the entry: the same .popef
    assert Path(hit["path"]).name == Path(written["path"]).name
    assert Path(hit["path"]).is_relative_to(tmp_path / "relative-cache")


# -- defect 10: RecoveryAction values without ``name`` -----------------------------------------------------


def test_popart_recovery_action_without_name_is_still_reset_and_retried(double, tmp_path):
    model = tiny_model(tmp_path / "model" / "model.onnx")
    with _session(model, "disabled") as session:
        _check(session, model)
        faults = [{"id": "reset", "at": "run", "error": "recoverable", "action": "IPU_RESET", "times": 1}]
        configure(double, ipus=IPUS, pybind11_enum_name=False, faults=faults)
        _check(session, model, seed=1)  # reset, reloaded, run once more
        assert calls(double, "DeviceInfo.attach")
        faults = [{"id": "partition", "at": "run", "error": "recoverable", "action": "PARTITION_RESET"}]
        configure(double, ipus=IPUS, pybind11_enum_name=False, faults=faults)
        with pytest.raises(DeviceResetError, match="PARTITION_RESET"):
            session.run(None, feed())


def test_popart_recovery_action_name_from_any_pybind11_build():
    from optimum_ipu_backend.engines.worker_server import recovery_action_name

    class Named:  # pybind11 2.3 and later
        name = "LINK_RESET"

    class Unnamed:  # pybind11 before 2.3: only repr/str
        def __repr__(self) -> str:
            return "RecoveryAction.IPU_RESET"

    assert recovery_action_name(Named()) == "LINK_RESET"
    assert recovery_action_name(Unnamed()) == "IPU_RESET"


# -- defect 7: an offline device refuses detach() -----------------------------------------------------------


def test_popart_offline_compile_releases_its_device_without_detach(tmp_path):
    model = tiny_model(tmp_path / "model" / "model.onnx")
    environment = sdk_environment(tmp_path / "sdk", ipus=0)
    completed = compile_offline(
        model.parent, environment, batch_size="1", executable_cache_dir=str(tmp_path / "c")
    )
    assert completed.returncode == 0, completed.stderr
    assert calls(environment, "DeviceManager.createOfflineIPUDevice")
    refused = [entry for entry in calls(environment, "DeviceInfo.detach") if entry.get("refused")]
    assert not refused, "detach() on an offline device throws 'Cannot detach from offline device'"
    assert "releasing a device failed" not in completed.stdout + completed.stderr


# -- defect 5: under PopRun, PopART's InferenceSession imports popdist ------------------------------------


@contextlib.contextmanager
def _sdk_without_popdist(directory: Path) -> Iterator[dict[str, str]]:
    """The PopART double on the path without the popdist package (an SDK whose popdist wheel is not
    installed in this Python)."""
    only_popart = directory / "only-popart"
    only_popart.mkdir(parents=True)
    (only_popart / "popart").symlink_to(DOUBLE_DIR / "popart", target_is_directory=True)
    with use_sdk_double(directory, only_popart, ipus=IPUS) as environment:
        yield environment


def test_popart_poprun_without_popdist_is_refused_before_acquiring(tmp_path, monkeypatch):
    model = tiny_model(tmp_path / "model" / "model.onnx")
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "4")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "2")
    monkeypatch.setenv("POPDIST_REPLICA_INDEX_OFFSET", "2")
    monkeypatch.setenv("POPDIST_NUM_IPUS_PER_REPLICA", "1")
    with _sdk_without_popdist(tmp_path / "sdk") as environment:
        session = _session(model, "disabled", batch_size="2")
        with pytest.raises(InstallationError, match=r"PopRun.*popdist.*Poplar SDK.*popdist-\*\.whl") as info:
            session.run(None, feed(batch=2))
        assert "No module named" not in str(info.value).splitlines()[0]
        assert not calls(environment, "DeviceManager.acquireAvailableDevice")
        assert not calls(environment, "InferenceSession.__init__")
        session.close()


def test_popart_poprun_with_popdist_uses_its_device_and_options(double, tmp_path, monkeypatch):
    model = tiny_model(tmp_path / "model" / "model.onnx")
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "4")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "2")
    monkeypatch.setenv("POPDIST_REPLICA_INDEX_OFFSET", "2")
    monkeypatch.setenv("POPDIST_NUM_IPUS_PER_REPLICA", "1")
    with _session(model, "disabled", batch_size="1,2") as session:
        _check(session, model)
    (device,) = calls(double, "popdist.popart.getDevice")
    (acquired,) = calls(double, "DeviceManager.acquireDeviceById")
    assert acquired["id"] == device["id"] and acquired["numIpus"] == 2
    assert calls(double, "popdist.popart.configureSessionOptions") and calls(double, "popdist_backend_init")
    (created,) = calls(double, "InferenceSession.__init__")
    options = created["options"]
    assert (options["globalReplicationFactor"], options["globalReplicaOffset"]) == (4, 2)
    assert json.dumps(options["enableDistributedReplicatedGraphs"]) == "true"
