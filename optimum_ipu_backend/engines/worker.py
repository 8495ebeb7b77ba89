"""The Poplar SDK runs in a worker process; this is the host side of it.

Why a process: ``import popart`` raises ImportError once ``onnx`` is imported, and optimum imports onnx
long before a session exists (as the SDK documents). The worker is started with
``python -c "import popart; ..."``, so the SDK is its first import; it inherits the user's environment
as it is (the SDK's ``enable`` script sets ``PYTHONPATH`` and ``POPLAR_SDK_ENABLED``), and asks the SDK
which IPUs exist. A process also contains device faults: a compile that hangs is stopped after
``compile_timeout``, and a worker that dies is reported and started again on the next call.

The SDK's Python. ``python`` is the interpreter ``engines.probe.resolve_sdk_python`` names (the provider
option ``sdk_python``, ``OPTIMUM_IPU_SDK_PYTHON``, else this one): PopTorch 3.4 pins torch 2.0.1, which
the user's optimum stack cannot use, and PopART's extension is built for the SDK's own CPython. That
interpreter does not see this one's packages, and must not: they hold transformers, onnxruntime and
extensions built for another Python. The worker gets only this package, as a private directory that
holds nothing but a link to it, put first on its ``PYTHONPATH`` (the user's ``PYTHONPATH``, which holds
the SDK, follows). Everything the worker imports (``worker_server``, the engines' backends, ``base``,
``errors``) runs on Python 3.8 and imports none of transformers, optimum, onnxruntime or this package's
host layers; tests check both rules.

One worker per SDK and interpreter serves every engine of this process, so that executables of several
sessions can share the IPUs it acquires (``engines.worker_server``). Requests and replies are small dicts
of plain Python values over a socket pair (the two interpreters may have different numpy versions);
arrays never cross it: each executable's input and output buffers are shared memory (files in
``/dev/shm``, mapped by both processes and unlinked once mapped), written in place by the host and by
the SDK.

Background compiles. The worker serves one request at a time, and a compile there holds the device too:
PopART's ``prepareDevice`` marks the engine loaded on a shared device as not loaded (``Devicex::prepare``
ends in ``setEngineIsLoaded(false)``, willow/src/popx/devicex.cpp at sdk-release-3.4), so the next run of
that engine reloads it. A background compile (``Engine.build_aside``, the serving plan's) therefore goes
to a second worker, the compile worker, which builds for an offline twin of the device
(``createOfflineIPUDevice``: the same architecture, IPU count and tiles) into the executable's artifact
directory; the executable is built on its device, from that binary, at its first use. The engine
cache's key hashes a device by those facts only (``std::hash<popart::DeviceInfo>``,
willow/src/devicemanager.cpp: hardware-compatible, target architecture, IPUs, tiles per IPU, worker
contexts), so the twin's binary serves the device; were the key to differ, the build on the device would
compile again and serve the same results, only later. PopTorch's engine compiles on the device as before
(``WorkerEngine.offline_binary_serves_device``): its cache key has not been read this way yet.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from optimum_ipu_backend.engines.base import (
    Availability,
    CompileOptions,
    Engine,
    EngineClosedError,
    EngineContractError,
    EngineUnavailableError,
    Executable,
    TensorSpec,
)
from optimum_ipu_backend.engines.probe import (
    DEVICE_KINDS,
    SDK_PYTHON_ENV,
    SDK_PYTHON_OPTION,
    module_origin,
    resolve_sdk_python,
)
from optimum_ipu_backend.errors import DeviceError, InstallationError

_logger = logging.getLogger(__name__)

# The code a worker starts with: the SDK first, before anything could import onnx. ``-c`` puts the working
# directory first on sys.path; it goes, so that the worker imports only the SDK's paths and this package
# (a backend changes directory to the graph's while the SDK reads it).
_BOOTSTRAP = (
    "import sys\n"
    "if sys.path and sys.path[0] == '': del sys.path[0]\n"
    "import {sdk}\n"
    "from optimum_ipu_backend.engines.worker_server import serve\n"
    "serve({fd}, {backend!r})\n"
)
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
_STARTUP_TIMEOUT = float(os.environ.get("OPTIMUM_IPU_WORKER_START_TIMEOUT", "600"))
# This package's directory, the one the worker must import whatever interpreter runs it.
PACKAGE_DIR = Path(__file__).resolve().parent.parent
_entry_lock = threading.Lock()


_package_entry: list[str] = []  # the directory package_path_entry made


def package_path_entry() -> str:
    """A private directory (removed at exit) holding only a link to this package: the worker's first
    ``PYTHONPATH`` entry, so that it imports this package and nothing else of this interpreter's. Made
    again when a cleaner of the temporary directory removed it from a long-running process."""
    with _entry_lock:
        if _package_entry and os.path.isdir(os.path.join(_package_entry[0], PACKAGE_DIR.name)):
            return _package_entry[0]
        directory = tempfile.mkdtemp(prefix="optimum-ipu-worker-path-")
        os.symlink(PACKAGE_DIR, os.path.join(directory, PACKAGE_DIR.name), target_is_directory=True)
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        _package_entry[:] = [directory]
        return directory


def worker_environment() -> dict[str, str]:
    """The worker's environment: this process's, with the package first on ``PYTHONPATH``."""
    environment = dict(os.environ)
    paths = [package_path_entry()]
    if environment.get("PYTHONPATH"):
        paths.append(environment["PYTHONPATH"])
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    return environment


class Worker:
    """One SDK worker process on the interpreter ``python``, started on demand and again after it died
    (``generation`` counts starts)."""

    def __init__(self, sdk: str, backend: str, python: str = sys.executable, role: str = "device") -> None:
        self.sdk, self.backend, self.python = sdk, backend, python
        #: "device" serves the executables on the IPUs; "compile" builds for offline targets only.
        self.role = role
        self.key = (sdk, python, role)
        self.generation = 0
        self.info: dict[str, Any] = {}
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._pending_releases: list[tuple[int, int]] = []  # (generation, executable id) from finalizers
        self._output: deque[str] = deque(maxlen=40)
        self._closed = False

    # -- process -------------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None and self._conn is not None

    def _start(self) -> None:
        parent, child = socket.socketpair()
        code = _BOOTSTRAP.format(sdk=self.sdk, fd=child.fileno(), backend=self.backend)
        self._output.clear()
        self._process = subprocess.Popen(
            [self.python, "-c", code],
            env=worker_environment(),
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        child.close()
        self._conn = Connection(parent.detach())
        threading.Thread(target=self._forward_output, args=(self._process,), daemon=True).start()
        self.generation += 1
        try:
            self.info = self._request({"op": "hello"}, timeout=_STARTUP_TIMEOUT, what="start-up")
        except WorkerDiedError as exc:
            raise EngineUnavailableError(
                f"the {self.sdk} worker process could not start on {self.python}: {exc}. Is the Poplar SDK "
                f"enabled in this environment (source <sdk>/enable), and does `{self.python} -c 'import "
                f"{self.sdk}'` work? The worker's Python is the {SDK_PYTHON_OPTION!r} provider option or "
                f"{SDK_PYTHON_ENV} (default: this interpreter); it needs Python 3.8 or newer with numpy."
            ) from exc
        _logger.info("started the %s worker on %s (pid %s): %s", self.sdk, self.python, self.pid, self.info)

    def _forward_output(self, process: subprocess.Popen) -> None:
        """The SDK's log goes to this process's stderr; the last lines are kept for error reports."""
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            self._output.append(line)
            print(f"[{self.sdk} worker] {line}", file=sys.stderr)
        process.stdout.close()

    def _mark_dead(self) -> str:
        """Stop what is left of the process; describe how it ended."""
        process, self._process = self._process, None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if process is None:
            return "not running"
        if process.poll() is None:
            process.kill()
        code = process.wait()
        if process.stdout is not None:
            time.sleep(0.05)  # let the forwarder read the last lines
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        tail = "\n".join(list(self._output)[-10:])
        return f"pid {process.pid}, {how}" + (f"; its last output:\n{tail}" if tail else "")

    def ensure_started(self) -> None:
        if self._closed:
            raise EngineClosedError(f"the {self.sdk} worker was shut down")
        if not self.alive:
            if self._process is not None:
                self._mark_dead()
            self._start()

    # -- requests ------------------------------------------------------------------------------------

    def _request(self, message: dict, timeout: float | None, what: str) -> Any:
        conn = self._conn
        try:
            assert conn is not None
            conn.send(message)
            if timeout is not None and not conn.poll(timeout):
                description = self._mark_dead()
                raise CompileTimeoutError(
                    f"{what} took longer than {timeout:g} s (the compile_timeout provider option); the "
                    f"{self.sdk} worker ({description.split(';')[0]}) was stopped and starts again on "
                    "the next "
                    "call. Raise compile_timeout, serve smaller buckets, or compile ahead of time with "
                    "`optimum-ipu compile MODEL`."
                )
            reply = conn.recv()
        except (EOFError, OSError, AssertionError) as exc:
            description = self._mark_dead()
            raise WorkerDiedError(
                f"the {self.sdk} worker process died during {what} ({description}). It is started again, "
                "and the executables reloaded, on the next call."
            ) from exc
        if "error" in reply:
            error = reply["error"]
            if error.get("kind") == "internal":
                raise RuntimeError(
                    f"{self.sdk} worker: {error['type']}: {error['message']}\n{error['traceback']}"
                )
            if error.get("kind") == "contract":
                raise EngineContractError(error["message"])
            if error.get("kind") == "installation":
                raise InstallationError(error["message"])
            raise _RemoteFault(error)
        return reply["ok"]

    def call(self, op: str, *, timeout: float | None = None, what: str | None = None, **args: Any) -> Any:
        with self._lock:
            self.ensure_started()
            self._flush_releases()
            return self._request({"op": op, **args}, timeout, what or op)

    def release_now(self, generation: int, executable_id: int) -> None:
        """Release at once when the worker is free (an explicit close); otherwise queue it, since this may
        run inside a garbage collection that interrupted a call holding the lock."""
        if not self._lock.acquire(blocking=False):
            self.release_later(generation, executable_id)
            return
        try:
            if self.alive and generation == self.generation:
                self._flush_releases()
                self._request({"op": "release", "executable": executable_id}, None, "release")
        except Exception as exc:  # a dead worker holds nothing any more
            _logger.info("release in the %s worker failed: %s", self.sdk, exc)
        finally:
            self._lock.release()

    def release_later(self, generation: int, executable_id: int) -> None:
        """Called from finalizers, which may run inside ``call``: queue, never send from here."""
        self._pending_releases.append((generation, executable_id))

    def _flush_releases(self) -> None:
        while self._pending_releases:
            generation, executable_id = self._pending_releases.pop()
            if generation == self.generation:
                self._request({"op": "release", "executable": executable_id}, None, "release")

    def shutdown(self) -> None:
        """Release every device the worker holds and stop it."""
        with self._lock:
            self._closed = True
            if self.alive:
                try:
                    self._request({"op": "shutdown"}, 30, "shutdown")
                except Exception as exc:  # a worker that cannot shut down cleanly is stopped anyway
                    _logger.info("the %s worker did not shut down cleanly: %s", self.sdk, exc)
            if self._process is not None:
                try:
                    self._process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
                self._mark_dead()


# -- device faults: the worker sends an SDK exception's class, message and kind; ``device_fault`` turns it
# into one of these classes, saying what happened and what to try, with the SDK's message chained in full.


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


class _RemoteFault(Exception):
    """An SDK error the worker classified; turned into a ``DeviceFaultError`` by the executable."""

    def __init__(self, error: Mapping[str, Any]) -> None:
        super().__init__(error.get("message"))
        self.error = dict(error)


# -- one worker per SDK and interpreter, shared by the engines of this process ---------------------------

# keyed by (SDK module, interpreter, role)
_workers: dict[tuple[str, str, str], Worker] = {}
_users: dict[tuple[str, str, str], int] = {}
_registry_lock = threading.Lock()


def _shared_worker(sdk: str, backend: str, python: str, role: str = "device") -> Worker:
    key = (sdk, python, role)
    with _registry_lock:
        worker = _workers.get(key)
        if worker is None or worker._closed:
            worker = _workers[key] = Worker(sdk, backend, python, role)
        _users[key] = _users.get(key, 0) + 1
        return worker


def _idle_seconds() -> float:
    """How long a worker without engines waits for a new one before it stops (its IPUs are already
    released with its executables); saves re-importing the SDK when sessions are recreated."""
    return float(os.environ.get("OPTIMUM_IPU_WORKER_IDLE_SECONDS", "5"))


def _release_worker(worker: Worker) -> None:
    """Drop one user; when none is left, the worker stops after ``_idle_seconds``."""
    with _registry_lock:
        _users[worker.key] = _users.get(worker.key, 1) - 1
        if _users[worker.key] > 0 or _workers.get(worker.key) is not worker:
            return
    idle = _idle_seconds()
    if idle <= 0:
        _stop_if_unused(worker)
    else:
        timer = threading.Timer(idle, _stop_if_unused, args=(worker,))
        timer.daemon = True
        timer.start()


def _stop_if_unused(worker: Worker) -> None:
    with _registry_lock:
        if _users.get(worker.key, 0) > 0 or _workers.get(worker.key) is not worker:
            return
        del _workers[worker.key]
    worker.shutdown()


@atexit.register
def shutdown_workers() -> None:
    """Stop every worker of this process (at exit; tests that change the SDK's environment)."""
    with _registry_lock:
        workers = list(_workers.values())
        _workers.clear()
        _users.clear()
    for worker in workers:
        worker.shutdown()


# -- shared-memory buffers ------------------------------------------------------------------------------


def map_buffer(path: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[mmap.mmap, np.ndarray]:
    """Map an existing shared-memory file as an array (both processes call this)."""
    size = max(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, 1)
    with open(path, "r+b") as stream:
        mapping = mmap.mmap(stream.fileno(), size)
    array = np.ndarray(shape, dtype=dtype, buffer=mapping)
    return mapping, array


def create_buffer(shape: tuple[int, ...], dtype: np.dtype) -> str:
    """A new zero-filled shared-memory file large enough for ``shape``; returns its path."""
    size = max(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, 1)
    descriptor, path = tempfile.mkstemp(prefix="optimum-ipu-", dir=SHM_DIR)
    try:
        os.ftruncate(descriptor, size)
    finally:
        os.close(descriptor)
    return path


def _spec(entry: Mapping[str, Any]) -> TensorSpec:
    return TensorSpec(entry["name"], tuple(entry["shape"]), np.dtype(entry["dtype"]))


def _release_remote(worker: Worker, generation: int, executable_id: int, mappings: list[mmap.mmap]) -> None:
    worker.release_later(generation, executable_id)
    _unmap(mappings)


def _unmap(mappings: list[mmap.mmap]) -> None:
    for mapping in mappings:
        try:
            mapping.close()
        except BufferError:  # an array still views it; the mapping goes when that array does
            pass


class RemoteExecutable(Executable):
    """An executable living in the worker. Runs copy the step's inputs into shared memory, send one small
    request, and copy the outputs out. After the worker restarted or the device was lost, the next run
    builds it again (from the cache entry when there is one) before running.

    Carried state: ``write_state`` copies the values into shared memory and sends one request.
    ``state_epoch`` counts the rebuilds here and the loads and resets the worker reports (worker_server);
    a run that loaded the executable onto its device reports it in its reply, so that run already read the
    state the load left (``state_epoch`` then differs from what it was before the run).

    Built ``aside`` (a background compile; see the module's notes): the compile worker builds it for an
    offline twin of the device, and it is built on the device, from the binary that left in its artifact
    directory, at its first run, load or state upload."""

    def __init__(
        self,
        engine: WorkerEngine,
        request: dict[str, Any],
        options: CompileOptions,
        what: str,
        aside: Worker | None = None,
    ) -> None:
        self._engine = engine
        self._worker = engine._worker
        self._request = request
        self._options = options
        self._what = what
        self._mappings: list[mmap.mmap] = []
        self._state_epoch = -1  # the first build on the device makes it 0
        self._id: int | None = None  # in the device worker; None until built there
        if aside is None:
            self._build()
        else:
            self._build_aside(aside)

    # -- building ------------------------------------------------------------------------------------

    def _call_build(self, worker: Worker, request: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            reply = worker.call("build", timeout=self._options.compile_timeout, what=what, **request)
        except _RemoteFault as fault:
            error = device_fault(fault.error, self._what, self._options.ipus)
            raise error from error.__cause__
        self.inputs = tuple(_spec(entry) for entry in reply["inputs"])
        self.outputs = tuple(_spec(entry) for entry in reply["outputs"])
        self.state = tuple(_spec(entry) for entry in reply.get("state", ()))
        return reply

    def _build_aside(self, worker: Worker) -> None:
        """Compile for the device's offline twin in the compile worker (the binary goes to the artifact
        directory), then release it there: only its tensors are kept until the build on the device."""
        reply = self._call_build(
            worker, {**self._request, "offline": True}, f"compiling {self._what} beside the device"
        )
        for kind in ("input_buffers", "output_buffers", "state_buffers"):
            for entry in reply.get(kind, ()):
                os.unlink(entry["path"])  # nothing runs there: its buffers are never mapped
        worker.release_now(worker.generation, reply["executable"])
        self.device_label = None
        self._offline = False
        self._generation = -1  # not on the device yet: its first use builds it there

    def _build(self) -> None:
        reply = self._call_build(self._worker, self._request, f"compiling {self._what}")
        self._id, self._generation = reply["executable"], self._worker.generation
        # a rebuild starts from the initializers' values: whatever state the runtime wrote is gone
        self._state_epoch += 1
        self._worker_epoch = reply.get("epoch", 0)
        self.device_label = reply.get("device")
        self._offline = reply.get("offline", False)
        shapes = ", ".join(f"{spec.name}{list(spec.shape)}" for spec in self.inputs)
        self._what = f"the executable for {shapes}"
        mappings = []
        self._input_buffers: dict[str, np.ndarray] = {}
        self._output_buffers: dict[str, np.ndarray] = {}
        self._state_buffers: dict[str, np.ndarray] = {}
        for kind, target in (
            ("input_buffers", self._input_buffers),
            ("output_buffers", self._output_buffers),
            ("state_buffers", self._state_buffers),
        ):
            for entry in reply.get(kind, ()):
                mapping, array = map_buffer(entry["path"], tuple(entry["shape"]), np.dtype(entry["dtype"]))
                os.unlink(entry["path"])  # both sides have it mapped: nothing is left behind if one dies
                mappings.append(mapping)
                target[entry["name"]] = array
        old = self._mappings
        self._mappings = mappings
        self._on_close(_release_remote, self._worker, self._generation, self._id, self._mappings)
        _unmap(old)

    def close(self) -> None:
        """Release the executable (and its IPUs, when it was their last) in the worker now."""
        if self._finalizer is not None and self._finalizer.detach() is not None:
            self._worker.release_now(self._generation, self._id)
            _unmap(self._mappings)
        super().close()

    def relocated(self, graph: Path, artifacts: Path | None) -> None:
        self._request["graph"] = str(graph)
        self._request["artifacts"] = None if artifacts is None else str(artifacts)

    # -- running -------------------------------------------------------------------------------------

    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        options = self._options
        if options.device_iterations * options.replicas != 1:
            raise EngineContractError(
                f"{self._what} was compiled for steps of {options.device_iterations} iteration(s) x "
                f"{options.replicas} replica(s); run it with run_step"
            )
        outputs = self.run_step({name: array[None, None] for name, array in feed.items()}, 1, 1)
        return {name: array[0, 0] for name, array in outputs.items()}

    @property
    def state_epoch(self) -> int:
        return self._state_epoch

    def run_step(
        self, feed: Mapping[str, np.ndarray], device_iterations: int, replicas: int
    ) -> dict[str, np.ndarray]:
        self._check_open()

        def fill() -> None:
            for name, buffer in self._input_buffers.items():
                array = feed[name]
                if array.shape != buffer.shape or array.dtype != buffer.dtype:
                    raise EngineContractError(
                        f"executable input {name!r} takes {buffer.dtype}{list(buffer.shape)} per step "
                        f"and got "
                        f"{array.dtype}{list(array.shape)}; the runtime must pad or split to compiled shapes"
                    )
                np.copyto(buffer, array)

        reply = self._on_device("run", fill, f"running {self._what}")
        self.last_run_seconds = reply["seconds"]
        return {name: buffer.copy() for name, buffer in self._output_buffers.items()}

    def load(self) -> None:
        self._check_open()
        if not self._offline:
            self._on_device("load", lambda: None, f"loading {self._what}")

    def write_state(self, values: Mapping[str, np.ndarray]) -> None:
        self._check_open()
        self._check_state(values)

        def fill() -> None:  # after a rebuild too: the new buffers
            for name, value in values.items():
                np.copyto(self._state_buffers[name], value)

        self._on_device("write_state", fill, f"writing the state of {self._what}", names=list(values))

    def _on_device(self, op: str, fill: Any, what: str, **args: Any) -> dict[str, Any]:
        """``fill`` the shared buffers and send ``op``; builds the executable again first when its worker
        restarted or its device was released, and once more when the worker lost it meanwhile."""
        if self._offline:
            raise EngineContractError(
                f"{self._what} was compiled for an offline IPU target; it fills the cache and cannot run"
            )
        for attempt in (1, 2):
            if self._generation != self._worker.generation or not self._worker.alive:
                if self._id is None:  # built aside: onto the device now, from its binary
                    _logger.info("loading %s onto its device (compiled beside it)", self._what)
                else:
                    _logger.warning(
                        "rebuilding %s: its %s worker restarted or its device was released",
                        self._what,
                        self._worker.sdk,
                    )
                self._build()
            fill()
            try:
                reply = self._worker.call(op, executable=self._id, what=what, **args)
            except _RemoteFault as fault:
                if fault.error.get("kind") == "lost" and attempt == 1:
                    self._generation = -1  # unloaded with a lost device: build again and run once more
                    continue
                error = device_fault(fault.error, self._what, self._options.ipus)
                raise error from error.__cause__
            break
        if reply.get("epoch", self._worker_epoch) != self._worker_epoch:
            self._state_epoch += 1
            self._worker_epoch = reply["epoch"]
        self.switches += int(reply["switched"])
        if reply.get("recovered"):
            _logger.warning(
                "%s: the IPU reported a recoverable error (%s); it was reset and the %s ran again",
                self._what,
                "step" if op == "run" else op,
                reply["recovered"],
            )
        return reply

    def residency(self) -> dict[str, object]:
        return {
            "switches": self.switches,
            "device": self.device_label,
            "last_run_seconds": getattr(self, "last_run_seconds", None),  # inside the worker, SDK run only
        }


class WorkerEngine(Engine):
    """An engine whose SDK runs in the shared worker process; subclasses name the SDK module and the
    worker-side backend class."""

    sdk_module: ClassVar[str]
    sdk_label: ClassVar[str]  # the SDK module's name in messages ("PopART")
    sdk_install: ClassVar[str]  # what to do when the SDK module is missing
    backend: ClassVar[str]  # "module:Class" of the worker-side backend
    #: Whether a binary built for an offline twin of a device serves the device from the artifact
    #: directory (the SDK's cache key hashes the device by target facts only): ``build_aside`` needs it.
    offline_binary_serves_device: ClassVar[bool] = False

    @classmethod
    def probe(cls) -> Availability:
        origin = module_origin(cls.sdk_module)
        if origin is None:
            missing = f"the Python module {cls.sdk_module} of Graphcore's Poplar SDK was not found"
            return Availability(False, f"{missing}; {cls.sdk_install}")
        return Availability(
            True, f"{cls.sdk_label} found ({origin}); the SDK lists the IPUs when a session starts"
        )

    def __init__(self, device: str, *, offline: bool = False, sdk_python: str | None = None) -> None:
        super().__init__(device, offline=offline, sdk_python=sdk_python)
        # The interpreter the SDK runs on; not part of cache keys (the binary does not depend on it), but
        # the SDK version its worker reports is.
        self.sdk_python = resolve_sdk_python(sdk_python)
        self._worker = _shared_worker(self.sdk_module, self.backend, self.sdk_python)
        self._on_close(_release_worker, self._worker)
        self._compile_lock = threading.Lock()
        self._compile_worker: Worker | None = None  # started by the first background compile
        self._compile_worker_release: Any = None
        try:
            with self._worker._lock:
                self._worker.ensure_started()
        except BaseException:
            self.close()
            raise
        info = self._worker.info
        # The version comes from the worker's SDK, so an SDK on another interpreter keys the cache too.
        self.sdk_version = f"{self.sdk_module} {info['sdk_version']}"
        self.python_version = info.get("python_version")
        self.visible_ipus = int(info.get("ipus", 0))
        self.ipu_version = info.get("ipu_version")
        if DEVICE_KINDS[device].needs_hardware and not offline and self.visible_ipus == 0:
            self.close()
            from optimum_ipu_backend.engines.probe import OPT_IN_HINT, DeviceUnavailableError

            raise DeviceUnavailableError(
                f"device 'ipu': the Poplar SDK ({self.sdk_version}) found no IPUs "
                "(DeviceManager().enumerateDevices() is empty). On an IPU-POD, set IPUOF_VIPU_API_HOST and "
                "IPUOF_VIPU_API_PARTITION_ID (or IPUOF_CONFIG_PATH) for your partition; use device "
                "'ipu-model' "
                f"for Graphcore's simulator. {OPT_IN_HINT}"
            )

    def _target_ipu_version(self, options: CompileOptions) -> str:
        if self.offline or not DEVICE_KINDS[self.device].needs_hardware:
            return options.ipu_version or "ipu2"
        return self.ipu_version or "ipu2"

    def key_settings(self, options: CompileOptions) -> dict[str, Any]:
        return {"ipu_version": self._target_ipu_version(options)}

    def close(self) -> None:
        super().close()
        if self._compile_worker_release is not None:
            self._compile_worker_release()

    def compile(self, graph: Path, options: CompileOptions, artifacts: Path | None = None) -> Executable:
        self._check_open()
        request = self._request(graph, options, artifacts)
        return self._track(RemoteExecutable(self, request, options, f"the graph {graph}"))

    def build_aside(self, graph: Path, options: CompileOptions, artifacts: Path) -> Executable:
        """On hardware, compile in the compile worker for the device's offline twin (see the module's
        notes), so the device worker goes on serving runs and the executable loaded on a shared device
        stays loaded; elsewhere (an IPU Model, an offline or a PopDist target) as ``compile``."""
        self._check_open()
        if (
            not self.offline_binary_serves_device
            or self.offline
            or not DEVICE_KINDS[self.device].needs_hardware
            or options.distributed is not None  # the instance's device comes from PopDist's configuration
        ):
            return self.compile(graph, options, artifacts)
        with self._compile_lock:
            if self._compile_worker is None:
                worker = _shared_worker(self.sdk_module, self.backend, self.sdk_python, "compile")
                self._compile_worker = worker
                self._compile_worker_release = weakref.finalize(self, _release_worker, worker)
            worker = self._compile_worker
        request = self._request(graph, options, artifacts)
        return self._track(RemoteExecutable(self, request, options, f"the graph {graph}", aside=worker))

    def _request(self, graph: Path, options: CompileOptions, artifacts: Path | None) -> dict[str, Any]:
        return {
            "graph": str(graph),
            "artifacts": None if artifacts is None else str(artifacts),
            "device": self.device,
            "offline": self.offline,
            "ipu_version": self._target_ipu_version(options),
            # device and offline travel once, as the engine's own, not again inside the options
            "options": {k: v for k, v in asdict(options).items() if k not in ("device", "offline")},
        }

    def describe(self) -> str:
        python = ""
        if self.sdk_python != sys.executable:
            python = f", Python {self.python_version} {self.sdk_python}"
        offline = ", offline" if self.offline else ""
        return f"{self.name} ({self.sdk_version}{python}, device {self.device}{offline})"


__all__ = ["DeviceFaultError", "RemoteExecutable", "Worker", "WorkerEngine"]
