"""The ONNX-model level: the model cases the onnx wheel ships, found by listing its data directory,
run through the provider's session and judged like node cases; expectation entries and the reports take
their ids as they take ``op/...`` ones."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree

import jsonschema
import numpy as np
import pytest

from optimum_ipu_backend.conformance import onnx_models
from optimum_ipu_backend.conformance.definition import DefinitionError
from optimum_ipu_backend.conformance.judging import static_status
from optimum_ipu_backend.conformance.onnx_models import KINDS, discover, run_onnx_model_case, select
from optimum_ipu_backend.conformance.providers import OperatorSupport, resolve_provider
from optimum_ipu_backend.conformance.report_html import render
from optimum_ipu_backend.conformance.reports import (
    JUNIT_FILE,
    Report,
    markdown,
    report_schema,
    write_junit,
)
from optimum_ipu_backend.conformance.results import (
    NOT_APPLICABLE,
    ONNX_MODEL,
    OUT_OF_TABLE,
    PASSED,
    REFERENCE,
    XPASS,
    level_of,
)
from optimum_ipu_backend.conformance.runner import ConformanceRun, RunSettings


@pytest.fixture(scope="module")
def cases() -> dict[str, onnx_models.OnnxModelCase]:
    return {case.case_id: case for case in discover()}


def test_discovery_finds_the_four_kinds_without_loading_a_model(cases) -> None:
    counts = {kind: len([c for c in cases.values() if c.kind == kind]) for kind in KINDS}
    assert counts == {"simple": 23, "pytorch-converted": 82, "pytorch-operator": 35, "light": 9}
    assert not any("model" in case.__dict__ for case in cases.values())  # listing only: nothing parsed
    sign = cases["onnx-model/simple/test_sign_model"]
    assert (sign.rtol, sign.atol) == (1e-3, 1e-7) and level_of(sign.case_id) == ONNX_MODEL
    # A light model takes the tolerances of the `real` entry whose url names it, as ONNX's runner does.
    assert cases["onnx-model/light/light_densenet121"].rtol == 2e-3
    assert cases["onnx-model/light/light_squeezenet"].rtol == 1e-3


def test_selection_by_kind_and_glob_and_its_errors(cases) -> None:
    every = list(cases.values())
    assert select(every, quick=False, names=()) == every  # the full run takes them all
    assert select(every, quick=True, names=()) == []  # --quick takes none
    assert select(every, quick=True, names=["none"]) == []
    assert {c.kind for c in select(every, False, ["light"])} == {"light"}
    chosen = select(every, False, ["simple/test_sign_model,onnx-model/pytorch-operator/test_operator_add*"])
    assert [c.name for c in chosen][:2] == ["test_sign_model", "test_operator_add_broadcast"]
    with pytest.raises(DefinitionError, match="matches no ONNX model case"):
        select(every, False, ["real"])


def test_the_light_input_is_onnx_runners_deterministic_one(cases) -> None:
    ((feed, outputs),) = onnx_models.load_data_sets(cases["onnx-model/light/light_squeezenet"])
    (value,) = feed.values()  # the initializers listed as inputs get no value
    assert value.dtype == np.float32 and value.shape == (1, 3, 224, 224)
    assert value.flat[1] == np.float32(1 / value.size) and outputs[0].shape == (1, 1000, 1, 1)


@pytest.mark.parametrize(
    "case_id",
    [
        "onnx-model/simple/test_sign_model",
        "onnx-model/simple/test_sequence_model1",  # sequence values inside, a tensor out
        "onnx-model/pytorch-operator/test_operator_view",  # an IR-3 model
        "onnx-model/light/light_squeezenet",  # the runner's dummy input against the stored output
    ],
)
def test_cpu_meets_onnx_stored_outputs(cases, case_id: str) -> None:
    result = run_onnx_model_case(cases[case_id], resolve_provider("CPUExecutionProvider", {}))
    assert result.status == PASSED, result.message
    assert result.level == ONNX_MODEL and result.group == case_id.split("/")[1]
    assert result.oracle == REFERENCE and result.cpu is None  # CPU itself: judged against ONNX's outputs


def test_the_declaration_rules_model_cases_out_as_it_does_node_cases(cases) -> None:
    support = OperatorSupport(
        table=frozenset({("", "Relu"), ("", "Add"), ("", "Constant")}),
        element_types=frozenset({"FLOAT"}),
        element_types_reason="the test NPU holds float32 only",
        source="test [operators]",
    )
    assert static_status(cases["onnx-model/simple/test_single_relu_model"], support) is None
    status, reason = static_status(cases["onnx-model/simple/test_sign_model"], support)
    assert status == OUT_OF_TABLE and reason.startswith("uses Sign, not in the provider's operator table")
    status, reason = static_status(cases["onnx-model/pytorch-operator/test_operator_addconstant"], support)
    assert (status, reason) == (NOT_APPLICABLE, "element type(s) DOUBLE: the test NPU holds float32 only")


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> ConformanceRun:
    extra = tmp_path_factory.mktemp("expectations") / "extra.toml"
    extra.write_text(
        'provider = "CPUExecutionProvider"\n'
        '[[known_failure]]\ncases = ["onnx-model/simple/test_single_relu_model"]\nreason = "listed"\n'
        '[[not_applicable]]\ncases = ["onnx-model/simple/test_sign*"]\nreason = "not for this test"\n',
        encoding="utf-8",
    )
    settings = RunSettings(
        provider="CPUExecutionProvider",
        models=("none",),
        ops=("none",),
        onnx_models=("simple/test_si*", "simple/test_strnorm_model_monday_empty_output"),
        expectations=(str(extra),),
        work_dir=str(tmp_path_factory.mktemp("work")),
    )
    return ConformanceRun.create(settings).plan()


def test_expectation_entries_match_onnx_model_ids_by_name_and_glob(planned: ConformanceRun) -> None:
    (decided,) = planned.decided
    assert decided.case_id == "onnx-model/simple/test_sign_model" and decided.status == NOT_APPLICABLE
    assert decided.expectation["reason"] == "not for this test"
    known = {case.case_id: case.known_failure for case in planned.planned}
    assert set(known) == {
        "onnx-model/simple/test_single_relu_model",
        "onnx-model/simple/test_strnorm_model_monday_empty_output",
    }
    assert known["onnx-model/simple/test_single_relu_model"]["reason"] == "listed"
    assert "en_US.UTF-8" in known["onnx-model/simple/test_strnorm_model_monday_empty_output"]["reason"]
    relu = next(case for case in planned.planned if case.case_id.endswith("relu_model"))
    result = planned.execute(relu, zoo=None)
    assert result.status == XPASS and "conformance-expectations remove" in result.message


def test_the_reports_carry_the_level(planned: ConformanceRun, tmp_path: Path) -> None:
    results = [*planned.decided, *(planned.execute(case, zoo=None) for case in planned.planned)]
    report = Report.build(planned, results, started=0.0, interrupted=False)
    jsonschema.validate(json.loads(json.dumps(report.data)), report_schema())
    assert report.data["summary"]["onnx_model"]["not_applicable"] == 1
    assert report.data["onnx_models"]["simple"]["not_applicable"] == 1
    assert report.data["settings"]["onnx_models"] == list(planned.settings.onnx_models)
    text = markdown(report)
    assert "| onnx_model | " in text and "## ONNX models: cases per kind" in text
    assert "--onnx-models simple/test_si*" in text
    suites = ElementTree.parse(write_junit(report, tmp_path / JUNIT_FILE)).getroot()
    suite = next(s for s in suites if s.get("name") == "conformance.onnx_models")
    assert suite.get("tests") == str(len(results))
    assert {case.get("classname") for case in suite.iter("testcase")} == {"conformance.onnx_models.simple"}
    assert "ONNX models: cases per kind" in render(report)
