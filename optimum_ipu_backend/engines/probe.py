"""Which device and engine a session gets, and why; which Python runs the Poplar SDK.

The probe is cheap (``importlib.util.find_spec``, environment variables, device nodes): it never
imports the Poplar SDK, because ``import popart`` must precede ``import onnx`` and may be slow.

The SDK runs in a worker process (``engines.worker``) on the interpreter ``resolve_sdk_python`` names:
the provider option ``sdk_python``, else ``OPTIMUM_IPU_SDK_PYTHON``, else this interpreter. PopTorch 3.4
pins torch 2.0.1 and PopART's extension is built for the SDK's own CPython, so the SDK often cannot share
the user's interpreter. When the SDK's Python is another interpreter, the probe asks that interpreter
where it finds the SDK's modules (one short subprocess, remembered), still without importing them.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache

from optimum_ipu_backend.engines.base import EngineUnavailableError
from optimum_ipu_backend.errors import ConfigurationError


@dataclass(frozen=True)
class DeviceKind:
    """One kind of device a session runs on, and what it means: the one place device names are compared."""

    name: str
    #: onnxruntime computes on this machine's CPU from the exact graph the IPU would get (not IPU results)
    host_emulation: bool
    #: Graphcore's IPU Model: the Poplar SDK simulates an IPU on the host
    simulated: bool
    #: needs IPU hardware attached (device nodes or an IPU-over-fabric partition)
    needs_hardware: bool


class _DeviceKinds(dict):
    """Device kinds by name; an unknown name is a ``ValueError`` naming the kinds and where to set one."""

    def __missing__(self, name: str) -> DeviceKind:
        raise ValueError(
            f"device {name!r} is not one of {', '.join(self)} (set it with provider_options="
            f"{{'device': ...}} or {DEVICE_ENV})"
        )


DEVICE_ENV = "OPTIMUM_IPU_DEVICE"
DEFAULT_DEVICE = "ipu"
DEVICE_KINDS = _DeviceKinds(
    (kind.name, kind)
    for kind in (
        DeviceKind("ipu", host_emulation=False, simulated=False, needs_hardware=True),
        DeviceKind("ipu-model", host_emulation=False, simulated=True, needs_hardware=False),
        DeviceKind("emulator", host_emulation=True, simulated=False, needs_hardware=False),
    )
)


def default_device() -> str:
    """The device a session gets when none is named: ``OPTIMUM_IPU_DEVICE``, else ``ipu``."""
    return os.environ.get(DEVICE_ENV, "").strip() or DEFAULT_DEVICE


EMULATION_NOTICE = (
    "host emulation: outputs are computed by onnxruntime on this machine's CPU from the exact graph "
    "the IPU would get; they are not IPU results and say nothing about IPU speed or memory"
)
OPT_IN_HINT = (
    "To check your pipeline without an IPU, opt into host emulation with "
    "provider_options={'device': 'emulator'} or the environment variable OPTIMUM_IPU_DEVICE=emulator."
)


# The Python interpreter that runs the SDK's worker process: provider option, then environment variable.
SDK_PYTHON_OPTION = "sdk_python"
SDK_PYTHON_ENV = "OPTIMUM_IPU_SDK_PYTHON"
# The SDK's Python modules the probe looks for.
SDK_MODULES = ("popart", "poptorch")
# Seconds the SDK's Python may take to say where it finds the SDK's modules.
_PROBE_TIMEOUT = 30.0


class DeviceUnavailableError(EngineUnavailableError):
    """The requested device cannot be used here; the message says what was probed."""


def resolve_sdk_python(value: str | os.PathLike | None = None) -> str:
    """The absolute path of the interpreter that runs the SDK worker: ``value`` (the provider option
    ``sdk_python``), else ``OPTIMUM_IPU_SDK_PYTHON``, else this interpreter. A bare name (``python3.8``)
    is looked up on ``PATH``; a path that is no executable file raises ``ConfigurationError`` naming the
    option and the variable. Symbolic links are kept: a virtual environment's ``bin/python`` links to its
    base interpreter but has other packages."""
    if value is not None and str(value).strip():
        given, source = str(value).strip(), f"provider option {SDK_PYTHON_OPTION!r}"
    elif os.environ.get(SDK_PYTHON_ENV, "").strip():
        given, source = os.environ[SDK_PYTHON_ENV].strip(), f"environment variable {SDK_PYTHON_ENV}"
    else:
        return sys.executable
    path = given if os.sep in given else (shutil.which(given) or given)
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        problem = "does not exist" if not os.path.exists(path) else "is not an executable file"
        raise ConfigurationError(
            f"{source}={given!r}: {path} {problem}. The {SDK_PYTHON_OPTION!r} provider option (or "
            f"{SDK_PYTHON_ENV}) names the Python interpreter that runs the Poplar SDK, for example the "
            "python of the virtual environment holding the SDK's PopTorch wheel; leave both unset to use "
            "this interpreter"
        )
    return path


def _is_this_interpreter(python: str) -> bool:
    return os.path.abspath(python) == os.path.abspath(sys.executable)


# The sdk_python option resolve_device is probing for; module_origin reads it, so that the engines' probes
# (``module_origin("popart")``) look where the worker will run.
_probed_python: ContextVar[str | None] = ContextVar("probed_python", default=None)


@contextlib.contextmanager
def probing_python(python: str | None) -> Iterator[None]:
    """Within the block, ``module_origin`` looks for modules in ``resolve_sdk_python(python)``."""
    token = _probed_python.set(python)
    try:
        yield
    finally:
        _probed_python.reset(token)


@dataclass(frozen=True)
class SdkProbe:
    popart: str | None
    poptorch: str | None
    sdk_enabled: str | None
    device_nodes: tuple[str, ...]
    fabric_config: str | None
    python: str | None = None  # the interpreter the modules were looked for in (None: this one)
    python_problem: str | None = None  # why sdk_python / OPTIMUM_IPU_SDK_PYTHON cannot be used

    @property
    def sdk_found(self) -> bool:
        return self.popart is not None or self.poptorch is not None

    @property
    def hardware_visible(self) -> bool:
        return bool(self.device_nodes) or self.fabric_config is not None

    def lines(self) -> list[str]:
        where = "" if self.python is None else f" (in {self.python})"
        python = self.python_problem or self.python or f"{sys.executable} (this interpreter)"
        return [
            f"Python running the SDK ({SDK_PYTHON_OPTION} / {SDK_PYTHON_ENV}): {python}",
            f"Python module popart{where}: {self.popart or 'not found'}",
            f"Python module poptorch{where}: {self.poptorch or 'not found'}",
            f"POPLAR_SDK_ENABLED: {self.sdk_enabled or 'unset'}",
            f"IPU device nodes (/dev/ipu*): {', '.join(self.device_nodes) or 'none'}",
            f"IPU-over-fabric configuration (IPUOF_*): {self.fabric_config or 'none'}",
        ]


def _origin_here(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin or "found"


# Run by another interpreter (Python 3.8 or newer): where it finds each module, without importing it.
_ORIGINS_CODE = """
import importlib.util, json, sys
if sys.path and sys.path[0] == "":
    del sys.path[0]  # -c put the working directory there; the worker removes it too
found = {}
for name in sys.argv[1:]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    found[name] = None if spec is None else (spec.origin or "found")
print(json.dumps(found))
"""


@lru_cache(maxsize=None)
def _origins_in(python: str, pythonpath: str) -> dict[str, str | None]:
    """Where ``python`` finds the SDK's modules; ``pythonpath`` (the SDK's enable script sets it) is
    part of the cache key only."""
    try:
        completed = subprocess.run(
            [python, "-c", _ORIGINS_CODE, *SDK_MODULES],
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
        found = json.loads(completed.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {name: None for name in SDK_MODULES}
    return {name: found.get(name) for name in SDK_MODULES}


def module_origin(name: str, python: str | None = None) -> str | None:
    """Where the SDK's Python finds module ``name`` (None: not found): ``python``, else the interpreter
    ``resolve_device`` is probing for, else ``resolve_sdk_python()``. In this interpreter it is
    ``importlib.util.find_spec``; another interpreter is asked once in a subprocess."""
    python = resolve_sdk_python(python or _probed_python.get())
    if _is_this_interpreter(python):
        return _origin_here(name)
    if name not in SDK_MODULES:
        raise ValueError(f"module_origin looks in another interpreter only for {', '.join(SDK_MODULES)}")
    return _origins_in(python, os.environ.get("PYTHONPATH", ""))[name]


def probe_sdk(python: str | None = None) -> SdkProbe:
    """What this machine shows of the SDK, looking for its modules in ``resolve_sdk_python(python)``."""
    fabric = os.environ.get("IPUOF_CONFIG_PATH") or os.environ.get("IPUOF_VIPU_API_PARTITION_ID")
    try:
        resolved: str | None = resolve_sdk_python(python or _probed_python.get())
        problem = None
    except ConfigurationError as exc:  # the probe reports, never raises
        resolved, problem = None, str(exc)
    return SdkProbe(
        popart=None if resolved is None else module_origin("popart", resolved),
        poptorch=None if resolved is None else module_origin("poptorch", resolved),
        sdk_enabled=os.environ.get("POPLAR_SDK_ENABLED"),
        device_nodes=tuple(sorted(p for p in glob.glob("/dev/ipu[0-9]*") if not p.endswith(("_ex", "_mem")))),
        fabric_config=fabric,
        python=None if resolved is None or _is_this_interpreter(resolved) else resolved,
        python_problem=problem,
    )


@dataclass(frozen=True)
class DeviceResolution:
    device: str
    engine: str
    emulated: bool
    reason: str


def resolve_device(device: str, engine: str | None = None, sdk_python: str | None = None) -> DeviceResolution:
    """Pick the engine for ``device`` from the registry (``engines.ENGINE_CLASSES``): the given one, or the
    available engine of highest priority. ``DeviceUnavailableError`` says what each probe found.

    Probes are cheap and import no SDK; whether IPUs exist is asked of the SDK itself when the engine
    starts (``DeviceManager().enumerateDevices()`` in its worker process). The SDK's modules are looked
    for in the interpreter ``sdk_python`` (the provider option; default: ``OPTIMUM_IPU_SDK_PYTHON``, else
    this interpreter)."""
    device = DEVICE_KINDS[device].name
    with probing_python(sdk_python):
        return _resolve(device, engine)


def _resolve(device: str, engine: str | None) -> DeviceResolution:
    from optimum_ipu_backend.engines import engine_class, engine_classes

    if engine is not None:
        chosen = engine_class(engine)
        if device not in chosen.devices:
            raise ValueError(
                f"engine {engine!r} serves device(s) {', '.join(chosen.devices)}, not {device!r}"
            )
        candidates = [chosen]
    else:
        candidates = [cls for cls in engine_classes() if device in cls.devices]
    reasons = []
    for cls in candidates:
        availability = cls.probe()
        if availability.available:
            emulated = DEVICE_KINDS[device].host_emulation
            return DeviceResolution(device, cls.name, emulated, availability.detail)
        reasons.append(f"engine {cls.name!r}: {availability.detail}")
    probe = probe_sdk()
    hint = (
        "Enable the SDK (source <sdk>/enable) in this environment, or ask for another device. "
        if not probe.sdk_found
        else ""
    )
    raise DeviceUnavailableError(
        f"device {device!r} cannot be used here: {'; '.join(reasons)}. Probed: {'; '.join(probe.lines())}. "
        f"{hint}{OPT_IN_HINT}"
    )


def provider_availability() -> tuple[bool, str]:
    """The discovery probe: can a session with the default device be created here?"""
    try:
        resolution = resolve_device(default_device())
    except (DeviceUnavailableError, ValueError) as exc:
        return False, f"{exc}"
    return True, resolution.reason
