"""docs/models.md is generated (tools/models_table.py) and lists exactly the rows the test matrix defines."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "models_table.py"


def _tool():
    spec = importlib.util.spec_from_file_location("models_table", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_committed_models_doc_is_current_with_the_matrix() -> None:
    tool = _tool()
    text = tool.DOC.read_text(encoding="utf-8")
    results = tool.documented_results(text)
    # A case added to (or removed from) the matrix without regenerating the file changes the rendering.
    assert tool.render(tool.matrix_rows(), results) == text, "regenerate docs/models.md (see its header)"
    assert tool.NOT_RUN not in results.values(), "docs/models.md was generated without a full run"
    classes = {row.ort_class for row in tool.matrix_rows()}
    assert {"ORTModelForVision2Seq", "ORTModelForPix2Struct", "ORTPipelineForText2Image"} <= classes


def test_results_come_from_the_junit_report(tmp_path: Path) -> None:
    tool = _tool()
    rows = tool.matrix_rows()
    first, second = rows[0].test, rows[1].test
    report = tmp_path / "report.xml"

    def case(node: str, body: str = "") -> str:
        module, name = node.split("::")
        classname = module.removesuffix(".py").replace("/", ".")
        return f'<testcase classname="{classname}" name="{name}">{body}</testcase>'

    failure = '<failure message="x"/>'
    report.write_text(
        f'<testsuites><testsuite name="pytest">{case(first)}{case(second, failure)}</testsuite></testsuites>'
    )
    results = tool.junit_results(report)
    assert results[first] == "passed" and results[second] == "failed"
    rendered = tool.render(rows, results)
    documented = tool.documented_results(rendered)
    assert documented == {row.test: results.get(row.test, tool.NOT_RUN) for row in rows}
