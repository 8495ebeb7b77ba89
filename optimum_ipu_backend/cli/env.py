"""``optimum-ipu env`` (also ``optimum-cli ipu env``): the report to paste into a bug report.

Optimum's own ``optimum-cli env`` report comes first, unchanged (it has no extension hook), then ours:
versions, whether the optimum-onnx patches are in place, the Poplar SDK, the Python its worker runs on
(with that interpreter's torch, popart and poptorch), the devices and why each can or cannot be used,
what ``provider="auto"`` would take, and the executable cache.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from typing import Any

# Seconds the SDK's Python may take to import popart and poptorch and report their versions.
WORKER_PYTHON_TIMEOUT = 60.0

# Run by the SDK's Python (3.8 or newer): its version and the versions of the SDK's modules, popart first
# (it must be imported before onnx). Printed as one JSON line.
_VERSIONS_CODE = """
import importlib, json, platform, sys
if sys.path and sys.path[0] == "":
    del sys.path[0]  # -c put the working directory there; the worker removes it too
found = {"python": sys.executable, "version": platform.python_version()}
for name in ("popart", "poptorch", "torch"):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == name
        found[name] = "not found" if missing else "cannot be imported: %s: %s" % (type(exc).__name__, exc)
        continue
    except Exception as exc:
        found[name] = "cannot be imported: %s: %s" % (type(exc).__name__, exc)
        continue
    version = getattr(module, "__version__", None)
    if version is None and hasattr(module, "versionString"):
        version = module.versionString()
    found[name] = str(version or "version unknown")
print(json.dumps(found))
"""


def add_env_parser(subparsers: Any) -> None:
    from optimum_ipu_backend.cli.providers import add_report_parser

    add_report_parser(subparsers, "env", run_env)


def optimum_report() -> tuple[dict[str, Any], str]:
    """What ``optimum-cli env`` reports, as its dict and its printed text."""
    from optimum.commands.env import EnvironmentCommand

    command = EnvironmentCommand(None, from_defaults_factory=True, parser=argparse.ArgumentParser())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        info = command.run()
    return dict(info), printed.getvalue()


def worker_python_report(python: str | None = None) -> dict[str, str]:
    """The Python the SDK's worker runs on (``python``, else ``OPTIMUM_IPU_SDK_PYTHON``, else this one),
    asked in a subprocess for its version and its popart, poptorch and torch versions ("not found" where
    missing)."""
    from optimum_ipu_backend.engines.probe import SDK_PYTHON_ENV, resolve_sdk_python
    from optimum_ipu_backend.errors import ConfigurationError

    source = "this interpreter"
    if python:
        source = "given"
    elif os.environ.get(SDK_PYTHON_ENV, "").strip():
        source = SDK_PYTHON_ENV
    try:
        path = resolve_sdk_python(python)
    except ConfigurationError as exc:
        return {"python": f"unusable: {exc}"}
    report = {"python": f"{path} ({source})"}
    try:
        completed = subprocess.run(
            [path, "-c", _VERSIONS_CODE],
            capture_output=True,
            text=True,
            timeout=WORKER_PYTHON_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {**report, "version": f"did not answer within {WORKER_PYTHON_TIMEOUT:g} s"}
    except OSError as exc:
        return {**report, "version": f"cannot be started: {exc}"}
    try:
        found = json.loads(completed.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (completed.stderr or completed.stdout).strip().splitlines()[-1:]
        return {**report, "version": f"did not answer (exit status {completed.returncode}: {' '.join(tail)})"}
    return {**report, **{name: str(found[name]) for name in ("version", "torch", "popart", "poptorch")}}


def backend_report() -> dict[str, Any]:
    """optimum-ipu-backend's part, as JSON data."""
    import importlib

    from optimum_ipu_backend import __version__, _bootstrap
    from optimum_ipu_backend.cli.providers import auto_report, ipu_devices
    from optimum_ipu_backend.conformance.reports import installed_version
    from optimum_ipu_backend.engines.probe import default_device, probe_sdk
    from optimum_ipu_backend.integration import patches
    from optimum_ipu_backend.runtime.executable_cache import ExecutableCache

    unimportable = {}
    for module in sorted(_bootstrap.TARGET_MODULES):  # so the report says whether each one got its patches
        try:
            importlib.import_module(module)
        except ImportError as exc:  # modeling_diffusion without diffusers: nothing there to patch
            unimportable[module] = f"cannot be imported here ({type(exc).__name__}: {exc})"
    sdk = probe_sdk()
    auto = auto_report()
    return {
        "optimum-ipu-backend version": __version__,
        "optimum-onnx version": installed_version("optimum-onnx"),
        "optimum-onnx range the patches were checked against": patches.SUPPORTED_OPTIMUM_ONNX,
        "optimum-onnx within that range": patches.optimum_onnx_supported(),
        "onnxruntime version": installed_version("onnxruntime"),
        "onnx version": installed_version("onnx"),
        "activation hook installed": _bootstrap.is_installed(),
        "patches": {**patches.patch_report(), **unimportable},
        "Poplar SDK found": sdk.sdk_found,
        "Poplar SDK probe": sdk.lines(),
        "Python running the SDK worker": worker_python_report(),
        "default IPU device": default_device(),
        "IPU devices": {
            row["device"]: ("usable: " if row["usable"] else "not usable: ") + row["why"]
            for row in ipu_devices()
        },
        "provider='auto' takes": auto["chosen"] or f"nothing: {auto['error']}",
        "executable cache": ExecutableCache().info(),
    }


def _format(report: dict[str, Any]) -> str:
    from optimum_ipu_backend.runtime.executable_cache import format_byte_size

    lines = []
    for key, value in report.items():
        if key == "executable cache":
            lines.append(
                f"- executable cache: {value['root']} ({value['root_source']}), {value['entries']} entries, "
                f"{format_byte_size(value['total_bytes'])} of {format_byte_size(value['size_limit_bytes'])}"
            )
        elif isinstance(value, dict):
            lines.append(f"- {key}:")
            lines.extend(f"  - {name}: {item}" for name, item in value.items())
        elif isinstance(value, list):
            lines.append(f"- {key}:")
            lines.extend(f"  - {item}" for item in value)
        else:
            lines.append(f"- {key}: {value}")
    return "\n".join(lines) + "\n"


def run_env(args: argparse.Namespace) -> int:
    optimum_info, optimum_text = optimum_report()
    ours = backend_report()
    if args.json:
        json.dump({"optimum": optimum_info, "optimum-ipu-backend": ours}, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(optimum_text)
    sys.stdout.write("optimum-ipu-backend:\n\n")
    sys.stdout.write(_format(ours))
    return 0
