"""The worker side of ``engines.worker``: serves build/run/release requests with an SDK backend.

It runs in the worker process after the SDK was imported, on the SDK's Python (3.8 or newer; see
``engines.worker``). The SDK-specific calls live in the backend (``engines.popart.PopARTBackend``,
``engines.poptorch.PopTorchBackend``); what is common to both is here: device residency, fault
containment and the shared-memory buffers.

Residency. An IPU holds one loaded executable at a time. Executables go to IPUs acquired for them while
the system has free ones, and share the least-used acquired device of the same size when it has none
(the IPU Model and offline targets are never short: each executable gets its own). Running an executable
that is not the one loaded on its device reloads it there: a *switch*, counted and reported to the host.
The runtime runs a call's device steps executable by executable, so one call switches at most once per
executable it uses.

Carried state (``engines.base.state_updates``). An executable whose graph keeps tensors on the device
reports them as ``state``; ``write_state`` uploads new values through shared-memory buffers made at build,
like the inputs. Each executable counts the events after which its device state may no longer be what its
runs left: a load onto its device (a switch), a reset. The count (``epoch``) comes back with every run and
write, and the host adds the rebuilds it does itself; PopTorch's detach and attach put the host copy of
every buffer back on the device, and PopART's engine reload leaves variables to the next
``weightsFromHost``.

Faults. A recoverable runtime error whose recovery is an IPU or link reset is retried once after the
reset; any other device fault releases the device, unloading every executable on it; their next run
builds them again. The process keeps serving.
"""

from __future__ import annotations

import importlib
import itertools
import os
import platform
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

import numpy as np

from optimum_ipu_backend.engines.base import CompileOptions, EngineContractError
from optimum_ipu_backend.engines.probe import DEVICE_KINDS
from optimum_ipu_backend.engines.worker import create_buffer, map_buffer
from optimum_ipu_backend.errors import InstallationError

RESETTABLE = ("IPU_RESET", "LINK_RESET")


class Built(Protocol):
    """A backend's executable: its tensors as plain specs (``{"name", "shape", "dtype"}``, the dtype a numpy
    name) and the device it went to, in words. ``state``, the tensors it keeps on the device between runs
    (``engines.base.state_updates``), may be absent: read with ``state_specs``."""

    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    device_label: str


BuiltT = TypeVar("BuiltT", bound=Built)


class Backend(Protocol[BuiltT]):
    """What an SDK implements inside the worker process (``PopARTBackend``, ``PopTorchBackend``); the
    ``Server`` below does residency and faults. The constructor takes no arguments and imports the SDK.
    ``hello`` reports ``sdk_version``, ``ipus`` and ``ipu_version``; ``open_device`` gives a device handle,
    or None when not ``required`` and none is free; ``build`` compiles a graph for a handle (loading it
    unless offline, artifacts into ``artifacts``); ``run`` reads ``inputs`` and writes ``outputs`` in place;
    ``write_state`` uploads new values of some of the executable's ``state`` (arrays shaped as its specs
    say) to the device it is loaded on, for the next run to read;
    ``load``/``unload`` move an executable on or off its device; ``reset`` is the documented recovery of
    a recoverable error; ``classify`` gives ``{"kind": ...}`` for an SDK exception, None for others."""

    def hello(self) -> dict[str, Any]: ...

    def open_device(
        self, device: str, ipus: int, offline: bool, ipu_version: str, options: dict, required: bool
    ) -> Any: ...

    def close_device(self, handle: Any) -> None: ...

    def build(
        self, graph: str, artifacts: str | None, options: dict, device: Any, device_name: str, offline: bool
    ) -> BuiltT: ...

    def run(self, built: BuiltT, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None: ...

    def write_state(self, built: BuiltT, values: dict[str, np.ndarray]) -> None:
        # backends subclass this protocol, so this body is what one without carried state inherits
        raise EngineContractError(f"the {type(self).__name__} keeps no state on the device")

    def load(self, built: BuiltT) -> None: ...

    def unload(self, built: BuiltT) -> None: ...

    def reset(self, built: BuiltT) -> None: ...

    def release(self, built: BuiltT) -> None: ...

    def classify(self, exc: BaseException) -> dict[str, Any] | None: ...


def state_specs(built: Built) -> list[dict[str, Any]]:
    """The state a backend's executable keeps on the device (none for a backend that models none)."""
    return list(getattr(built, "state", None) or [])


def recovery_action_name(action: Any) -> str:
    """The bare name ("IPU_RESET") of the recovery action an SDK error carries, as ``RESETTABLE`` holds
    them. PopTorch gives Poplar's string; PopART a pybind11 enum, which has a ``name`` property from
    pybind11 2.3 on (a method where ``__str__`` was redefined) and otherwise only ``str()``,
    ``"RecoveryAction.IPU_RESET"``."""
    name = getattr(action, "name", None)
    if callable(name):
        name = name()
    text = name if isinstance(name, str) and name else str(action)
    return text.strip().rsplit(".", 1)[-1]


class _Fault(Exception):
    """A classified fault to report, with the SDK's exception as its cause."""

    def __init__(self, kind: str, cause: BaseException, **extra: Any) -> None:
        super().__init__(str(cause))
        self.kind, self.cause, self.extra = kind, cause, extra


@dataclass
class _Slot:
    handle: Any
    ipus: int
    shareable: bool
    resident: int | None = None
    members: set[int] = field(default_factory=set)


@dataclass
class _Executable:
    built: Built
    slot: _Slot
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    mappings: list = field(default_factory=list)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    # Loads and resets since the build: each may have replaced the device state (see the module's notes).
    epoch: int = 0


class Server:
    def __init__(self, backend: Backend[Any]) -> None:
        self.backend = backend
        self.slots: list[_Slot] = []
        self.executables: dict[int, _Executable] = {}
        self._ids = itertools.count(1)

    # -- devices -------------------------------------------------------------------------------------

    def _slot_for(self, device: str, ipus: int, offline: bool, ipu_version: str, options: dict) -> _Slot:
        open_device = self.backend.open_device
        if offline or not DEVICE_KINDS[device].needs_hardware:
            handle = open_device(device, ipus, offline, ipu_version, options, required=True)
            return self._add_slot(handle, ipus, shareable=False)
        shared = [slot for slot in self.slots if slot.shareable and slot.ipus == ipus]
        groups = options.get("device_groups")
        if groups is not None and len(shared) >= groups:  # the session holds no more IPU groups
            return min(shared, key=lambda slot: len(slot.members))
        handle = open_device(device, ipus, offline, ipu_version, options, required=False)
        if handle is not None:
            return self._add_slot(handle, ipus, shareable=True)
        if shared:
            return min(shared, key=lambda slot: len(slot.members))
        handle = open_device(device, ipus, offline, ipu_version, options, required=True)  # raises
        return self._add_slot(handle, ipus, shareable=True)

    def _add_slot(self, handle: Any, ipus: int, shareable: bool) -> _Slot:
        slot = _Slot(handle, ipus, shareable)
        self.slots.append(slot)
        return slot

    def _drop_slot(self, slot: _Slot) -> None:
        """Unload everything on ``slot`` and release its device."""
        for executable_id in list(slot.members):
            executable = self.executables.pop(executable_id, None)
            if executable is not None:
                self.backend.release(executable.built)
        slot.members.clear()
        if slot in self.slots:
            self.slots.remove(slot)
        try:
            self.backend.close_device(slot.handle)
        except Exception as exc:  # a lost device may refuse to detach; it is dropped all the same
            print(f"releasing a device failed: {exc!r}", flush=True)

    def _make_resident(self, executable_id: int, executable: _Executable) -> bool:
        slot = executable.slot
        if slot.resident == executable_id:
            return False
        if slot.resident is not None and slot.resident in self.executables:
            self.backend.unload(self.executables[slot.resident].built)
        slot.resident = None
        executable.epoch += 1  # counted before the load: a load that fails half way lost the state too
        self.backend.load(executable.built)
        slot.resident = executable_id
        return True

    # -- requests ------------------------------------------------------------------------------------

    def op_hello(self) -> dict[str, Any]:
        return {
            **self.backend.hello(),
            "pid": os.getpid(),
            "python": sys.executable,
            "python_version": platform.python_version(),
        }

    def op_build(
        self, graph: str, artifacts: str | None, device: str, offline: bool, ipu_version: str, options: dict
    ) -> dict[str, Any]:
        # Exactly the IPUs asked for, counted as the client's fault messages count them: the configuration
        # refused counts the SDK cannot take (runtime.ipu_config); rounding up would change the graph.
        ipus = CompileOptions(replicas=options["replicas"], ipus_per_replica=options["ipus_per_replica"]).ipus
        try:
            slot = self._slot_for(device, ipus, offline, ipu_version, options)
        except Exception as exc:
            raise self._classified(exc, default="acquisition") from exc
        if slot.resident is not None and slot.resident in self.executables:
            self.backend.unload(self.executables[slot.resident].built)
            slot.resident = None
        try:
            built = self.backend.build(graph, artifacts, options, slot.handle, device, offline)
        except Exception as exc:
            if not slot.members:
                self._drop_slot(slot)
            raise self._classified(exc) from exc
        executable_id = next(self._ids)
        slot.members.add(executable_id)
        if not offline:
            slot.resident = executable_id
        steps = (options["device_iterations"], options["replicas"])
        reply: dict[str, Any] = {
            "executable": executable_id,
            "inputs": built.inputs,
            "outputs": built.outputs,
            "offline": offline,
            "device": built.device_label,
            "state": state_specs(built),
            "epoch": 0,
            "input_buffers": [],
            "output_buffers": [],
            "state_buffers": [],
        }
        arrays: dict[str, dict[str, np.ndarray]] = {
            "input_buffers": {},
            "output_buffers": {},
            "state_buffers": {},
        }
        mappings = []
        for kind, specs in (
            ("input_buffers", built.inputs),
            ("output_buffers", built.outputs),
            ("state_buffers", reply["state"]),
        ):
            for spec in specs:
                # one step's buffers for inputs and outputs; the state is one copy per executable
                shape = tuple(spec["shape"]) if kind == "state_buffers" else (*steps, *spec["shape"])
                path = create_buffer(shape, np.dtype(spec["dtype"]))
                mapping, array = map_buffer(path, shape, np.dtype(spec["dtype"]))
                mappings.append(mapping)
                arrays[kind][spec["name"]] = array
                reply[kind].append(
                    {"name": spec["name"], "path": path, "shape": shape, "dtype": spec["dtype"]}
                )
        self.executables[executable_id] = _Executable(
            built, slot, arrays["input_buffers"], arrays["output_buffers"], mappings, arrays["state_buffers"]
        )
        return reply

    def op_run(self, executable: int) -> dict[str, Any]:
        def run(entry: _Executable) -> None:
            self.backend.run(entry.built, entry.inputs, entry.outputs)

        return self._on_device(executable, run)

    def op_load(self, executable: int) -> dict[str, Any]:
        """Make the executable resident on its device (the serving plan swaps a new one in)."""
        return self._on_device(executable, lambda entry: None)

    def op_write_state(self, executable: int, names: list[str]) -> dict[str, Any]:
        """Upload the values the host put in the state buffers named ``names``."""

        def write(entry: _Executable) -> None:
            unknown = [name for name in names if name not in entry.state]
            if unknown:
                raise EngineContractError(f"{unknown[0]!r} is not state this executable keeps")
            self.backend.write_state(entry.built, {name: entry.state[name] for name in names})

        return self._on_device(executable, write)

    def _on_device(self, executable: int, action: Any) -> dict[str, Any]:
        """Load the executable if another is loaded on its device, then ``action(entry)``; a recoverable
        error whose recovery is a reset is retried once after the reset."""
        entry = self.executables.get(executable)
        if entry is None:
            raise _Fault("lost", RuntimeError("the executable was unloaded with its device"))
        try:
            switched = self._make_resident(executable, entry)
        except Exception as exc:
            raise self._fault_on_device(entry, exc) from exc
        started = time.perf_counter()
        recovered = None
        try:
            action(entry)
        except Exception as exc:
            fault = self._classified(exc)
            recovery = fault.extra.get("recovery_action")
            if fault.kind != "recoverable" or recovery not in RESETTABLE:
                raise self._fault_on_device(entry, exc, fault) from exc
            if state_specs(entry.built):
                # a reset loses what the runs left on the device, and a retry would read stale state: a
                # wrong answer. The error goes to the caller; the next call rebuilds and uploads again.
                fault.extra.update(
                    outcome="the executable keeps state on the device, which a reset would lose; not retried"
                )
                raise self._fault_on_device(entry, exc, fault) from exc
            try:  # the documented recovery: reset, reload, run once more
                entry.epoch += 1
                self.backend.reset(entry.built)
                entry.slot.resident = executable
                started = time.perf_counter()
                action(entry)
                recovered = recovery
            except Exception as again:
                fault = self._classified(again)
                fault.kind = "recoverable"
                fault.extra.update(recovery_action=recovery, outcome="a reset and one retry did not clear")
                raise self._fault_on_device(entry, again, fault) from again
        return {
            "switched": switched,
            "seconds": time.perf_counter() - started,
            "recovered": recovered,
            "epoch": entry.epoch,
        }

    def _fault_on_device(self, entry: _Executable, exc: BaseException, fault: _Fault | None = None) -> _Fault:
        """A device fault during a run: anything but a cleared reset releases the device."""
        fault = fault or self._classified(exc)
        if fault.kind in ("recoverable", "unrecoverable"):
            if fault.kind == "recoverable":
                fault.extra.setdefault("outcome", "needs an operator")
            self._drop_slot(entry.slot)
        return fault

    def op_release(self, executable: int) -> None:
        entry = self.executables.pop(executable, None)
        if entry is None:
            return
        self.backend.release(entry.built)
        slot = entry.slot
        slot.members.discard(executable)
        if slot.resident == executable:
            slot.resident = None
        if not slot.members:
            self._drop_slot(slot)

    def op_shutdown(self) -> None:
        for slot in list(self.slots):
            self._drop_slot(slot)

    # -- errors --------------------------------------------------------------------------------------

    def _classified(self, exc: BaseException, default: str | None = None) -> _Fault:
        if isinstance(exc, _Fault):
            return exc
        if isinstance(exc, EngineContractError):
            return _Fault("contract", exc)
        if isinstance(exc, InstallationError):  # the worker's Python lacks an SDK part (popdist)
            return _Fault("installation", exc)
        info = self.backend.classify(exc)
        if info is None:
            return _Fault("internal", exc)
        kind = info.pop("kind")
        if kind == "sdk" and default is not None:
            kind = default
        return _Fault(kind, exc, **info)


def _describe(fault: _Fault) -> dict[str, Any]:
    cause = fault.cause
    return {
        "kind": fault.kind,
        "type": getattr(type(cause), "__qualname__", type(cause).__name__),
        "message": str(cause),
        # the three-argument form: the one-argument form needs Python 3.10
        "traceback": "".join(traceback.format_exception(type(cause), cause, cause.__traceback__)),
        **fault.extra,
    }


def plain(value: Any) -> Any:
    """``value`` as plain Python values: the host may have another numpy than the SDK's Python, and a
    pickled numpy scalar names numpy's internal modules, which differ between numpy 1 and 2."""
    if isinstance(value, dict):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def _exit_with_parent() -> None:
    """The host may die without closing the socket cleanly (SIGKILL); never outlive it."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def serve(fd: int, backend: str) -> None:
    conn = Connection(fd)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    module_name, _, class_name = backend.partition(":")
    server = Server(getattr(importlib.import_module(module_name), class_name)())
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            break
        op = request.pop("op")
        try:
            result = getattr(server, f"op_{op}")(**request)
        except Exception as exc:
            fault = exc if isinstance(exc, _Fault) else server._classified(exc)
            conn.send({"error": plain(_describe(fault))})
        else:
            conn.send({"ok": plain(result)})
        if op == "shutdown":
            break
    server.op_shutdown()
    conn.close()
