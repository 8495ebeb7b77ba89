"""``optimum-ipu cache list|info|clear|prune`` on a cache filled through the library."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from optimum_ipu_backend.cli.cache import add_cache_parser, run_cache
from optimum_ipu_backend.runtime.cache_files import (
    CONFORMANCE_DIR,
    DESCRIPTIONS_DIR,
    LEGALIZED_DIR,
    PROOFS_DIR,
    UNUSED_RECORD_SECONDS,
    graph_digest,
)
from optimum_ipu_backend.runtime.executable_cache import CACHE_ENV, LAST_USED_NAME, CacheKey, ExecutableCache


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optimum-ipu")
    add_cache_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def cli(*argv: str) -> int:
    args = build_parser().parse_args(list(argv))
    return args.func(args)


def fill(root: Path, count: int, payload_size: int = 4096) -> list[str]:
    cache = ExecutableCache(root)
    digests = []
    for index in range(count):
        key = CacheKey.build(
            graph=f"graph-{index}".encode(),
            shapes={"x": (1, 8)},
            precision="fp32",
            engine="emulator",
            sdk_version=None,
        )
        cache.get_or_create(
            key,
            lambda directory: (directory / "executable.bin").write_bytes(b"x" * payload_size),
            meta={"model": f"model-{index}"},
        )
        stamp = time.time() - 100 + index  # entry 0 least recently used
        os.utime(cache.entry_path(key) / LAST_USED_NAME, (stamp, stamp))
        digests.append(key.digest)
    return digests


def test_list_json_reports_entries_most_recent_first(tmp_path: Path, capsys) -> None:
    digests = fill(tmp_path, 3)
    assert cli("cache", "list", "--dir", str(tmp_path), "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [entry["key"] for entry in listed] == digests[::-1]
    assert listed[0]["meta"] == {"model": "model-2"} and listed[0]["engine"] == "emulator"
    assert all(entry["size_bytes"] > 4096 for entry in listed)


def test_list_table_and_empty_cache(tmp_path: Path, capsys) -> None:
    assert cli("cache", "list", "--dir", str(tmp_path)) == 0
    assert "is empty" in capsys.readouterr().out
    digests = fill(tmp_path, 2)
    assert cli("cache", "list", "--dir", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert digests[0][:16] in out and digests[1][:16] in out and "model-1" in out
    assert "shapes x=1x8; precision fp32; engine emulator; device -" in out  # from the key
    assert "2 entries" in out


def test_info_uses_the_environment_variable(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    fill(tmp_path, 2)
    assert cli("cache", "info", "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["root"] == str(tmp_path) and info["root_source"] == "environment" and info["entries"] == 2
    assert cli("cache", "info") == 0
    out = capsys.readouterr().out
    assert f"${CACHE_ENV}" in out and "entries:    2" in out


def test_prune_to_a_size_evicts_least_recently_used(tmp_path: Path, capsys) -> None:
    digests = fill(tmp_path, 4)
    sizes = {entry.key: entry.size_bytes for entry in ExecutableCache(tmp_path).list()}
    kept = sizes[digests[2]] + sizes[digests[3]]
    assert cli("cache", "prune", "--dir", str(tmp_path), "--max-size", str(kept), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["evicted"] == digests[:2]
    assert report["total_bytes"] == kept and report["freed_bytes"] == sizes[digests[0]] + sizes[digests[1]]
    assert [entry.key for entry in ExecutableCache(tmp_path).list()] == digests[:1:-1]
    assert cli("cache", "prune", "--dir", str(tmp_path), "--max-size", "2GB") == 0
    assert "Evicted 0 entries" in capsys.readouterr().out


def test_prune_rejects_a_bad_size(tmp_path: Path, capsys) -> None:
    assert cli("cache", "prune", "--dir", str(tmp_path), "--max-size", "lots") == 2
    assert "--max-size" in capsys.readouterr().err


def test_clear_removes_everything(tmp_path: Path, capsys) -> None:
    fill(tmp_path, 3)
    assert cli("cache", "clear", "--dir", str(tmp_path)) == 0
    assert "Removed 3 entries" in capsys.readouterr().out
    assert ExecutableCache(tmp_path).list() == []
    assert cli("cache", "clear", "--dir", str(tmp_path), "--json") == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 0


def test_an_action_is_required() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cache"])


def test_run_cache_takes_a_plain_namespace(tmp_path: Path, capsys) -> None:
    fill(tmp_path, 1)
    assert run_cache(argparse.Namespace(cache_action="info", cache_dir=str(tmp_path), json=True)) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 1


def test_the_main_entry_point_has_the_cache_command(tmp_path: Path, capsys) -> None:
    from optimum_ipu_backend.cli.main import main

    fill(tmp_path, 1)
    assert main(["cache", "info", "--dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 1


def _session_entry(tmp_path: Path) -> Path:
    """A real entry: a one-node graph compiled for the emulator by a session, cached under tmp_path."""
    import numpy as np
    from integration.one_node import save_one_node_model

    from optimum_ipu_backend.session import PROVIDER_NAME, create_session

    model_dir = save_one_node_model(tmp_path / "tiny-model" / "model.onnx").parent
    options = {"device": "emulator", "executable_cache_dir": str(tmp_path / "cache")}
    session = create_session(
        str(model_dir / "model.onnx"), providers=[PROVIDER_NAME], provider_options=[options]
    )
    session.run(None, {"x": np.ones((1, 4), dtype=np.float32)})
    return model_dir


def test_list_shows_model_graph_file_shapes_precision_engine_and_device(tmp_path: Path, capsys) -> None:
    model_dir = _session_entry(tmp_path)
    assert cli("cache", "list", "--dir", str(tmp_path / "cache")) == 0
    out = capsys.readouterr().out
    assert f"{model_dir}/model.onnx" in out
    assert "shapes x=1x4; precision fp32; engine emulator; device emulator" in out
    assert cli("cache", "list", "--dir", str(tmp_path / "cache"), "--json") == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert (entry["model"], entry["graph_file"]) == (str(model_dir), "model.onnx")
    assert (entry["shapes"], entry["precision"], entry["engine"], entry["device"]) == (
        {"x": [1, 4]},
        "fp32",
        "emulator",
        "emulator",
    )


def test_info_with_a_key_shows_the_whole_manifest(tmp_path: Path, capsys) -> None:
    _session_entry(tmp_path)
    root = tmp_path / "cache"
    (entry,) = ExecutableCache(root).list()
    manifest = json.loads((entry.path / "manifest.json").read_text())
    assert cli("cache", "info", entry.key[:12], "--dir", str(root), "--json") == 0
    assert json.loads(capsys.readouterr().out) == manifest
    assert cli("cache", "info", entry.key, "--dir", str(root)) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"entry: {entry.path}\n")
    assert json.loads(out.split("\n", 1)[1]) == manifest
    for section in ("key_inputs", "files", "meta", "created", "engine"):
        assert section in manifest
    assert cli("cache", "info", "ffffffffffff", "--dir", str(root)) == 1
    assert "no entry" in capsys.readouterr().err


DYNAMIC = ("batch_size", "sequence_length")


def _session(model: Path, root: Path):
    """A session on ``model`` caching under ``root``: its graph description is stored."""
    from optimum_ipu_backend.session import PROVIDER_NAME, create_session

    options = {"device": "emulator", "executable_cache_dir": str(root), "sequence_lengths": "8"}
    return create_session(str(model), providers=[PROVIDER_NAME], provider_options=[options])


def _padded_call(model: Path, root: Path) -> None:
    """A session on ``model`` that pads one call (3 tokens to 8): an entry, a graph description and
    padding proofs under ``root``."""
    import numpy as np

    _session(model, root).run(None, {"x": np.ones((1, 3), dtype=np.float32)})


def test_clear_leaves_an_empty_root(tmp_path: Path, monkeypatch, capsys) -> None:
    from integration.one_node import save_one_node_model

    from optimum_ipu_backend.conformance.runner import default_work_dir

    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(root))
    monkeypatch.delenv("OPTIMUM_IPU_CONFORMANCE_DIR", raising=False)
    _padded_call(save_one_node_model(tmp_path / "model" / "model.onnx", shape=DYNAMIC), root)
    assert default_work_dir() == root / CONFORMANCE_DIR  # the conformance suite's work is in the cache
    (default_work_dir() / "onnx-node-cases").mkdir(parents=True)
    (default_work_dir() / "onnx-node-cases" / "index.json").write_text("{}")
    assert cli("cache", "info", "--json") == 0
    stores = json.loads(capsys.readouterr().out)["stores"]
    named = (DESCRIPTIONS_DIR, PROOFS_DIR, LEGALIZED_DIR, CONFORMANCE_DIR)
    assert all(stores[name]["files"] for name in named), stores
    assert cli("cache", "list") == 0
    assert "store:      padding-proofs/" in capsys.readouterr().out
    assert cli("cache", "clear") == 0
    assert "Removed 1 entry" in capsys.readouterr().out
    assert sorted(path.name for path in root.iterdir()) == []


def test_re_exports_share_one_graph_description(tmp_path: Path, capsys) -> None:
    from integration.one_node import save_one_node_model

    root = tmp_path / "cache"
    model = tmp_path / "model" / "model.onnx"
    for export in range(5):  # the same model saved again, with a new modification time
        save_one_node_model(model, shape=DYNAMIC)
        os.utime(model, ns=(export * 10**9, export * 10**9))
        _padded_call(model, root)
    assert cli("cache", "prune", "--dir", str(root)) == 0
    assert len(list((root / DESCRIPTIONS_DIR).iterdir())) == 1
    assert len(list((root / PROOFS_DIR).iterdir())) == 1


def test_prune_removes_the_records_of_graphs_no_entry_uses(tmp_path: Path, capsys) -> None:
    from integration.one_node import save_one_node_model

    root = tmp_path / "cache"
    _padded_call(save_one_node_model(tmp_path / "relu" / "model.onnx", shape=DYNAMIC), root)
    (relu,) = ExecutableCache(root).list()
    os.utime(relu.path / LAST_USED_NAME, (1, 1))  # the least recently used
    _padded_call(save_one_node_model(tmp_path / "tanh" / "model.onnx", "Tanh", DYNAMIC), root)
    assert len(list((root / DESCRIPTIONS_DIR).iterdir())) == 2
    kept = next(entry for entry in ExecutableCache(root).list() if entry.key != relu.key)
    assert cli("cache", "prune", "--dir", str(root), "--max-size", str(kept.size_bytes)) == 0
    assert [entry.key for entry in ExecutableCache(root).list()] == [kept.key]
    (description,) = (root / DESCRIPTIONS_DIR).iterdir()
    assert graph_digest(description.name.removesuffix(".json")) == kept.graph
    assert [path.name for path in (root / PROOFS_DIR).iterdir()] == [kept.graph]
    assert [path.name for path in (root / LEGALIZED_DIR).iterdir()] == [kept.graph]
    assert cli("cache", "prune", "--dir", str(root), "--max-size", "1") == 0
    assert not (root / DESCRIPTIONS_DIR).exists() and not (root / PROOFS_DIR).exists()
    assert not (root / LEGALIZED_DIR).exists()


def test_prune_keeps_the_description_of_a_graph_not_yet_built_for_a_day(tmp_path: Path, capsys) -> None:
    from integration.one_node import save_one_node_model

    root = tmp_path / "cache"
    _session(save_one_node_model(tmp_path / "model" / "model.onnx", shape=DYNAMIC), root)  # no call yet
    assert cli("cache", "prune", "--dir", str(root)) == 0
    (description,) = (root / DESCRIPTIONS_DIR).iterdir()
    day_ago = time.time() - UNUSED_RECORD_SECONDS - 60
    os.utime(description, (day_ago, day_ago))
    assert cli("cache", "prune", "--dir", str(root)) == 0
    assert not (root / DESCRIPTIONS_DIR).exists()
