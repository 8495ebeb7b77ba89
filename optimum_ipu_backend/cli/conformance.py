"""``optimum-ipu conformance``: prove an execution provider against CPU onnxruntime, model by model and
operator by operator, and write the reports (docs/conformance.md).

The cases run as pytest tests (``optimum_ipu_backend/conformance/pytest_cases.py``), in parallel with
pytest-xdist when it is installed, exactly as ``pytest conformance/ --provider NAME`` runs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

EXTRA = "optimum-ipu-backend[conformance]"
# What the command needs beyond the package's own dependencies (the `conformance` extra).
_NEEDED_MODULES = ("pytest", "jsonschema", "matplotlib") + (("tomli",) if sys.version_info < (3, 11) else ())


def add_conformance_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "conformance",
        help="check an execution provider against CPU onnxruntime: models, ONNX's model cases, operators",
        description=(
            "Run the conformance suite against one execution provider and write JUnit XML, JSON, Markdown "
            "and HTML reports. Exit status 0 only when every case not listed as a known failure passes."
        ),
    )
    parser.add_argument(
        "--provider",
        required=True,
        help="a plugin provider (name or alias, e.g. ipu) or one of onnxruntime's",
    )

    def repeatable(flag: str, metavar: str, help_text: str) -> None:
        parser.add_argument(flag, action="append", default=[], metavar=metavar, help=help_text)

    repeatable(
        "--provider-option",
        "K=V",
        "a provider option, repeatable (ipu: device=emulator, precision=fp16, sequence_lengths=16,32)",
    )
    parser.add_argument(
        "--models", nargs="+", default=[], metavar="ENTRY", help="matrix entries to run (globs)"
    )
    repeatable(
        "--model-dir",
        "PATH",
        "also check your exported or transformers model directory (task from its config); repeatable",
    )
    parser.add_argument(
        "--ops", nargs="+", default=[], metavar="OP", help="operator types to run ('none': no operator level)"
    )
    parser.add_argument(
        "--onnx-models",
        nargs="+",
        default=[],
        metavar="KIND",
        help="the onnx wheel's model cases to run: kinds (simple, pytorch-converted, pytorch-operator, "
        "light) or globs over KIND/NAME; all (the full run's default) or none",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one small model per task and the common operators (no ONNX model case)",
    )
    parser.add_argument(
        "--tier", default="fp32", help="tolerance tier: fp32 (default) or fp16 (conformance/tiers.toml)"
    )
    parser.add_argument("--report", required=True, metavar="DIR", help="directory for the four reports")
    parser.add_argument(
        "--work-dir",
        metavar="DIR",
        help="where built models, exports and generated node cases are kept between runs "
        "(default: $OPTIMUM_IPU_CONFORMANCE_DIR, else conformance/ in the executable cache directory)",
    )
    repeatable("--expectations", "FILE", "an extra expectation file; repeatable")
    parser.add_argument(
        "--jobs",
        default="auto",
        help="pytest-xdist workers: a number, or auto (the CPU count, at most 4; 1 without pytest-xdist)",
    )
    parser.set_defaults(func=run_conformance)
    _add_expectations_parser(subparsers)


def _add_expectations_parser(subparsers: Any) -> None:
    # One level of subcommands only: optimum-cli wraps each subcommand's own `func` (cli/optimum_cli.py).
    parser = subparsers.add_parser(
        "conformance-expectations",
        help="remove cases that now pass from a conformance expectation file",
        description=(
            "remove: take each CASE out of the entry of FILE that lists it by name, keeping the file's "
            "comments (an entry left empty goes too). A case listed only through a glob pattern is "
            "refused: edit that entry by hand. A run's reports print this command for every known "
            "failure that now passes."
        ),
    )
    parser.add_argument("action", choices=["remove"], help="what to do (remove)")
    parser.add_argument("file", type=Path, metavar="FILE", help="the expectation file (.toml)")
    parser.add_argument("cases", nargs="+", metavar="CASE", help="case ids, e.g. op/test_add")
    parser.set_defaults(func=run_remove_expectations)


def run_remove_expectations(args: argparse.Namespace) -> int:
    from optimum_ipu_backend.conformance.definition import DefinitionError, remove_cases

    if importlib.util.find_spec("tomlkit") is None:
        sys.stderr.write(f"optimum-ipu conformance-expectations needs tomlkit: pip install '{EXTRA}'\n")
        return 2
    try:
        removed = remove_cases(args.file, args.cases)
    except (DefinitionError, OSError) as exc:
        sys.stderr.write(f"optimum-ipu conformance-expectations remove: {exc}\n")
        return 1
    print(f"removed from {args.file}: {', '.join(removed)}")
    return 0


def _jobs(value: str) -> int:
    if value == "auto":
        if importlib.util.find_spec("xdist") is None:
            return 1
        return max(1, min(os.cpu_count() or 1, 4))
    try:
        jobs = int(value)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise SystemExit(f"optimum-ipu conformance: --jobs {value!r}: give a positive number or auto")
    if jobs > 1 and importlib.util.find_spec("xdist") is None:
        raise SystemExit(f"optimum-ipu conformance: --jobs {jobs} needs pytest-xdist: pip install '{EXTRA}'")
    return jobs


def pytest_arguments(args: argparse.Namespace, jobs: int) -> list[str]:
    """The pytest command line that runs the suite's cases for these options."""
    from optimum_ipu_backend import conformance

    package = Path(conformance.__file__).resolve().parent
    arguments = [
        str(package / "pytest_cases.py"),
        "-c",
        str(package / "pytest.ini"),
        "--rootdir",
        str(package),
        "-p",
        "optimum_ipu_backend.conformance.pytest_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "--tb=no",
        "-rN",
        "--provider",
        args.provider,
        "--tier",
        args.tier,
        "--report",
        str(Path(args.report).resolve()),
    ]
    repeated = {
        "--provider-option": args.provider_option,
        "--models": args.models,
        "--model-dir": [str(Path(path).resolve()) for path in args.model_dir],
        "--ops": [",".join(args.ops)] if args.ops else [],
        "--onnx-models": [",".join(args.onnx_models)] if args.onnx_models else [],
        "--expectations": [str(Path(path).resolve()) for path in args.expectations],
    }
    arguments += [word for flag, values in repeated.items() for value in values for word in (flag, value)]
    if args.quick:
        arguments.append("--quick")
    if args.work_dir:
        arguments += ["--work-dir", str(Path(args.work_dir).resolve())]
    if jobs > 1:
        arguments += ["-n", str(jobs)]
    return arguments


def _report_recorder() -> Any:
    """A pytest plugin object that keeps the report the suite's plugin built, for the exit status."""
    import pytest

    class ReportRecorder:
        report: Any = None

        @pytest.hookimpl(trylast=True)  # after the suite's plugin has built the report
        def pytest_sessionfinish(self, session: pytest.Session) -> None:
            # Imported here, after pytest has loaded (and assertion-rewritten) the plugin module.
            from optimum_ipu_backend.conformance.pytest_plugin import session_report

            self.report = session_report(session.config)

    return ReportRecorder()


def run_conformance(args: argparse.Namespace) -> int:
    missing = [name for name in _NEEDED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        sys.stderr.write(
            f"optimum-ipu conformance needs {', '.join(missing)}, which the `conformance` extra provides: "
            f"pip install '{EXTRA}'\n"
        )
        return 2
    import pytest

    recorder = _report_recorder()
    code = pytest.main(pytest_arguments(args, _jobs(args.jobs)), plugins=[recorder])
    report = recorder.report
    if report is None:  # pytest stopped before the session (a usage error): its status says why
        return int(code) or 2
    if report.data["interrupted"]:
        return 130
    if code in (pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR):
        return int(code)
    return 0 if report.passed else 1
