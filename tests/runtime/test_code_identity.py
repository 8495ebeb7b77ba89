"""Cached records and executables are keyed with the package's code: an edited compiler never serves
what an older one computed, and the same code always finds its own entries."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import optimum_ipu_backend
from optimum_ipu_backend.runtime.cache_files import code_identity


def _identity_of(package_dir: Path) -> str:
    code = "from optimum_ipu_backend.runtime.cache_files import code_identity; print(code_identity())"
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=package_dir.parent,
        env={"PYTHONPATH": str(package_dir.parent), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return completed.stdout.strip()


def test_an_edited_source_changes_the_identity_and_an_untouched_copy_keeps_it(tmp_path):
    source = Path(optimum_ipu_backend.__file__).resolve().parent
    copy = tmp_path / "optimum_ipu_backend"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert _identity_of(copy) == code_identity()  # the same sources: the same entries are found
    rewrite = copy / "compiler" / "passes" / "rewrites" / "attention.py"
    rewrite.write_text(rewrite.read_text() + "\n# an edit\n")
    edited = _identity_of(copy)
    assert edited != code_identity()
    assert edited.startswith(f"{optimum_ipu_backend.__version__}+")
