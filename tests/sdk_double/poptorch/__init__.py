"""A test double of PopTorch's public Python API, for CI without the Poplar SDK.

It behaves as graphcore/poptorch at branch ``sdk-release-3.4`` (commit c2a8b177) does; each behaviour
cites the source it follows (repository graphcore/poptorch unless said otherwise), or says that it is
*assumed* and why where the behaviour lives in closed source (Poplar, PopDist).

* ``inferenceModel(model, options)`` wraps a shallow copy of the module in a ``PoplarExecutor``.
* ``compile`` traces ``forward`` ONCE, on a device without values, as PopTorch traces on ``ipu:0``:
  parameters, buffers and inputs move to torch's ``meta`` device, the factory functions PopTorch
  redirects create meta tensors, and a host read (``.item()``, ``float(t)``, ``.tolist()``,
  ``.to("cpu")``) raises PopTorch's error. Only then is the executable "compiled" (memory, cache, IPUs).
* A call runs the module eagerly on the CPU, one micro-batch per device iteration and replica, and
  concatenates outputs on dim 0 (``OutputMode.All``): the values PopTorch would compute.
* The device holds its own copy of the floating-point parameters and buffers, uploaded on every attach;
  calls run on it, in-place updates of a buffer persist there, and the user's module sees them only after
  ``copyWeightsToHost()`` (see "device state" below). Other parameters and buffers are constants.

Revised for issue 36 (generation on PopTorch as the SDK runs it); each rule cites its source where the
double implements it:

1. A non-floating-point parameter or buffer (int32, int64, bool, ...) is a constant of the graph, not a
   PopART weight (JITDispatch::addParameter -> addConstant; ValueMapper::setParameterName logs "was
   downgraded to constant"). So (a) naming it in updatableNamedBuffers is refused at lowering with
   PopART's "Invalid named buffer in updatableNamedBuffers!\nNo Ir::Tensor with TensorId '...'";
   (b) an in-place update of it in forward is seen by the rest of that run only: every run, and every
   device iteration, starts again from its host value at compile time; (c) copyWeightsToDevice and
   copyWeightsToHost copy nothing for it (PoplarExecutable copies the weights by name, _parameter_names);
   (d) its in-place update is not a weight update: no broadcastBuffers refusal with replicas.
2. copyNamedBuffersToDevice pairs the host tensors sorted by name (std::map) with the device buffers in
   registration order, the order torch's Module._apply moves them (children first, then the module's own
   parameters, then its buffers), as a raw copy of each device buffer's byte size: buffers of the same
   size swap silently, smaller host tensors are refused (undefined behaviour on the SDK).
3. Uploads and downloads are raw copies of the PopART tensor's size through the host pointer: a float64
   weight (float32 on the device) receives its host tensor's first bytes reinterpreted.
4. int64 and float64 inputs, and int64 constants, hold int32 and float32 values on the device
   (downCastIfNeeded, PoplarExecutable::run); an input updated in place is copied back after the run.
5. Zero-sized inputs and floating-point parameters and buffers are refused at compile
   (errorOnZeroSizedTensor); zero-sized constants are not.

Test controls, shared with the popart double: ``POPART_DOUBLE_CONFIG`` (a JSON file reread on every call:
``ipus``, ``ipu_version``, ``version``, ``memory_bytes_per_ipu``, ``memory_report_lines`` (lines in
Poplar's out-of-memory message), ``faults`` with ``at`` in ``acquire``, ``compile``, ``run``) and
``POPART_DOUBLE_LOG`` (one JSON line per call).
"""

from __future__ import annotations

import os

# python/__init__.py: importing poptorch.poptorch_core fails without an enabled SDK and is re-raised with
# this text. Assumed: POPLAR_SDK_ENABLED stands for the SDK's libraries being on the path (the enable
# script sets it).
if not os.environ.get("POPLAR_SDK_ENABLED"):
    raise ImportError(
        "Unable to import PopTorch, this can be caused by attempting to import PopTorch without an active "
        "Poplar SDK.\n  The SDK can be enabled by running: `source /path/to/poplar-sdk/enable`"
    )
# python/__init__.py: RDMAV_FORK_SAFE is set unless already set.
os.environ.setdefault("RDMAV_FORK_SAFE", "1")
# python/__init__.py also asserts torch.__version__.startswith("2.0.1"). Assumed away: the double runs on
# the test environment's torch, and the engine must work on either.

import copy  # noqa: E402
import enum  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

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


# -- errors --------------------------------------------------------------------------------------------
# python/poptorch.cpp, class Error and initialiseExceptionHandling: poptorch.Error is a new exception type
# deriving from Exception (PyErr_NewException with base PyExc_Exception); RecoverableError and
# UnrecoverableError derive from it.


class Error(Exception):
    pass


class RecoverableError(Error):
    pass


class UnrecoverableError(Error):
    pass


# poptorch_err/source/ExceptionHandling.cpp: max_log_line_length and ERROR_LOG.
_MAX_LOG_LINES = 80
_ERROR_LOG = "poptorch_error.log"


def _python_error(message: str) -> Error:
    """python/_impl.py, createPoptorchError: an instance whose own attributes are type, message and
    location, and whose text is "'poptorch_py_error': <message>"."""
    error = Error(f"'poptorch_py_error': {message}")
    error.type, error.message, error.location = "poptorch_py_error", message, ""
    return error


def _cpp_error(kind: str, message: str, filename: str = "unknown", line: int = 0, action: str = "") -> Error:
    """An error from PopTorch's C++ side, as the Python code sees it.

    poptorch_err/source/ExceptionHandling.cpp, convertToPoptorchExceptionOrRethrow: a message of more
    than 80 lines is written to poptorch_error.log (in the current directory) and replaced by
    "See poptorch_error.log for details"; the text is "In <file>:<line>: '<type>': <message>", plus
    "\\nRecovery action required: <action>" for a recoverable runtime error. python/poptorch.cpp,
    PoptorchError::setupPyError: the category picks the class, and type, message, location and
    recovery_action are set with PyObject_SetAttrString on that exception *type* (class attributes),
    then the exception is raised with the text.
    """
    if message.count("\n") > _MAX_LOG_LINES:
        with open(_ERROR_LOG, "w", encoding="utf-8") as stream:
            stream.write(message)
        message = f"See {_ERROR_LOG} for details"
    text = f"In {filename}:{line}: '{kind}': {message}"
    if kind == "poplar_recoverable_runtime_error":
        cls: type[Error] = RecoverableError
        cls.recovery_action = action
        text += f"\nRecovery action required: {action}"
    elif kind == "poplar_unrecoverable_runtime_error":
        cls = UnrecoverableError
    else:
        cls = Error
    cls.type, cls.message, cls.location = kind, message, ""
    return cls(text)


# popart_compiler/source/CompilerImpl.cpp, where its ERROR/ERROR_ON_MSG calls are (poptorch::logging::Error:
# type "poptorch_cpp_error", the file and line of the check).
_COMPILER_IMPL = "popart_compiler/source/CompilerImpl.cpp"


def _oom_message(weights: int, limit: float) -> str:
    """Assumed (Poplar is closed): the text of poplar::graph_memory_allocation_error, as Graphcore's
    memory and performance optimisation guide quotes it, followed by a per-tile report of
    ``memory_report_lines`` lines (none by default) as the profile summary adds."""
    lines = [
        f"Out of memory on tile 0: {weights} bytes used but tiles only have {int(limit)} bytes of memory"
    ]
    lines += [f"  tile {i}: {weights} bytes" for i in range(int(_config().get("memory_report_lines", 0)))]
    return "\n".join(lines)


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
            # popart_compiler/source/Compiler.cpp, rethrowPopartOrPoplarException: type "poplar_" + the
            # Poplar error's type, recovery action poplar::toString(action). Assumed (Poplar is closed):
            # the type is "recoverable_runtime_error" and toString gives the bare enumerator name, which
            # docs/user_guide/error_handling.py compares with "IPU_RESET", "FULL_RESET".
            raise _cpp_error("poplar_recoverable_runtime_error", "An IPU error was detected",
                             action=fault.get("action", "IPU_RESET"))  # fmt: skip
        elif kind == "unrecoverable":
            raise _cpp_error("poplar_unrecoverable_runtime_error", "The IPU is lost")
        elif kind == "OutOfMemoryException":
            # graphcore/popart willow/src/popx/devicex.cpp, Devicex::prepare: Poplar's
            # graph_memory_allocation_error becomes devicex_memory_allocation_err, a popart::error
            # (willow/include/popart/error.hpp, memory_allocation_err), which PopTorch reports as
            # "popart_exception" (Compiler.cpp, rethrowPopartOrPoplarException).
            raise _cpp_error("popart_exception", _oom_message(1, 0))
        else:
            raise _cpp_error(
                "popart_exception", fault.get("message", f"{kind} provoked by the test configuration")
            )


# -- enums (python/enums.py) ---------------------------------------------------------------------------


class OutputMode(enum.IntEnum):
    All = 0
    Sum = 1
    Final = 2
    EveryN = 3
    Default = 4


class ConnectionType(enum.IntEnum):
    Always = 0
    OnDemand = 1
    Never = 2


# -- options (python/options.py, python/_options_impl.py) ----------------------------------------------


class _OptionsDict:
    """python/_options_impl.py, OptionsDict: options read as attributes; ``set`` only takes a known key
    with a value of the default's type (AssertionError otherwise); a frozen object refuses changes with
    AttributeError("Can't modify frozen Options"); a deep copy is not frozen."""

    def __init__(self, **defaults) -> None:
        self._is_frozen = False
        self._values = defaults

    def set(self, **kwargs) -> None:
        self.checkIsFrozen()
        for option, value in kwargs.items():
            assert option in self._values, f"Invalid option {option}, valid options are {self._values.keys()}"
            assert isinstance(value, type(self._values[option])), (
                f"Unexpected type {type(value)} for option {option}. Expected {type(self._values[option])}"
            )
            self._values[option] = value

    def createOrSet(self, **kwargs) -> None:  # noqa: N802
        self.checkIsFrozen()
        self._values.update(kwargs)

    def exists(self, option: str) -> bool:
        return option in self._values

    def checkIsFrozen(self) -> None:  # noqa: N802
        if self.__dict__.get("_is_frozen"):
            raise AttributeError("Can't modify frozen Options")

    def _freeze(self) -> None:
        self._is_frozen = True
        for value in self.__dict__.values():
            if isinstance(value, _OptionsDict):
                value._freeze()

    def __deepcopy__(self, memory):
        copied = self.__class__.__new__(self.__class__)
        memory[id(self)] = copied
        for key, value in self.__dict__.items():
            setattr(copied, key, False if key == "_is_frozen" else copy.deepcopy(value, memory))
        return copied

    def __getattr__(self, name: str):
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)


class _PrecisionOptions(_OptionsDict):
    def __init__(self, popart: _PopartOptions) -> None:
        super().__init__()
        self._popart = popart

    def setPartialsType(self, dtype) -> _PrecisionOptions:  # noqa: N802
        """python/options.py, _PrecisionOptions.setPartialsType: float or half, else ValueError; it sets
        PopART's partialsTypeMatMuls and convolutionOptions."""
        if dtype in (torch.float, torch.float32):
            kind = "float"
        elif dtype in (torch.half, torch.float16):
            kind = "half"
        else:
            raise ValueError("parameter to setPartialsType should be either torch.float or torch.half")
        self._popart.set("partialsTypeMatMuls", kind)
        self._popart.set("convolutionOptions", {"partialsType": kind})
        return self


class _DistributedOptions(_OptionsDict):
    """python/options.py, _DistributedOptions: reads OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_RANK when
    constructed (setEnvVarNames); the class says not to use it under PopRun (popdist.poptorch.Options)."""

    def __init__(self) -> None:
        super().__init__(num_distributed_processes=1, distributed_process_id=0)
        self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")

    def disable(self):
        self.set(num_distributed_processes=1, distributed_process_id=0)
        return self

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str):  # noqa: N802
        return self.configureProcessId(
            int(os.environ.get(var_process_id, "0")), int(os.environ.get(var_num_processes, "1"))
        )

    def configureProcessId(self, process_id: int, num_processes: int):  # noqa: N802
        self.set(distributed_process_id=process_id)
        self.set(num_distributed_processes=num_processes)
        return self

    @property
    def processId(self) -> int:  # noqa: N802
        return self.distributed_process_id

    @property
    def numProcesses(self) -> int:  # noqa: N802
        return self.num_distributed_processes


class _TrainingOptions(_OptionsDict):
    def __init__(self) -> None:
        super().__init__(gradient_accumulation=1)

    def gradientAccumulation(self, gradient_accumulation: int):  # noqa: N802
        self.set(gradient_accumulation=gradient_accumulation)
        return self


class _PopartOptions:
    """python/options.py, _PopartOptions: a plain dict of PopART session options."""

    def __init__(self) -> None:
        self.options: dict = {}

    def set(self, key: str, value) -> _PopartOptions:
        self.options[key] = value
        return self


class Options(_OptionsDict):
    """python/options.py, Options."""

    def __init__(self) -> None:
        self._popart = _PopartOptions()
        self._graphProcessing = _PrecisionOptions(self._popart)
        self._training = _TrainingOptions()
        self._distributed = _DistributedOptions()
        super().__init__(
            replication_factor=1,
            broadcast_buffers=True,
            device_iterations=1,
            auto_round_num_ipus=False,
            output_mode=OutputMode.Default.value,
            connection_type=ConnectionType.Always.value,
        )
        # Options.__init__: POPTORCH_CACHE_DIR turns executable caching on, then POPTORCH_DEFAULT_OPTIONS
        # (JSON) is applied with from_json.
        path = os.environ.get("POPTORCH_CACHE_DIR", "")
        if path:
            self.enableExecutableCaching(path)
        self.from_json(os.environ.get("POPTORCH_DEFAULT_OPTIONS", r"{}"))

    def from_json(self, string: str) -> Options:
        """Options.from_json: {"Dotted.accessor": value}; a list is passed as arguments (enum strings are
        not modelled)."""
        for option, value in json.loads(string).items():
            target = self
            for attribute in option.split("."):
                target = getattr(target, attribute)
            target(*value) if isinstance(value, list) else target(value)
        return self

    @property
    def Precision(self) -> _PrecisionOptions:  # noqa: N802
        return self._graphProcessing

    @property
    def Distributed(self) -> _DistributedOptions:  # noqa: N802
        return self._distributed

    @property
    def Training(self) -> _TrainingOptions:  # noqa: N802
        return self._training

    @property
    def _Popart(self) -> _PopartOptions:  # noqa: N802
        return self._popart

    def deviceIterations(self, device_iterations: int) -> Options:  # noqa: N802
        self.set(device_iterations=device_iterations)
        return self

    def replicationFactor(self, replication_factor: int) -> Options:  # noqa: N802
        self.set(replication_factor=replication_factor)
        return self

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> Options:  # noqa: N802
        """Options.broadcastBuffers (default True, Options.__init__): False lets each replica keep its
        own buffers (SessionOptions.cpp registers it as poptorch_options.broadcast_buffers)."""
        self.set(broadcast_buffers=broadcast_buffers)
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> Options:  # noqa: N802
        self.set(auto_round_num_ipus=auto_round_num_ipus)
        return self

    def outputMode(self, output_mode: OutputMode, output_return_period=None) -> Options:  # noqa: N802
        if not isinstance(output_mode, OutputMode):
            raise AssertionError("outputMode expects a poptorch.OutputMode")
        self.set(output_mode=output_mode.value)
        return self

    def defaultOutputMode(self) -> bool:  # noqa: N802
        return self.output_mode == OutputMode.Default.value

    def enableExecutableCaching(self, path) -> Options:  # noqa: N802
        """Options.enableExecutableCaching: None turns PopART's enableEngineCaching off; a path sets
        cachePath and turns it on."""
        if path is None:
            self._Popart.set("enableEngineCaching", False)
        else:
            self._Popart.set("cachePath", path)
            self._Popart.set("enableEngineCaching", True)
        return self

    def useIpuModel(self, use_model: bool) -> Options:  # noqa: N802
        """Options.useIpuModel: createOrSet(use_model=...); once set it takes precedence over
        POPTORCH_IPU_MODEL (CompilerImpl.cpp, updateUseModelConfig)."""
        self.createOrSet(use_model=use_model)
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> Options:  # noqa: N802
        self.connectionType(ConnectionType.Never)
        self.createOrSet(ipu_version=ipu_version)
        return self

    def connectionType(self, connection_type: ConnectionType) -> Options:  # noqa: N802
        assert isinstance(connection_type, ConnectionType)
        self.set(connection_type=connection_type.value)
        return self

    def useIpuId(self, ipu_id: int) -> Options:  # noqa: N802
        assert isinstance(ipu_id, int)
        self.createOrSet(ipu_id=ipu_id)
        return self

    def randomSeed(self, random_seed: int) -> Options:  # noqa: N802
        self.createOrSet(random_seed=random_seed)
        return self

    def setAvailableMemoryProportion(self, proportions: dict) -> Options:  # noqa: N802
        for key in proportions:
            assert key.startswith("IPU"), f"Invalid key: {key}"
        self.createOrSet(available_memory_proportion={int(k[3:]): v for k, v in proportions.items()})
        return self

    def updatableNamedBuffers(self, buffers: list) -> Options:  # noqa: N802
        """Options.updatableNamedBuffers (python/options.py): the list goes to the PopART options as it
        is; popart_compiler/source/SessionOptions.cpp registers it as SessionOptions.updatableNamedBuffers.
        Names are checked only when the graph is lowered (PoplarExecutor._compile here)."""
        self._Popart.set("updatableNamedBuffers", buffers)
        return self

    def clone(self) -> Options:
        return copy.deepcopy(self)


# -- hardware ------------------------------------------------------------------------------------------


def _env_flag(name: str) -> bool:
    """popart_compiler/source/Utils.cpp: std::stoi(getenv(name)) != 0 when the variable is set."""
    value = os.environ.get(name)
    return value is not None and int(value) != 0


def _model_from_environment() -> bool:
    """Utils.cpp, ipuModelEnvironmentVariableIsEnabled / ipuSmallModelEnvironmentVariableIsEnabled."""
    return _env_flag("POPTORCH_IPU_MODEL") or _env_flag("POPTORCH_SMALL_IPU_MODEL")


def _device_groups(num_ipus: int) -> bool:
    """Whether the system lists a device of ``num_ipus`` IPUs. Assumed (Poplar's device list is closed):
    devices are single IPUs and aligned groups of a power of two IPUs, as ``gc-info -l`` lists them and
    the popart double's DeviceManager enumerates them."""
    total = int(_config().get("ipus", 0))
    return num_ipus >= 1 and num_ipus & (num_ipus - 1) == 0 and num_ipus <= total


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:  # noqa: N802
    """python/__init__.py: ipuHardwareVersion(num_ipus) != 0; Utils.cpp, ipuHardwareVersion: 0 when an
    IPU Model is enabled by environment, or when enumerateDevices(Full, num_ipus) is empty."""
    if _model_from_environment():
        return False
    return _device_groups(num_ipus)


def ipuHardwareVersion() -> int:  # noqa: N802
    """python/__init__.py: asserts hardware is present; Utils.cpp: the digits after "ipu" of the first
    device's architecture string ("ipu2" -> 2, "ipu21" -> 21), -1 when not of that form."""
    assert ipuHardwareIsAvailable(), "No IPU hardware available on this system"
    arch = str(_config().get("ipu_version", "ipu2"))
    digits = arch[3:]
    if not arch.startswith("ipu") or not digits or not all("1" <= c <= "9" for c in digits):
        return -1
    return int(digits)


def _ids_ipus(device_id: int) -> int:
    """The IPUs a device id covers. Assumed: ids as the popart double numbers them (single IPUs 0..n-1, a
    group of ``size`` IPUs from ``start`` is 1000 * size + start); 0 for an id the system does not list."""
    size, start = (1, device_id) if device_id < 1000 else divmod(device_id, 1000)
    total = int(_config().get("ipus", 0))
    if size & (size - 1) or start % size or start + size > total:
        return 0
    return size


# -- tracing (python/_poplar_executor.py) --------------------------------------------------------------

# _SetDefaultDeviceType.replace: the factory functions that create their tensor on the IPU when no
# device is given ("normal" only when no tensor argument is given).
_FACTORIES = ("arange", "empty", "full", "full_like", "linspace", "logspace", "ones", "rand", "randint",
              "randn", "randperm", "range", "tensor", "zeros", "zeros_like")  # fmt: skip
# The device the double traces on, standing for ipu:0: tensors without values.
_TRACE_DEVICE = "meta"

# poptorch/source/dispatch_tracer/RegisterAtenOverloads.cpp, item: aten::item raises this (and so do
# float(t), int(t), bool(t) and indexing with a tensor, which call it).
_ITEM_ERROR = (
    "aten::item is only supported in eager mode, but was intercepted in a static graph. This means an IPU "
    "to CPU copy was triggered before the end of the graph, for example by calling tensor.item(). Please "
    "ensure that any such copies are removed."
)
# RegisterAtenOverloads.cpp, copy_: an IPU -> CPU copy outside the move of the outputs.
_MOVE_ERROR = (
    'Illegal move to CPU (via `.to("cpu")`) when using the dispatcher. Instead, return this output as an '
    "IPU tensor."
)
_ITEM_CALLS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
               torch.Tensor.__index__}  # fmt: skip
# An IPU -> CPU copy: .cpu(), .to("cpu") and .tolist() (torch copies to the CPU first). numpy() is refused
# by torch itself for a tensor not on the CPU (a TypeError), as it is here for a meta tensor.
_COPY_CALLS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.to}


# Ops without a handler: JitDispatch.cpp, JITDispatch::fallback records any aten op as a node of its
# schema; InplaceOps.cpp, removeRemainingInplaceOps turns an in-place node into its out-of-place kind
# (outplaceKind drops the trailing "_"); a node canonicalisation leaves as "aten::" fails the compile
# (ErrorOnUnsupportedAten.cpp). Inferred, not run on an SDK: poptorch/source has no handler for
# aten::index_copy or aten::index_copy_ (the name occurs only in python/_dataloader.py), so both forms
# are refused under the out-of-place name.
_UNSUPPORTED = {torch.Tensor.index_copy_: "aten::index_copy", torch.Tensor.index_copy: "aten::index_copy",
                torch.index_copy: "aten::index_copy"}  # fmt: skip


class _DispatchTrace(TorchFunctionMode):
    """A host read of a traced tensor raises PopTorch's error (type poptorch_cpp_error: the dispatcher's
    ERROR goes through PopTorch's exception conversion). Ops without a handler are recorded in
    ``unsupported``: PopTorch refuses them only after the trace, when the graph is lowered."""

    def __init__(self) -> None:
        super().__init__()
        self.unsupported: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        traced = any(isinstance(a, torch.Tensor) and a.device.type == _TRACE_DEVICE for a in args)
        if traced and func in _UNSUPPORTED:
            self.unsupported.add(_UNSUPPORTED[func])
        if traced and func in _ITEM_CALLS:
            raise _cpp_error(
                "poptorch_cpp_error",
                _ITEM_ERROR,
                "poptorch/source/dispatch_tracer/RegisterAtenOverloads.cpp",
                508,
            )
        if traced and func in _COPY_CALLS:
            targets = [str(a) for a in [*args[1:], *kwargs.values()] if isinstance(a, (str, torch.device))]
            if func is not torch.Tensor.to or any(t.startswith("cpu") for t in targets):
                raise _cpp_error(
                    "poptorch_cpp_error",
                    _MOVE_ERROR,
                    "poptorch/source/dispatch_tracer/RegisterAtenOverloads.cpp",
                    310,
                )
        return func(*args, **kwargs)


def _factory_on_trace_device(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        kwargs.setdefault("device", _TRACE_DEVICE)
        return function(*args, **kwargs)

    return wrapper


def _normal_on_trace_device(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if "device" not in kwargs and not any(
            isinstance(a, torch.Tensor) for a in itertools.chain(args, kwargs.values())
        ):
            kwargs["device"] = _TRACE_DEVICE
        return function(*args, **kwargs)

    return wrapper


class _OnTraceDevice:
    """_SetDefaultDeviceType: the factories (and torch.normal) redirected for the duration of the trace."""

    def __enter__(self):
        self.saved = {name: getattr(torch, name) for name in (*_FACTORIES, "normal")}
        for name in _FACTORIES:
            setattr(torch, name, _factory_on_trace_device(self.saved[name]))
        torch.normal = _normal_on_trace_device(self.saved["normal"])
        return self

    def __exit__(self, *exc_info) -> None:
        for name, function in self.saved.items():
            setattr(torch, name, function)


def _entries(model: torch.nn.Module, kind: str):
    for module in model.modules():
        table = getattr(module, kind)
        for name, tensor in list(table.items()):
            if tensor is not None:
                yield table, name, tensor


# _impl.py, BUFFERS_CAN_CHANGE: modules whose buffers may be replaced during forward.
_BUFFERS_CAN_CHANGE = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
# _poplar_executor.py, NO_EXECUTABLE_ERR.
_NO_EXECUTABLE = "Model has not been compiled or has been destroyed."
# InplaceOps.cpp, InplaceInputsTracker::finalizeGraph: an in-place update of a parameter or buffer (all
# that _compileWithDispatch moves to the IPU count as parameters: RegisterAtenOverloads.cpp,
# moving_parameters) when replicas need broadcasting (LowerToPopartFactories.cpp, lowerToPopartFromDispatch:
# hasInputReplication() && broadcastBuffers(); SessionOptions.cpp: input_group_size < replicatedGraphCount).
_BROADCAST_ERROR = (
    "PopTorch does not support broadcasting buffers. If your model is able to tolerate buffers becoming "
    "out of sync between replicas, you can disable buffer broadcasting using "
    "poptorch.Options.broadcastBuffers(False)."
)


def _addresses(model: torch.nn.Module) -> tuple[dict, dict]:
    """_impl.py, getBufferAndParameterAddresses: each buffer (not those of BUFFERS_CAN_CHANGE modules) and
    each parameter by name, with its identity (an IPU tensor's id there, the tensor object here)."""
    buffers = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, _BUFFERS_CAN_CHANGE):
            buffers.update(module.named_buffers(prefix=prefix, recurse=False))
    return buffers, dict(model.named_parameters())


def _error_on_address_changes(old: tuple[dict, dict], new: tuple[dict, dict]) -> None:
    """_impl.py, errorOnBufferOrParameterAddressChanges: buffers first, then parameters."""
    for kind, before, after in zip(("Buffer", "Parameter"), old, new):  # noqa: B905
        for name, tensor in before.items():
            if name not in after:
                raise _python_error(
                    f"{kind} {name} is removed from the model when calling the forward method."
                )
            if after[name] is not tensor:
                raise _python_error(
                    f"{kind} {name} is reassigned within the model when calling the forward method. This is "
                    f"not supported. Consider using self.{name}.copy_(src) to copy data from a source tensor, "
                    "where src is the name of the source tensor."
                )


def _like_host(host: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in the module's place: a Parameter where the host tensor is one."""
    if isinstance(host, torch.nn.Parameter):
        return torch.nn.Parameter(value, host.requires_grad and value.is_floating_point())
    return value


# RegisterAtenOverloads.cpp, downCastIfNeeded, and Utils.cpp, coerceToSupportedType: what a host tensor
# becomes on the IPU (int64 -> int32, float64 -> float32; other dtypes stay).
_COERCED = {torch.int64: torch.int32, torch.float64: torch.float32}


def _as_on_device(tensor: torch.Tensor) -> torch.Tensor:
    """The values a host tensor has once on the IPU: int64 wrapped to int32 (``Tensor::to``, the cast
    downCastIfNeeded makes for parameters, buffers and inputs, and PoplarExecutable::run makes for an
    int64 input at every run), float64 rounded to float32. Assumed for the CPU run: an integer tensor
    keeps its host dtype (CPU index kernels take only int64) and carries the int32 values."""
    tensor = tensor.detach()
    if tensor.dtype == torch.int64:
        return tensor.to(torch.int32).to(torch.int64)
    return tensor.to(_COERCED.get(tensor.dtype, tensor.dtype), copy=True)


def _byte_size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor's memory from its data pointer, as PopTorch hands it over (python/poptorch.cpp,
    getParameterBuffers: ``data_ptr()``). Assumed: the tensor is contiguous (its elements in order)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _past_the_end(tensor_id: str, needed: int, host_name: str, available: int, verb: str) -> Error:
    """graphcore/popart willow/src/popx/devicex.cpp, Devicex::writeWeights (and readWeights): PopART
    copies its tensor's own byte size through the host pointer, with nothing to check it against. A
    host tensor smaller than that is read (or written) past its end: undefined behaviour on the SDK,
    which the double refuses rather than invent bytes."""
    return _cpp_error("sdk_double_undefined_behaviour", (
        f"{verb} {needed} bytes of PopART tensor '{tensor_id}' through host tensor '{host_name}' of "
        f"{available} bytes: past its end (undefined behaviour on the SDK)"))  # fmt: skip


def _from_host(host: torch.Tensor, host_name: str, tensor_id: str, spec: tuple) -> torch.Tensor:
    """PopART tensor ``tensor_id`` (shape and dtype ``spec``) written from ``host``'s memory:
    popart_compiler/source/CompilerImpl.cpp, WeightsIO::updateData sets only the data pointer, the
    MutableVoidData keeps the tensor's own TensorInfo (WeightsIO::registerParameter), so
    Tensor::verifyMutableVoidInfo always passes and TensorData::resetData copies the tensor's byte size
    from the pointer (willow/src/tensordata.cpp): a raw copy, whatever the host tensor's shape and dtype."""
    shape, dtype = spec
    needed, data = _byte_size(shape, dtype), _host_bytes(host)
    if data.numel() < needed:
        raise _past_the_end(tensor_id, needed, host_name, data.numel(), "Reading")
    return data[:needed].clone().view(dtype).reshape(shape)


def _into_host(host: torch.Tensor, host_name: str, tensor_id: str, value: torch.Tensor) -> None:
    """Compiler::copyWeightsToHost: readWeights writes the PopART tensor's byte size into the host
    tensor's memory (the pointer from getParameterBuffers), a raw copy as in ``_from_host``."""
    raw = value.detach().reshape(-1).view(torch.uint8)
    if not host.is_contiguous():  # assumed away (see _host_bytes): the values are copied
        host.detach().copy_(value.reshape(host.shape))
        return
    target = _host_bytes(host)
    if target.numel() < raw.numel():
        raise _past_the_end(tensor_id, raw.numel(), host_name, target.numel(), "Writing")
    target[: raw.numel()].copy_(raw)


def _registration_order(model: torch.nn.Module, names: dict[int, str]) -> list[str]:
    """The order in which PopTorch makes the parameters and buffers graph inputs, which is the order of
    PopART's weights. _poplar_executor.py, _compileWithDispatch moves them with ``self._model.to(ipu)``;
    torch's Module._apply (torch/nn/modules/module.py, torch 2.0.1 as PopTorch 3.4 pins it) converts the
    children first, recursively, then the module's own ``_parameters``, then its ``_buffers``; each
    conversion's copy_ CPU -> IPU is RegisterAtenOverloads.cpp, copyInplace -> JITDispatch::addParameter
    -> addTensor -> graph->addInput. A tensor reached again (a shared module, a tied weight) adds no
    input that survives (the alias is harmonised to the first and its input is unused). Then
    LowerToPopart.cpp, LowerToPopartImpl::lowerParameters walks the graph inputs in that order: each
    parameter becomes addInitializedInputTensor and, when listed in updatableNamedBuffers, is registered
    (Compiler::registerUpdatableNamedBuffer -> WeightsIO::registerParameter, which appends to
    _weights_order)."""
    order: list[str] = []
    seen: set[int] = set()

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            visit(child)
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is not None and id(tensor) not in seen and id(tensor) in names:
                    seen.add(id(tensor))
                    order.append(names[id(tensor)])

    visit(model)
    return order


def _zero_sized(tensor: torch.Tensor) -> Error | None:
    """poptorch/source/dispatch_tracer/Tensor.cpp, errorOnZeroSizedTensor (JITDispatch::addTensor: every
    input and floating-point parameter or buffer; addConstant does not check). tests/misc_test.py,
    test_zero_size_tensor_error shows it for an input. For a parameter or buffer it is read from the
    source (JITDispatch::addParameter -> addTensor), assuming torch's Tensor.to (_to_copy) reaches
    copy_ for an empty tensor as for any other."""
    if 0 not in tensor.shape:
        return None
    shape = ", ".join(str(d) for d in tensor.shape)
    return _cpp_error("poptorch_cpp_error", f"Zero-sized tensors are unsupported (Got shape [{shape}]).",
                      "poptorch/source/dispatch_tracer/Tensor.cpp", 313)  # fmt: skip


class PoplarExecutor:
    """Device state. PopTorch keeps the weights in two places: the host tensors of the user's module and
    the device's variables. The double keeps the second as ``_device``, a copy per replica of every
    floating-point parameter and buffer (the PopART weights; the others are constants of the graph, see
    _trace), and runs ``forward`` with those copies in the module's place:

    * upload: _on_device_attach calls copyWeightsToDevice on every attach, i.e. when _compile attaches
      (ConnectionType.Always) and in attachToDevice; copyWeightsToDevice writes all weights
      (_poplar_executor.py; popart_compiler/source/Compiler.cpp, Compiler::copyWeightsToDevice:
      writeWeights then weightsFromHost);
    * in-place updates of a weight in forward become poptorch::update_param_inplace
      (InplaceOps.cpp, finalizeGraph), lowered to PopART's CopyVarUpdate, so they persist on the device
      across calls (tests/buffers_test.py, test_no_input_but_one_buffer); those of a constant last only
      until the end of the run;
    * download: only copyWeightsToHost, which copies all weights into the host tensors' memory
      (Compiler::copyWeightsToHost: weightsToHost, readWeights; python/poptorch.cpp passes the tensors'
      data pointers). An inference model never does it implicitly: __call__ sets _dirty_host_weights
      only when training, and detachFromDevice and destroy copy back only when training;
      docs/user_guide/overview.rst, "PyTorch buffers", says so;
    * with replicas and broadcastBuffers(False), each replica updates its own buffers
      (tests/buffers_test.py, test_unsynchronised_replicated_buffers). Micro-batch k of a call runs on
      replica k % replicas (PopART's host layout [iterations, replicas, ...]).
    """

    def __init__(self, model: torch.nn.Module, options: Options) -> None:
        # PoplarExecutor.__init__: the given options are frozen and cloned; an inference model defaults to
        # OutputMode.All; gradientAccumulation must be 1.
        options._freeze()
        options = options.clone()
        if options.defaultOutputMode():
            options.outputMode(OutputMode.All)
        if options.Training.gradient_accumulation != 1:
            raise _python_error(
                "You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as its "
                "default value (1) when running a poptorch.inferenceModel()."
            )
        self._model = model
        self._options = options
        self._compiled_args = None
        self._outputs_structure = None
        self._is_attached = False
        self._attached_ipus = 0
        self._device: list[dict[str, torch.Tensor]] = []
        # Set by _trace: the PopART weights in registration order, their device shape and dtype, and the
        # constants' compile-time values.
        self._registered: list[str] = []
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._constants: dict[str, torch.Tensor] = {}
        self._replicas_diverge = False
        options._freeze()

    def __getattr__(self, name: str):
        """PoplarExecutor.__getattr__: other attributes are the wrapped module's (its host tensors).
        Assumed away: PopTorch hands a Parameter back inside a ReplicaGroupingWrapper that forwards its
        attributes; the double hands back the Parameter."""
        model = self.__dict__.get("_model")
        if model is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(model, name)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def _factor(self) -> int:
        opts = self._options
        return opts.device_iterations * opts.replication_factor * opts.Training.gradient_accumulation

    def _narrow(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """PoplarExecutor._narrow_tensor: dim 0 must be a multiple of the batch factor (an assertion),
        and the trace sees one micro-batch; a scalar counts as a batch of 1 and is passed whole."""
        opts = self._options
        size = 1 if not tensor.size() else tensor.size()[0]
        assert size % self._factor == 0, (
            f"Invalid batch dimension: In the input {tuple(tensor.shape)}, the batch dimension ({size}) must "
            f"be a multiple of Options.deviceIterations({opts.device_iterations}) * "
            f"(Options.replicationFactor({opts.replication_factor}) / "
            "Options.inputReplicaGrouping.input_group_size(1)) * "
            f"Options.Training.gradientAccumulation({opts.Training.gradient_accumulation}) = {self._factor} "
            "because it is used to calculate the batch size which will be executed on the device in any "
            "given iteration. For a full explanation see the batching semantics page of the documentation."
        )
        return tensor if tensor.shape == torch.Size([]) else tensor.narrow(0, 0, size // self._factor)

    def _trace(self, micro_args: list) -> tuple[bool, set[str]]:
        """_compileWithDispatch: parameters and buffers move to the IPU (here: meta) and back afterwards,
        inputs with requires_grad are refused, the module runs once, outputs not on the device draw a
        warning; once the CPU tensors are back, a parameter or buffer that forward replaced or removed is
        refused (errorOnBufferOrParameterAddressChanges, in the same finally block).

        Before that, the module's tensors are sorted as the move sorts them (JITDispatch::addParameter):
        a floating-point parameter or buffer becomes a graph input, a PopART weight (``_registered``, in
        registration order, with its device shape and dtype in ``_specs``); any other (int, bool) becomes
        a constant of the graph, its host value at this moment (JITDispatch::addConstant, insertConstant
        of ``cpu_tensor.to(...)``; ValueMapper::setParameterName then logs "was downgraded to constant
        because PopART doesn't support non floating point parameters" and gives it no name).

        Returns whether forward updated a weight in place (an in-place op on it or on a view of it bumps
        its version counter, as the dispatcher's alias tracking follows views to the input) and the ops
        that have no handler. An in-place update of a constant is not one: addConstant does not track it
        (only addTensor calls InplaceInputsTracker::addTensor), so JITDispatch::fallback finds no aliased
        input, InplaceInputsTracker::finalizeGraph adds no update_param_inplace (and raises no broadcast
        error), and removeRemainingInplaceOps makes the op out-of-place (copy_, kept in place there,
        becomes an identity or cast of its source: popart_canonicalization/TensorOps.cpp, copyHandler):
        nothing refuses it, later reads in the same run see the new value (fallback points the tensor's
        record at the op's output), and the next run sees the constant again (see _run_micro_batch)."""
        weights = self._weights()
        names = {id(tensor): name for name, tensor in weights.items()}
        self._registered = [
            name for name in _registration_order(self._model, names) if weights[name].is_floating_point()
        ]
        self._specs = {
            name: (tuple(weights[name].shape), _COERCED.get(weights[name].dtype, weights[name].dtype))
            for name in self._registered
        }
        self._constants = {
            name: _as_on_device(tensor) for name, tensor in weights.items() if not tensor.is_floating_point()
        }
        for name in self._registered:  # moved (addTensor) before the inputs are checked and moved
            if (error := _zero_sized(weights[name])) is not None:
                raise error
        for index, tensor in enumerate(micro_args):
            if tensor.requires_grad:
                raise _python_error(f"An input tensor to an IPU model can not have requires_grad set to True, "
                                    f"however input {index} does: {tensor}")  # fmt: skip
        for tensor in micro_args:
            if (error := _zero_sized(tensor)) is not None:
                raise error
        saved, moved = [], []
        tracer = _DispatchTrace()
        old = new = ({}, {})
        try:
            for kind in ("_parameters", "_buffers"):
                for table, name, tensor in list(_entries(self._model, kind)):
                    saved.append((table, name, tensor))
                    on_device = torch.empty_like(tensor, device=_TRACE_DEVICE)
                    if kind == "_parameters":
                        on_device = torch.nn.Parameter(on_device, tensor.requires_grad)
                    table[name] = on_device
                    if tensor.is_floating_point():
                        moved.append(on_device)
            old = _addresses(self._model)
            try:
                with _OnTraceDevice(), tracer:
                    result = self._model(*[_as_on_device(t).to(_TRACE_DEVICE) for t in micro_args])
            finally:
                new = _addresses(self._model)
        finally:
            for table, name, tensor in reversed(saved):
                table[name] = tensor
            _error_on_address_changes(old, new)
        outputs = [result] if isinstance(result, torch.Tensor) else list(result)
        for output in outputs:
            if output.device.type != _TRACE_DEVICE:
                warnings.warn(
                    f"Output expected to be on the IPU but is on {output.device.type}", stacklevel=3
                )
        self._outputs_structure = type(result)
        return any(tensor._version for tensor in moved), tracer.unsupported

    def _lower(self, updates_weights: bool, unsupported: set[str]) -> None:
        """LowerToPopartFactories.cpp, lowerToPopartFromDispatch: the in-place pass (finalizeGraph) runs
        before the check for ops left without a handler (errorOnUnsupportedAten); both are C++ errors."""
        opts = self._options
        # The double has no inputReplicaGrouping: input_group_size is 1.
        if updates_weights and opts.replication_factor > 1 and opts.broadcast_buffers:
            raise _cpp_error("poptorch_cpp_error", _BROADCAST_ERROR, "poptorch/source/InplaceOps.cpp", 228)
        if unsupported:
            # torch::jit::Symbol::toQualString of each; the order of an unordered_set (here: sorted).
            raise _cpp_error("poptorch_cpp_error", (
                f"Unsupported ops found in compiled model: [{', '.join(sorted(unsupported))}]. Not all "
                "operations are supported yet by Graphcore's PyTorch compiler. If you believe any of these "
                "should be, please report this message to support@graphcore.ai."),
                "poptorch/source/ErrorOnUnsupportedAten.cpp", 30)  # fmt: skip
        # Replicas differ only when forward writes a weight; otherwise one copy stands for all.
        self._replicas_diverge = updates_weights and opts.replication_factor > 1
        self._check_updatable_buffers()

    def _check_updatable_buffers(self) -> None:
        """graphcore/popart willow/src/popx/irlowering.cpp, IrLowering::prepareGraph: each name in
        updatableNamedBuffers must be a tensor of the IR ("Fail early if incorrect buffer names are set"),
        else Ir::getTensor's error (willow/src/ir.cpp) is rethrown with this prefix; PopTorch passes it on
        as a poptorch.Error (tests/buffers_test.py, test_copy_named_buffer_to_device_invalid_opt).
        PopTorch names a parameter's or buffer's PopART tensor by its name in the model
        (poptorch/source/LowerToPopart.cpp: getParameterName, then addInitializedInputTensor).
        Only weights are IR tensors of that name: a constant (a non-floating-point buffer, see _trace) is
        not, so listing one is refused here too.
        Assumed: every floating-point parameter and buffer is used by the graph (lowerParameters drops
        unused ones, "Skipping unused parameter", which would then be unknown names too), and no other IR
        tensor has such a name."""
        names = self._options._Popart.options.get("updatableNamedBuffers")
        if not names:
            return
        known = set(self._registered)
        for name in names:
            if name not in known:
                raise _cpp_error("popart_exception", (
                    f"Invalid named buffer in updatableNamedBuffers!\nNo Ir::Tensor with TensorId '{name}' in "
                    "Ir::getTensor(..) "))  # fmt: skip

    def _ipus(self) -> int:
        return self._options.replication_factor

    def _acquire(self) -> None:
        """CompilerImpl::createDevice: the IPU Model from use_model, else POPTORCH_IPU_MODEL /
        POPTORCH_SMALL_IPU_MODEL (updateUseModelConfig); a hardware count that is not a power of two is
        refused unless autoRoundNumIPUs; "Failed to acquire" plus checkSystemConfig's reason otherwise."""
        opts = self._options
        if self._uses_model():
            self._is_attached = True
            return
        _fault("acquire")
        num_ipus = self._ipus()
        rounded = 1 << (num_ipus - 1).bit_length()
        if rounded != num_ipus:
            if not opts.auto_round_num_ipus:
                raise _cpp_error("poptorch_cpp_error", (
                    f"The model specifies the use of {num_ipus} IPUs, however PopTorch must reserve a minimum "
                    f"of {rounded} in order to allow the model to run, because PopTorch must reserve a power "
                    "of 2 or maximum of 64 IPUs per process. Please reconfigure your model to use a different "
                    "number of IPUs or set poptorch.Options().autoRoundNumIPUs(True)."), _COMPILER_IMPL, 707)  # fmt: skip
            num_ipus = rounded
        total = int(_config().get("ipus", 0))
        if opts.exists("ipu_id"):
            covered = _ids_ipus(opts.ipu_id)
            if not covered or _attached_ipus[0] + covered > total:
                raise _cpp_error(
                    "poptorch_cpp_error", f"Failed to acquire device Id {opts.ipu_id}", _COMPILER_IMPL, 736
                )
            if covered < num_ipus:
                raise _cpp_error("poptorch_cpp_error", (
                    f"Expected at least replication factor * used IPUs = 1 * {opts.replication_factor} = "
                    f"{num_ipus} device Ids but the user provided {covered}"), _COMPILER_IMPL, 739)  # fmt: skip
            num_ipus = covered
        elif _attached_ipus[0] + num_ipus > total:
            if total == 0:
                reason = "\nNo IPU detected in the system. \nFor more information use the Graphcore command-line tool `gc-monitor`."
            elif not _device_groups(num_ipus):
                reason = (
                    f"\nNo device found on the system with {num_ipus} IPUs: the configuration needs changing"
                )
            else:  # the devices exist but are taken
                reason = ""
            raise _cpp_error(
                "poptorch_cpp_error", f"Failed to acquire {num_ipus} IPU(s){reason}", _COMPILER_IMPL, 725
            )
        _attached_ipus[0] += num_ipus
        self._attached_ipus = num_ipus
        self._is_attached = True
        _log("attach", ipus=num_ipus, ipu_id=opts.ipu_id if opts.exists("ipu_id") else None)

    def _uses_model(self) -> bool:
        opts = self._options
        return bool(opts.use_model) if opts.exists("use_model") else _model_from_environment()

    def _caching(self) -> str | None:
        popart = self._options._Popart.options
        return popart.get("cachePath") if popart.get("enableEngineCaching") else None

    def compile(self, *args) -> None:
        """PoplarExecutor.compile: a second compile is ignored (with a warning)."""
        if self._compiled_args is not None:
            warnings.warn("Call to compile() ignored: the executable is already compiled", stacklevel=2)
            return
        self._compile(args)

    def _compile(self, args) -> None:
        opts = self._options
        offline = opts.connection_type == ConnectionType.Never.value
        cache = self._caching()
        _log("compile", args=[{"shape": list(a.shape), "dtype": str(a.dtype)} for a in args],
             deviceIterations=opts.device_iterations, replicationFactor=opts.replication_factor,
             outputMode=OutputMode(opts.output_mode).name, ipuModel=self._uses_model(), cachePath=cache,
             partials={"float": "torch.float32", "half": "torch.float16"}[
                 opts._Popart.options.get("partialsTypeMatMuls", "float")],
             offline=opts.ipu_version if offline else None,
             processes=[opts.Distributed.processId, opts.Distributed.numProcesses],
             ipuId=opts.ipu_id if opts.exists("ipu_id") else None)  # fmt: skip
        micro = [self._narrow(index, a) for index, a in enumerate(args)]
        self._lower(*self._trace(micro))
        _fault("compile")
        if self._uses_model() and offline:
            raise _cpp_error("poptorch_cpp_error", "ConnectionType.Never / poptorch.Options.useOfflineIpuTarget "
                             "not supported for the IPU model", _COMPILER_IMPL, 654)  # fmt: skip
        if self._uses_model() and cache:
            # CompilerImpl::createDevice warns and PopART's cache is not used on the IPU Model.
            warnings.warn("enableExecutableCaching doesn't work with the IPU model", stacklevel=3)
            cache = None
        limit = _config().get("memory_bytes_per_ipu")
        weights = sum(t.numel() * t.element_size() for t in self._model.state_dict().values())
        if limit is not None and weights > float(limit):
            raise _cpp_error("popart_exception", _oom_message(weights, float(limit)))
        if cache:
            # Assumed (PopART's hash is of the IR, not the weights' values, which PopTorch uploads on
            # attach with copyWeightsToDevice): the key ignores weight values.
            shapes = [(tuple(t.shape), str(t.dtype)) for t in micro]
            digest = hashlib.sha256(repr((shapes, opts.device_iterations, opts.replication_factor)).encode())
            path = os.path.join(cache, f"{digest.hexdigest()[:32]}.popef")
            if os.path.exists(path):
                _log("cache_hit", path=path)
            else:
                os.makedirs(cache, exist_ok=True)
                with open(path, "wb") as stream:
                    stream.write(b"POPEF-DOUBLE poptorch\n")
                _log("cache_write", path=path)
        self._compiled_args = [(a.shape, a.dtype) for a in args]
        # _compile: ConnectionType.Always attaches while compiling, Never not at all; an attach uploads
        # the weights (_on_device_attach).
        if not offline:
            self._acquire()
            self._on_device_attach()

    def _on_device_attach(self) -> None:
        """PoplarExecutor._on_device_attach: copyWeightsToDevice (the optimizer and RNG state are not
        modelled)."""
        self.copyWeightsToDevice()

    def _weights(self) -> dict[str, torch.Tensor]:
        """copyWeightsToHost / copyWeightsToDevice: named_parameters, then named_buffers, of the model."""
        return {**dict(self._model.named_parameters()), **dict(self._model.named_buffers())}

    def _on_device(self) -> None:
        """The device copies are reachable only while attached. PopART's Devicex::weightsFromHost and
        weightsToHost run a program (Devicex::run), which loads the engine when it is not loaded:
        loadEngineAndConnectStreams refuses an offline device with this text (graphcore/popart
        willow/src/popx/devicex.cpp). Assumed (Poplar is closed): loading on a device this process
        detached from fails as well; the double refuses rather than return stale values."""
        if self._is_attached:
            return
        if self._options.connection_type == ConnectionType.Never.value:
            raise _cpp_error("popart_exception", "Trying to load an engine on an offline device")
        raise _cpp_error("popart_exception", "Trying to load an engine on a device that is not attached")

    def _host_values(self, host: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """PoplarExecutable::copyWeightsToDevice / copyWeightsToHost (poptorch/source/PoplarExecutable.cpp):
        the host pointers looked up by name (``buffers.at(name)``) for each PopART weight, in
        registration order (_parameter_names, filled by lowerParameters). Constants are not weights:
        nothing is copied for them, either way."""
        missing = [name for name in self._registered if name not in host]
        if missing:  # std::map::at on a name the model no longer has
            raise _cpp_error("std::out_of_range", "map::at")
        return [host[name] for name in self._registered]

    def copyWeightsToDevice(self) -> None:  # noqa: N802
        """PoplarExecutor.copyWeightsToDevice: the named parameters and buffers of the model go to
        poptorch_core.copyWeightsToDevice_impl, which writes the PopART weights among them (_host_values)
        and then runs weightsFromHost (Compiler::copyWeightsToDevice), to every replica (PopART streams
        one host value to all replicas of an ungrouped variable). A constant keeps its compile-time value
        on the device whatever the host tensor holds."""
        if self._compiled_args is None:
            raise _python_error(_NO_EXECUTABLE)
        hosts = self._host_values(self._weights())
        values = {
            name: _from_host(host, name, name, self._specs[name])
            for name, host in zip(self._registered, hosts)  # noqa: B905
        }
        self._on_device()
        replicas = self._options.replication_factor if self._replicas_diverge else 1
        self._device = [{name: value.clone() for name, value in values.items()} for _ in range(replicas)]
        _log("copyWeightsToDevice", weights=len(values))

    def copyNamedBuffersToDevice(self) -> None:  # noqa: N802
        """PoplarExecutor.copyNamedBuffersToDevice (python/_poplar_executor.py): compiled, else
        NO_EXECUTABLE_ERR; the option updatableNamedBuffers set, else a PoptorchError; then the host
        tensors of those buffers (the model's named_buffers(), so a parameter's name is a KeyError) go
        to the device, and nothing else.

        How they are paired with the device's buffers: python/poptorch.cpp, getParameterBuffers puts
        (name, data pointer) into a std::map<std::string, void *> (a repeated name keeps its first entry);
        PoplarExecutable::copyNamedBuffersToDevice passes the pointers on in the map's order, i.e. the
        names sorted bytewise, without the names; popart_compiler/source/Compiler.cpp,
        Compiler::copyNamedBuffersToDevice hands them to updatable_named_buffers.updateData
        (CompilerImpl.cpp, WeightsIO::updateData: ERROR_ON a count other than the registered buffers',
        then pointer i to _weights_order[i]), which lists the buffers in registration order (see
        _registration_order). Where the two orders differ (``state_10`` sorts before ``state_9``), a
        buffer receives another's bytes, a raw copy of its own size (_from_host): no error where shapes
        and dtypes agree. Then writeWeights and Session::buffersFromHost (the copyNamedBuffers program of
        irlowering.cpp) write them to the device. Each replica gets the host value, as with
        copyWeightsToDevice."""
        if self._compiled_args is None:
            raise _python_error(_NO_EXECUTABLE)
        popart = self._options._Popart.options
        if "updatableNamedBuffers" not in popart:
            raise _python_error("No named buffers marked as updatable via updatableNamedBuffers option")
        buffers = dict(self._model.named_buffers())
        listed = [(name, buffers[name]) for name in popart["updatableNamedBuffers"]]
        by_name: dict[str, torch.Tensor] = {}
        for name, tensor in listed:
            by_name.setdefault(name, tensor)  # std::map::insert keeps the first
        host_names = sorted(by_name, key=lambda name: name.encode())
        registered = [name for name in self._registered if name in set(popart["updatableNamedBuffers"])]
        if len(host_names) != len(registered):
            raise _cpp_error("poptorch_cpp_error", "host_buffers.size() != _weights_order.size()",
                             "popart_compiler/source/CompilerImpl.cpp", 385)  # fmt: skip
        values = {
            tensor_id: _from_host(by_name[host_name], host_name, tensor_id, self._specs[tensor_id])
            for tensor_id, host_name in zip(registered, host_names)  # noqa: B905
        }
        self._on_device()
        for state in self._device:
            for name, value in values.items():
                state[name] = value.clone()
        _log("copyNamedBuffersToDevice", buffers=host_names, registered=registered)

    def copyWeightsToHost(self) -> None:  # noqa: N802
        """PoplarExecutor.copyWeightsToHost: the PopART weights (_host_values) are written into the host
        tensors' memory (the user's, through the shallow copy; Compiler::copyWeightsToHost: weightsToHost,
        then readWeights into the host pointers). A constant's host tensor is left as it is. Assumed
        (PopART's retrieval of an ungrouped variable from replicas that diverged is decided in Poplar's
        streams): replica 0's."""
        if self._compiled_args is None:
            raise _python_error(_NO_EXECUTABLE)
        self._on_device()
        hosts = self._host_values(self._weights())
        with torch.no_grad():
            for name, host in zip(self._registered, hosts):  # noqa: B905
                _into_host(host, name, name, self._device[0][name])
        _log("copyWeightsToHost")

    def _run_micro_batch(self, replica: int, names: dict[int, str], args: list):
        """One micro-batch with the replica's device copies in place of the module's tensors; the host
        tensors are put back whatever happens.

        A constant is its compile-time value again in every run and device iteration (it is part of the
        graph, see _trace): a fresh copy of it per micro-batch, one per tensor so aliases stay aliases.
        Inputs hold the device's values (_as_on_device: PoplarExecutable::run casts an int64 input to
        int32 and a float64 one to float32); an input updated in place is copied back into the caller's
        tensor after the run (PoplarExecutable::run, input_output_mapping from finalizeGraph)."""
        state = self._device[replica if self._replicas_diverge else 0]
        constants = {name: value.clone() for name, value in self._constants.items()}
        converted = [_as_on_device(a) if a.dtype in _COERCED else a for a in args]
        versions = [a._version for a in converted]
        saved = []
        try:
            for kind in ("_parameters", "_buffers"):
                for table, name, tensor in list(_entries(self._model, kind)):
                    saved.append((table, name, tensor))
                    key = names[id(tensor)]
                    table[name] = _like_host(tensor, state[key] if key in state else constants[key])
            result = self._model(*converted)
        finally:
            for table, name, tensor in reversed(saved):
                table[name] = tensor
        for original, value, version in zip(args, converted, versions):  # noqa: B905
            if value is not original and value._version != version:
                original.copy_(value)
        return result

    def __call__(self, *args):
        assert self._options.connection_type != ConnectionType.Never.value, (
            "Trying to run a model on an offline device (ConnectionType.Never): use model.compile(inputs) "
            "instead of model(inputs)"
        )
        if self._compiled_args is None:
            self._compile(args)
        if not self._is_attached:
            self.attachToDevice()
        # _args_parser.py, validateInputs: the same count, dtypes and full shapes as at compile.
        end = ("\nThis error occurred because the inputs passed at runtime don't match the inputs used to "
               "compile the model.\nTo recompile the model for the new inputs create a new inferenceModel / "
               "trainingModel wrapper or call destroy() on the curent one and try again.")  # fmt: skip
        if len(args) != len(self._compiled_args):
            raise _python_error(f"Number of positional arguments mismatch: expected {len(self._compiled_args)} "
                                f"arguments but got {len(args)}.{end}")  # fmt: skip
        for index, (tensor, (shape, dtype)) in enumerate(zip(args, self._compiled_args)):  # noqa: B905
            if tensor.dtype != dtype:
                raise _python_error(
                    f"Data type mismatch for args[{index}]: expected {dtype} but got {tensor.dtype}.{end}"
                )
            if tensor.shape != shape:
                raise _python_error(
                    f"Shape mismatch for args[{index}]: expected {shape} but got {tensor.shape}.{end}"
                )
        _log("run", args=[{"shape": list(a.shape), "dtype": str(a.dtype)} for a in args])
        _fault("run")
        factor = self._factor
        chunks = [torch.chunk(a, factor, dim=0) if a.dim() else [a] * factor for a in args]
        names = {id(tensor): name for name, tensor in self._weights().items()}
        replicas = self._options.replication_factor
        with torch.no_grad():
            results = [
                self._run_micro_batch(k % replicas, names, [c[k] for c in chunks]) for k in range(factor)
            ]
        if isinstance(results[0], torch.Tensor):
            results = [(r,) for r in results]
        merged = []
        for index in range(len(results[0])):
            tensor = torch.cat([r[index] for r in results], dim=0)
            # _compileWithDispatch: long outputs become int, double outputs float.
            if tensor.dtype == torch.int64:
                tensor = tensor.to(torch.int32)
            elif tensor.dtype == torch.float64:
                tensor = tensor.to(torch.float32)
            merged.append(tensor)
        # __call__: the outputs in the structure the module returned.
        if self._outputs_structure is torch.Tensor:
            return merged[0]
        return self._outputs_structure(merged) if self._outputs_structure in (tuple, list) else tuple(merged)

    def detachFromDevice(self) -> None:  # noqa: N802
        """PoplarExecutor.detachFromDevice: compiled and attached, or poptorch_py_error; the weights are
        read back only when training, so an inference model's device state is lost (the next attach
        uploads the host values again)."""
        if self._compiled_args is None:
            raise _python_error(_NO_EXECUTABLE)
        if not self._is_attached:
            raise _python_error("Device is not attached")
        _attached_ipus[0] -= self._attached_ipus
        self._attached_ipus = 0
        self._is_attached = False
        _log("detachFromDevice")

    def attachToDevice(self) -> None:  # noqa: N802
        """PoplarExecutor.attachToDevice: compiled, not offline (assertion), not attached; then the
        device is acquired and the weights uploaded (_on_device_attach)."""
        if self._compiled_args is None:
            raise _python_error(_NO_EXECUTABLE)
        assert self._options.connection_type != ConnectionType.Never.value, (
            "Trying to attach to an offline device (ConnectionType.Never)"
        )
        if self._is_attached:
            raise _python_error("Device is already attached")
        self._acquire()
        _log("attachToDevice")
        self._on_device_attach()

    def isAttachedToDevice(self) -> bool:  # noqa: N802
        return self._compiled_args is not None and self._is_attached

    def isCompiled(self) -> bool:  # noqa: N802
        return self._compiled_args is not None

    def destroy(self) -> None:
        """PoplarExecutor.destroy: nothing when not compiled; otherwise the executable is deleted, which
        releases its device (assumed: the C++ executable's destructor detaches). Weights are copied back
        only when training."""
        if self._compiled_args is None:
            return
        if self._is_attached:
            _attached_ipus[0] -= self._attached_ipus
            self._attached_ipus = 0
            self._is_attached = False
        self._compiled_args = None
        self._device = []
        _log("destroy")


def inferenceModel(model, options: Options | None = None) -> PoplarExecutor:  # noqa: N802
    """python/__init__.py, inferenceModel: a shallow copy of the module (copy.copy); options must be a
    poptorch.Options (PoplarExecutor.__init__)."""
    if options is not None and not isinstance(options, Options):
        raise _python_error(f"Invalid type: 'options' is of type {type(options)} (Expected poptorch.Options)")
    _log("inferenceModel", training=model.training)
    return PoplarExecutor(copy.copy(model), options or Options())
