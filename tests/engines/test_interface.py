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


def test_another_engine_reuses_the_legalized_graph_a_cache_entry_holds(tmp_path, monkeypatch):
    """A table on another engine (or device, or SDK version) in another process legalizes nothing the cache
    holds for the same graph, shapes and options: it compiles from the graph of the first engine's entry
    and returns the same outputs. A changed compiler, or a record that does not verify, legalizes again."""
    from optimum_ipu_backend.compiler import pipeline
    from optimum_ipu_backend.runtime import executables
    from optimum_ipu_backend.runtime.cache_files import LEGALIZED_DIR
    from optimum_ipu_backend.runtime.executable_cache import ExecutableCache

    model = tiny_model(tmp_path / "model.onnx", sequence=5)
    cache = ExecutableCache(tmp_path / "cache")
    legalized = []
    real_legalize = pipeline.legalize
    monkeypatch.setattr(pipeline, "legalize", lambda *a, **k: legalized.append(1) or real_legalize(*a, **k))
    emulator = load_engine("emulator", "emulator")

    def engine_named(name: str):
        """The emulator under another engine name: its own cache entries."""
        return type(f"{name}-engine", (type(emulator),), {"name": name})("emulator")

    shapes = {"input_ids": (2, 5), "x": (2, 4)}
    inputs = {k: v.astype(np.int32) if v.dtype == np.int64 else v for k, v in feed(2).items()}

    def serve(engine) -> np.ndarray:
        monkeypatch.setattr(executables, "_legalized_files", {})  # a new process: nothing in memory
        table = ExecutableTable(
            lambda: onnx.load(str(model)), engine, CompileOptions(), graph_digest="1" * 64, cache=cache
        )
        with table:
            return table.entry_for(shapes, {}).executable.run(inputs)["y"]

    first = serve(emulator)
    assert len(legalized) == 1
    records = list((tmp_path / "cache" / LEGALIZED_DIR / ("1" * 64)).glob("*.json"))
    assert len(records) == 1
    twin = serve(engine_named("emulator-twin"))
    assert len(legalized) == 1, "the twin engine legalized the graph again"
    np.testing.assert_array_equal(twin, first)
    assert len({info.key for info in cache.list()}) == 2  # one entry per engine

    records[0].write_text("{not json")  # a record that does not verify is not served
    np.testing.assert_array_equal(serve(engine_named("emulator-third")), first)
    assert len(legalized) == 2

    monkeypatch.setattr(executables, "code_identity", lambda: "another compiler")
    np.testing.assert_array_equal(serve(engine_named("emulator-fourth")), first)
    assert len(legalized) == 3
