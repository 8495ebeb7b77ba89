"""Device faults of the Poplar SDK engines, as errors a user can act on.

The worker process classifies an SDK exception by its documented class and sends the class name,
message and kind across; ``device_fault`` turns that into one of the classes below with what happened
and what to try. The SDK's own message is kept in full and chained
as ``SdkError`` (the SDK's exception object itself lives in the worker process).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from optimum_ipu_backend.errors import DeviceError


class SdkError(DeviceError):
    """The SDK's exception as the worker reported it: ``sdk_type`` is its class (``popart_exception``,
    ``poplar_recoverable_runtime_error``, ``poptorch.Error``, ...)."""

    def __init__(self, sdk_type: str, message: str, details: str = "") -> None:
        super().__init__(f"{sdk_type}: {message}")
        self.sdk_type = sdk_type
        self.sdk_message = message
        self.details = details


class DeviceFaultError(DeviceError):
    """A Poplar SDK engine failed; the message says what happened and what to try."""


class DeviceAcquisitionError(DeviceFaultError):
    """The IPUs an executable needs could not be acquired."""


class IPUOutOfMemoryError(DeviceFaultError):
    """An executable does not fit in the memory of the IPUs it was compiled for."""


class DeviceResetError(DeviceFaultError):
    """The IPU reported a recoverable error that a reset and one retry did not clear, or whose
    recovery needs an operator (partition reset, power cycle)."""


class DeviceLostError(DeviceFaultError):
    """The IPU reported an unrecoverable error; its device was released."""


class SdkFailureError(DeviceFaultError):
    """Any other SDK error (an unsupported operator, a shape the SDK refuses, ...)."""


class WorkerError(DeviceFaultError):
    """The worker process that runs the SDK failed."""


class WorkerDiedError(WorkerError):
    """The worker process died; it is restarted on the next call."""


class CompileTimeoutError(WorkerError):
    """A compile took longer than ``compile_timeout``; the worker was stopped."""


_HINTS = {
    "acquisition": (
        DeviceAcquisitionError,
        "could not acquire {ipus} IPU(s) for {what}. Other processes may hold them (see `gc-monitor`), or "
        "the partition is smaller (see IPUOF_VIPU_API_PARTITION_ID / `vipu list partitions`). Free IPUs, "
        "lower replication_factor, or use device 'ipu-model' to run on Graphcore's simulator.",
    ),
    "out_of_memory": (
        IPUOutOfMemoryError,
        "{what} does not fit in the memory of {ipus} IPU(s). Check the estimate with `optimum-ipu check "
        "MODEL --dim name=size`, serve smaller buckets (sequence_lengths=..., batch_size=...), try "
        "precision='fp16', or give the model more IPUs.",
    ),
    "unrecoverable": (
        DeviceLostError,
        "the IPU running {what} reported an unrecoverable error. Its device was released and other "
        "executables on it were unloaded; the next call acquires a device again and reloads them. If it "
        "happens again, check the hardware with `gc-monitor` and your system administrator.",
    ),
    "recoverable": (
        DeviceResetError,
        "the IPU running {what} reported a recoverable error needing {action}, which {outcome}. The "
        "device was released; the next call acquires a device again.{operator}",
    ),
    "sdk": (
        SdkFailureError,
        "the Poplar SDK refused {what}. If an operator or shape is named above, check the model with "
        "`optimum-ipu check MODEL`; otherwise report it with the SDK's message.",
    ),
}


def device_fault(error: Mapping[str, Any], what: str, ipus: int) -> DeviceFaultError:
    """The actionable error for a fault the worker reported, with the SDK's error chained."""
    kind = error.get("kind", "sdk")
    cls, template = _HINTS.get(kind, _HINTS["sdk"])
    action = error.get("recovery_action") or "a reset"
    operator = (
        " This recovery needs an operator: reset the partition (`vipu reset partition`) or power-cycle."
        if action in ("PARTITION_RESET", "FULL_RESET")
        else ""
    )
    outcome = error.get("outcome", "did not clear it")
    message = template.format(what=what, ipus=ipus, action=action, outcome=outcome, operator=operator)
    fault = cls(f"{message}\nSDK error: {error['type']}: {error['message']}")
    fault.__cause__ = SdkError(error["type"], error["message"], error.get("traceback", ""))
    return fault
