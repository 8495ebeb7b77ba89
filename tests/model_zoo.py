"""The model zoo for a pytest session; the builders live in ``optimum_ipu_backend.conformance.zoo``.

Typical use from a test module::

    @pytest.fixture(scope="session")
    def zoo(tmp_path_factory):
        return session_zoo(tmp_path_factory)

    def test_x(zoo):
        onnx_dir = zoo.onnx("bert", "text-classification")
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from optimum_ipu_backend.conformance.zoo import ModelZoo, cache_fingerprint

_ZOOS: dict[Path, ModelZoo] = {}

PERSISTENT_ZOO_ENV = "OPTIMUM_IPU_TEST_ZOO"


def session_zoo(tmp_path_factory: pytest.TempPathFactory) -> ModelZoo:
    """The zoo for this test session.

    With ``OPTIMUM_IPU_TEST_ZOO=<dir>`` models persist across runs under ``<dir>/<fingerprint>``.
    Otherwise they live in the session's temporary directory; pytest-xdist workers share the run's common
    parent directory (file locks keep them from building the same model twice).
    """
    persistent = os.environ.get(PERSISTENT_ZOO_ENV)
    if persistent:
        root = Path(persistent).expanduser() / cache_fingerprint()
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "model-zoo"
    else:
        root = tmp_path_factory.getbasetemp() / "model-zoo"
    root = root.resolve()
    if root not in _ZOOS:
        _ZOOS[root] = ModelZoo(root)
    return _ZOOS[root]


def conformance_work_dir() -> Path:
    """Where the tests' conformance runs keep their zoo and generated node cases: the persistent zoo when
    set, else one directory under the system's temporary directory (keyed inside by fingerprints and
    versions, file-locked, so runs and xdist workers share it safely)."""
    persistent = os.environ.get(PERSISTENT_ZOO_ENV)
    if persistent:
        return Path(persistent).expanduser().resolve()
    return Path(tempfile.gettempdir()) / f"optimum-ipu-conformance-{os.getuid()}"
