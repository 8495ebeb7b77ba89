"""The PopART and PopTorch engines end to end against the SDK double: host layouts, residency and
switches, the executable cache, device faults and their recovery, lifecycle, PopDist, the registry.

Everything runs through a real worker process that imports the double first; the double's call log
(one JSON line per SDK call, written by the worker) is what the assertions read.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time

import numpy as np
import onnx
import pytest
from sdk_testing import IPUS, calls, clear_log, configure
from tiny_models import feed, reference, tiny_model

from optimum_ipu_backend.engines import EngineClosedError, engine_names
from optimum_ipu_backend.engines.base import CompileOptions
from optimum_ipu_backend.engines.popart import PopARTEngine
from optimum_ipu_backend.engines.probe import resolve_device
from optimum_ipu_backend.engines.worker import (
    CompileTimeoutError,
    DeviceAcquisitionError,
    DeviceLostError,
    DeviceResetError,
    IPUOutOfMemoryError,
    SdkError,
    WorkerDiedError,
)
from optimum_ipu_backend.runtime.executable_cache import ExecutableCache
from optimum_ipu_backend.runtime.executables import ExecutableTable
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions, ProviderOptionError
from optimum_ipu_backend.session import IPUInferenceSession, create_session

ATOL = 1e-6


def _session(model, cache, engine="popart", device="ipu", **options) -> IPUInferenceSession:
    raw = {"device": device, "engine": engine, "executable_cache_dir": str(cache), **options}
    return IPUInferenceSession(str(model), options=IPUProviderOptions.parse(raw))


def _check(session, model, batch=3, seed=0) -> None:
    inputs = feed(batch=batch, seed=seed)
    got, expected = session.run(None, inputs), reference(model, inputs)
    np.testing.assert_allclose(got[0], expected[0], atol=ATOL)
    np.testing.assert_array_equal(got[1], expected[1])


# -- registry --------------------------------------------------------------------------------------------


def test_one_registry_chooses_by_priority_and_serves_the_engine_option(double):
    assert set(engine_names()) == {"popart", "poptorch", "emulator"}
    assert resolve_device("ipu").engine == "popart"  # both SDK modules found: the higher priority
    assert resolve_device("ipu-model", "poptorch").engine == "poptorch"
    with pytest.raises(ValueError, match="serves device"):
        resolve_device("emulator", "popart")
    with pytest.raises(ProviderOptionError, match="engine"):
        IPUProviderOptions.parse({"device": "ipu", "engine": "tensorflow"})


# -- layouts, residency ----------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["popart", "poptorch"])
def test_replication_and_device_iterations_use_the_documented_host_layout(double, model, tmp_path, engine):
    session = _session(model, tmp_path, engine, replication_factor=2, device_iterations=2, batch_size="1,2")
    for batch in (1, 7, 13):
        _check(session, model, batch=batch, seed=batch)
    if engine == "popart":
        (created,) = calls(double, "InferenceSession.__init__")[:1]
        assert created["batchesPerStep"] == 2 and created["device"]["numIpus"] == 2
        assert (
            created["options"]["enableReplicatedGraphs"] and created["options"]["replicatedGraphCount"] == 2
        )
        for run in calls(double, "InferenceSession.run"):
            # [batches_per_step, replicas, micro_batch, ...], anchors in the same layout
            assert run["inputs"]["x"]["shape"][:2] == [2, 2] and run["outputs"]["y"]["shape"][:2] == [2, 2]
    else:
        for compiled in calls(double, "poptorch.compile"):
            assert (compiled["deviceIterations"], compiled["replicationFactor"]) == (2, 2)
        for run in calls(double, "poptorch.run"):  # dim 0 = micro x iterations x replicas
            assert run["args"][1]["shape"][0] in (4, 8)
    session.close()


@pytest.mark.parametrize("engine", ["popart", "poptorch"])
def test_more_buckets_than_ipus_switch_at_most_once_per_executable_per_call(double, model, tmp_path, engine):
    configure(double, ipus=2)
    session = _session(model, tmp_path, engine, batch_size="1,2,4,8")
    loads = (
        "InferenceSession.loadEngineAndConnectStreams" if engine == "popart" else "poptorch.attachToDevice"
    )
    previous = 0
    for batch in (1, 2, 3, 8, 1, 21, 2, 5):  # 21 rows: three steps of the batch-8 executable
        before = len(calls(double, loads))
        _check(session, model, batch=batch, seed=batch)
        stats = session.compiled_executables()
        switches = sum(entry["switches"] for entry in stats)
        assert switches - previous <= 1, "one call uses one executable here, so it may switch once"
        if engine == "popart":
            assert len(calls(double, loads)) - before <= 1 + (batch not in (1, 2, 3, 8, 21, 5))
        previous = switches
    stats = session.compiled_executables()
    assert len(stats) == 4 and len({entry["device"] for entry in stats}) == 2  # spread over both IPUs
    assert sum(entry["switches"] for entry in stats) >= 2
    session.close()


def test_ipu_groups_caps_the_ipus_a_session_holds(double, model, tmp_path):
    configure(double, ipus=4)
    session = _session(model, tmp_path, batch_size="1,2,4,8", ipu_groups="2")
    for batch in (1, 2, 3, 8, 1, 5):
        _check(session, model, batch=batch, seed=batch)
    stats = session.compiled_executables()
    assert len(stats) == 4 and len({entry["device"] for entry in stats}) == 2  # 4 IPUs free, 2 held
    session.close()


def _fixed_batch(path, batch: int, seed: int = 0):
    """The tiny graph with every size static, as the runtime hands an engine its legalized graphs."""
    model = onnx.load(str(tiny_model(path, seed=seed, sequence=5)))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = batch
    onnx.save(model, str(path))
    return path


def test_a_background_compile_leaves_the_shared_ipu_and_the_device_worker_to_the_calls(double, tmp_path):
    """On one IPU, a background compile (``build_aside``) runs in the compile worker, for an offline twin of
    the device: the executable loaded there serves on, neither waiting for the compile nor reloaded after
    it, and the new one goes onto the IPU, from the binary the compile left, at its first run."""
    configure(double, ipus=1)
    graphs = {batch: _fixed_batch(tmp_path / f"b{batch}" / "model.onnx", batch) for batch in (2, 4)}
    options = CompileOptions(device="ipu")

    def check(executable, batch: int) -> None:
        inputs = feed(batch=batch, seed=batch)
        device_feed = {spec.name: inputs[spec.name].astype(spec.dtype) for spec in executable.inputs}
        got, expected = executable.run(device_feed), reference(graphs[batch], inputs)
        np.testing.assert_allclose(got["y"], expected[0], atol=ATOL)
        np.testing.assert_array_equal(got["ids_plus_one"], expected[1])

    with PopARTEngine("ipu") as engine:
        artifacts = {batch: graph.parent / "artifacts" for batch, graph in graphs.items()}
        for directory in artifacts.values():
            directory.mkdir()
        loaded = engine.compile(graphs[2], options, artifacts[2])
        check(loaded, 2)
        configure(double, ipus=1, faults=[{"at": "prepareDevice", "error": "hang", "seconds": 3}])
        built = {}
        compiling = threading.Thread(
            target=lambda: built.update(new=engine.build_aside(graphs[4], options, artifacts[4]))
        )
        compiling.start()
        seconds = []
        while compiling.is_alive():
            started = time.perf_counter()
            check(loaded, 2)
            seconds.append(time.perf_counter() - started)
        compiling.join()
        configure(double, ipus=1)  # the device worker's own builds are not held
        # the runs went on through the 3 s compile, each as fast as alone, and none reloaded the executable
        assert len(seconds) >= 5 and max(seconds) < 1.0, seconds
        assert loaded.switches == 0
        new = built["new"]
        check(new, 4)  # built on the IPU now: its first load, not a switch
        assert new.switches == 0 and loaded.switches == 0
        check(loaded, 2)
        assert loaded.switches == 1  # the IPU holds the new one now: this reload is real
    sessions = calls(double, "InferenceSession.__init__")
    compile_pid = next(entry["pid"] for entry in sessions if entry["device"]["type"] == "OfflineIpu")
    on_device = [entry for entry in sessions if entry["device"]["type"] == "Ipu"]
    assert len(on_device) == 2 and all(entry["pid"] != compile_pid for entry in on_device)
    (written,) = [entry for entry in calls(double, "cache_write") if entry["pid"] == compile_pid]
    hits = [entry for entry in calls(double, "cache_hit") if entry["pid"] != compile_pid]
    assert [entry["path"] for entry in hits] == [written["path"]]  # the device ran the twin's binary


@pytest.mark.parametrize("cached", [False, True])
def test_the_table_builds_background_executables_aside_from_the_device(double, tmp_path, cached):
    """``ExecutableTable.entry_for(background=True)`` (the serving plan's compiles) builds with
    ``build_aside``, with or without an executable cache (the binary then lies in the table's scratch
    directory): the executable serving on the one IPU is not reloaded by it."""
    configure(double, ipus=1)
    model = tiny_model(tmp_path / "model.onnx", sequence=5)
    cache = ExecutableCache(tmp_path / "cache") if cached else None
    with PopARTEngine("ipu") as engine:
        table = ExecutableTable(
            lambda: onnx.load(str(model)),
            engine,
            CompileOptions(device="ipu"),
            graph_digest="1" * 64,
            cache=cache,
        )
        with table:
            entries = {}
            for batch, background in ((2, False), (4, True)):
                shapes = {"input_ids": (batch, 5), "x": (batch, 4)}
                entries[batch] = table.entry_for(shapes, {}, background=background)
            for batch in (2, 4, 2):
                inputs = feed(batch=batch, seed=batch)
                executable = entries[batch].executable
                typed = {spec.name: inputs[spec.name].astype(spec.dtype) for spec in executable.inputs}
                got = executable.run(typed)
                np.testing.assert_allclose(got["y"], reference(model, inputs)[0], atol=ATOL)
                if batch == 4:
                    assert entries[2].executable.switches == 0  # the background build did not reload it
            assert entries[2].executable.switches == 1 and entries[4].executable.switches == 0
    sessions = calls(double, "InferenceSession.__init__")
    assert [entry["device"]["type"] for entry in sessions] == ["Ipu", "OfflineIpu", "Ipu"]
    (hit,) = calls(double, "cache_hit")
    assert hit["pid"] != sessions[1]["pid"] and (not cached or str(tmp_path / "cache") in hit["path"])


# -- the executable cache --------------------------------------------------------------------------------


def test_engine_cache_is_ours_per_entry_so_new_weights_are_never_served_stale(double, tmp_path):
    cache = tmp_path / "cache"
    first = tiny_model(tmp_path / "a" / "model.onnx", seed=1)
    second = tiny_model(tmp_path / "b" / "model.onnx", seed=2)  # same graph, other weights
    with _session(first, cache) as session:
        _check(session, first)
    with _session(second, cache) as session:
        _check(session, second)  # PopART's own key ignores weights: a shared cachePath would fail here
    writes = [entry["path"] for entry in calls(double, "cache_write")]
    assert len(writes) == 2 and len({os.path.dirname(path) for path in writes}) == 2
    with _session(first, cache) as session:  # a later process loads the .popef: no compile
        _check(session, first)
        assert [entry["source"] for entry in session.compiled_executables()] == ["cache"]
    assert len(calls(double, "cache_hit")) == 1


# -- faults ----------------------------------------------------------------------------------------------


def test_acquisition_failure_is_actionable_and_other_sessions_keep_serving(double, model, tmp_path):
    healthy = _session(model, tmp_path)
    _check(healthy, model)
    greedy = _session(model, tmp_path, replication_factor=8)
    with pytest.raises(DeviceAcquisitionError, match="gc-monitor") as info:
        greedy.run(None, feed())
    assert "replication_factor" in str(info.value)
    assert isinstance(info.value.__cause__, SdkError) and "Failed to acquire" in str(info.value.__cause__)
    _check(healthy, model, seed=5)
    healthy.close()
    greedy.close()


def test_out_of_memory_names_the_estimate_and_smaller_buckets(double, model, tmp_path):
    configure(double, ipus=IPUS, memory_bytes_per_ipu=8)
    session = _session(model, tmp_path)
    with pytest.raises(IPUOutOfMemoryError, match="optimum-ipu check") as info:
        session.run(None, feed())
    assert "sequence_lengths" in str(info.value) and "OutOfMemoryException" in str(info.value)
    configure(double, ipus=IPUS)
    _check(session, model)  # the same session serves once the executable fits
    session.close()


def test_recoverable_error_is_reset_and_retried_once(double, model, tmp_path, caplog):
    session = _session(model, tmp_path)
    _check(session, model)
    configure(double, ipus=IPUS, faults=[{"id": "reset", "at": "run", "error": "recoverable", "times": 1}])
    with caplog.at_level(logging.WARNING):
        _check(session, model, seed=1)
    assert "reset" in caplog.text
    assert calls(double, "DeviceInfo.detach") and calls(double, "DeviceInfo.attach")
    configure(double, ipus=IPUS, faults=[{"id": "twice", "at": "run", "error": "recoverable", "times": 2}])
    with pytest.raises(DeviceResetError, match="did not clear"):
        session.run(None, feed())
    _check(session, model, seed=2)  # the device was released; the next call acquires it again
    session.close()


def test_reset_that_needs_an_operator_and_unrecoverable_errors_release_the_device(double, model, tmp_path):
    session, other = _session(model, tmp_path), _session(model, tmp_path, engine="poptorch")
    _check(session, model)
    _check(other, model)
    faults = [{"id": "partition", "at": "run", "error": "recoverable", "action": "PARTITION_RESET"}]
    configure(double, ipus=IPUS, faults=faults)
    with pytest.raises(DeviceResetError, match="vipu reset partition"):
        session.run(None, feed())
    configure(double, ipus=IPUS, faults=[{"id": "lost", "at": "run", "error": "unrecoverable"}])
    detached = len(calls(double, "DeviceInfo.detach"))
    with pytest.raises(DeviceLostError, match="released") as info:
        session.run(None, feed())
    assert "poplar_unrecoverable_runtime_error" in str(info.value.__cause__)
    assert len(calls(double, "DeviceInfo.detach")) == detached + 1
    configure(double, ipus=IPUS)
    _check(session, model, seed=3)
    _check(other, model, seed=4)
    session.close()
    other.close()


def test_hung_compile_times_out_and_the_next_call_serves(double, model, tmp_path):
    configure(
        double, ipus=IPUS, faults=[{"id": "hang", "at": "prepareDevice", "error": "hang", "seconds": 60}]
    )
    session = _session(model, tmp_path, compile_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(CompileTimeoutError, match="compile_timeout") as info:
        session.run(None, feed())
    assert time.monotonic() - started < 120
    assert "optimum-ipu compile" in str(info.value)
    configure(double, ipus=IPUS)
    _check(session, model)  # a new worker process compiles it
    session.close()


def test_killed_worker_is_reported_and_restarted(double, model, tmp_path, caplog):
    session = _session(model, tmp_path)
    _check(session, model)
    pid = session.engine._worker.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    with caplog.at_level(logging.WARNING):
        try:  # died between calls: restarted on this call (warned), or reported by it and restarted next
            _check(session, model, seed=1)
        except WorkerDiedError as exc:
            assert "killed by signal 9" in str(exc)
            _check(session, model, seed=1)
        else:
            assert "rebuilding" in caplog.text
    configure(double, ipus=IPUS, faults=[{"id": "die", "at": "run", "error": "exit", "code": 3}])
    with pytest.raises(WorkerDiedError, match="exit status 3"):
        session.run(None, feed())
    configure(double, ipus=IPUS)
    _check(session, model, seed=2)
    session.close()


def test_eager_compile_lets_listed_fallback_providers_take_over(double, tmp_path):
    model = tiny_model(tmp_path / "static" / "model.onnx", sequence=5)
    configure(double, ipus=IPUS, memory_bytes_per_ipu=8)
    options = {"device": "ipu", "engine": "popart", "compile": "eager"}
    with pytest.raises(IPUOutOfMemoryError):
        create_session(str(model), providers=["ipu"], provider_options=[options])
    with pytest.warns(RuntimeWarning, match="Falling back"):
        session = create_session(
            str(model), providers=["ipu", "CPUExecutionProvider"], provider_options=[options, {}]
        )
    assert session.get_providers() == ["CPUExecutionProvider"]


# -- lifecycle, threads ----------------------------------------------------------------------------------


def test_close_releases_the_ipus_and_a_closed_session_refuses_to_run(double, model, tmp_path):
    other = _session(model, tmp_path, batch_size="2")  # keeps the worker busy with another device
    _check(other, model, batch=2)
    with _session(model, tmp_path, batch_size="4") as session:
        _check(session, model)
    detached = calls(double, "DeviceInfo.detach")
    assert len(detached) == 1, "closing released the closed session's IPU, and only that one"
    with pytest.raises(EngineClosedError, match="closed"):
        session.run(None, feed())
    _check(other, model, batch=2, seed=1)
    pid = other.engine._worker.pid
    other.close()
    for _ in range(50):  # the last engine closed: its worker process exits
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid)


def test_garbage_collection_releases_the_worker(double, model, tmp_path):
    gc.collect()  # sessions other tests dropped
    session = _session(model, tmp_path)
    _check(session, model)
    pid = session.engine._worker.pid
    del session
    gc.collect()
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid) and calls(double, "DeviceInfo.detach")


def _wait_until_dead(pid: int) -> None:
    for _ in range(100):
        try:
            with open(f"/proc/{pid}/stat") as stream:
                if stream.read().split()[2] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return finished == 0


def test_calls_from_threads_are_serialized_for_an_engine_that_is_not_thread_safe(double, model, tmp_path):
    session = _session(model, tmp_path, batch_size="4")
    errors = []

    def work(seed: int) -> None:
        try:
            for index in range(5):
                _check(session, model, batch=3, seed=seed * 10 + index)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    session.close()


# -- PopRun / PopDist ------------------------------------------------------------------------------------


def test_each_poprun_instance_configures_its_share(double, model, tmp_path, monkeypatch):
    """poprun --num-instances 2 --num-replicas 4: instance i runs replicas 2i, 2i+1."""
    monkeypatch.setenv("POPDIST_NUM_TOTAL_REPLICAS", "4")
    monkeypatch.setenv("POPDIST_NUM_LOCAL_REPLICAS", "2")
    monkeypatch.setenv("POPDIST_NUM_IPUS_PER_REPLICA", "1")
    for offset in (0, 2):
        monkeypatch.setenv("POPDIST_REPLICA_INDEX_OFFSET", str(offset))
        clear_log(double)
        with _session(model, tmp_path, batch_size="1,2") as session:
            assert session.get_provider_options()["IPUExecutionProvider"]["replication_factor"] == "2"
            _check(session, model, batch=5)
        (created,) = calls(double, "InferenceSession.__init__")
        options = created["options"]
        assert options["enableDistributedReplicatedGraphs"] is True
        assert (options["globalReplicationFactor"], options["globalReplicaOffset"]) == (4, offset)
        assert (options["enableReplicatedGraphs"], options["replicatedGraphCount"]) == (True, 2)
    with pytest.raises(ProviderOptionError, match="PopRun"):
        _session(model, tmp_path, replication_factor=4)


def test_sdk_double_refuses_import_after_onnx():
    """The trap the worker process exists for (the SDK imported after onnx in one process), as the
    double reproduces it."""
    from sdk_testing import DOUBLE_DIR
    from subprocess_env import python

    completed = python("import onnx\nimport popart\n", env={"PYTHONPATH": str(DOUBLE_DIR)})
    assert completed.returncode != 0 and "popart must be imported before onnx" in completed.stderr


def test_no_ipu_listed_by_the_sdk_is_a_device_error_with_fallback(double, model):
    configure(double, ipus=0)
    with pytest.raises(Exception, match="found no IPUs") as info:
        IPUInferenceSession(str(model), options=IPUProviderOptions.parse({"device": "ipu"}))
    assert "IPUOF_VIPU_API_PARTITION_ID" in str(info.value)
    with pytest.warns(RuntimeWarning, match="Falling back"):
        create_session(str(model), providers=["ipu", "CPUExecutionProvider"])
    assert calls(double, "DeviceManager.enumerateDevices")


def test_interpreter_exit_releases_the_ipus_and_the_worker(double, model):
    from subprocess_env import python

    code = (
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from tiny_models import feed\n"
        "from optimum_ipu_backend.session import IPUInferenceSession\n"
        "from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions\n"
        "options = IPUProviderOptions.parse({'device': 'ipu'})\n"
        f"session = IPUInferenceSession({str(model)!r}, options=options)\n"
        "session.run(None, feed())\n"
        "print(session.engine._worker.pid)\n"  # no close(): the interpreter exits
    )
    completed = python(code, env=double)
    assert completed.returncode == 0, completed.stderr
    pid = int(completed.stdout.split()[-1])
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] in ("Z", "X")
    detached = [entry for entry in calls(double, "DeviceInfo.detach") if entry["pid"] == pid]
    assert detached and detached[0]["type"] == "Ipu"
