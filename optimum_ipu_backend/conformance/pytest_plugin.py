"""The pytest plugin that runs the conformance cases as tests and writes the reports.

``optimum-ipu conformance`` runs pytest with this plugin on ``pytest_cases.py``; ``pytest conformance/``
loads it from ``conformance/conftest.py``. With pytest-xdist the cases spread over workers; every worker
plans the same cases, and the controller gathers each case's result (carried in the test report) and
writes the reports when the session ends, an interrupted one included.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from optimum_ipu_backend.conformance.results import ERROR, FAILED, XFAIL, CaseResult, level_of
from optimum_ipu_backend.conformance.runner import ConformanceRun, PlannedCase, RunSettings

RESULT_PROPERTY = "conformance_result"
TEST_NAME = "test_conformance"
PROGRESS_FILE = "progress.jsonl"

_RUN_KEY = pytest.StashKey[ConformanceRun]()
# The collector of the session in progress: test reports reach the controller without their config.
_ACTIVE: list[_Collector] = []
_COLLECTOR_KEY = pytest.StashKey["_Collector"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "optimum-ipu-backend conformance suite")
    group.addoption(
        "--provider", default=None, help="execution provider under test (plugin name, alias or onnxruntime's)"
    )
    group.addoption(
        "--provider-option", action="append", default=[], metavar="K=V", help="provider option (repeatable)"
    )
    group.addoption("--models", action="append", default=[], help="matrix entries to run (globs; repeatable)")
    group.addoption(
        "--model-dir", action="append", default=[], help="a user's exported or transformers model directory"
    )
    group.addoption(
        "--ops",
        action="append",
        default=[],
        help="operator types to run (comma-separated; 'none': no operator)",
    )
    group.addoption(
        "--onnx-models",
        action="append",
        default=[],
        help="ONNX model cases to run: kinds (simple, pytorch-converted, pytorch-operator, light) or globs "
        "over <kind>/<name> (comma-separated; 'none': no ONNX model)",
    )
    group.addoption(
        "--quick", action="store_true", default=False, help="one small model per task, common operators"
    )
    group.addoption("--tier", default="fp32", help="tolerance tier (conformance/tiers.toml): fp32 or fp16")
    group.addoption(
        "--report", default=None, metavar="DIR", help="write the JUnit, JSON, Markdown and HTML reports here"
    )
    group.addoption(
        "--work-dir", default=None, metavar="DIR", help="where built models and node cases are kept"
    )
    group.addoption(
        "--expectations",
        action="append",
        default=[],
        metavar="FILE",
        help="an extra expectation file (repeatable)",
    )


def settings_from(config: pytest.Config) -> RunSettings | None:
    provider = config.getoption("provider")
    if provider is None:
        return None
    return RunSettings(
        provider=provider,
        provider_options=tuple(config.getoption("provider_option")),
        models=tuple(config.getoption("models")),
        model_dirs=tuple(config.getoption("model_dir")),
        ops=tuple(config.getoption("ops")),
        onnx_models=tuple(config.getoption("onnx_models")),
        quick=config.getoption("quick"),
        tier=config.getoption("tier"),
        report_dir=config.getoption("report"),
        work_dir=config.getoption("work_dir"),
        expectations=tuple(config.getoption("expectations")),
    )


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def conformance_run(config: pytest.Config) -> ConformanceRun:
    """The run of this session, planned once per process (the plan is deterministic, so workers agree)."""
    run = config.stash.get(_RUN_KEY, None)
    if run is None:
        settings = settings_from(config)
        if settings is None:
            raise pytest.UsageError(
                "the conformance suite needs --provider NAME (e.g. --provider CPUExecutionProvider)"
            )
        try:
            run = ConformanceRun.create(settings).plan()
        except (LookupError, ValueError, OSError) as exc:  # a bad option, name or definition file
            raise pytest.UsageError(f"conformance: {exc}") from exc
        config.stash[_RUN_KEY] = run
    return run


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if settings_from(config) is None or _is_worker(config) or config.option.collectonly:
        return
    # Planning here, in the controller, generates the node cases once before any xdist worker starts.
    run = conformance_run(config)
    collector = _Collector(run)
    config.stash[_COLLECTOR_KEY] = collector
    _ACTIVE[:] = [collector]
    collector.start()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_case" not in metafunc.fixturenames:
        return
    run = conformance_run(metafunc.config)
    params = []
    for planned in run.planned:
        marks = []
        if planned.known_failure is not None:
            marks.append(pytest.mark.xfail(reason=planned.known_failure["reason"], strict=False))
        params.append(pytest.param(planned, id=planned.case_id, marks=marks))
    metafunc.parametrize("conformance_case", params)


@pytest.fixture(scope="session")
def conformance_zoo(request: pytest.FixtureRequest) -> Any:
    """The model zoo the matrix is built in (overridden by the repository's own test zoo)."""
    from optimum_ipu_backend.conformance.zoo import ModelZoo, cache_fingerprint

    return ModelZoo(conformance_run(request.config).settings.work_path() / cache_fingerprint())


def run_case(request: pytest.FixtureRequest, planned: PlannedCase, zoo: Any) -> None:
    """The body of every conformance test: run the case, hand its result to the controller, judge it."""
    result = conformance_run(request.config).execute(planned, zoo)
    request.node.user_properties.append((RESULT_PROPERTY, result.to_json()))
    if result.status in (FAILED, ERROR, XFAIL):  # an XFAIL case carries pytest's xfail mark
        pytest.fail(f"{result.message}\n\n{result.detail}".strip(), pytrace=False)


class _Collector:
    """In the controller: every case's result as it arrives, a progress file, the reports at the end."""

    def __init__(self, run: ConformanceRun) -> None:
        self.run = run
        self.results: dict[str, CaseResult] = {}
        self.started = time.time()
        self.report_dir = Path(run.settings.report_dir) if run.settings.report_dir else None
        self.interrupted = False
        self.report: Any = None
        self._previous_sigterm: Any = None

    def start(self) -> None:
        if self.report_dir is not None:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            (self.report_dir / PROGRESS_FILE).write_text("", encoding="utf-8")
        # A terminated run is an interrupted one: pytest still ends the session, and the reports are written.
        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        except ValueError:  # not the main thread
            self._previous_sigterm = None

    def add(self, result: CaseResult) -> None:
        self.results[result.case_id] = result
        if self.report_dir is not None:
            with open(self.report_dir / PROGRESS_FILE, "a", encoding="utf-8") as handle:
                handle.write(result.to_json() + "\n")

    def finish(self, exitstatus: int) -> list[Path]:
        """Build the report of what finished; write it when a report directory was given."""
        from optimum_ipu_backend.conformance.reports import Report

        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self.interrupted = self.interrupted or exitstatus == pytest.ExitCode.INTERRUPTED
        self.report = Report.build(
            self.run,
            [*self.run.decided, *self.results.values()],
            started=self.started,
            interrupted=self.interrupted,
        )
        return [] if self.report_dir is None else _write_reports(self.report, self.report_dir)


def _write_reports(report: Any, directory: Path) -> list[Path]:
    """The four reports, in the order a reader wants them listed."""
    from optimum_ipu_backend.conformance.report_html import write_html
    from optimum_ipu_backend.conformance.reports import (
        HTML_FILE,
        JSON_FILE,
        JUNIT_FILE,
        MARKDOWN_FILE,
        write_json,
        write_junit,
        write_markdown,
    )

    directory.mkdir(parents=True, exist_ok=True)
    return [
        write_junit(report, directory / JUNIT_FILE),
        write_json(report, directory / JSON_FILE),
        write_markdown(report, directory / MARKDOWN_FILE),
        write_html(report, directory / HTML_FILE),
    ]


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    collector = _ACTIVE[0] if _ACTIVE else None
    if collector is None or f"{TEST_NAME}[" not in report.nodeid:
        return
    properties = dict(report.user_properties)
    if RESULT_PROPERTY in properties and report.when == "call":
        collector.add(CaseResult.from_json(properties[RESULT_PROPERTY]))
    elif report.failed and report.when in ("setup", "call"):
        # The case never produced a result (a fixture failed): still a finding, and never a silent pass.
        case_id = report.nodeid.rpartition("[")[2].rstrip("]")
        level = level_of(case_id)
        text = str(report.longrepr)
        collector.add(
            CaseResult(
                case_id,
                level,
                case_id,
                ERROR,
                message=f"{case_id}: {text.strip().splitlines()[-1]}",
                detail=text,
            )
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    collector = session.config.stash.get(_COLLECTOR_KEY, None)
    if collector is None:
        return
    _ACTIVE.clear()
    session.config.stash[_WRITTEN_KEY] = collector.finish(exitstatus)


_WRITTEN_KEY = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    collector = config.stash.get(_COLLECTOR_KEY, None)
    if collector is None or collector.report is None:
        return
    from optimum_ipu_backend.conformance.reports import summary_lines

    terminalreporter.section("conformance")
    for line in summary_lines(collector.report):
        terminalreporter.write_line(line)
    for path in config.stash.get(_WRITTEN_KEY, []):
        terminalreporter.write_line(f"report: {path}")


def session_report(config: pytest.Config) -> Any:
    """The report the controller built at the end of the session (None outside a conformance run)."""
    collector = config.stash.get(_COLLECTOR_KEY, None)
    return None if collector is None else collector.report


__all__ = [
    "conformance_zoo",
    "pytest_addoption",
    "pytest_generate_tests",
    "pytest_runtest_logreport",
    "pytest_sessionfinish",
    "pytest_sessionstart",
    "pytest_terminal_summary",
]
