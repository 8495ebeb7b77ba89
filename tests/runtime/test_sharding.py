"""A model sharded over several IPUs per replica on the emulator: it runs the annotated graph and matches
the CPU, every compiled shape carries a placement PopART accepts, and ipu_config.json's layers_per_ipu
sets it up (the PopART side: tests/engines/test_sharding_on_sdk.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from large_model_helper import (
    copy_export,
    cpu_outputs,
    emulator_session,
    external_bert,
    placement,
    sample_feed,
)

from optimum_ipu_backend.compiler.passes.shard_over_ipus import placement_problems
from optimum_ipu_backend.runtime.executable_cache import ExecutableCache
from optimum_ipu_backend.runtime.executables import LEGALIZED_GRAPH_FILE
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions, ProviderOptionError

ATOL = 1e-5


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return external_bert(tmp_path_factory)


def _legalized_graphs(cache_dir):
    cache = ExecutableCache(cache_dir)
    return [
        onnx.load(str(cache.get(info.key).file(LEGALIZED_GRAPH_FILE)), load_external_data=False)
        for info in cache.list()
    ]


def test_two_ipus_by_layers_match_cpu_on_the_emulator(export, tmp_path):
    session = emulator_session(export, tmp_path, ipus_per_replica=2, layers_per_ipu="1,1")
    for batch, seq in ((1, 5), (3, 12)):  # 3 rows: two pipeline-filling steps of 2, the last one padded
        feed = sample_feed(batch, seq, seed=seq)
        np.testing.assert_allclose(session.run(None, feed)[0], cpu_outputs(export, feed)[0], atol=ATOL)
    graphs = _legalized_graphs(tmp_path)
    assert len(graphs) == 2
    for graph in graphs:
        assert placement_problems(graph, 2) == []
        assert {stage for _, stage in placement(graph).values()} == {0, 1}


def test_ipu_config_layers_per_ipu_sets_the_ipus_per_replica(export, tmp_path):
    onnx_dir = copy_export(export, tmp_path / "export")
    (onnx_dir / "ipu_config.json").write_text(json.dumps({"inference_layers_per_ipu": [1, 1]}))
    options = IPUProviderOptions.parse({"device": "emulator"}, onnx_dir)
    assert options.runtime.ipus_per_replica == 2 and options.runtime.layers_per_ipu == (1, 1)
    with pytest.raises(ProviderOptionError, match=r"layers_per_ipu=\[1, 1\].*ipus_per_replica=4"):
        IPUProviderOptions.parse({"device": "emulator", "ipus_per_replica": 4}, onnx_dir)


def test_balanced_sharding_over_four_ipus_matches_cpu(export, tmp_path):
    session = emulator_session(export, tmp_path, ipus_per_replica=4, sequence_lengths="16")
    feed = sample_feed(2, 9)
    np.testing.assert_allclose(session.run(None, feed)[0], cpu_outputs(export, feed)[0], atol=ATOL)
    (graph,) = _legalized_graphs(tmp_path)
    assert placement_problems(graph, 4) == []
    assert {ipu for ipu, _ in placement(graph).values()} == {0, 1, 2, 3}
