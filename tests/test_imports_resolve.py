"""Every import of this package's names, at module level or inside a function, in the package, the tests
and the benchmarks, resolves. Function-level imports (kept lazy for start-up time) only fail when their
function runs, so a name moved by one change and still imported by another would otherwise surface in a
user's call or a benchmark run, long after the merge."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    path
    for folder in ("optimum_ipu_backend", "tests", "benchmarks")
    for path in (ROOT / folder).rglob("*.py")
)


def _imports(path: Path):
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level:
            base = list(package[: len(package) - (node.level - 1)])
            module = ".".join(base + ([module] if module else []))
        if module.startswith("optimum_ipu_backend"):
            yield node.lineno, module, [alias.name for alias in node.names if alias.name != "*"]


def _resolves(module_name: str, name: str) -> bool:
    module = importlib.import_module(module_name)
    if hasattr(module, name):
        return True
    try:
        importlib.import_module(f"{module_name}.{name}")
    except ModuleNotFoundError:
        return False
    return True


def test_every_import_of_the_package_resolves():
    missing = [
        f"{path.relative_to(ROOT)}:{line}: {module}.{name}"
        for path in SOURCES
        for line, module, names in _imports(path)
        for name in names
        if not _resolves(module, name)
    ]
    assert not missing, "imports that no longer resolve:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", ["iter_graphs"])
def test_the_check_sees_a_missing_name(name):
    """The check can fail: a name the package does not define is reported."""
    assert not _resolves("optimum_ipu_backend.compiler.op_table", name)
