"""The SDK test double on the path, the way the SDK's ``enable`` script puts the real one there.

``sdk_environment`` gives the variables a process needs to see the double (``PYTHONPATH``,
``POPLAR_SDK_ENABLED``) and the double's own controls (its configuration file and call log);
``use_sdk_double`` applies them to this process for the duration of a test module and restores them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

DOUBLE_DIR = Path(__file__).resolve().parent.parent / "sdk_double"
# The hardware IPUs the double shows the engine tests (conftest.py's ``sdk`` fixture).
IPUS = 4


def sdk_environment(directory: Path, sdk_dir: Path = DOUBLE_DIR, **config) -> dict[str, str]:
    """``sdk_dir``: the folder the enable script would put on the path (the double, or part of it)."""
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "double-config.json"
    config_path.write_text(json.dumps(config))
    return {
        "PYTHONPATH": str(sdk_dir),
        "POPLAR_SDK_ENABLED": str(sdk_dir),
        "POPART_DOUBLE_CONFIG": str(config_path),
        "POPART_DOUBLE_LOG": str(directory / "double-calls.jsonl"),
        # A worker without sessions stops at once, so tests see IPUs and processes released.
        "OPTIMUM_IPU_WORKER_IDLE_SECONDS": "0",
    }


def configure(environment: dict[str, str], **config) -> None:
    """Change the double's behaviour; it rereads the file on every call."""
    Path(environment["POPART_DOUBLE_CONFIG"]).write_text(json.dumps(config))


def call_log(environment: dict[str, str]) -> list[dict]:
    path = Path(environment["POPART_DOUBLE_LOG"])
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def calls(environment: dict[str, str], name: str) -> list[dict]:
    """The logged SDK calls named ``name``."""
    return [entry for entry in call_log(environment) if entry["call"] == name]


def clear_log(environment: dict[str, str]) -> None:
    Path(environment["POPART_DOUBLE_LOG"]).unlink(missing_ok=True)


@contextlib.contextmanager
def use_sdk_double(directory: Path, sdk_dir: Path = DOUBLE_DIR, **config) -> Iterator[dict[str, str]]:
    """This process sees the double (its probe finds ``popart``; workers it starts import it)."""
    from optimum_ipu_backend.engines.worker import shutdown_workers

    environment = sdk_environment(directory, sdk_dir, **config)
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    sys.path.insert(0, str(sdk_dir))
    try:
        yield environment
    finally:
        shutdown_workers()
        sys.path.remove(str(sdk_dir))
        # Modules of the double a test imported here stay in sys.modules, where find_spec (the engine
        # probe) would still find them: a later test in this process would see an SDK that is not there.
        for name, module in list(sys.modules.items()):
            if str(getattr(module, "__file__", None) or "").startswith(str(sdk_dir)):
                del sys.modules[name]
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def compile_offline(model_dir: Path, environment: dict[str, str], **options: str):
    """``optimum-ipu compile MODEL --offline --json`` for the popart engine on device ipu, in a new process
    seeing the double through ``environment``; returns the completed process."""
    from subprocess_env import python

    options = {"device": "ipu", "engine": "popart", **options}
    arguments = [f"--provider-option={key}={value}" for key, value in options.items()]
    return python(
        "import sys\nfrom optimum_ipu_backend.cli.main import main\n"
        f"sys.exit(main(['compile', {str(model_dir)!r}, '--offline', '--json', "
        f"'--dim', 'sequence_length=5', *{arguments!r}]))",
        env=environment,
    )
