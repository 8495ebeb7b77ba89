"""The two tiers (tests/full_matrix.py): every matrix's default share covers each value of each of its
dimensions, so a case moved to the release check never takes the only test of a behaviour with it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from full_matrix import FULL, MATRICES

TESTS_DIR = Path(__file__).resolve().parent


def _matrix_modules() -> list[Path]:
    """Every test module that defines a matrix (they all build theirs with ``Matrix(``)."""
    return sorted(
        path
        for path in TESTS_DIR.rglob("*.py")
        if path.name not in ("full_matrix.py", "test_full_matrix.py")
        and "sdk_double" not in path.parts
        and "Matrix(" in path.read_text()
    )


def _import(path: Path) -> None:
    """Import ``path`` unless pytest's collection imported it already (matrices register themselves),
    with its directory first on the path, as pytest's collection puts it."""
    if any(getattr(module, "__file__", None) == str(path) for module in list(sys.modules.values())):
        return
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_matrix_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


MODULES = _matrix_modules()
for _path in MODULES:
    _import(_path)


def test_every_matrix_module_is_found():
    """The search above finds the matrices (a module renamed away from it would escape this check)."""
    names = {path.relative_to(TESTS_DIR).as_posix() for path in MODULES}
    assert {
        "engines/ortmodels_on_engines.py",
        "engines/test_kv_cache_on_engines.py",
        "integration/test_optimized_models.py",
    } <= names, names
    assert len(MATRICES) >= len(MODULES)


@pytest.mark.parametrize("name", sorted(MATRICES))
def test_the_default_share_covers_every_value_of_every_dimension(name):
    matrix = MATRICES[name]
    assert matrix.share, f"{name}: the default command runs none of its cases"
    assert matrix.covers, f"{name}: a matrix names the dimensions its share must cover"
    assert matrix.uncovered() == {}, f"{name}: values only the release check exercises"
    assert set(matrix.share) <= set(matrix.product)
    assert matrix.cases == (matrix.product if FULL else matrix.share)


@pytest.mark.parametrize("name", sorted(MATRICES))
def test_release_only_cases_say_why(name):
    matrix = MATRICES[name]
    assert not matrix.release_only or len(matrix.why) > 20, f"{name}: say why some are release-only"
    assert len(matrix.release_only) + len(matrix.share) == len(matrix.product)
