"""The executable cache: keys, atomic builds, integrity checks, one build across racing processes,
LRU eviction under a size cap, and where it lives."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path

import platformdirs
import pytest
import xxhash
from filelock import FileLock

import optimum_ipu_backend.runtime.executable_cache as cache_module
from optimum_ipu_backend.runtime.executable_cache import (
    CACHE_ENV,
    LAST_USED_NAME,
    CacheError,
    CacheKey,
    ExecutableCache,
    parse_byte_size,
)

PAYLOAD = bytes(range(256)) * 40  # 10 KiB


def make_key(tag: str = "a", **changes: object) -> CacheKey:
    arguments: dict = {
        "graph": f"graph-{tag}".encode(),
        "shapes": {"input_ids": (1, 128), "attention_mask": (1, 128)},
        "precision": "fp32",
        "engine": "emulator",
        "sdk_version": None,
        "options": {"threads": 1},
    }
    arguments.update(changes)
    return CacheKey.build(**arguments)


def writer(payload: bytes = PAYLOAD, name: str = "executable.popef", calls: list | None = None):
    def build(directory: Path) -> None:
        if calls is not None:
            calls.append(directory)
        (directory / name).write_bytes(payload)
        (directory / "model.onnx").write_bytes(b"onnx:" + payload[:100])

    return build


def age(cache: ExecutableCache, key: CacheKey, seconds_ago: float) -> None:
    """Pretend ``key`` was last used ``seconds_ago``, so LRU order does not depend on clock resolution."""
    stamp = time.time() - seconds_ago
    os.utime(cache.entry_path(key) / LAST_USED_NAME, (stamp, stamp))


# ----------------------------------------------------------------------------------------------------------
# Keys and locations
# ----------------------------------------------------------------------------------------------------------


def test_key_is_the_sha256_of_canonical_json_of_its_inputs() -> None:
    key = make_key()
    text = json.dumps(key.inputs, sort_keys=True, separators=(",", ":"))
    assert key.digest == hashlib.sha256(text.encode()).hexdigest()
    assert key.inputs["graph_sha256"] == hashlib.sha256(b"graph-a").hexdigest()
    assert key.inputs["shapes"] == {"attention_mask": [1, 128], "input_ids": [1, 128]}
    assert make_key(graph=hashlib.sha256(b"graph-a").hexdigest()).digest == key.digest
    assert make_key().digest == key.digest


@pytest.mark.parametrize(
    "change",
    [
        {"graph": b"other graph"},
        {"shapes": {"input_ids": (1, 64), "attention_mask": (1, 128)}},
        {"precision": "fp16"},
        {"engine": "popart"},
        {"sdk_version": "3.4.0"},
        {"options": {"threads": 2}},
    ],
)
def test_every_key_input_changes_the_key(change: dict) -> None:
    assert make_key(**change).digest != make_key().digest


def test_key_inputs_must_be_json() -> None:
    with pytest.raises(TypeError, match="JSON"):
        make_key(options={"callback": object()})
    with pytest.raises(TypeError):
        make_key(graph=12345)


def test_root_comes_from_the_argument_then_the_environment_then_the_platform(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    default = ExecutableCache()
    assert default.root == Path(platformdirs.user_cache_dir("optimum-ipu-backend"))
    assert default.root_source == "default"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "from-env"))
    from_env = ExecutableCache()
    assert (from_env.root, from_env.root_source) == (tmp_path / "from-env", "environment")
    explicit = ExecutableCache(tmp_path / "explicit")
    assert (explicit.root, explicit.root_source) == (tmp_path / "explicit", "argument")
    entry = from_env.get_or_create(make_key(), writer())
    assert entry.path.is_relative_to(tmp_path / "from-env")


def test_bad_keys_and_limits_are_rejected(tmp_path: Path) -> None:
    cache = ExecutableCache(tmp_path)
    for bad in ("../../etc", "ABC", "0" * 63, 42):
        with pytest.raises(CacheError):
            cache.get(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ExecutableCache(tmp_path, size_limit_bytes=0)


# ----------------------------------------------------------------------------------------------------------
# Building and reading
# ----------------------------------------------------------------------------------------------------------


def test_get_or_create_builds_once_and_reads_after(tmp_path: Path) -> None:
    cache = ExecutableCache(tmp_path)
    key = make_key()
    assert cache.get(key) is None
    calls: list = []
    first = cache.get_or_create(key, writer(calls=calls), meta={"model": "bert", "shapes": "1x128"})
    second = cache.get_or_create(key, writer(calls=calls))
    assert len(calls) == 1
    assert first.created_now and not second.created_now
    assert second.read_bytes("executable.popef") == PAYLOAD
    assert first.path == tmp_path / key.digest[:2] / key.digest
    assert sorted(first.files) == ["executable.popef", "model.onnx"]
    manifest = json.loads((first.path / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["files"]["executable.popef"] == {
        "size": len(PAYLOAD),
        "xxh3_128": xxhash.xxh3_128_hexdigest(PAYLOAD),
    }
    assert manifest["engine"] == "emulator" and manifest["key_inputs"] == key.inputs
    assert manifest["meta"] == {"model": "bert", "shapes": "1x128"}
    assert isinstance(manifest["created"], float)
    with pytest.raises(KeyError, match="executable.popef"):
        first.file("missing.bin")


def test_nested_payload_files_are_kept(tmp_path: Path) -> None:
    def build(directory: Path) -> None:
        (directory / "weights").mkdir()
        (directory / "weights" / "part0.bin").write_bytes(b"w" * 10)
        (directory / "model.onnx").write_bytes(b"m")

    entry = ExecutableCache(tmp_path).get_or_create(make_key(), build)
    assert entry.read_bytes("weights/part0.bin") == b"w" * 10
    assert ExecutableCache(tmp_path).get(make_key()) is not None


def test_a_failing_build_leaves_nothing(tmp_path: Path) -> None:
    cache = ExecutableCache(tmp_path)
    key = make_key()

    def broken(directory: Path) -> None:
        (directory / "executable.popef").write_bytes(PAYLOAD[:100])
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.get_or_create(key, broken)
    assert not cache.entry_path(key).exists()
    assert cache.get(key) is None and cache.list() == []
    assert list((tmp_path / ".tmp").iterdir()) == []
    # The next attempt builds normally.
    assert cache.get_or_create(key, writer()).read_bytes("executable.popef") == PAYLOAD


def test_a_build_that_writes_nothing_is_an_error(tmp_path: Path) -> None:
    cache = ExecutableCache(tmp_path)
    with pytest.raises(CacheError, match="wrote no files"):
        cache.get_or_create(make_key(), lambda directory: None)
    assert cache.list() == []


def test_metadata_must_be_json_and_is_checked_before_building(tmp_path: Path) -> None:
    calls: list = []
    with pytest.raises(TypeError):
        ExecutableCache(tmp_path).get_or_create(make_key(), writer(calls=calls), meta={"model": object()})
    assert calls == []


def test_nothing_is_ever_unpickled() -> None:
    source = Path(cache_module.__file__).read_text(encoding="utf-8")
    for module in ("pickle", "marshal", "shelve", "dill", "joblib"):
        assert f"import {module}" not in source


# ----------------------------------------------------------------------------------------------------------
# Integrity
# ----------------------------------------------------------------------------------------------------------


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def delete(path: Path) -> None:
    path.unlink()


def garble_manifest(path: Path) -> None:
    (path.parent / "manifest.json").write_text("{ not json", encoding="utf-8")


@pytest.mark.parametrize("damage", [flip_a_byte, truncate, delete, garble_manifest])
def test_a_corrupt_entry_is_removed_with_a_warning_and_rebuilt(tmp_path: Path, caplog, damage) -> None:
    cache = ExecutableCache(tmp_path)
    key = make_key()
    entry = cache.get_or_create(key, writer())
    damage(entry.file("executable.popef"))
    with caplog.at_level(logging.WARNING, logger=cache_module.__name__):
        assert cache.get(key) is None
    assert any("corrupt" in record.getMessage() for record in caplog.records)
    assert not cache.entry_path(key).exists()
    calls: list = []
    rebuilt = cache.get_or_create(key, writer(calls=calls))
    assert len(calls) == 1 and rebuilt.read_bytes("executable.popef") == PAYLOAD


def test_get_or_create_rebuilds_a_corrupt_entry_directly(tmp_path: Path, caplog) -> None:
    cache = ExecutableCache(tmp_path)
    key = make_key()
    flip_a_byte(cache.get_or_create(key, writer()).file("model.onnx"))
    calls: list = []
    with caplog.at_level(logging.WARNING, logger=cache_module.__name__):
        entry = cache.get_or_create(key, writer(calls=calls))
    assert len(calls) == 1 and entry.created_now
    assert entry.read_bytes("model.onnx") == b"onnx:" + PAYLOAD[:100]
    assert "corrupt" in caplog.text


# ----------------------------------------------------------------------------------------------------------
# Two processes racing for one key
# ----------------------------------------------------------------------------------------------------------


def race_for_one_key(root: str, digest: str, counter: str, barrier, results) -> None:
    cache = ExecutableCache(root)

    def build(directory: Path) -> None:
        with open(counter, "a", encoding="utf-8") as stream:
            stream.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough for the other process to arrive while this one builds
        (directory / "executable.popef").write_bytes(PAYLOAD)

    barrier.wait()
    entry = cache.get_or_create(digest, build)
    results.put((os.getpid(), entry.read_bytes("executable.popef") == PAYLOAD, entry.created_now))


def test_two_processes_racing_for_one_key_build_it_once(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    results = context.Queue()
    counter = tmp_path / "builds.txt"
    digest = make_key().digest
    processes = [
        context.Process(
            target=race_for_one_key, args=(str(tmp_path / "cache"), digest, str(counter), barrier, results)
        )
        for _ in range(2)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    builders = counter.read_text(encoding="utf-8").split()
    assert len(builders) == 1
    assert all(correct for _, correct, _ in outcomes)
    assert sorted(created for _, _, created in outcomes) == [False, True]
    assert [pid for pid, _, created in outcomes if created] == [int(builders[0])]


def test_two_threads_racing_for_one_key_build_it_once(tmp_path: Path) -> None:
    calls: list = []
    barrier = threading.Barrier(2)

    def slow_build(directory: Path) -> None:
        calls.append(directory)
        time.sleep(0.3)
        (directory / "executable.popef").write_bytes(PAYLOAD)

    def worker(results: list) -> None:
        barrier.wait()
        results.append(ExecutableCache(tmp_path).get_or_create(make_key(), slow_build))

    results: list = []
    threads = [threading.Thread(target=worker, args=(results,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(calls) == 1 and len(results) == 2
    assert sorted(entry.created_now for entry in results) == [False, True]
    assert all(entry.read_bytes("executable.popef") == PAYLOAD for entry in results)


# ----------------------------------------------------------------------------------------------------------
# Size cap, LRU and maintenance
# ----------------------------------------------------------------------------------------------------------


def entry_size(cache: ExecutableCache, key: CacheKey) -> int:
    return next(info.size_bytes for info in cache.list() if info.key == key.digest)


def test_lru_entries_are_evicted_beyond_the_size_cap(tmp_path: Path) -> None:
    probe = ExecutableCache(tmp_path / "probe")
    probe.get_or_create(make_key("probe"), writer())
    size = entry_size(probe, make_key("probe"))  # every entry written by writer() has this size
    cache = ExecutableCache(tmp_path / "cache", size_limit_bytes=int(size * 2.5))
    a, b, c = make_key("a"), make_key("b"), make_key("c")
    cache.get_or_create(a, writer())
    cache.get_or_create(b, writer())
    age(cache, a, 100)
    age(cache, b, 90)
    assert cache.get(a) is not None  # a is now the most recently used
    cache.get_or_create(c, writer())
    assert cache.get(b) is None and cache.get(a) is not None and cache.get(c) is not None
    assert cache.info()["total_bytes"] <= cache.size_limit_bytes


def test_prune_evicts_least_recently_used_first_and_list_orders_by_use(tmp_path: Path) -> None:
    cache = ExecutableCache(tmp_path)
    keys = [make_key(tag) for tag in "abcd"]
    for index, key in enumerate(keys):
        cache.get_or_create(key, writer())
        age(cache, key, 100 - index)  # a oldest ... d newest
    age(cache, keys[0], 1)  # a used last
    assert [info.key for info in cache.list()] == [keys[i].digest for i in (0, 3, 2, 1)]
    sizes = {key.digest: entry_size(cache, key) for key in keys}  # equal up to a byte of manifest
    evicted = cache.prune(sizes[keys[0].digest] + sizes[keys[3].digest])
    assert evicted == [keys[1].digest, keys[2].digest]
    assert cache.info()["entries"] == 2
    assert cache.info()["total_bytes"] == sizes[keys[0].digest] + sizes[keys[3].digest]


def test_an_entry_larger_than_the_cap_is_kept(tmp_path: Path, caplog) -> None:
    cache = ExecutableCache(tmp_path, size_limit_bytes=100)
    with caplog.at_level(logging.WARNING, logger=cache_module.__name__):
        entry = cache.get_or_create(make_key(), writer())
    assert cache.get(entry.key) is not None
    assert "above its cap" in caplog.text


def test_entries_locked_by_another_builder_are_not_evicted_or_cleared(tmp_path: Path) -> None:
    cache = ExecutableCache(tmp_path)
    a, b = make_key("a"), make_key("b")
    cache.get_or_create(a, writer())
    cache.get_or_create(b, writer())
    lock = FileLock(str(tmp_path / ".locks" / f"{a.digest}.lock"))
    with lock:
        assert cache.prune(1) == [b.digest]
        assert cache.clear() == 0
        assert cache.remove(a) is False
    assert cache.clear() == 1 and cache.list() == []


def test_clear_remove_and_info(tmp_path: Path) -> None:
    cache = ExecutableCache(tmp_path, size_limit_bytes=parse_byte_size("1GB"))
    keys = [make_key(tag) for tag in "abc"]
    for key in keys:
        cache.get_or_create(key, writer(), meta={"model": f"m-{key.digest[:4]}"})
    info = cache.info()
    assert info["entries"] == 3 and info["size_limit_bytes"] == 1024**3 and info["root"] == str(tmp_path)
    assert info["total_bytes"] == sum(entry.size_bytes for entry in cache.list())
    assert cache.remove(keys[0]) is True and cache.remove(keys[0]) is False
    assert cache.clear() == 2
    assert cache.list() == [] and cache.info()["total_bytes"] == 0
    assert not any(path.name[:2] == keys[1].digest[:2] and path.is_dir() for path in tmp_path.iterdir())


def test_stale_temporary_build_directories_are_swept(tmp_path: Path) -> None:
    cache = ExecutableCache(tmp_path)
    stale = tmp_path / ".tmp" / "dead-build"
    fresh = tmp_path / ".tmp" / "live-build"
    stale.mkdir(parents=True)
    fresh.mkdir()
    old = time.time() - cache_module.STALE_BUILD_SECONDS - 60
    os.utime(stale, (old, old))
    cache.prune()
    assert not stale.exists() and fresh.exists()


def test_a_group_joined_after_maintenance_listed_the_entries_is_kept(tmp_path: Path) -> None:
    """Maintenance in one process lists the entries, then drops the weight groups no entry names. An entry
    another process committed in between (the first of its group) is seen once the group's lock is held,
    so its weights and graph stay: removing them would fail that process's next load of the entry."""
    cache = ExecutableCache(tmp_path)

    def build(directory: Path) -> None:
        (directory / "weights.bin").write_bytes(b"w" * 4096)
        (directory / "graph.onnx").write_bytes(b"graph")

    key = "ab" * 32
    stale = cache.list()  # maintenance's listing, taken before the entry below is committed
    entry = cache.get_or_create(key, build, shared="weights.bin", beside_shared=("graph.onnx",))
    listings = [stale]
    real_list = cache.list
    cache.list = lambda: listings.pop() if listings else real_list()  # type: ignore[method-assign]
    cache._drop_unreferenced()
    cache.list = real_list  # type: ignore[method-assign]
    assert not listings  # maintenance did work from the stale listing
    assert entry.file("weights.bin").read_bytes() == b"w" * 4096
    assert entry.file("graph.onnx").read_bytes() == b"graph"
    assert cache.get(key) is not None
