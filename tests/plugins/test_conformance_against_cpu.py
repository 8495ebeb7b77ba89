"""CPU onnxruntime is the conformance suite's oracle: a plugin that is CPUExecutionProvider under another
name, with no expectation file of its own, passes the quick run and the full run; one wrong element of
one operator output still fails, naming the case and the output.

The full run (every operator, model and ONNX model case: about a minute on 2 cores) is the release
check's (``OPTIMUM_IPU_FULL_MATRIX=1``). By default a targeted run guards what the full run adds to the
quick one: the operators whose CPU deviations from ONNX's reference are reported, not held against the
plugin (Cast's int4 casts, Resize's align_corners downsampling), and the suite's own plan of the full run,
made in the same interpreter without running it, which must hold those cases and the full run's size.
"""

from __future__ import annotations

import re

import pytest
from conformance_runs import Run, run_fixture
from full_matrix import FULL
from junitparser import JUnitXml

PERTURBED_ADD = (
    "perturb_model=test_add",
    "perturb_output=sum",
    "perturb_by=2e-3",
    "perturb_element=5",
)


#: The operators whose cases CPU itself cannot run (int4 casts) or runs differently from ONNX's reference
#: (Resize with align_corners): the full run's deviations of the CPU column.
DEVIATING_OPERATORS = ("Cast", "Resize")


def _options(*options: str) -> tuple[str, ...]:
    return tuple(arg for option in options for arg in ("--provider-option", option))


PERTURBED_ONNX_MODELS = (
    "simple/test_single_relu_model",
    "simple/test_sign_model",
    "pytorch-operator/test_operator_mm",  # an opset-6 Gemm: CPU has no kernel for it
)
PERTURBED_RELU = ("perturb_model=test_single_relu_model", "perturb_output=y", "perturb_by=2e-3")

#: The default tier's runs (name: the command's arguments, and the provider whose full run is planned
#: beside it), made together in one interpreter.
RUNS = {
    "mirror-quick": (("--provider", "mirror", "--quick"), None),
    "mirror-deviations": (
        ("--provider", "mirror", "--models", "none", "--onnx-models", "none", "--ops", *DEVIATING_OPERATORS),
        "mirror",
    ),
    "perturbed-add": (
        ("--provider", "perturbed", *_options(*PERTURBED_ADD), "--models", "none", "--ops", "Add")
        + ("--onnx-models", "none"),
        None,
    ),
    "perturbed-onnx-models": (
        ("--provider", "perturbed", *_options(*PERTURBED_RELU, "perturb_element=1"))
        + ("--models", "none", "--ops", "none", "--onnx-models", *PERTURBED_ONNX_MODELS),
        None,
    ),
}


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return Run.together(tmp_path_factory, RUNS)


mirror_quick = run_fixture("mirror-quick")
mirror_deviations = run_fixture("mirror-deviations")
perturbed_add = run_fixture("perturbed-add")
perturbed_onnx_models = run_fixture("perturbed-onnx-models")


@pytest.fixture(scope="session")
def mirror_full(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run.once(tmp_path_factory, "mirror-full", "--provider", "mirror")


release_check = pytest.mark.skipif(
    not FULL, reason="release check: the full conformance run, every case of the suite (a minute on 2 cores)"
)


def _assert_passes_with_no_expectations(run: Run) -> None:
    _assert_passes_judged_against_cpu(run)
    operators = [case for case in run.data["cases"] if case["level"] == "operator"]
    assert len([case for case in operators if case["status"] == "passed"]) > 0.8 * len(operators)


def _assert_passes_judged_against_cpu(run: Run) -> None:
    """The run passes with no expectation file; each operator case is judged against CPU where CPU runs
    it, and is not applicable only where CPU refuses it too."""
    assert run.returncode == 0, run.output[-4000:]
    assert run.data["passed"] is True and run.data["provider"]["expectation_files"] == []
    by_status = run.data["summary"]["by_status"]
    assert set(by_status) <= {"passed", "not_applicable"}, by_status
    operators = [case for case in run.data["cases"] if case["level"] == "operator"]
    for case in operators:
        if case["status"] == "passed":
            # Judged against CPU's outputs where CPU runs the case, else against ONNX's reference.
            raises = case["cpu"]["status"] == "raises"
            assert case["oracle"] == ("ONNX's reference outputs" if raises else "CPUExecutionProvider")
        else:  # not applicable only because CPU refuses the case too, and the report says so
            assert case["cpu"]["status"] == "raises", case
            assert "CPUExecutionProvider refuses it too" in case["message"]


def test_a_cpu_plugin_with_no_expectation_file_passes_the_quick_run(mirror_quick: Run) -> None:
    _assert_passes_with_no_expectations(mirror_quick)
    assert {case["level"] for case in mirror_quick.data["cases"]} == {"model", "operator"}


def _assert_cpu_deviations_are_not_held_against_it(cases: dict[str, dict]) -> None:
    """CPU's own deviations from ONNX's reference are reported in the CPU column, not held against it:
    the int4 casts CPU cannot exchange, and Resize's align_corners downsampling."""
    assert cases["op/test_cast_FLOAT_to_INT4"]["status"] == "not_applicable"
    aligned = cases["op/test_resize_downsample_scales_linear_align_corners"]
    assert aligned["status"] == "passed" and aligned["cpu"]["status"] == "differs", aligned


def _assert_full_run_size(case_ids) -> None:
    assert len([c for c in case_ids if c.startswith("op/")]) > 1500
    assert len([c for c in case_ids if c.startswith("model/")]) > 20


@pytest.mark.slow
@release_check
def test_a_cpu_plugin_with_no_expectation_file_passes_the_full_run(
    mirror_full: Run, mirror_deviations: Run
) -> None:
    _assert_passes_with_no_expectations(mirror_full)
    _assert_full_run_size(mirror_full.cases)
    _assert_cpu_deviations_are_not_held_against_it(mirror_full.cases)
    # the plan the default tier checks is what the full run runs
    assert set(mirror_full.cases) == set(mirror_deviations.full_plan)


def test_a_cpu_plugin_passes_the_operators_where_cpu_deviates(mirror_deviations: Run) -> None:
    """The default tier's share of the full run: the operators of CPU's deviations, every case of each.
    Only the casts to or from a type onnxruntime's Python API cannot exchange are not applicable (half of
    Cast's cases: the full run's share of passes is checked by the release check and, on the common
    operators, by the quick run); every Resize case passes."""
    run = mirror_deviations
    _assert_passes_judged_against_cpu(run)
    assert {case["group"] for case in run.data["cases"]} == set(DEVIATING_OPERATORS)
    not_applicable = {c["case_id"] for c in run.data["cases"] if c["status"] == "not_applicable"}
    unexchangeable = re.compile(r"op/test_cast_.*(BFLOAT16|FLOAT8|FLOAT4|INT4|INT2|E8M0)")
    assert not_applicable and all(unexchangeable.match(case_id) for case_id in not_applicable), not_applicable
    resize = [c for c in run.data["cases"] if c["group"] == "Resize"]
    assert len(resize) > 30 and {c["status"] for c in resize} == {"passed"}
    _assert_cpu_deviations_are_not_held_against_it(mirror_deviations.cases)


def test_the_full_run_plans_every_case_of_the_suite(mirror_deviations: Run) -> None:
    """The suite's plan of the full run (what the release check's full run runs), made without running:
    its size, every case of the targeted run in it, and nothing settled without running (no expectation
    file, no operator table)."""
    plan = mirror_deviations.full_plan
    assert plan is not None
    _assert_full_run_size(plan)
    assert {"model", "operator", "onnx_model"} == {case["level"] for case in plan.values()}
    settled = [case_id for case_id, case in plan.items() if not case["planned"]]
    assert settled == [], settled
    assert set(mirror_deviations.cases) < set(plan)


def test_one_element_off_by_2e3_fails_naming_the_case_and_the_output(perturbed_add: Run) -> None:
    assert perturbed_add.returncode == 1, perturbed_add.output[-4000:]
    failed = perturbed_add.cases["op/test_add"]
    assert failed["status"] == "failed" and failed["oracle"] == "CPUExecutionProvider"
    assert failed["message"].startswith(
        "op/test_add (Add): output 'sum' differs from CPUExecutionProvider beyond rtol 0.001, atol 1e-07"
    )
    assert failed["info"]["max_abs"] == pytest.approx(2e-3, rel=1e-3)
    assert failed["cpu"]["status"] == "agrees"  # the CPU column: CPU meets ONNX's reference here
    # Only that case is wrong: the other Add cases of the same provider pass against CPU.
    others = [c for c in perturbed_add.data["cases"] if c["group"] == "Add" and c["case_id"] != "op/test_add"]
    assert others and {c["status"] for c in others} == {"passed"}
    assert re.search(r"FAILED op/test_add \(Add\): output 'sum' differs", perturbed_add.output)


def test_the_four_reports_carry_the_cpu_column(perturbed_add: Run) -> None:
    counts = perturbed_add.data["cpu_column"]["Add"]
    total = len([c for c in perturbed_add.data["cases"] if c["group"] == "Add"])
    assert counts["against_cpu"] == counts["cpu_agrees"] == total
    xml = JUnitXml.fromfile(str(perturbed_add.report / "conformance.junit.xml"))
    case = next(case for suite in xml for case in suite if case.name == "op/test_add")
    # junitparser reads suite properties only; a testcase's are plain XML children.
    properties = {p.get("name"): p.get("value") for p in case._elem.iter("property")}
    assert properties["oracle"] == "CPUExecutionProvider" and properties["cpu"] == "agrees"
    markdown = (perturbed_add.report / "conformance.md").read_text()
    assert "## Operators: the CPU column (CPUExecutionProvider against ONNX's reference outputs)" in markdown
    assert f"| Add | {total} | 0 | {total} | 0 | 0 |" in markdown
    page = (perturbed_add.report / "conformance.html").read_text()
    assert "the CPU column (CPUExecutionProvider against ONNX&#x27;s reference outputs)" in page


def test_an_onnx_model_off_by_2e3_fails_naming_the_case(perturbed_onnx_models: Run) -> None:
    run = perturbed_onnx_models
    assert run.returncode == 1, run.output[-4000:]
    failed = run.cases["onnx-model/simple/test_single_relu_model"]
    assert failed["level"] == "onnx_model" and failed["group"] == "simple"
    assert failed["status"] == "failed" and failed["oracle"] == "CPUExecutionProvider"
    assert failed["message"].startswith(
        "onnx-model/simple/test_single_relu_model: output 'y' differs from CPUExecutionProvider beyond "
        "rtol 0.001, atol 1e-07"
    )
    assert failed["info"]["max_abs"] == pytest.approx(2e-3, rel=1e-3)
    assert failed["cpu"]["status"] == "agrees"  # CPU meets ONNX's stored outputs
    assert run.cases["onnx-model/simple/test_sign_model"]["status"] == "passed"
    refused = run.cases["onnx-model/pytorch-operator/test_operator_mm"]
    assert refused["status"] == "not_applicable" and refused["cpu"]["status"] == "raises"
    assert "CPUExecutionProvider refuses it too" in refused["message"]
    assert "FAILED onnx-model/simple/test_single_relu_model: output 'y' differs" in run.output
    assert run.data["summary"]["onnx_model"] == {"passed": 1, "failed": 1, "not_applicable": 1}
    assert run.data["onnx_models_cpu_column"]["simple"]["against_cpu"] == 2
    xml = JUnitXml.fromfile(str(run.report / "conformance.junit.xml"))
    suite = next(suite for suite in xml if suite.name == "conformance.onnx_models")
    assert suite.failures == 1 and suite.tests == 3
    assert "| onnx_model | 1 | 1 | 0 | 0 | 0 | 1 | 0 |" in (run.report / "conformance.md").read_text()
    assert "ONNX models: the CPU column" in (run.report / "conformance.html").read_text()
