"""Which device and engine a session gets, and why.

The probe is cheap (``importlib.util.find_spec``, environment variables, device nodes): it never
imports the Poplar SDK, because ``import popart`` must precede ``import onnx`` and may be slow.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

from optimum_ipu_backend.engines.base import EngineUnavailableError

DEVICES = ("ipu", "ipu-model", "emulator")
DEVICE_ENV = "OPTIMUM_IPU_DEVICE"
DEFAULT_DEVICE = "ipu"

EMULATION_NOTICE = (
    "host emulation: outputs are computed by onnxruntime on this machine's CPU from the exact graph "
    "the IPU would get; they are not IPU results and say nothing about IPU speed or memory"
)
OPT_IN_HINT = (
    "To check your pipeline without an IPU, opt into host emulation with "
    "provider_options={'device': 'emulator'} or the environment variable OPTIMUM_IPU_DEVICE=emulator."
)


class DeviceUnavailableError(EngineUnavailableError):
    """The requested device cannot be used here; the message says what was probed."""


@dataclass(frozen=True)
class SdkProbe:
    popart: str | None
    poptorch: str | None
    sdk_enabled: str | None
    device_nodes: tuple[str, ...]
    fabric_config: str | None

    @property
    def sdk_found(self) -> bool:
        return self.popart is not None or self.poptorch is not None

    @property
    def hardware_visible(self) -> bool:
        return bool(self.device_nodes) or self.fabric_config is not None

    def lines(self) -> list[str]:
        return [
            f"Python module popart: {self.popart or 'not found'}",
            f"Python module poptorch: {self.poptorch or 'not found'}",
            f"POPLAR_SDK_ENABLED: {self.sdk_enabled or 'unset'}",
            f"IPU device nodes (/dev/ipu*): {', '.join(self.device_nodes) or 'none'}",
            f"IPU-over-fabric configuration (IPUOF_*): {self.fabric_config or 'none'}",
        ]


def module_origin(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return spec.origin or "found"


def probe_sdk() -> SdkProbe:
    fabric = os.environ.get("IPUOF_CONFIG_PATH") or os.environ.get("IPUOF_VIPU_API_PARTITION_ID")
    return SdkProbe(
        popart=module_origin("popart"),
        poptorch=module_origin("poptorch"),
        sdk_enabled=os.environ.get("POPLAR_SDK_ENABLED"),
        device_nodes=tuple(sorted(p for p in glob.glob("/dev/ipu[0-9]*") if not p.endswith(("_ex", "_mem")))),
        fabric_config=fabric,
    )


@dataclass(frozen=True)
class DeviceResolution:
    device: str
    engine: str
    emulated: bool
    reason: str


def default_device() -> str:
    return os.environ.get(DEVICE_ENV, "").strip() or DEFAULT_DEVICE


def check_device_name(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(
            f"device {device!r} is not one of {', '.join(DEVICES)} (set it with provider_options="
            f"{{'device': ...}} or {DEVICE_ENV})"
        )
    return device


def resolve_device(device: str | None = None, engine: str | None = None) -> DeviceResolution:
    """Pick the engine for ``device`` from the registry (``engines.ENGINE_CLASSES``): the given one, or the
    available engine of highest priority. ``DeviceUnavailableError`` says what each probe found.

    Probes are cheap and import no SDK; whether IPUs exist is asked of the SDK itself when the engine
    starts (``DeviceManager().enumerateDevices()`` in its worker process)."""
    from optimum_ipu_backend.engines import engine_class, engine_classes

    device = check_device_name(device or default_device())
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
            return DeviceResolution(device, cls.name, cls.emulated, availability.reason)
        reasons.append(f"engine {cls.name!r}: {availability.reason}")
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
        resolution = resolve_device()
    except (DeviceUnavailableError, ValueError) as exc:
        return False, f"{exc}"
    return True, resolution.reason
