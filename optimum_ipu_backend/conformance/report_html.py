"""The HTML report: one self-contained page (styles inline, plots embedded as PNG data URIs, no script),
readable in any browser without the terminal output."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from optimum_ipu_backend.conformance import results
from optimum_ipu_backend.conformance.reports import (
    CASE_TABLES,
    CPU_COLUMN,
    STATUS_LABELS,
    Report,
    cpu_deviations,
    figure_text,
    options_line,
    provider_line,
    run_line,
)

STATUS_COLOURS = {
    results.PASSED: "#2e7d32",
    results.FAILED: "#c62828",
    results.ERROR: "#6a1b9a",
    results.XFAIL: "#f9a825",
    results.XPASS: "#0277bd",
    results.NOT_APPLICABLE: "#9e9e9e",
    results.OUT_OF_TABLE: "#d7ccc8",
}
# Errors of exactly zero have no place on a log axis; they are drawn at this floor and labelled "exact".
_ERROR_FLOOR = 1e-12

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #212121; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.verdict { display: inline-block; padding: 0.2em 0.8em; color: white; font-weight: bold; border-radius: 4px; }
.pass { background: #2e7d32; } .fail { background: #c62828; }
code { font-size: 0.95em; } figure { margin: 1em 0; } figcaption { color: #555; font-size: 0.9em; }
img.plot { max-width: 100%; border: 1px solid #eee; }
"""


def _png(figure: Any) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def model_error_plot(report: Report) -> str | None:
    """Horizontal bars: the largest absolute error of each model output, against the tier's atol."""
    from matplotlib.figure import Figure

    rows = [
        (f"{case_id.split('/', 1)[1]}: {output}", row["max_abs"], row["within_tolerance"])
        for case_id, outputs in report.data["models"].items()
        for output, row in outputs.items()
    ]
    if not rows:
        return None
    figure = Figure(figsize=(9, 0.32 * len(rows) + 1.4))
    axes = figure.add_subplot()
    values = [_ERROR_FLOOR if value is None or value < _ERROR_FLOOR else value for _, value, _ in rows]
    colours = [
        STATUS_COLOURS[results.FAILED]
        if (within is False or value is None)
        else STATUS_COLOURS[results.PASSED]
        if within
        else "#607d8b"
        for _, value, within in rows
    ]
    positions = range(len(rows))
    axes.barh(positions, values, color=colours)
    axes.set_xscale("log")
    axes.set_yticks(list(positions), [label for label, _, _ in rows], fontsize=8)
    axes.invert_yaxis()
    for position, (_, value, _) in zip(positions, rows, strict=True):
        text = "not finite" if value is None else ("exact" if value == 0 else f"{value:.2g}")
        axes.annotate(
            text,
            (_ERROR_FLOOR, position),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
            color="white" if value else "#212121",
        )
    atol = report.data["tier"]["thresholds"].get("atol")
    if atol is not None:
        axes.axvline(atol, color="#c62828", linestyle="--", linewidth=1)
        axes.annotate(
            f"atol {atol:g}",
            (atol, 0),
            xytext=(3, -12),
            textcoords="offset points",
            fontsize=8,
            color="#c62828",
        )
    axes.set_xlim(left=_ERROR_FLOOR / 2)
    axes.set_xlabel("largest |provider - CPU| over the input sets (log scale)")
    axes.set_title("Error per model and output")
    return _png(figure)


def operator_coverage_plot(report: Report) -> str | None:
    """Stacked bars per operator under test: how many of its cases ended in each status."""
    from matplotlib.figure import Figure

    coverage = report.data["operators"]
    if not coverage:
        return None
    operators = list(coverage)
    figure = Figure(figsize=(9, 0.16 * len(operators) + 1.6))
    axes = figure.add_subplot()
    left = [0] * len(operators)
    for status in results.STATUSES:
        counts = [coverage[op].get(status, 0) for op in operators]
        if any(counts):
            axes.barh(
                range(len(operators)),
                counts,
                left=left,
                color=STATUS_COLOURS[status],
                label=STATUS_LABELS[status],
            )
            left = [a + b for a, b in zip(left, counts, strict=True)]
    axes.set_yticks(range(len(operators)), operators, fontsize=6)
    axes.set_ylim(len(operators) - 0.5, -0.5)
    axes.set_xlabel("node cases")
    axes.set_title("Operator coverage: node cases per operator under test")
    axes.legend(loc="lower right", fontsize=8)
    return _png(figure)


def _cell(value: Any) -> str:
    return html.escape(figure_text(value))


def _table(headers: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_cell(c)}</td>' if i in numeric else f"<td>{_cell(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _status_table(title: str, rows: dict[str, dict[str, int]]) -> str:
    """A table of case counts by status, one row per key of ``rows``."""
    return _table(
        [title, *(STATUS_LABELS[s] for s in results.STATUSES)],
        [[name, *(counts.get(s, 0) for s in results.STATUSES)] for name, counts in rows.items()],
        set(range(1, len(results.STATUSES) + 1)),
    )


def render(report: Report) -> str:
    data = report.data
    provider = data["provider"]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Conformance: {html.escape(provider['name'])}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>Conformance: {html.escape(provider['name'])}</h1>",
        f'<p><span class="verdict {"pass" if data["passed"] else "fail"}" id="verdict">'
        f"{'PASS' if data['passed'] else 'FAIL'}</span>"
        + (" The run was interrupted: only the finished cases are reported." if data["interrupted"] else "")
        + "</p>",
        _table(
            ["", ""],
            [
                ["provider", provider_line(provider)],
                ["options", options_line(provider)],
                ["tier", f"{data['tier']['name']}: {data['tier']['description']}"],
                ["expectation files", ", ".join(provider["expectation_files"]) or "none"],
                ["operator support", provider["operator_support"]],
                ["run", run_line(data)],
                ["environment", ", ".join(f"{k} {v}" for k, v in data["environment"].items())],
            ],
        ),
        "<h2>Summary</h2>",
        _status_table("level", {level: data["summary"].get(level, {}) for level in results.LEVELS}),
    ]
    failing = [r for r in report.results if r.is_failing]
    parts.append(f'<h2 id="failures">Failures ({len(failing)})</h2>')
    if failing:
        rows = [[r.case_id, r.status, failure] for r in failing for failure in (r.failures or [r.message])]
        parts.append(_table(["case", "status", "what failed"], rows))
    else:
        parts.append("<p>None.</p>")
    xpass = [r for r in report.results if r.status == results.XPASS]
    if xpass:
        parts.append(f"<h2>Known failures that now pass ({len(xpass)}): remove their entries</h2>")
        parts.append(
            _table(
                ["case", "entry", "reason"],
                [[r.case_id, r.expectation["source"], r.expectation["reason"]] for r in xpass],
            )
        )
    if data["not_run"]:
        why = "the run was interrupted" if data["interrupted"] else "not selected"
        parts.append(f"<h2>Not run ({len(data['not_run'])}: {why})</h2>")
        parts.append("<p>" + ", ".join(f"<code>{html.escape(c)}</code>" for c in data["not_run"]) + "</p>")

    for plot_id, title, png, caption in (
        (
            "plot-model-errors",
            "Models",
            model_error_plot(report),
            "Largest absolute error of every output of every model case over its input sets; green: within "
            "the tier's tolerance, red: outside it, grey: the tier judges task measures only.",
        ),
        (
            "plot-operator-coverage",
            "Operators",
            operator_coverage_plot(report),
            "Node cases per operator under test, by outcome.",
        ),
    ):
        if png is None:
            continue
        parts.append(f"<h2>{title}</h2>")
        parts.append(
            f'<figure><img class="plot" id="{plot_id}" alt="{html.escape(caption)}" '
            f'src="data:image/png;base64,{png}"><figcaption>{html.escape(caption)}</figcaption></figure>'
        )
        if plot_id == "plot-model-errors":
            rows = [
                [case_id, output, row["max_abs"], row["max_rel"], row["min_cosine"], row["within_tolerance"]]
                for case_id, outputs in data["models"].items()
                for output, row in outputs.items()
            ]
            parts.append(
                _table(
                    ["case", "output", "max abs", "max rel", "min cosine", "within tolerance"],
                    rows,
                    {2, 3, 4},
                )
            )
            metrics = [
                [
                    r.case_id,
                    m.input_set,
                    m.metric,
                    m.value,
                    "reported only" if m.threshold is None else m.threshold,
                ]
                for r in report.results
                for m in r.metrics
            ]
            if metrics:
                parts.append(_table(["case", "input set", "task measure", "value", "required"], metrics, {3}))
        else:
            parts.append(_status_table("operator", data["operators"]))
    # The operators first: their counts are under their plot, just above.
    for level, group, counts_title, counts_key, column_title, column_key in sorted(
        CASE_TABLES, key=lambda table: table[0] != results.OPERATOR
    ):
        if level != results.OPERATOR and data.get(counts_key):
            parts.append(f"<h2>{html.escape(counts_title)}</h2>")
            parts.append(_status_table(group, data[counts_key]))
        if data.get(column_key):
            parts.append(f"<h2>{html.escape(column_title)}</h2>")
            rows = [[name, *(row[key] for key in CPU_COLUMN)] for name, row in data[column_key].items()]
            parts.append(_table([group, *CPU_COLUMN.values()], rows, set(range(1, len(CPU_COLUMN) + 1))))
            deviations = [
                [r.case_id, r.cpu["status"], r.cpu["message"]] for r in cpu_deviations(report, level)
            ]
            if deviations:
                parts.append(_table(["case", "CPU", "against the reference"], deviations))

    expected = [
        r for r in report.results if r.status in (results.XFAIL, results.NOT_APPLICABLE) and r.expectation
    ]
    if expected:
        parts.append("<h2>Expected failures and cases not applicable, with their reasons</h2>")
        by_reason: dict[tuple[str, str, str], list[str]] = {}
        for result in expected:
            key = (result.status, result.expectation["reason"], result.expectation["source"])
            by_reason.setdefault(key, []).append(result.case_id)
        rows = [
            [STATUS_LABELS[status], reason, source, len(ids)]
            for (status, reason, source), ids in by_reason.items()
        ]
        parts.append(_table(["outcome", "reason", "entry", "cases"], rows, {3}))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(report: Report, path: Path) -> Path:
    path.write_text(render(report), encoding="utf-8")
    return path
