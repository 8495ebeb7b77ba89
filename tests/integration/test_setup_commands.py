"""The README's set-up is two commands on a fresh machine (`make demo`, `make test`), each creating the
virtual environment when it is missing (checked with make's dry run, `make -n`, which prints what it
would execute), and `.ci/run` takes the README's steps by hand in a fresh environment, then runs the
README's test command, the one `make test` runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = [
    "python3 -m venv {venv}",
    "{venv}/bin/pip install torch==2.13.0",  # first, pinned: an unpinned torch pulls a CUDA build
    '{venv}/bin/pip install {editable}".[test]"',
    "{venv}/bin/pip check",
]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


# Under `make test` (how CI runs the suite) the outer make's state reaches this make: its level and flags
# (it would print "Entering directory" lines) and, in the environment, the variables set on its command
# line (.ci/run's `VENV=... EDITABLE=`). Run it as a top-level make with the Makefile's own defaults.
_OUTER_MAKE = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "PYTHON", "VENV", "EDITABLE")


def _dry_run(*args: str, env: dict[str, str] | None = None) -> list[str]:
    base = {name: value for name, value in os.environ.items() if name not in _OUTER_MAKE}
    result = subprocess.run(
        ["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, env={**base, **(env or {})}
    )
    assert result.returncode == 0, result.stderr
    return [" ".join(line.split()) for line in result.stdout.splitlines() if line.strip()]


def _setup(venv: Path, editable: str = "-e ") -> list[str]:
    return [step.format(venv=venv, editable=editable) for step in SETUP]


def test_the_readme_sets_up_with_two_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Two commands on a fresh machine\s+```bash\n(.*?)```", text, re.S)
    assert block, "the README has no 'Two commands on a fresh machine' section"
    commands = [
        line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()
    ]
    assert commands == ["make demo", "make test"]


def test_make_test_and_demo_create_the_environment_when_it_is_missing(tmp_path):
    venv = tmp_path / "venv"
    assert _dry_run("test", f"VENV={venv}") == [
        *_setup(venv),
        f"touch {venv}/.optimum-ipu-ready",
        f"{venv}/bin/python -m pytest -n 2",
    ]
    assert _dry_run("demo", f"VENV={venv}")[-1] == (
        f"OPTIMUM_IPU_DEVICE=emulator {venv}/bin/python examples/sentence_embeddings.py"
    )


def test_an_existing_environment_is_reused_until_pyproject_changes(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    ready = venv / ".optimum-ipu-ready"
    ready.touch()
    later = time.time() + 60
    os.utime(ready, (later, later))
    assert _dry_run("test", f"VENV={venv}") == [f"{venv}/bin/python -m pytest -n 2"]
    earlier = (ROOT / "pyproject.toml").stat().st_mtime - 60
    os.utime(ready, (earlier, earlier))
    assert _dry_run("test", f"VENV={venv}")[0] == f"python3 -m venv {venv}"


def _readme_block(heading: str) -> list[str]:
    """The commands of the first bash block under ``heading`` in the README, split at ``&&``."""
    text = (ROOT / "README.md").read_text()
    block = re.search(rf"{re.escape(heading)}.*?```bash\n(.*?)```", text, re.S)
    assert block, f"the README has no bash block after {heading!r}"
    return [part.strip() for line in block.group(1).splitlines() for part in line.split("&&") if part.strip()]


def _in_fresh_venv(command: str) -> str | None:
    """A README command as .ci/run gives it: with the fresh environment's programs instead of activating
    ``.venv``, and the package installed as a wheel (without ``-e``)."""
    if command == ". .venv/bin/activate":
        return None
    if command == "python3 -m venv .venv":
        return 'python3 -m venv "$venv"'
    program, _, arguments = command.partition(" ")
    assert program in ("pip", "python"), command
    return f'"$venv/bin/{program}" {arguments.replace("-e ", "")}'


def test_ci_runs_the_readme_set_up_in_a_fresh_environment_with_the_wheel_then_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    lines = [
        line.strip() for line in script.splitlines() if line.strip() and not line.strip().startswith("#")
    ]
    fresh = 'venv="$(mktemp -d)/venv"'  # a new temporary directory, never the checkout's .venv
    assert fresh in lines
    (test_command,) = _readme_block("## Tests")
    readme = [*_readme_block("The same steps by hand:"), test_command]
    expected = [command for command in map(_in_fresh_venv, readme) if command is not None]
    assert lines[lines.index(fresh) + 1 :] == expected
    assert (
        expected[-1] == '"$venv/bin/python" -m pytest -n 2'
        and '"$venv/bin/pip" install ".[test]"' in expected
    )
    # make test runs the same test command
    assert _dry_run("test", "VENV=/nonexistent/venv")[-1] == f"/nonexistent/venv/bin/{test_command}"
