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


def _module_origin(name: str) -> str | None:
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
        popart=_module_origin("popart"),
        poptorch=_module_origin("poptorch"),
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
    """Pick the engine for ``device`` or raise ``DeviceUnavailableError`` saying what was found."""
    device = check_device_name(device or default_device())
    if device == "emulator":
        if engine not in (None, "emulator"):
            raise ValueError(f"device 'emulator' runs on the 'emulator' engine, not {engine!r}")
        return DeviceResolution(
            "emulator", "emulator", True, f"device 'emulator' was asked for: {EMULATION_NOTICE}"
        )
    if engine == "emulator":
        raise ValueError(f"engine 'emulator' only serves device 'emulator', not {device!r}")

    probe = probe_sdk()
    found = "; ".join(probe.lines())
    if not probe.sdk_found:
        raise DeviceUnavailableError(
            f"device {device!r} needs Graphcore's Poplar SDK (PopART or PopTorch), which was not found. "
            f"Probed: {found}. Enable the SDK (source <sdk>/enable) in this environment, or ask for "
            f"another device. {OPT_IN_HINT}"
        )
    if device == "ipu" and not probe.hardware_visible:
        raise DeviceUnavailableError(
            f"device 'ipu' needs IPU hardware, and none is visible. Probed: {found}. Use device "
            f"'ipu-model' for Graphcore's IPU Model simulator (needs the SDK), or: {OPT_IN_HINT}"
        )
    chosen = engine or ("popart" if probe.popart else "poptorch")
    from optimum_ipu_backend.engines import ENGINES

    if chosen not in ENGINES:
        raise DeviceUnavailableError(
            f"the Poplar SDK was found ({found}), but the {chosen!r} engine that device {device!r} needs is "
            f"not part of this release of optimum-ipu-backend. {OPT_IN_HINT}"
        )
    return DeviceResolution(device, chosen, False, f"Poplar SDK found; engine {chosen!r}")


def provider_availability() -> tuple[bool, str]:
    """The discovery probe: can a session with the default device be created here?"""
    try:
        resolution = resolve_device()
    except (DeviceUnavailableError, ValueError) as exc:
        return False, f"{exc}"
    return True, resolution.reason
