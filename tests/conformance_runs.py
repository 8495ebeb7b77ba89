"""One ``optimum-ipu conformance`` run per test session, in a fresh interpreter of the installed
environment with the test-only provider distributions on the path; pytest-xdist workers share it on
disk. The conformance suite's tests and the plugin tests read its reports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from filelock import FileLock
from model_zoo import conformance_command_work_dir, conformance_work_dir
from subprocess_env import python


def conformance_argv(report: Path, *args: str, work_dir: Path | None = None) -> list[str]:
    work_dir = conformance_work_dir() if work_dir is None else work_dir
    return ["conformance", *args, "--report", str(report), "--work-dir", str(work_dir), "--jobs", "1"]


class Run:
    """One run of the command, done once per test session: pytest-xdist workers share it on disk."""

    def __init__(self, report: Path) -> None:
        self.report = report
        outcome = json.loads((report / "outcome.json").read_text())
        self.returncode, self.output = outcome["returncode"], outcome["output"]
        self.data = json.loads((report / "conformance.json").read_text())
        self.cases = {case["case_id"]: case for case in self.data["cases"]}

    @classmethod
    def once(cls, tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Run:
        shared = tmp_path_factory.getbasetemp()
        shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
        report = shared / "conformance-runs" / name
        report.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(report) + ".lock"):
            if not (report / "outcome.json").is_file():
                argv = conformance_argv(
                    report, *args, work_dir=conformance_command_work_dir(tmp_path_factory)
                )
                code = f"import sys; from optimum_ipu_backend.cli.main import main; sys.exit(main({argv!r}))"
                result = python(code, plugins=True)
                outcome = {"returncode": result.returncode, "output": result.stdout + result.stderr}
                (report / "outcome.json").write_text(json.dumps(outcome))
        return cls(report)
