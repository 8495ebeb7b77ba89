"""The reports of a run, all written from one ``Report``: JUnit XML (for CI), JSON (checked against its
versioned schema, which ships beside this module) and a Markdown summary; the self-contained HTML page is
``report_html.py``'s."""

from __future__ import annotations

import json
import os
import platform
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata, resources
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from optimum_ipu_backend.conformance.providers import REFERENCE_PROVIDER
from optimum_ipu_backend.conformance.results import (
    ERROR,
    FAILED,
    LEVELS,
    MODEL,
    NOT_APPLICABLE,
    ONNX_MODEL,
    OPERATOR,
    OUT_OF_TABLE,
    PASSED,
    STATUSES,
    XFAIL,
    XPASS,
    CaseResult,
)

# 1.1: operator cases carry their oracle and the CPU column; 1.2: the ONNX-model level
SCHEMA_VERSION = "1.2"
SCHEMA_FILE = "report-schema-1.json"

JUNIT_FILE = "conformance.junit.xml"
JSON_FILE = "conformance.json"
MARKDOWN_FILE = "conformance.md"
HTML_FILE = "conformance.html"

#: Each level's name in the reports' headings and JUnit's suite names.
LEVEL_TITLES = {MODEL: "models", ONNX_MODEL: "onnx_models", OPERATOR: "operators"}

STATUS_LABELS = {
    PASSED: "passed",
    FAILED: "failed",
    ERROR: "error",
    XFAIL: "expected failure",
    XPASS: "known failure now passing",
    NOT_APPLICABLE: "not applicable",
    OUT_OF_TABLE: "out of the table",
}


def report_schema() -> dict[str, Any]:
    """The JSON Schema every JSON report is valid against."""
    return json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


def installed_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, str]:
    facts = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": str(os.cpu_count()),
    }
    for distribution in ("onnx", "onnxruntime", "torch", "transformers", "optimum-onnx"):
        facts[distribution] = installed_version(distribution)
    return facts


@dataclass
class Report:
    data: dict[str, Any]  # exactly what the JSON report holds
    results: list[CaseResult]

    @property
    def passed(self) -> bool:
        return bool(self.data["passed"])

    @classmethod
    def build(cls, run: Any, results: Iterable[CaseResult], *, started: float, interrupted: bool) -> Report:
        results = sorted(results, key=lambda r: (LEVELS.index(r.level), r.case_id))
        finished = {result.case_id for result in results}
        not_run = [planned.case_id for planned in run.planned if planned.case_id not in finished]
        # Cases that did not run (an interruption, or pytest's own -k selection) never count as passed,
        # but only an interruption fails the run for them.
        passed = not interrupted and not any(result.is_failing for result in results)
        data = {
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "optimum-ipu-backend", "version": installed_version("optimum-ipu-backend")},
            "started_at": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
            "duration_s": round(max(datetime.now(timezone.utc).timestamp() - started, 0.0), 2),
            "interrupted": interrupted,
            "passed": passed,
            "settings": run.settings.describe(),
            "provider": run.provider.describe(),
            "tier": {
                "name": run.tier.name,
                "description": " ".join(run.tier.description.split()),
                "thresholds": run.tier.thresholds(),
            },
            "environment": environment(),
            "summary": _summary(results),
            "operators": coverage(results),
            "cpu_column": cpu_column(results),
            "onnx_models": coverage(results, ONNX_MODEL),
            "onnx_models_cpu_column": cpu_column(results, ONNX_MODEL),
            "models": model_errors(results),
            "not_run": not_run,
            "cases": [result.to_dict() for result in results],
        }
        return cls(data, results)


def _counts(results: Iterable[CaseResult]) -> dict[str, int]:
    counter = Counter(result.status for result in results)
    return {status: counter[status] for status in STATUSES if counter[status]}


def _summary(results: Sequence[CaseResult]) -> dict[str, Any]:
    return {
        "total": len(results),
        "by_status": _counts(results),
        **{level: _counts(r for r in results if r.level == level) for level in LEVELS},
    }


def coverage(results: Iterable[CaseResult], level: str = OPERATOR) -> dict[str, dict[str, int]]:
    """Per group of one level (the operator under test, or the ONNX model kind): how many of its cases
    passed, failed, ..."""
    by_group: dict[str, list[CaseResult]] = {}
    for result in results:
        if result.level == level:
            by_group.setdefault(result.group, []).append(result)
    return {group: _counts(by_group[group]) for group in sorted(by_group)}


#: The CPU column's counts, in the order the reports print them.
CPU_COLUMN_TITLE = "Operators: the CPU column (CPUExecutionProvider against ONNX's reference outputs)"
ONNX_MODELS_CPU_COLUMN_TITLE = (
    "ONNX models: the CPU column (CPUExecutionProvider against ONNX's stored outputs)"
)
CPU_COLUMN = {
    "against_cpu": "judged against CPU",
    "against_reference": "judged against ONNX's reference",
    "cpu_agrees": "CPU agrees with the reference",
    "cpu_differs": "CPU differs from the reference",
    "cpu_raises": "CPU raises",
}


def cpu_column(results: Iterable[CaseResult], level: str = OPERATOR) -> dict[str, dict[str, int]]:
    """Per group of one level (the operator under test, or the ONNX model kind): how many of its cases
    were judged against CPU's outputs and how many against ONNX's reference, and how CPU itself fared
    against the reference."""
    table: dict[str, Counter] = {}
    for result in results:
        if result.level != level or (result.oracle is None and result.cpu is None):
            continue
        row = table.setdefault(result.group, Counter())
        if result.oracle is not None:
            row["against_cpu" if result.oracle == REFERENCE_PROVIDER else "against_reference"] += 1
        if result.cpu is not None:
            row[f"cpu_{result.cpu['status']}"] += 1
    return {operator: {key: table[operator][key] for key in CPU_COLUMN} for operator in sorted(table)}


#: The per-group tables of the judged levels, in the reports' order: (level, group heading, counts title,
#: counts key of the JSON report, CPU column title, CPU column key).
CASE_TABLES = (
    (
        ONNX_MODEL,
        "kind",
        "ONNX models: cases per kind",
        "onnx_models",
        ONNX_MODELS_CPU_COLUMN_TITLE,
        "onnx_models_cpu_column",
    ),
    (
        OPERATOR,
        "operator",
        "Operators: cases per operator under test",
        "operators",
        CPU_COLUMN_TITLE,
        "cpu_column",
    ),
)


def cpu_deviations(report: Report, level: str) -> list[CaseResult]:
    """The cases of one level where CPU itself does not agree with ONNX's reference."""
    return [
        r for r in report.results if r.level == level and r.cpu is not None and r.cpu["status"] != "agrees"
    ]


def model_errors(results: Iterable[CaseResult]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per model case and output: the worst error over the input sets."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for result in results:
        for comparison in result.outputs:
            row = table.setdefault(result.case_id, {}).setdefault(
                comparison.output,
                {"max_abs": 0.0, "max_rel": 0.0, "min_cosine": 1.0, "within_tolerance": None},
            )
            for key, value, pick in (
                ("max_abs", comparison.max_abs, max),
                ("max_rel", comparison.max_rel, max),
                ("min_cosine", comparison.cosine, min),
            ):
                row[key] = None if value is None or row[key] is None else pick(row[key], value)
            if comparison.within_tolerance is not None:
                row["within_tolerance"] = comparison.within_tolerance and row["within_tolerance"] is not False
    return table


def summary_lines(report: Report) -> list[str]:
    """A few lines for the terminal: the counts, every failure, every known failure that now passes."""
    data = report.data
    provider = data["provider"]
    counts = data["summary"]["by_status"]
    lines = [
        f"provider {provider['name']} ({provider['kind']}, options {provider['options'] or 'none'}), "
        f"tier {data['tier']['name']}: "
        + ", ".join(f"{counts[status]} {STATUS_LABELS[status]}" for status in STATUSES if status in counts)
    ]
    lines += [f"FAILED {result.message}" for result in report.results if result.is_failing]
    lines += [f"NOW PASSING {result.message}" for result in report.results if result.status == XPASS]
    if data["interrupted"]:
        lines.append(
            f"INTERRUPTED: {len(data['not_run'])} case(s) did not run; "
            "the reports hold the ones that finished"
        )
    elif data["not_run"]:
        lines.append(f"{len(data['not_run'])} planned case(s) were not selected and did not run")
    lines.append("verdict: " + ("PASS" if data["passed"] else "FAIL"))
    return lines


# ------------------------------------------------------------------------------------------------
# Writers
# ------------------------------------------------------------------------------------------------


def write_json(report: Report, path: Path) -> Path:
    import jsonschema

    # A report that does not match its own schema is a bug here; never hand one to a vendor.
    jsonschema.validate(report.data, report_schema())
    path.write_text(json.dumps(report.data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path


# JUnit's element for a failing case, by status: (suite counter, element tag, type attribute).
_JUNIT_FAULTS = {
    FAILED: ("failures", "failure", "ConformanceFailure"),
    ERROR: ("errors", "error", "ConformanceError"),
}


def write_junit(report: Report, path: Path) -> Path:
    """One testsuite per level; failures carry the case, the output and the error in their message."""
    data = report.data
    root = ElementTree.Element("testsuites", name=f"optimum-ipu conformance: {data['provider']['name']}")
    properties = {
        "provider": data["provider"]["name"],
        "provider_options": json.dumps(data["provider"]["options"], sort_keys=True),
        "tier": data["tier"]["name"],
        "interrupted": str(data["interrupted"]).lower(),
    }
    totals = Counter()
    for level, title in LEVEL_TITLES.items():
        cases = [result for result in report.results if result.level == level]
        suite = ElementTree.SubElement(root, "testsuite", name=f"conformance.{title}")
        props = ElementTree.SubElement(suite, "properties")
        for key, value in properties.items():
            ElementTree.SubElement(props, "property", name=key, value=value)
        counts = Counter()
        for result in cases:
            counts["tests"] += 1
            classname = f"conformance.{title}.{result.group}"
            case = ElementTree.SubElement(
                suite, "testcase", classname=classname, name=result.case_id, time=f"{result.duration_s:.3f}"
            )
            if result.oracle is not None or result.cpu is not None:
                case_props = ElementTree.SubElement(case, "properties")
                for key, value in junit_cpu_properties(result).items():
                    ElementTree.SubElement(case_props, "property", name=key, value=value)
            if result.status in _JUNIT_FAULTS:
                count, tag, kind = _JUNIT_FAULTS[result.status]
                counts[count] += 1
                ElementTree.SubElement(case, tag, message=result.message, type=kind).text = result.detail
            elif result.status in (XFAIL, NOT_APPLICABLE, OUT_OF_TABLE):
                counts["skipped"] += 1
                reason = result.expectation["reason"] if result.expectation else result.message
                ElementTree.SubElement(
                    case, "skipped", type=result.status, message=f"{STATUS_LABELS[result.status]}: {reason}"
                )
            elif result.status == XPASS:
                out = ElementTree.SubElement(case, "system-out")
                out.text = result.message
        for key in ("tests", "failures", "errors", "skipped"):
            suite.set(key, str(counts[key]))
            totals[key] += counts[key]
        suite.set("time", f"{sum(result.duration_s for result in cases):.3f}")
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(totals[key]))
    root.set("time", f"{data['duration_s']:.3f}")
    ElementTree.indent(root)
    ElementTree.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
    return path


def junit_cpu_properties(result: CaseResult) -> dict[str, str]:
    """An operator case's oracle and CPU column, as JUnit testcase properties."""
    properties = {"oracle": result.oracle or "none"}
    if result.cpu is not None:
        properties["cpu"] = result.cpu["status"]
        for key in ("max_abs", "max_rel"):
            if key in result.cpu:
                properties[f"cpu_{key}"] = figure_text(result.cpu[key])
        if result.cpu["message"]:
            properties["cpu_message"] = result.cpu["message"]
    return properties


def provider_line(provider: dict[str, Any]) -> str:
    return f"{provider['name']} ({provider['kind']}; {provider['distribution']} {provider['version']})"


def options_line(provider: dict[str, Any]) -> str:
    return json.dumps(provider["options"], sort_keys=True) if provider["options"] else "none"


def run_line(data: dict[str, Any]) -> str:
    settings = data["settings"]
    scope = "--quick" if settings["quick"] else "full"
    chosen = [f"--models {' '.join(settings['models'])}"] if settings["models"] else []
    chosen += [f"--ops {' '.join(settings['ops'])}"] if settings["ops"] else []
    onnx_models = settings.get("onnx_models", [])  # a report of schema 1.2 on
    chosen += [f"--onnx-models {' '.join(onnx_models)}"] if onnx_models else []
    chosen += [f"--model-dir {path}" for path in settings["model_dirs"]]
    parts = [scope, *chosen, f"started {data['started_at']}", f"{data['duration_s']:.0f} s"]
    return ", ".join(parts)


def required_line(threshold: float | None) -> str:
    return "reported only" if threshold is None else figure_text(threshold)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def figure_text(value: Any) -> str:
    """A figure as the reports print it: 3 significant digits, yes/no, n/a for a missing one."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if value else "0"
    return str(value)


def _status_table(title: str, rows: dict[str, dict[str, int]]) -> list[str]:
    """A Markdown table of case counts by status, one row per key of ``rows``."""
    lines = [
        "| " + " | ".join([title, *(STATUS_LABELS[s] for s in STATUSES)]) + " |",
        "|---|" + "---:|" * len(STATUSES),
    ]
    lines += [
        f"| {name} | " + " | ".join(str(counts.get(s, 0)) for s in STATUSES) + " |"
        for name, counts in rows.items()
    ]
    return lines


def markdown(report: Report) -> str:
    data = report.data
    provider = data["provider"]
    lines = [
        f"# Conformance: {provider['name']}",
        "",
        f"**Verdict: {'PASS' if data['passed'] else 'FAIL'}**"
        + (" (interrupted: only the finished cases are reported)" if data["interrupted"] else ""),
        "",
        "| | |",
        "|---|---|",
        f"| provider | {provider_line(provider)} |",
        f"| options | {_md(options_line(provider))} |",
        f"| tier | {data['tier']['name']}: {_md(data['tier']['description'])} |",
        f"| expectation files | {_md(', '.join(provider['expectation_files']) or 'none')} |",
        f"| operator support | {_md(provider['operator_support'])} |",
        f"| run | {_md(run_line(data))} |",
        f"| environment | {_md(', '.join(f'{k} {v}' for k, v in data['environment'].items()))} |",
        "",
        "## Summary",
        "",
        *_status_table("level", {level: data["summary"].get(level, {}) for level in LEVELS}),
    ]
    failing = [r for r in report.results if r.is_failing]
    lines += ["", f"## Failures ({len(failing)})", ""]
    if failing:
        lines += ["| case | status | what failed |", "|---|---|---|"]
        for result in failing:
            for failure in result.failures or [result.message]:
                lines.append(f"| `{result.case_id}` | {result.status} | {_md(failure)} |")
    else:
        lines.append("None.")
    xpass = [r for r in report.results if r.status == XPASS]
    if xpass:
        lines += ["", f"## Known failures that now pass ({len(xpass)}): remove their entries", ""]
        lines += [
            f"- `{r.case_id}`: {_md(r.expectation['source'])} ({_md(r.expectation['reason'])})" for r in xpass
        ]
    if data["not_run"]:
        why = "the run was interrupted" if data["interrupted"] else "not selected"
        lines += ["", f"## Not run ({len(data['not_run'])}: {why})", ""]
        lines += [f"- `{case_id}`" for case_id in data["not_run"]]
    if data["models"]:
        lines += [
            "",
            "## Models: largest error per output over the input sets",
            "",
            "| case | output | max abs | max rel | min cosine | within tolerance |",
            "|---|---|---:|---:|---:|---|",
        ]
        for case_id, outputs in data["models"].items():
            for output, row in outputs.items():
                figures = (row[key] for key in ("max_abs", "max_rel", "min_cosine", "within_tolerance"))
                lines.append(f"| `{case_id}` | {output} | " + " | ".join(map(figure_text, figures)) + " |")
        metrics = [(r, m) for r in report.results for m in r.metrics]
        if metrics:
            lines += ["", "| case | input set | task measure | value | required |", "|---|---|---|---:|---:|"]
            for result, metric in metrics:
                lines.append(
                    f"| `{result.case_id}` | {metric.input_set} | {metric.metric} | "
                    f"{figure_text(metric.value)} | {required_line(metric.threshold)} |"
                )
    for level, group, counts_title, counts_key, column_title, column_key in CASE_TABLES:
        if data.get(counts_key):
            lines += ["", f"## {counts_title}", ""]
            lines += _status_table(group, data[counts_key])
        if data.get(column_key):
            lines += ["", f"## {column_title}", ""]
            lines += [f"| {group} | " + " | ".join(CPU_COLUMN.values()) + " |"]
            lines += ["|---|" + "---:|" * len(CPU_COLUMN)]
            lines += [
                f"| {name} | " + " | ".join(str(row[key]) for key in CPU_COLUMN) + " |"
                for name, row in data[column_key].items()
            ]
            deviations = cpu_deviations(report, level)
            if deviations:
                lines += ["", f"CPU's own deviations from the reference ({len(deviations)}):", ""]
                lines += [f"- `{r.case_id}`: {r.cpu['status']}: {_md(r.cpu['message'])}" for r in deviations]
    expected = [r for r in report.results if r.status in (XFAIL, NOT_APPLICABLE) and r.expectation]
    if expected:
        lines += ["", "## Expected failures and cases not applicable, with their reasons", ""]
        by_reason: dict[tuple[str, str], list[str]] = {}
        for result in expected:
            key = (result.status, result.expectation["reason"])
            by_reason.setdefault(key, []).append(result.case_id)
        for (status, reason), case_ids in by_reason.items():
            lines.append(f"- {STATUS_LABELS[status]} ({len(case_ids)}): {_md(reason)}")
    return "\n".join(lines) + "\n"


def write_markdown(report: Report, path: Path) -> Path:
    path.write_text(markdown(report), encoding="utf-8")
    return path
