"""The suite's definition files: what they promise, that mistakes in them are named, and that a wheel
carries them."""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

import pytest

from optimum_ipu_backend.conformance import definition
from optimum_ipu_backend.conformance.definition import (
    DefinitionError,
    load_expectation_file,
    load_models,
    load_operators,
    load_tiers,
    remove_cases,
)
from optimum_ipu_backend.conformance.zoo import MODEL_NAMES, PATTERN_TASKS, TASKS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def test_matrix_covers_every_zoo_architecture_and_every_ortmodel_class() -> None:
    matrix = load_models()
    assert {entry.architecture for entry in matrix.entries} == set(MODEL_NAMES)
    classes = set(TASKS) | set(PATTERN_TASKS)
    assert {entry.ort_class for entry in matrix.entries} == classes
    # --quick: exactly one small model per ORTModel class of the main matrix, never the 22M-parameter
    # MiniLM; the padding-pattern models (audio frames among them) run in the full run. Beside them, the
    # O2-optimized forms of the quick models whose architectures ORTOptimizer fuses.
    quick = matrix.select(quick=True, names=None)
    exported = [entry for entry in quick if entry.optimization is None]
    assert sorted(entry.ort_class for entry in exported) == sorted(TASKS)
    optimized = {(entry.architecture, entry.task, entry.optimization) for entry in quick} - {
        (entry.architecture, entry.task, None) for entry in exported
    }
    assert {(a, t) for a, t, _ in optimized} <= {(e.architecture, e.task) for e in exported}
    assert {level for _, _, level in optimized} == {"O2"} and len(optimized) == 4
    assert all(entry.architecture != "minilm" for entry in quick)
    # Several lengths and batch sizes, and every batch of more than one row carries a padded row.
    assert len({(s.batch, s.sequence_length) for s in matrix.input_sets}) >= 3
    assert any(s.batch > 1 for s in matrix.quick_input_sets)


def test_matrix_selection_by_glob_and_its_errors() -> None:
    matrix = load_models()
    assert [e.case_id for e in matrix.select(False, ["bert-text-*"])] == [
        "model/bert-text-classification",
        "model/bert-text-classification-O2",
    ]
    assert matrix.select(True, ["none"]) == []
    assert len(matrix.select(True, ["all"])) == len(matrix.entries)
    with pytest.raises(DefinitionError, match="matches no matrix entry; entries: bert-text-classification"):
        matrix.select(False, ["mistral-*"])


def test_tiers_state_what_the_issue_promises() -> None:
    tiers = load_tiers()
    assert tiers["fp32"].thresholds() == {"atol": 1e-4, "rtol": 1e-4, "identical_new_tokens": 16}
    assert tiers["fp16"].thresholds() == {
        "operator_rtol": 1e-2,
        "operator_atol": 1e-3,
        "top1_agreement": 0.99,
        "span_agreement": 0.99,
        "embedding_cosine": 0.999,
        "identical_new_tokens": 16,
    }


def test_quick_operators_exist_in_onnx() -> None:
    import onnx

    for op_type in load_operators().quick:
        assert onnx.defs.has(op_type), op_type


@pytest.mark.parametrize("name", ["CPUExecutionProvider", "IPUExecutionProvider"])
def test_shipped_expectation_files_load_and_every_entry_has_a_reason(name: str) -> None:
    path = definition.suite_expectation_file(name)
    assert path is not None
    file = load_expectation_file(path)
    assert file.provider == name and file.entries
    assert all(entry.reason and entry.cases for entry in file.entries)


# What an entry may not say: that a case fails for want of a review, or because of a defect of ours.
# Those are work to do, not expectations; an expectation names a limit of the provider's target.
_EXCUSES = re.compile(r"not reviewed|has not reviewed|newer than any version|\bdefects?\b", re.IGNORECASE)


@pytest.mark.parametrize("name", ["CPUExecutionProvider", "IPUExecutionProvider"])
def test_no_entry_excuses_a_gap_or_a_defect_of_ours(name: str) -> None:
    entries = load_expectation_file(definition.suite_expectation_file(name)).entries
    excuses = [f"{entry.source}: {entry.reason}" for entry in entries if _EXCUSES.search(entry.reason)]
    assert not excuses, "\n".join(excuses)


def test_removing_a_case_that_now_passes_keeps_the_rest_of_the_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '# the file\'s comment\nprovider = "X"\n\n[[not_applicable]]\ncases = ["op/test_na"]\n'
        'reason = "n"\n\n'
        "# --- section one ---\n\n[[known_failure]]\n# why\n"
        'cases = ["op/test_a", "op/test_b"]\nreason = "r1"\n\n# --- section two ---\n\n'
        '# about c\n[[known_failure]]\ncases = ["op/test_c"]\nreason = "r2"\n\n'
        '[[known_failure]]\ncases = [\n    "op/test_d_*",\n    "op/test_e",\n]\nreason = "r3"\n',
    )
    assert remove_cases(path, ["op/test_a", "op/test_c"]) == ["op/test_a", "op/test_c"]
    text = path.read_text()
    # Section comments stay; the emptied entry goes with the comment right above it.
    for kept in ("# the file's comment", "# --- section one ---", "# why", "# --- section two ---"):
        assert kept in text
    assert "# about c" not in text and "r2" not in text
    # The not_applicable entry, first in the file, comes last in load order: entries match by kind.
    assert [entry.cases for entry in load_expectation_file(path).entries] == [
        ("op/test_b",),
        ("op/test_d_*", "op/test_e"),
        ("op/test_na",),
    ]
    before = path.read_text()
    with pytest.raises(DefinitionError, match=r"listed through the pattern 'op/test_d_\*'.*by hand"):
        remove_cases(path, ["op/test_b", "op/test_d_1"])
    with pytest.raises(DefinitionError, match="no entry lists op/test_zzz"):
        remove_cases(path, ["op/test_zzz"])
    assert path.read_text() == before  # nothing is written unless every case can go
    from optimum_ipu_backend.cli.main import main

    assert main(["conformance-expectations", "remove", str(path), "op/test_b", "op/test_e"]) == 0
    assert [entry.cases for entry in load_expectation_file(path).entries] == [
        ("op/test_d_*",),
        ("op/test_na",),
    ]
    assert "# --- section two ---" in path.read_text() and "# --- section one ---" in path.read_text()
    assert main(["conformance-expectations", "remove", str(path), "op/test_b"]) == 1


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "expectations.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('provider = "X"\n[[known_failure]]\ncases = ["op/test_add"]\n', r"missing key\(s\) \['reason'\]"),
        ('provider = "X"\n[[known_failure]]\ncases = ["op/test_add"]\nreason = " "\n', "needs a reason"),
        ('provider = "X"\n[[known_failure]]\ncases = ["test_add"]\nreason = "r"\n', "must start with model/"),
        (
            'provider = "X"\n[[known_failure]]\ncases = ["op/a"]\nreason = "r"\nwhen = 1\n',
            r"unknown key\(s\) \['when'\]",
        ),
        ('provider = "X"\n[operators]\nelement_types = ["FLOAT"]\n', "needs an element_types_reason"),
        ('provider = "X"\n[operators]\nnon_tensor_values = false\n', "needs a non_tensor_reason"),
        ('provider = "X"\n[operators]\ntables = "a:b"\n', r"unknown key\(s\) \['tables'\]"),
        ("provider = [", "not valid TOML"),
    ],
)
def test_a_malformed_expectation_file_is_an_error_naming_file_and_key(
    tmp_path: Path, text: str, message: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(DefinitionError, match=message) as caught:
        load_expectation_file(path)
    assert str(path) in str(caught.value)


def test_an_entry_applies_to_its_cases_tier_and_options_only(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        'provider = "X"\n[[known_failure]]\ncases = ["op/test_add_*"]\nreason = "r"\ntier = "fp16"\n'
        'options = { precision = "fp16" }\n',
    )
    (entry,) = load_expectation_file(path).entries
    assert entry.applies("op/test_add_bcast", "fp16", {"precision": "fp16", "device": "emulator"})
    assert not entry.applies("op/test_add_bcast", "fp32", {"precision": "fp16"})
    assert not entry.applies("op/test_add_bcast", "fp16", {})
    assert not entry.applies("op/test_sub", "fp16", {"precision": "fp16"})
    assert str(path) in entry.source and "#1" in entry.source


def test_the_wheel_carries_the_definition_files() -> None:
    """pyproject's force-include maps every definition file into the package, where the loader looks."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    force = config["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    packaged = {source: target for source, target in force.items() if source.startswith("conformance")}
    for name in ("models.toml", "tiers.toml", "operators.toml", "expectations"):
        assert packaged[f"conformance/{name}"] == f"optimum_ipu_backend/conformance/suite/{name}"
    # The package's own data (the report schema, pytest's configuration) ships as package files.
    package = REPO / "optimum_ipu_backend" / "conformance"
    assert (package / "report-schema-1.json").is_file() and (package / "pytest.ini").is_file()


def test_the_command_runs_from_an_installed_wheel(tmp_path: Path) -> None:
    """From the wheel's files alone: the packaged definition wins over the checkout's conformance/, and
    the command finds its pytest configuration, cases, schema and the suite's expectation files."""
    hatchling = pytest.importorskip("hatchling.builders.wheel", reason="hatchling builds the wheel")
    (wheel,) = hatchling.WheelBuilder(str(REPO)).build(directory=str(tmp_path), versions=["standard"])
    site = tmp_path / "site"
    with zipfile.ZipFile(Path(wheel)) as archive:
        names = set(archive.namelist())
        archive.extractall(site)
    for name in ("models.toml", "tiers.toml", "operators.toml", "expectations/IPUExecutionProvider.toml"):
        assert f"optimum_ipu_backend/conformance/suite/{name}" in names
    for name in ("report-schema-1.json", "pytest.ini", "pytest_cases.py"):
        assert f"optimum_ipu_backend/conformance/{name}" in names
    from model_zoo import conformance_work_dir
    from subprocess_env import python

    report = tmp_path / "report"
    argv = ["conformance", "--provider", "CPUExecutionProvider", "--models", "none", "--ops", "Add"]
    argv += ["--onnx-models", "none"]
    argv += ["--report", str(report), "--work-dir", str(conformance_work_dir()), "--jobs", "1"]
    code = f"""
        import sys
        import optimum_ipu_backend.conformance.definition as definition
        from optimum_ipu_backend.cli.main import main
        print(definition.definition_dir())
        sys.exit(main({argv!r}))
    """
    result = python(code, env={"PYTHONPATH": str(site)}, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    suite = site / "optimum_ipu_backend" / "conformance" / "suite"
    assert result.stdout.splitlines()[0] == str(suite)
    data = json.loads((report / "conformance.json").read_text())
    assert data["provider"]["expectation_files"] == [
        str(suite / "expectations" / "CPUExecutionProvider.toml")
    ]
    assert data["summary"]["by_status"] == {"passed": 8}
