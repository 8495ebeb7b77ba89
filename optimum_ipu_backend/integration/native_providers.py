"""onnxruntime's own execution providers: which of the installed ones compute on this machine, and why not.

``onnxruntime.get_available_providers()`` lists what the installed build *contains*, not what this
machine can run: a plain CPU wheel lists ``AzureExecutionProvider``, which forwards inference to a remote
endpoint, and ``onnxruntime-gpu`` lists ``CUDAExecutionProvider`` on a machine without a GPU, where a
session quietly runs on the CPU. ``provider="auto"`` takes a native provider only when this module can
confirm, cheaply (device nodes, the platform, onnxruntime's own device list), that its device is here.
A provider it cannot confirm is passed over with that reason; naming it explicitly still works.
"""

from __future__ import annotations

import glob
import sys
from dataclasses import dataclass

CPU = "CPUExecutionProvider"

# Never an automatic choice, whatever the machine has.
REMOTE = {
    "AzureExecutionProvider": (
        "forwards inference to a remote Azure endpoint; it does not compute on this machine"
    ),
}

# Providers whose default device is this machine's CPU: present wherever they are installed.
ON_HOST_CPU = frozenset(
    (
        CPU,
        "DnnlExecutionProvider",
        "XnnpackExecutionProvider",
        "OpenVINOExecutionProvider",  # its default device_type is CPU
        "ACLExecutionProvider",
        "ArmNNExecutionProvider",
    )
)


@dataclass(frozen=True)
class DeviceCheck:
    """How to see that an accelerator is present: device nodes (any glob matching) or a platform."""

    device: str
    node_globs: tuple[str, ...] = ()
    platform: str | None = None


DEVICE_CHECKS = {
    "CUDAExecutionProvider": DeviceCheck("an NVIDIA GPU", ("/dev/nvidia[0-9]*",)),
    "TensorrtExecutionProvider": DeviceCheck("an NVIDIA GPU", ("/dev/nvidia[0-9]*",)),
    "NvTensorRTRTXExecutionProvider": DeviceCheck("an NVIDIA GPU", ("/dev/nvidia[0-9]*",)),
    "ROCMExecutionProvider": DeviceCheck("an AMD GPU", ("/dev/kfd",)),
    "MIGraphXExecutionProvider": DeviceCheck("an AMD GPU", ("/dev/kfd",)),
    "CANNExecutionProvider": DeviceCheck("an Ascend NPU", ("/dev/davinci[0-9]*",)),
    "CoreMLExecutionProvider": DeviceCheck("Apple's Core ML", platform="darwin"),
}


@dataclass(frozen=True)
class NativeAvailability:
    name: str
    usable: bool
    reason: str


def available_providers() -> list[str]:
    """onnxruntime's installed providers, in the order onnxruntime prefers them."""
    import onnxruntime

    return list(onnxruntime.get_available_providers())


def _listed_devices() -> dict[str, list[str]]:
    """Provider name -> hardware device types onnxruntime itself reports (onnxruntime >= 1.22)."""
    try:
        import onnxruntime

        devices = onnxruntime.get_ep_devices()
    except Exception:  # older onnxruntime, or a build without device discovery
        return {}
    listed: dict[str, list[str]] = {}
    for ep_device in devices:
        kind = str(getattr(ep_device.device, "type", "")).rsplit(".", 1)[-1]
        listed.setdefault(ep_device.ep_name, []).append(kind)
    return listed


def _device_nodes(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern))


def native_availability(name: str, listed: dict[str, list[str]] | None = None) -> NativeAvailability:
    """Whether onnxruntime's provider ``name`` computes on this machine, with the reason."""
    if name in REMOTE:
        return NativeAvailability(name, False, f"{REMOTE[name]}; never chosen automatically")
    if name in ON_HOST_CPU:
        return NativeAvailability(name, True, "computes on this machine's CPU")
    listed = _listed_devices() if listed is None else listed
    kinds = [kind for kind in listed.get(name, ()) if kind != "CPU"]
    if kinds:
        return NativeAvailability(name, True, f"onnxruntime reports a {'/'.join(sorted(set(kinds)))} device")
    check = DEVICE_CHECKS.get(name)
    if check is None:
        return NativeAvailability(
            name,
            False,
            "its device cannot be confirmed cheaply (onnxruntime reports none for it); name it explicitly "
            f"with provider={name!r} to use it",
        )
    if check.platform is not None:
        if sys.platform == check.platform:
            return NativeAvailability(name, True, f"{check.device} is part of this platform ({sys.platform})")
        return NativeAvailability(name, False, f"needs {check.device}, which is on {check.platform} only")
    for pattern in check.node_globs:
        nodes = _device_nodes(pattern)
        if nodes:
            return NativeAvailability(name, True, f"{check.device} is present ({', '.join(nodes[:4])})")
    return NativeAvailability(
        name,
        False,
        f"needs {check.device}, and none is present (no {' or '.join(check.node_globs)}); onnxruntime would "
        "run its sessions on the CPU",
    )
