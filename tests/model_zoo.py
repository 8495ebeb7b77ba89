"""Where the tests' zoos live (the builders are in ``optimum_ipu_backend.conformance.zoo``); the session's
zoo itself is the ``zoo`` fixture of tests/conftest.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

PERSISTENT_ZOO_ENV = "OPTIMUM_IPU_TEST_ZOO"


def zoo_dir(tmp_path_factory: pytest.TempPathFactory, name: str, persistent_name: str | None = None) -> Path:
    """The directory ``name`` of this test session's models.

    With ``OPTIMUM_IPU_TEST_ZOO=<dir>`` models persist across runs under ``<dir>/<persistent_name>``
    (default: ``name``). Otherwise they live in the session's temporary directory; pytest-xdist workers
    share the run's common parent directory (file locks keep them from building the same model twice).
    """
    persistent = os.environ.get(PERSISTENT_ZOO_ENV)
    if persistent:
        return (Path(persistent).expanduser() / (persistent_name or name)).resolve()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return (tmp_path_factory.getbasetemp().parent / name).resolve()
    return (tmp_path_factory.getbasetemp() / name).resolve()


def conformance_work_dir() -> Path:
    """Where the tests' conformance runs keep their zoo and generated node cases: the persistent zoo when
    set, else one directory under the system's temporary directory (keyed inside by fingerprints and
    versions, file-locked, so runs and xdist workers share it safely)."""
    persistent = os.environ.get(PERSISTENT_ZOO_ENV)
    if persistent:
        return Path(persistent).expanduser().resolve()
    return Path(tempfile.gettempdir()) / f"optimum-ipu-conformance-{os.getuid()}"


def session_model_zoo(tmp_path_factory: pytest.TempPathFactory):
    """The model zoo of this test session: the ``zoo`` fixture of tests/conftest.py, and the conformance
    suite's when the project's tests run it."""
    from optimum_ipu_backend.conformance.zoo import ModelZoo, cache_fingerprint

    return ModelZoo(zoo_dir(tmp_path_factory, "model-zoo", cache_fingerprint()))
