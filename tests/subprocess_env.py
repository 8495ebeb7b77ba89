"""Run Python code in a fresh interpreter of the environment under test.

Activation is tested the way users get it: by the installed ``.pth`` file and entry points, never
by calling ``install()`` in the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

PLUGIN_SITE = Path(__file__).resolve().parent / "plugins" / "site"
SITE_PACKAGES = sysconfig.get_paths()["purelib"]


def _site_paths_without_pth_code() -> list[str]:
    """site-packages plus the plain directory lines of its .pth files (an editable install's source
    path), but none of their import lines: what ``-S`` loses, minus the activation under test."""
    paths = [SITE_PACKAGES]
    for pth in sorted(Path(SITE_PACKAGES).glob("*.pth")):
        for line in pth.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import ", "import\t")) and Path(line).is_dir():
                paths.append(line)
    return paths


def python(
    code: str,
    *,
    env: dict[str, str] | None = None,
    plugins: bool = False,
    no_site: bool = False,
    cwd: str | os.PathLike | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run ``code``; ``plugins`` adds the test-only provider distributions to the path, ``no_site`` runs
    with ``-S`` (no .pth processing) and puts site-packages on the path by hand."""
    # The test run's own cache and zoo locations carry over; settings under test do not.
    kept = ("OPTIMUM_IPU_CACHE", "OPTIMUM_IPU_TEST_ZOO")
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k in kept or not k.startswith(("OPTIMUM_IPU_", "OPTIMUM_PROVIDER"))
    }
    full_env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "default"})
    paths = []
    if plugins:
        paths.append(str(PLUGIN_SITE))
    if paths:
        full_env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        full_env.pop("PYTHONPATH", None)
    full_env.update(env or {})
    prelude = ""
    if no_site:
        prelude = f"import sys; sys.path.extend({_site_paths_without_pth_code()!r})\n"
    args = [sys.executable] + (["-S"] if no_site else []) + ["-c", prelude + textwrap.dedent(code)]
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or Path(__file__).parent.parent / "tests",
        timeout=timeout,
    )


def python_json(code: str, **kwargs) -> dict:
    """Run ``code``, which must print one JSON object as its last stdout line; fail with stderr otherwise."""
    result = python(code, **kwargs)
    if result.returncode != 0:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# Runs each check's code in turn, in its own globals as ``python -c`` would, and reports what a process of
# its own would have shown: its printed output, and for an exception the traceback and exit status 1.
_CHECKS_RUNNER = """
import contextlib, io, json, sys, traceback
results = {}
for name, code in json.loads(sys.argv[1]):
    printed = io.StringIO()
    status, error = 0, ""
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        status, error = 1, traceback.format_exc()
    results[name] = {"returncode": status, "stdout": printed.getvalue(), "stderr": error}
print(json.dumps(results))
"""


def python_checks(checks: dict[str, str], **kwargs) -> dict[str, subprocess.CompletedProcess]:
    """Run several checks, in order, in one fresh interpreter (what ``python`` takes, in ``kwargs``): for
    checks that need the same kind of interpreter and cannot interfere, one start-up (torch, transformers,
    optimum: seconds) instead of one each. Each check's result reads like ``python``'s: its stdout, and for
    an uncaught exception exit status 1 with the traceback as its stderr. Checks that set environment
    variables or test import order need an interpreter of their own."""
    argument = json.dumps([[name, textwrap.dedent(code)] for name, code in checks.items()])
    out = python_json(f"import sys; sys.argv = ['checks', {argument!r}]\n" + _CHECKS_RUNNER, **kwargs)
    return {
        name: subprocess.CompletedProcess(name, row["returncode"], row["stdout"], row["stderr"])
        for name, row in out.items()
    }
