"""``pytest conformance/ --provider NAME [options]`` runs the suite's cases as tests (docs/conformance.md);
the options are those of ``optimum-ipu conformance``.

Without ``--provider`` (the project's own test run, CI included) it runs the quick suite against the ipu
provider on the host emulator: the tiny models the tests share, and the common operators.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from optimum_ipu_backend.conformance.pytest_plugin import *  # noqa: F403 - the suite's hooks and fixtures

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if config.getoption("provider") is None:
        config.option.provider = "ipu"
        config.option.provider_option = ["device=emulator"]
        config.option.quick = True
        # Compiled executables of the project's test run go to a cache of that run, never the user's.
        os.environ.setdefault("OPTIMUM_IPU_CACHE", tempfile.mkdtemp(prefix="optimum-ipu-test-cache-"))
    if config.getoption("work_dir") is None:
        config.option.work_dir = str(_tests_model_zoo().conformance_work_dir())


def _tests_model_zoo():
    if str(TESTS_DIR) not in sys.path:
        sys.path.insert(0, str(TESTS_DIR))
    import model_zoo

    return model_zoo


@pytest.fixture(scope="session")
def conformance_zoo(tmp_path_factory: pytest.TempPathFactory):
    """The tests' own zoo, so the test run builds and exports each tiny model once."""
    return _tests_model_zoo().session_model_zoo(tmp_path_factory)
