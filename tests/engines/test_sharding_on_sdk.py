"""Sharding on the PopART engine (the SDK double, through its documented API only): manual virtual
graphs, pipelining with enough batches per step, replicas x ipus_per_replica IPUs acquired, results equal
to the CPU; an engine that cannot shard says so when the session is created."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from large_model_helper import external_bert, sample_feed
from sdk_testing import call_log, use_sdk_double

from optimum_ipu_backend.errors import ConfigurationError
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session import IPUInferenceSession

ATOL = 1e-5


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return external_bert(tmp_path_factory)


def _cpu(onnx_dir, feed):
    return ort.InferenceSession(str(onnx_dir / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        None, feed
    )


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    with use_sdk_double(tmp_path_factory.mktemp("sdk"), ipus=8) as environment:
        yield environment


def test_popart_acquires_replicas_times_ipus_and_pipelines(sdk, export, tmp_path):
    raw = {
        "device": "ipu",
        "engine": "popart",
        "executable_cache_dir": str(tmp_path),
        "sequence_lengths": "16",
        "ipus_per_replica": 4,
        "replication_factor": 2,
    }
    session = IPUInferenceSession(str(export / "model.onnx"), options=IPUProviderOptions.parse(raw, export))
    feed = sample_feed(3, 10)
    np.testing.assert_allclose(session.run(None, feed)[0], _cpu(export, feed)[0], atol=ATOL)
    session.close()
    log = call_log(sdk)
    acquired = [entry for entry in log if entry["call"] == "DeviceManager.acquireAvailableDevice"]
    assert acquired and all(entry["numIpus"] == 8 for entry in acquired)
    (created,) = [entry for entry in log if entry["call"] == "InferenceSession.__init__"]
    options = created["options"]
    assert str(options["virtualGraphMode"]).endswith("Manual") and options["enablePipelining"] is True
    assert options["enableReplicatedGraphs"] is True and options["replicatedGraphCount"] == 2
    assert created["batchesPerStep"] >= 4 and created["device"]["numIpus"] == 8


def test_an_engine_that_cannot_shard_says_so(sdk, export, tmp_path):
    raw = {
        "device": "ipu",
        "engine": "poptorch",
        "executable_cache_dir": str(tmp_path),
        "ipus_per_replica": 2,
    }
    with pytest.raises(
        ConfigurationError, match="poptorch engine runs each replica on one IPU.*engine='popart'"
    ):
        IPUInferenceSession(str(export / "model.onnx"), options=IPUProviderOptions.parse(raw, export))
