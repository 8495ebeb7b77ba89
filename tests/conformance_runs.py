"""``optimum-ipu conformance`` runs, each done once per test session with the test-only provider
distributions on the path; pytest-xdist workers share them on disk. The conformance suite's tests and
the plugin tests read their reports.

The runs a module needs are made together (``Run.together``): one fresh interpreter of the installed
environment imports what every run needs (torch, transformers, optimum, onnxruntime: most of a run's
start-up), then forks one child per run, which runs the command with its output in a file of its own and
ends; no state of one run reaches another."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from filelock import FileLock
from model_zoo import conformance_command_work_dir, conformance_work_dir
from subprocess_env import python


def conformance_argv(report: Path, *args: str, work_dir: Path | None = None) -> list[str]:
    work_dir = conformance_work_dir() if work_dir is None else work_dir
    return ["conformance", *args, "--report", str(report), "--work-dir", str(work_dir), "--jobs", "1"]


#: The interpreter that makes the runs: the imports they share, then one forked child per job
#: (report directory, the command's arguments, the provider whose full run to plan or None).
_RUNNER = """
import json, os, sys, traceback
from pathlib import Path
import onnxruntime, optimum.onnxruntime, torch, transformers  # noqa: F401 - shared by every run
from optimum_ipu_backend.cli.main import main
from optimum_ipu_backend.conformance.runner import ConformanceRun, RunSettings


def plan_full_run(provider, work_dir, path):
    # The suite's own plan of the full run (it reads the case listing and runs nothing).
    plan = ConformanceRun.create(RunSettings(provider=provider, work_dir=work_dir)).plan()
    cases = {c.case_id: {"level": c.level, "planned": True} for c in plan.planned}
    cases.update({c.case_id: {"level": c.level, "planned": False, "status": c.status} for c in plan.decided})
    Path(path).write_text(json.dumps(cases))


def child(report, argv, plan_provider, work_dir):
    output = os.open(str(report / "output.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 1)
    os.dup2(output, 2)
    code = 1
    try:
        if plan_provider is not None:
            plan_full_run(plan_provider, work_dir, report / "full-plan.json")
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


for report, argv, plan_provider, work_dir in json.loads(sys.argv[1]):
    report = Path(report)
    report.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(report, argv, plan_provider, work_dir)
    _, status = os.waitpid(pid, 0)
    output = (report / "output.txt").read_text(errors="replace")
    outcome = {"returncode": os.waitstatus_to_exitcode(status), "output": output}
    (report / "outcome.json").write_text(json.dumps(outcome))
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
        """The run ``name`` of ``args``; ``plan_full_run`` (a provider) also plans, in the same process,
        the full run of that provider (``full_plan``) without running it."""
        return cls.together(tmp_path_factory, {name: (args, plan_full_run)})[name]

    @classmethod
    def together(
        cls,
        tmp_path_factory: pytest.TempPathFactory,
        runs: Mapping[str, tuple[Sequence[str], str | None]],
    ) -> dict[str, Run]:
        """The runs named in ``runs`` (name: the command's arguments, and the provider whose full run to
        plan or None); those no test of the session made yet are made in one interpreter."""
        shared = tmp_path_factory.getbasetemp()
        shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
        reports = {name: shared / "conformance-runs" / name for name in runs}
        (shared / "conformance-runs").mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as locks:
            for name in sorted(reports):  # one order for every worker: none waits on another's second lock
                locks.enter_context(FileLock(str(reports[name]) + ".lock"))
            missing = [name for name, report in reports.items() if not (report / "outcome.json").is_file()]
            if missing:
                work_dir = conformance_command_work_dir(tmp_path_factory)
                jobs = [
                    (
                        str(reports[name]),
                        conformance_argv(reports[name], *runs[name][0], work_dir=work_dir),
                        runs[name][1],
                        str(work_dir),
                    )
                    for name in missing
                ]
                result = python(
                    f"import sys\nsys.argv = ['runs', {json.dumps(jobs)!r}]\n{_RUNNER}",
                    plugins=True,
                    timeout=600 * len(jobs),
                )
                assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        return {name: cls(report) for name, report in reports.items()}


def run_fixture(name: str):
    """A session fixture of the run ``name`` of a module's ``runs`` fixture (its ``Run.together``)."""

    @pytest.fixture(scope="session")
    def run(runs: dict[str, Run]) -> Run:
        return runs[name]

    return run
