"""The entry-point target for ``ipu``: a description only. The session code is imported on first use."""

from __future__ import annotations

from optimum_ipu_backend.engines.base import Availability
from optimum_ipu_backend.integration.discovery import ProviderSpec

IPU_PROVIDER = ProviderSpec(
    name="IPUExecutionProvider",
    aliases=("ipu",),
    session_factory="optimum_ipu_backend.session:create_session",
    probe="optimum_ipu_backend.integration.ipu_provider:probe",
    description="Graphcore IPU through PopART/PopTorch, with a host emulator for machines without one",
    # A dedicated accelerator the user installed a plugin for: ahead of onnxruntime's own (0).
    priority=10,
    # What the compiler takes: PopART's opset-11 table, every operator a rewrite lowers, and the few that
    # folding removes; the session's pre-check reads the same function.
    operator_table="optimum_ipu_backend.compiler.precheck:accepted_op_types",
)


def probe() -> Availability:
    """Can a session on the default device be created here, and would it run on IPU hardware?

    The host emulator and Graphcore's IPU Model simulator both compute on the host: usable when named,
    reported as emulated so that ``provider="auto"`` never takes them.
    """
    from optimum_ipu_backend.engines.probe import (
        DEVICE_KINDS,
        default_device,
        probe_sdk,
        provider_availability,
    )

    available, detail = provider_availability()
    if not available:
        return Availability(False, detail)
    device = default_device()
    kind = DEVICE_KINDS[device]
    if kind.needs_hardware and not probe_sdk().hardware_visible:
        # The SDK lists IPUs only when a session starts; a build host with the SDK and no IPU is common.
        return Availability(
            False,
            f"device 'ipu': {detail}, but no IPU is visible here (no /dev/ipu* device node, no IPUOF_* "
            "fabric configuration)",
        )
    if kind.host_emulation:
        return Availability(True, "the default device 'emulator' is the host emulator", emulated=True)
    if not kind.needs_hardware:
        return Availability(
            True,
            f"the default device {device!r} is Graphcore's IPU Model simulator on the host",
            emulated=True,
        )
    return Availability(True, f"device 'ipu': {detail}")
