"""A test double of PopTorch's public Python API, for CI without the SDK.

``inferenceModel`` wraps a ``torch.nn.Module`` in a ``PoplarExecutor`` that checks PopTorch's batch rule
and runs the module on the CPU, one micro-batch per device iteration and replica, concatenating outputs
on dim 0 (``OutputMode.All``). IPUs, faults and the call log are shared with the popart double:
``POPART_DOUBLE_CONFIG`` (``ipus``, ``version``, ``memory_bytes_per_ipu``, ``faults`` with ``at`` in
``acquire``, ``compile``, ``run``) and ``POPART_DOUBLE_LOG``.
"""

from __future__ import annotations

import os

if not os.environ.get("POPLAR_SDK_ENABLED"):
    raise ImportError(
        "Unable to import PopTorch, this can be caused by attempting to import PopTorch without an active "
        "Poplar SDK. Please source the enable script of your Poplar SDK."
    )
os.environ["RDMAV_FORK_SAFE"] = "1"

import copy  # noqa: E402
import enum  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

_fired: dict[str, int] = {}
_attached_ipus = [0]
FULL_TILES = 1472


def _config() -> dict:
    path = os.environ.get("POPART_DOUBLE_CONFIG")
    if not path or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as stream:
        return json.load(stream)


__version__ = str(_config().get("version", "3.4.0"))


def _log(call: str, **fields) -> None:
    path = os.environ.get("POPART_DOUBLE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as stream:
            stream.write(
                json.dumps({"call": f"poptorch.{call}", "pid": os.getpid(), **fields}, default=str) + "\n"
            )


class Error(RuntimeError):
    def __init__(self, message: str, type: str = "poptorch_py_error", location: str = "") -> None:  # noqa: A002
        super().__init__(message)
        self.message, self.type, self.location = message, type, location


class RecoverableError(Error):
    def __init__(self, message: str, recovery_action: str = "IPU_RESET") -> None:
        super().__init__(message, "poplar_recoverable_runtime_error")
        self.recovery_action = recovery_action


class UnrecoverableError(Error):
    def __init__(self, message: str) -> None:
        super().__init__(message, "poplar_unrecoverable_runtime_error")


def _fault(at: str) -> None:
    for fault in _config().get("faults", []):
        if fault.get("at") != at:
            continue
        key = str(fault.get("id", json.dumps(fault, sort_keys=True)))
        if _fired.get(key, 0) >= int(fault.get("times", 1)):
            continue
        _fired[key] = _fired.get(key, 0) + 1
        _log("fault", at=at, fault=fault)
        kind = fault["error"]
        if kind == "hang":
            time.sleep(float(fault.get("seconds", 3600)))
        elif kind == "exit":
            os._exit(int(fault.get("code", 70)))
        elif kind == "recoverable":
            raise RecoverableError("An IPU error was detected", fault.get("action", "IPU_RESET"))
        elif kind == "unrecoverable":
            raise UnrecoverableError("The IPU is lost")
        elif kind == "OutOfMemoryException":
            raise Error(
                "Out of memory: provoked by the test configuration", "poplar_graph_memory_allocation_error"
            )
        else:
            raise Error(
                fault.get("message", f"{kind} provoked by the test configuration"), "popart_exception"
            )


class OutputMode(enum.Enum):
    All = 0
    Sum = 1
    Final = 2
    EveryN = 3
    Default = 4


class ConnectionType(enum.Enum):
    Always = 0
    OnDemand = 1
    Never = 2


class _Precision:
    def __init__(self) -> None:
        self.partials_type = torch.float32

    def setPartialsType(self, dtype) -> _Precision:  # noqa: N802
        if dtype not in (torch.float, torch.half):
            raise ValueError("setPartialsType only accepts torch.float or torch.half")
        self.partials_type = dtype
        return self

    def enableFloatingPointExceptions(self, enabled: bool) -> _Precision:  # noqa: N802
        return self

    def enableStochasticRounding(self, enabled: bool) -> _Precision:  # noqa: N802
        return self


class _Distributed:
    def __init__(self) -> None:
        self.process_id = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        self.num_processes = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))

    def configureProcessId(self, process_id: int, num_processes: int):  # noqa: N802
        self.process_id, self.num_processes = process_id, num_processes
        return self

    def disable(self):
        self.process_id, self.num_processes = 0, 1
        return self


class _Training:
    def gradientAccumulation(self, n: int):  # noqa: N802
        if n != 1:
            raise Error("gradientAccumulation must be 1 for inference")
        return self


class _PopartOptions:
    def __init__(self) -> None:
        self.options: dict = {}

    def set(self, key: str, value) -> _PopartOptions:
        self.options[key] = value
        return self


class Options:
    def __init__(self) -> None:
        self.device_iterations = 1
        self.replication_factor = 1
        self.output_mode = OutputMode.Default
        self.ipu_model = bool(int(os.environ.get("POPTORCH_IPU_MODEL", "0")))
        self.cache_path: str | None = None
        self.offline_version: int | None = None
        self.connection_type = ConnectionType.Always
        self.Precision = _Precision()
        self.Distributed = _Distributed()
        self.Training = _Training()
        self._Popart = _PopartOptions()
        if os.environ.get("POPTORCH_CACHE_DIR"):
            self.enableExecutableCaching(os.environ["POPTORCH_CACHE_DIR"])

    def deviceIterations(self, n: int) -> Options:  # noqa: N802
        self.device_iterations = int(n)
        return self

    def replicationFactor(self, n: int) -> Options:  # noqa: N802
        self.replication_factor = int(n)
        return self

    def outputMode(self, mode: OutputMode, output_return_period=None) -> Options:  # noqa: N802
        if not isinstance(mode, OutputMode):
            raise TypeError("outputMode expects a poptorch.OutputMode")
        self.output_mode = mode
        return self

    def enableExecutableCaching(self, path) -> Options:  # noqa: N802
        self.cache_path = None if path is None else str(path)
        return self

    def useIpuModel(self, use: bool) -> Options:  # noqa: N802
        self.ipu_model = bool(use)
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> Options:  # noqa: N802
        self.offline_version = ipu_version
        self.connection_type = ConnectionType.Never
        return self

    def connectionType(self, connection: ConnectionType) -> Options:  # noqa: N802
        self.connection_type = connection
        return self

    def autoRoundNumIPUs(self, enabled: bool) -> Options:  # noqa: N802
        return self

    def randomSeed(self, seed: int) -> Options:  # noqa: N802
        return self

    def useIpuId(self, ipu_id: int) -> Options:  # noqa: N802
        return self

    def setAvailableMemoryProportion(self, proportions: dict) -> Options:  # noqa: N802
        if any(not key.startswith("IPU") for key in proportions):
            raise ValueError("keys must start with 'IPU'")
        return self


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:  # noqa: N802
    if int(os.environ.get("POPTORCH_IPU_MODEL", "0")) or int(os.environ.get("POPTORCH_SMALL_IPU_MODEL", "0")):
        return False
    return int(_config().get("ipus", 0)) >= num_ipus


def ipuHardwareVersion() -> int:  # noqa: N802
    if not ipuHardwareIsAvailable():
        raise AssertionError("No IPU hardware available on this system")
    return {"ipu2": 2, "ipu21": 21}.get(_config().get("ipu_version", "ipu2"), -1)


class PoplarExecutor:
    def __init__(self, model: torch.nn.Module, options: Options) -> None:
        self._model = copy.copy(model)  # shallow, as the real wrapper
        self._options = options
        self._compiled_shapes = None
        self._attached = False

    @property
    def _ipus(self) -> int:
        return self._options.replication_factor

    def _attach(self) -> None:
        if self._options.ipu_model or self._attached:
            self._attached = True
            return
        _fault("acquire")
        if _attached_ipus[0] + self._ipus > int(_config().get("ipus", 0)):
            raise Error(f"Failed to acquire {self._ipus} IPU(s). No device found on the system with {self._ipus} IPUs",
                        "poptorch_cpp_error")  # fmt: skip
        _attached_ipus[0] += self._ipus
        self._attached = True
        _log("attach", ipus=self._ipus)

    def _micro_shapes(self, args) -> list:
        factor = self._options.device_iterations * self._options.replication_factor
        shapes = []
        for index, tensor in enumerate(args):
            if tensor.shape[0] % factor:
                raise Error(
                    f"Invalid batch dimension: In the input {index}, the batch dimension ({tensor.shape[0]}) must be "
                    f"a multiple of Options.deviceIterations({self._options.device_iterations}) * "
                    f"Options.replicationFactor({self._options.replication_factor}) = {factor}"
                )
            shapes.append((tensor.shape[0] // factor, *tensor.shape[1:]))
        return shapes

    def compile(self, *args, **kwargs) -> None:
        opts = self._options
        _log("compile", args=[{"shape": list(a.shape), "dtype": str(a.dtype)} for a in args],
             deviceIterations=opts.device_iterations, replicationFactor=opts.replication_factor,
             outputMode=opts.output_mode.name, ipuModel=opts.ipu_model, cachePath=opts.cache_path,
             partials=str(opts.Precision.partials_type), offline=opts.offline_version,
             processes=[opts.Distributed.process_id, opts.Distributed.num_processes])  # fmt: skip
        if self._compiled_shapes is not None:
            return
        shapes = self._micro_shapes(args)
        _fault("compile")
        limit = _config().get("memory_bytes_per_ipu")
        weights = sum(t.numel() * t.element_size() for t in self._model.state_dict().values())
        if limit is not None and weights > float(limit):
            raise Error(
                f"Out of memory on tile 0: {weights} bytes of weights per IPU",
                "poplar_graph_memory_allocation_error",
            )
        if opts.cache_path and not opts.ipu_model:
            digest = hashlib.sha256(repr((shapes, opts.device_iterations, opts.replication_factor)).encode())
            path = os.path.join(opts.cache_path, f"{digest.hexdigest()[:32]}.popef")
            if os.path.exists(path):
                _log("cache_hit", path=path)
            else:
                os.makedirs(opts.cache_path, exist_ok=True)
                with open(path, "wb") as stream:
                    stream.write(b"POPEF-DOUBLE poptorch\n")
                _log("cache_write", path=path)
        self._compiled_shapes = shapes
        if opts.connection_type is not ConnectionType.Never:
            self._attach()

    def __call__(self, *args):
        if self._options.connection_type is ConnectionType.Never:
            raise AssertionError("use model.compile(inputs) instead of model(inputs)")
        if self._compiled_shapes is None:
            self.compile(*args)
        shapes = self._micro_shapes(args)
        if shapes != self._compiled_shapes:
            raise Error(
                f"Shape mismatch: expected {self._compiled_shapes} but got {shapes}. To recompile the model for the "
                "new inputs create a new inferenceModel / trainingModel wrapper or call destroy() on the current one"
            )
        if not self._attached:
            self._attach()
        _log("run", args=[{"shape": list(a.shape), "dtype": str(a.dtype)} for a in args])
        _fault("run")
        factor = self._options.device_iterations * self._options.replication_factor
        chunks = [torch.chunk(a, factor, dim=0) for a in args]
        results = [self._model(*[c[k] for c in chunks]) for k in range(factor)]
        if isinstance(results[0], torch.Tensor):
            results = [(r,) for r in results]
        merged = []
        for index in range(len(results[0])):
            tensor = torch.cat([r[index] for r in results], dim=0)
            if tensor.dtype == torch.int64:
                tensor = tensor.to(torch.int32)
            elif tensor.dtype == torch.float64:
                tensor = tensor.to(torch.float32)
            merged.append(tensor)
        return merged[0] if len(merged) == 1 else tuple(merged)

    def detachFromDevice(self) -> None:  # noqa: N802
        if self._compiled_shapes is None or not self._attached:
            raise Error("Device is not attached")
        if not self._options.ipu_model:
            _attached_ipus[0] -= self._ipus
        self._attached = False
        _log("detachFromDevice")

    def attachToDevice(self) -> None:  # noqa: N802
        if self._compiled_shapes is None:
            raise Error("Model has not been compiled")
        self._attach()
        _log("attachToDevice")

    def isAttachedToDevice(self) -> bool:  # noqa: N802
        return self._attached

    def isCompiled(self) -> bool:  # noqa: N802
        return self._compiled_shapes is not None

    def destroy(self) -> None:
        if self._attached:
            self.detachFromDevice()
        self._compiled_shapes = None
        _log("destroy")


def inferenceModel(model, options: Options | None = None) -> PoplarExecutor:  # noqa: N802
    if not isinstance(model, torch.nn.Module):
        raise TypeError("inferenceModel expects a torch.nn.Module")
    _log("inferenceModel", training=model.training)
    return PoplarExecutor(model, options or Options())
