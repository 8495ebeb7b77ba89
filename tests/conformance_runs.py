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


#: Run before the command by ``Run.once(..., plan_full_run=PROVIDER)``: the cases the full run of PROVIDER
#: would run or settle (the suite's own plan, which reads the case listing and runs nothing), by id and
#: level, written to ``full-plan.json`` of the report directory.
_PLAN_FULL_RUN = """
import json
from pathlib import Path
from optimum_ipu_backend.conformance.runner import ConformanceRun, RunSettings
plan = ConformanceRun.create(RunSettings(provider={provider!r}, work_dir={work_dir!r})).plan()
cases = {{c.case_id: {{"level": c.level, "planned": True}} for c in plan.planned}}
cases.update({{c.case_id: {{"level": c.level, "planned": False, "status": c.status}} for c in plan.decided}})
Path({path!r}).write_text(json.dumps(cases))
"""


class Run:
    """One run of the command, done once per test session: pytest-xdist workers share it on disk."""

    def __init__(self, report: Path) -> None:
        self.report = report
        outcome = json.loads((report / "outcome.json").read_text())
        self.returncode, self.output = outcome["returncode"], outcome["output"]
        self.data = json.loads((report / "conformance.json").read_text())
        self.cases = {case["case_id"]: case for case in self.data["cases"]}
        plan = report / "full-plan.json"
        #: With ``plan_full_run``: what the provider's full run would run, by case id.
        self.full_plan: dict[str, dict] | None = json.loads(plan.read_text()) if plan.is_file() else None

    @classmethod
    def once(
        cls, tmp_path_factory: pytest.TempPathFactory, name: str, *args: str, plan_full_run: str | None = None
    ) -> Run:
        """The run of ``args``; ``plan_full_run`` (a provider) also plans, in the same interpreter, the
        full run of that provider (``full_plan``) without running it."""
        shared = tmp_path_factory.getbasetemp()
        shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
        report = shared / "conformance-runs" / name
        report.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(report) + ".lock"):
            if not (report / "outcome.json").is_file():
                work_dir = conformance_command_work_dir(tmp_path_factory)
                argv = conformance_argv(report, *args, work_dir=work_dir)
                code = f"import sys; from optimum_ipu_backend.cli.main import main; sys.exit(main({argv!r}))"
                if plan_full_run is not None:
                    path = str(report / "full-plan.json")
                    report.mkdir(parents=True, exist_ok=True)
                    plan = _PLAN_FULL_RUN.format(provider=plan_full_run, work_dir=str(work_dir), path=path)
                    code = plan + code
                result = python(code, plugins=True)
                outcome = {"returncode": result.returncode, "output": result.stdout + result.stderr}
                (report / "outcome.json").write_text(json.dumps(outcome))
        return cls(report)
