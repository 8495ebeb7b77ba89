"""Where the tests' zoos live (the builders are in ``optimum_ipu_backend.conformance.zoo``); the session's
zoo itself is the ``zoo`` fixture of tests/conftest.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from filelock import FileLock

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


def _session_zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from optimum_ipu_backend.conformance.zoo import cache_fingerprint

    return zoo_dir(tmp_path_factory, "model-zoo", cache_fingerprint())


def session_model_zoo(tmp_path_factory: pytest.TempPathFactory):
    """The model zoo of this test session: the ``zoo`` fixture of tests/conftest.py, and the conformance
    suite's when the project's tests run it."""
    from optimum_ipu_backend.conformance.zoo import ModelZoo

    return ModelZoo(_session_zoo_dir(tmp_path_factory))


def conformance_command_work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``--work-dir`` of the tests' ``optimum-ipu conformance`` runs. The command keeps its zoo in
    ``<work dir>/<cache fingerprint>``: here that is the session's zoo, so a run exports nothing the tests
    built already; its generated node cases are the shared ones of ``conformance_work_dir()``."""
    from optimum_ipu_backend.conformance.zoo import cache_fingerprint

    shared = conformance_work_dir()
    if os.environ.get(PERSISTENT_ZOO_ENV):
        return shared  # the session's zoo is <persistent dir>/<fingerprint> already
    work = zoo_dir(tmp_path_factory, "conformance-work")
    links = {
        cache_fingerprint(): _session_zoo_dir(tmp_path_factory),
        "onnx-node-cases": shared / "onnx-node-cases",
    }
    with FileLock(str(work) + ".lock"):
        for name, target in links.items():
            target.mkdir(parents=True, exist_ok=True)
            link = work / name
            if not link.is_symlink():
                work.mkdir(parents=True, exist_ok=True)
                link.symlink_to(target, target_is_directory=True)
    return work
