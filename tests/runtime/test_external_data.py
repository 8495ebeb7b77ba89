"""Exports with external weights, end to end: read without loading the weights, legalized and compiled
from the files, served equal to the CPU, keyed by the weights, stored once in the cache and never
served corrupt."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from large_model_helper import (
    DATA_FILE,
    copy_export,
    cpu_outputs,
    emulator_session,
    external_bert,
    sample_feed,
)

from optimum_ipu_backend.cli.check import main as check_main
from optimum_ipu_backend.compiler.external_data import ALIGNMENT, is_external, load_graph
from optimum_ipu_backend.compiler.graphs import WEIGHT_MIN_BYTES, tensor_bytes
from optimum_ipu_backend.runtime.executable_cache import CHECKSUM, ExecutableCache
from optimum_ipu_backend.runtime.executables import LEGALIZED_DATA_FILE, LEGALIZED_GRAPH_FILE

ATOL = 1e-5


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return external_bert(tmp_path_factory)


def _entries(cache_dir):
    cache = ExecutableCache(cache_dir)
    return cache, [cache.get(info.key) for info in cache.list()]


def test_the_export_keeps_its_weights_outside_the_graph(export):
    model = load_graph(export / "model.onnx")
    weights = [t for t in model.graph.initializer if tensor_bytes(t) >= WEIGHT_MIN_BYTES]
    assert len(weights) >= 8 and all(is_external(t) for t in weights)
    # small external tensors were read in: passes may need their values
    assert all(not is_external(t) for t in model.graph.initializer if tensor_bytes(t) < WEIGHT_MIN_BYTES)
    assert model.ByteSize() < (export / DATA_FILE).stat().st_size / 10


@pytest.mark.parametrize("precision, atol", [("fp32", ATOL), ("fp16", 2e-2)])
def test_two_shapes_match_cpu_and_share_one_weight_file(export, tmp_path, precision, atol):
    session = emulator_session(export, tmp_path, precision=precision)
    for seq in (5, 12):  # buckets 8 and 16: two executables
        feed = sample_feed(2, seq, seed=seq)
        np.testing.assert_allclose(session.run(None, feed)[0], cpu_outputs(export, feed)[0], atol=atol)
    cache, entries = _entries(tmp_path)
    assert len(entries) == 2 and all(entry is not None for entry in entries)
    first, second = (entry.file(LEGALIZED_DATA_FILE) for entry in entries)
    assert first == second and first.stat().st_nlink == 1  # one file on disk, no links
    for entry in entries:  # each shape's graph sits beside it and points to it by its name
        assert entry.file(LEGALIZED_GRAPH_FILE).parent == first.parent
        assert entry.manifest["files"][LEGALIZED_DATA_FILE]["shared"] == first.parent.name
    data_bytes = first.stat().st_size
    expected = (export / DATA_FILE).stat().st_size // (2 if precision == "fp16" else 1)
    assert abs(data_bytes - expected) < expected * 0.1
    info = cache.info()
    assert info["shared_bytes"] == data_bytes
    assert info["total_bytes"] == sum(e.size_bytes - e.shared_bytes for e in cache.list()) + data_bytes
    # the legalized graphs hold no weights: each added shape costs a small fraction of them
    for entry in entries:
        assert entry.file(LEGALIZED_GRAPH_FILE).stat().st_size < data_bytes / 10
    legalized = onnx.load(str(entries[0].file(LEGALIZED_GRAPH_FILE)), load_external_data=False)
    offsets = [
        int(next(e.value for e in t.external_data if e.key == "offset"))
        for t in legalized.graph.initializer
        if is_external(t)
    ]
    assert offsets and all(offset % ALIGNMENT == 0 for offset in offsets)


def test_changing_only_the_weights_never_serves_the_old_entry(export, tmp_path):
    onnx_dir = copy_export(export, tmp_path / "export")
    feed = sample_feed(1, 6)
    before = emulator_session(onnx_dir, tmp_path / "cache").run(None, feed)[0]
    model = onnx.load(onnx_dir / "model.onnx")  # with its weights
    largest = max(model.graph.initializer, key=tensor_bytes)  # the word embeddings
    values = onnx.numpy_helper.to_array(largest) * -2.0
    largest.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), largest.name))
    onnx.save_model(
        model, onnx_dir / "model.onnx", save_as_external_data=True, location=DATA_FILE, size_threshold=1024
    )
    after = emulator_session(onnx_dir, tmp_path / "cache").run(None, feed)[0]
    np.testing.assert_allclose(after, cpu_outputs(onnx_dir, feed)[0], atol=ATOL)
    assert not np.allclose(after, before, atol=1e-3)
    assert len(ExecutableCache(tmp_path / "cache").list()) == 2


def test_a_corrupt_shared_weight_file_is_detected_rebuilt_and_never_served(export, tmp_path, caplog):
    feed = sample_feed(2, 5)
    emulator_session(export, tmp_path).run(None, feed)
    cache, (entry,) = _entries(tmp_path)
    blob = entry.file(LEGALIZED_DATA_FILE)
    assert blob.parent == cache.blob_path(entry.manifest["files"][LEGALIZED_DATA_FILE][CHECKSUM])
    with open(blob, "r+b") as stream:  # flip bytes in the middle of a weight
        stream.seek(blob.stat().st_size // 2)
        chunk = stream.read(64)
        stream.seek(-64, os.SEEK_CUR)
        stream.write(bytes(b ^ 0xFF for b in chunk))
    with caplog.at_level(logging.WARNING):
        got = emulator_session(export, tmp_path).run(None, feed)[0]
    assert "corrupt" in caplog.text
    np.testing.assert_allclose(got, cpu_outputs(export, feed)[0], atol=ATOL)
    cache, (rebuilt,) = _entries(tmp_path)
    assert rebuilt is not None  # verified: size and checksum match again
    assert rebuilt.file(LEGALIZED_DATA_FILE) == blob


def test_a_new_shape_never_joins_a_corrupt_weight_file(export, tmp_path, caplog):
    session = emulator_session(export, tmp_path)
    session.run(None, sample_feed(1, 5))
    _, (entry,) = _entries(tmp_path)
    blob = entry.file(LEGALIZED_DATA_FILE)
    good = blob.read_bytes()
    blob.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))  # the last weight's last byte goes bad
    with caplog.at_level(logging.WARNING):
        feed = sample_feed(1, 12)  # a second shape: its weights are checked before it uses the file
        np.testing.assert_allclose(session.run(None, feed)[0], cpu_outputs(export, feed)[0], atol=ATOL)
    assert "is corrupt; replacing it" in caplog.text
    assert blob.read_bytes() == good
    _, entries = _entries(tmp_path)
    assert len(entries) == 2 and all(e is not None for e in entries)


def test_pruning_keeps_the_weights_live_entries_need(export, tmp_path):
    session = emulator_session(export, tmp_path)
    session.run(None, sample_feed(1, 5))
    session.run(None, sample_feed(1, 12))
    cache = ExecutableCache(tmp_path)
    infos = cache.list()  # most recently used first
    (checksum,) = set(infos[0].blobs) | set(infos[1].blobs)
    group = cache.blob_path(checksum)
    blob = group / LEGALIZED_DATA_FILE
    own = infos[0].size_bytes - infos[0].shared_bytes
    evicted = cache.prune(max_bytes=own + blob.stat().st_size + 4096)
    assert evicted == [infos[1].key]
    assert blob.is_file()  # the remaining entry uses it
    assert sorted(path.name for path in group.iterdir()) == [
        f"{infos[0].key}.{LEGALIZED_GRAPH_FILE}",  # the evicted entry's graph went with it
        LEGALIZED_DATA_FILE,
    ]
    assert cache.get(infos[0].key) is not None
    assert cache.prune(max_bytes=1) == [infos[0].key]
    assert not group.exists() and cache.info()["total_bytes"] == 0


def test_check_legalizes_an_external_data_export(export, tmp_path, capsys):
    status = check_main([str(export), "--dim", "sequence_length=16", "--save", str(tmp_path), "--json"])
    document = json.loads(capsys.readouterr().out)
    assert status == 0 and document["ready"] is True
    (result,) = document["files"]
    saved = tmp_path / "model.onnx"
    assert result["saved_to"] == str(saved) and (tmp_path / "model.onnx.data").is_file()
    feed = {name: array.astype(np.int32) for name, array in sample_feed(1, 16).items()}
    got = ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, cpu_outputs(export, sample_feed(1, 16))[0], atol=ATOL)


def test_a_single_file_export_is_read_without_parsing_its_weights(export, tmp_path, monkeypatch):
    from optimum_ipu_backend.compiler import external_data
    from optimum_ipu_backend.compiler.external_data import read_graph, save_graph
    from optimum_ipu_backend.compiler.pipeline import legalize

    single = tmp_path / "single"
    single.mkdir()
    onnx.save_model(onnx.load(export / "model.onnx"), single / "model.onnx")  # weights inside the file
    whole = onnx.load(single / "model.onnx")
    monkeypatch.setattr(external_data, "SINGLE_FILE_SCAN_BYTES", 0)
    scanned, files = read_graph(single / "model.onnx")
    assert files == []  # no data file besides the model: the model file alone keys the cache
    assert scanned.graph.node == whole.graph.node and scanned.graph.input == whole.graph.input
    by_name = {tensor.name: tensor for tensor in whole.graph.initializer}
    referenced = [tensor for tensor in scanned.graph.initializer if is_external(tensor)]
    assert len(referenced) >= 8 and all(tensor_bytes(t) >= WEIGHT_MIN_BYTES for t in referenced)
    for tensor in scanned.graph.initializer:
        np.testing.assert_array_equal(
            external_data.read_weight(tensor, single), onnx.numpy_helper.to_array(by_name[tensor.name])
        )
    shapes = {"input_ids": (1, 16), "attention_mask": (1, 16), "token_type_ids": (1, 16)}
    legalized = legalize(scanned, shapes, weights_dir=single)
    saved = save_graph(legalized.model, tmp_path / "legalized.onnx", single, legalized.weight_names)
    feed = sample_feed(1, 16)
    device_feed = {name: array.astype(np.int32) for name, array in feed.items()}
    got = ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"]).run(None, device_feed)[0]
    np.testing.assert_allclose(got, cpu_outputs(export, feed)[0], atol=ATOL)


@pytest.mark.parametrize("layout", ["external data", "single file"])
def test_model_files_linked_from_elsewhere_are_served(export, tmp_path, layout, monkeypatch):
    """The Hugging Face cache links each file of a snapshot to a blob in another directory: the links'
    directory is the model's, wherever the links point."""
    from optimum_ipu_backend.compiler import external_data

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    if layout == "single file":
        blobs.mkdir()
        onnx.save_model(onnx.load(export / "model.onnx"), blobs / "model.onnx")  # weights inside the file
        monkeypatch.setattr(external_data, "SINGLE_FILE_SCAN_BYTES", 0)  # referenced in place, not parsed
    else:
        copy_export(export, blobs)
    snapshot.mkdir()
    for item in blobs.iterdir():
        (snapshot / item.name).symlink_to(item)
    feed = sample_feed(2, 7)
    got = emulator_session(snapshot, tmp_path / "cache").run(None, feed)[0]
    np.testing.assert_allclose(got, cpu_outputs(export, feed)[0], atol=ATOL)


def test_weights_outside_the_model_directory_are_refused(export, tmp_path):
    from optimum_ipu_backend.compiler.external_data import read_weight

    model = load_graph(export / "model.onnx")
    tensor = next(t for t in model.graph.initializer if is_external(t))
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = "../elsewhere/model.onnx_data"
    with pytest.raises(ValueError, match="not a file beside the model"):
        read_weight(tensor, export)


def test_only_the_exports_weights_go_to_the_data_file(tmp_path):
    """A constant folded for one shape (here 128 KiB) stays in that shape's graph, so the data file is
    the same for every shape and the cache keeps one copy."""
    from onnx import helper

    from optimum_ipu_backend.compiler.external_data import save_graph

    weight = onnx.numpy_helper.from_array(np.full((128, 128), 0.5, np.float32), "weight")
    folded = onnx.numpy_helper.from_array(np.ones((256, 128), np.float32), "folded_mask")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["folded_mask", "weight"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [256, 128])],
        initializer=[weight, folded],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    save_graph(model, tmp_path / "g.onnx", None, frozenset({"weight"}))
    saved = onnx.load(str(tmp_path / "g.onnx"), load_external_data=False)
    placed = {t.name: is_external(t) for t in saved.graph.initializer}
    assert placed == {"weight": True, "folded_mask": False}
    assert (tmp_path / "g.onnx.data").stat().st_size == 128 * 128 * 4
    (y,) = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"]).run(None, {})
    np.testing.assert_allclose(y, np.full((256, 128), 64.0, np.float32))


def test_cache_commands_count_a_shared_weight_file_once(export, tmp_path, capsys):
    import argparse

    from optimum_ipu_backend.cli.cache import add_cache_parser
    from optimum_ipu_backend.runtime.executable_cache import format_byte_size

    session = emulator_session(export, tmp_path)
    session.run(None, sample_feed(1, 5))
    session.run(None, sample_feed(1, 12))
    parser = argparse.ArgumentParser()
    add_cache_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", "list", "--dir", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    info = ExecutableCache(tmp_path).info()
    assert info["total_bytes"] < sum(entry.size_bytes for entry in ExecutableCache(tmp_path).list())
    assert f"2 entries, {format_byte_size(info['total_bytes'])}" in out
