"""docs/hardware.md's table of SDK touchpoints stays the whole truth: every name the engines take from an
SDK module appears in it, and every test it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE_HEADING = "## Every SDK touchpoint"
ENGINE_FILES = ("popart.py", "poptorch.py", "popdist.py")
SDK_MODULES = ("popart", "poptorch", "popdist")


def _table() -> list[list[str]]:
    text = (ROOT / "docs" / "hardware.md").read_text()
    section = text[text.index(TABLE_HEADING) :]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    return [row for row in cells[1:] if not set(row[0]) <= {"-"}]  # without the header and rule


def _sdk_names(source: str) -> set[str]:
    """The names read from an SDK module: ``popart.X``, ``self.popart.X``, ``popdist.popart.X``, and the
    attributes of what ``_popdist_popart()`` returns."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "self":
            base = ast.Name(base.attr)  # self.popart -> popart
        if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
            if base.value.id in SDK_MODULES and base.attr in SDK_MODULES:  # popdist.popart.X
                names.add(node.attr)
            continue
        if isinstance(base, ast.Name) and base.id in SDK_MODULES and node.attr not in SDK_MODULES:
            names.add(node.attr)
        if isinstance(base, ast.Call) and getattr(base.func, "id", "") == "_popdist_popart":
            names.add(node.attr)
    return names


def _defined_tests() -> set[str]:
    pattern = re.compile(r"^def (test_\w+)\(", re.MULTILINE)
    return {
        name for path in (ROOT / "tests").rglob("test_*.py") for name in pattern.findall(path.read_text())
    }


def test_the_table_has_a_row_per_touchpoint_with_its_source_and_tests():
    rows = _table()
    assert len(rows) >= 20
    for row in rows:
        assert len(row) == 4, row
        call, where, source, tests = row
        assert call and where and tests, row
        assert "sdk-release" in source or "/" in source or "assumed" in source, row


@pytest.mark.parametrize("engine_file", ENGINE_FILES)
def test_every_sdk_name_an_engine_uses_is_in_the_table(engine_file):
    calls = " ".join(row[0] for row in _table())
    documented = set(re.findall(r"\w+", calls))
    used = _sdk_names((ROOT / "optimum_ipu_backend" / "engines" / engine_file).read_text())
    assert used, f"found no SDK names in {engine_file}: the scan is broken"
    missing = sorted(used - documented)
    assert not missing, (
        f"{engine_file} uses SDK names the touchpoint table in docs/hardware.md lacks: {missing}"
    )


def test_every_test_the_table_names_exists():
    defined = _defined_tests()
    named = {name for row in _table() for name in re.findall(r"`(test_\w+)`", row[3])}
    assert named
    assert not sorted(named - defined), (
        f"tests named in docs/hardware.md that do not exist: {sorted(named - defined)}"
    )


def test_the_scan_finds_sdk_names_in_every_form():
    source = (
        "import popdist\n"
        "def f(self, popart):\n"
        "    popart.DeviceManager()\n"
        "    self.poptorch.inferenceModel(m)\n"
        "    popdist.popart.getDevice(1)\n"
        "    _popdist_popart().configureSessionOptions(o)\n"
    )
    assert _sdk_names(source) == {"DeviceManager", "inferenceModel", "getDevice", "configureSessionOptions"}
