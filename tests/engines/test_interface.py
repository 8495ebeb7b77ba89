"""Engine interface v2 on the emulator engine: lifecycle, path-based compile, cache keys."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
from tiny_models import feed, tiny_model

from optimum_ipu_backend.engines import CompileOptions, EngineClosedError, load_engine
from optimum_ipu_backend.runtime.executables import ExecutableTable


@pytest.fixture()
def table(tmp_path):
    model = tiny_model(tmp_path / "model.onnx", sequence=5)
    engine = load_engine("emulator", "emulator")
    table = ExecutableTable(lambda: onnx.load(str(model)), engine, CompileOptions(), graph_digest="0" * 64)
    return table, engine


def test_compile_takes_a_path_and_close_releases_executables(table):
    table, engine = table
    entry = table.entry_for({"input_ids": (2, 5), "x": (2, 4)}, {})
    inputs = {name: array.astype(np.int32) if array.dtype == np.int64 else array
              for name, array in feed(2).items()}  # fmt: skip
    assert entry.executable.run(inputs)["y"].shape == (2, 3)
    with table:
        pass
    assert entry.executable.closed
    with pytest.raises(EngineClosedError):
        entry.executable.run(inputs)
    with pytest.raises(EngineClosedError):
        table.entry_for({"input_ids": (2, 5), "x": (2, 4)}, {})
    with engine:
        pass
    assert engine.closed


def test_every_binary_changing_setting_is_in_the_cache_key(table):
    table, engine = table
    shapes = {"input_ids": (2, 5)}
    base = table._cache_key(shapes, {}).digest
    for changed in (
        replace(table._options, extra={"engineOptions": {"opt.enableInlining": "false"}}),
        replace(table._options, precision="fp16"),
        replace(table._options, replicas=2),
        replace(table._options, device_iterations=4),
    ):
        table._options = changed
        assert table._cache_key(shapes, {}).digest != base
    table._options = CompileOptions(threads=3, compile_timeout=5.0, offline=True)
    assert table._cache_key(shapes, {}).digest == base  # none of these changes a binary
    engine.sdk_version = "popart 9.9.9"  # the instance's SDK version
    assert table._cache_key(shapes, {}).digest != base
