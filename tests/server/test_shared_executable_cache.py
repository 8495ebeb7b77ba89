"""The fleet's read-only shared cache layer (runtime/shared_cache.py): an operator fills and signs it, a
replica copies a verified entry instead of compiling; an entry tampered with (bytes changed with the
cache's own checksums rewritten to match, signature missing, signed under another key) is refused,
named in the log, and compiled locally, with the same outputs as CPU."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from emulator_sessions import cpu_outputs, emulator_session

from optimum_ipu_backend.cli.main import main as cli
from optimum_ipu_backend.errors import ConfigurationError
from optimum_ipu_backend.runtime.executable_cache import checksum_file
from optimum_ipu_backend.runtime.shared_cache import (
    SHARED_CACHE_ENV,
    SHARED_KEY_ENV,
    SHARED_KEY_FILE_ENV,
    SIGNATURE_NAME,
)

KEY = "operator-key-0123456789abcdef"


@pytest.fixture(scope="module")
def bert_task() -> str:
    return "feature-extraction"


@pytest.fixture(scope="module")
def feed(bert):
    from optimum_ipu_backend.conformance.zoo import preprocessed_inputs

    return preprocessed_inputs(bert[0], batch=2, seq=12)


def run(onnx_dir: Path, cache_dir: Path, feed) -> tuple[np.ndarray, list[str]]:
    """One call on a fresh emulator session over ``cache_dir``; its output and executables' sources."""
    session = emulator_session(onnx_dir, cache_dir)
    try:
        names = {i.name for i in session.get_inputs()}
        output = session.run(None, {k: v for k, v in feed.items() if k in names})[0]
        return output, [entry["source"] for entry in session.compiled_executables()]
    finally:
        session.close()


def cpu(onnx_dir: Path, feed) -> np.ndarray:
    import onnxruntime

    names = {i.name for i in onnxruntime.InferenceSession(str(onnx_dir / "model.onnx")).get_inputs()}
    return cpu_outputs(onnx_dir, {k: v for k, v in feed.items() if k in names})[0]


@pytest.fixture(scope="module")
def signed_layer(bert, feed, tmp_path_factory):
    """A shared root filled by a session and signed with ``optimum-ipu cache sign``; its key file."""
    root = tmp_path_factory.mktemp("shared-layer")
    key_file = root.parent / "operator.key"
    key_file.write_text(KEY)
    _, sources = run(bert[1], root, feed)
    assert sources == ["compiled"]
    assert cli(["cache", "sign", "--dir", str(root), "--key-file", str(key_file)]) == 0
    assert len(list(root.glob(f"*/*/{SIGNATURE_NAME}"))) == 1
    return root, key_file


def replica(monkeypatch, layer: Path, key_file: Path) -> None:
    monkeypatch.setenv(SHARED_CACHE_ENV, str(layer))
    monkeypatch.setenv(SHARED_KEY_FILE_ENV, str(key_file))


def entry_dir(root: Path) -> Path:
    (manifest,) = root.glob("*/*/manifest.json")
    return manifest.parent


def test_a_verified_shared_entry_is_copied_not_compiled(bert, feed, signed_layer, tmp_path, monkeypatch):
    replica(monkeypatch, *signed_layer)
    output, sources = run(bert[1], tmp_path / "local", feed)
    assert sources == ["cache"]  # nothing compiled in this replica
    np.testing.assert_allclose(output, cpu(bert[1], feed), atol=1e-5)
    assert (entry_dir(tmp_path / "local") / "manifest.json").is_file()  # now a local entry too


def _change_a_weight(layer: Path, rewrite_manifest: bool) -> str:
    """Change a weight of the shared entry's graph; with ``rewrite_manifest``, also rewrite the cache's own
    XXH3 checksum in its manifest to match: what a writer of the shared directory could do, invisible to
    the local checks."""
    entry = entry_dir(layer)
    manifest = json.loads((entry / "manifest.json").read_text())
    name, item = max(manifest["files"].items(), key=lambda kv: kv[1]["size"])
    path = layer / item["at"] if "at" in item else entry / name
    data = bytearray(path.read_bytes())
    weights = np.frombuffer(data, dtype=np.float32, count=len(data) // 4)
    middle = len(weights) // 2
    data[middle * 4 : middle * 4 + 4] = np.float32(weights[middle] + 1.0).tobytes()
    path.write_bytes(bytes(data))
    if not rewrite_manifest:
        return f"{name} differs from the signed file"
    item["xxh3_128"] = checksum_file(path)
    (entry / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return "manifest.json differs from the signed one"


def _tamper_bytes(layer: Path) -> str:
    return _change_a_weight(layer, rewrite_manifest=False)


def _tamper_bytes_and_checksums(layer: Path) -> str:
    return _change_a_weight(layer, rewrite_manifest=True)


def _remove_signature(layer: Path) -> str:
    (entry_dir(layer) / SIGNATURE_NAME).unlink()
    return "never signed"


@pytest.mark.parametrize(
    "tamper",
    [_tamper_bytes, _tamper_bytes_and_checksums, _remove_signature],
    ids=["bytes-changed", "bytes-and-checksums-changed", "signature-missing"],
)
def test_a_tampered_shared_entry_is_refused_logged_and_compiled_locally(
    bert, feed, signed_layer, tmp_path, monkeypatch, caplog, tamper
):
    layer = tmp_path / "shared"
    shutil.copytree(signed_layer[0], layer, symlinks=True)
    reason = tamper(layer)
    replica(monkeypatch, layer, signed_layer[1])
    with caplog.at_level(logging.WARNING, logger="optimum_ipu_backend.runtime.shared_cache"):
        output, sources = run(bert[1], tmp_path / "local", feed)
    assert sources == ["compiled"]
    np.testing.assert_allclose(output, cpu(bert[1], feed), atol=1e-5)
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1, caplog.text
    assert (
        str(entry_dir(layer)) in refusals[0]
        and reason in refusals[0]
        and "compiling it locally" in refusals[0]
    )


def test_an_entry_signed_under_another_key_is_refused(
    bert, feed, signed_layer, tmp_path, monkeypatch, caplog
):
    other = tmp_path / "other.key"
    other.write_text("another-operator-key-0123456789")
    replica(monkeypatch, signed_layer[0], other)
    with caplog.at_level(logging.WARNING, logger="optimum_ipu_backend.runtime.shared_cache"):
        _, sources = run(bert[1], tmp_path / "local", feed)
    assert sources == ["compiled"]
    assert "does not verify under this replica's key" in caplog.text


def test_a_shared_layer_without_a_key_is_a_configuration_error(
    bert, feed, signed_layer, tmp_path, monkeypatch
):
    monkeypatch.setenv(SHARED_CACHE_ENV, str(signed_layer[0]))
    monkeypatch.delenv(SHARED_KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(SHARED_KEY_ENV, raising=False)
    with pytest.raises(ConfigurationError, match=SHARED_KEY_FILE_ENV):
        run(bert[1], tmp_path / "local", feed)
