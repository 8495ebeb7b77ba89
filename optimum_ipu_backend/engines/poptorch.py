"""The PopTorch engine: the legalized ONNX graph as a torch module run by ``poptorch.inferenceModel``.

Chosen with the provider option ``engine="poptorch"`` (install ``optimum-ipu-backend[poptorch]`` and
the SDK's PopTorch wheel). PopTorch compiles torch modules, not ONNX, so the worker turns the legalized
graph into one (``engines.onnx_torch``; why not onnx2torch is said there) and maps the provider options
onto ``poptorch.Options`` (as PopTorch documents them): ``deviceIterations``, ``replicationFactor``,
``outputMode(OutputMode.All)``, ``Precision.setPartialsType`` from the precision,
``enableExecutableCaching`` into the artifact directory of our cache entry (IPU and offline targets;
PopTorch warns that caching does not work on the IPU Model), ``useIpuModel`` (set either way) and
``useOfflineIpuTarget`` to compile without hardware. Under PopRun the options are PopDist's
``popdist.poptorch.Options``, which set this instance's replicas, place and device themselves.

What the environment would otherwise decide is set explicitly: ``poptorch.Options()`` turns PopTorch's
own executable cache on from ``POPTORCH_CACHE_DIR`` (or ``POPTORCH_DEFAULT_OPTIONS``), and its key ignores
the weights' values, so it is turned off unless our cache entry holds it; and ``POPTORCH_IPU_MODEL`` /
``POPTORCH_SMALL_IPU_MODEL`` would put a device="ipu" session on the IPU Model and hide the hardware
from ``ipuHardwareIsAvailable``, so the worker drops them: the device option decides.

PopTorch's batch rule: dim 0 of every input is ``micro-batch x deviceIterations x replicationFactor``,
and outputs come back concatenated on dim 0. Our step buffers ``[device_iterations, replicas, *shape]``
are exactly that in C order, so they are passed as views, reshaped, without a copy. A scalar has no
dim 0: it travels as ``[steps]`` and the module hands the graph its scalar (``ScalarsWithLeadingAxis``).

Residency: a PopTorch executor attaches to its own IPUs. When executables outnumber the IPUs, the worker
detaches the one loaded on a device before attaching another (``detachFromDevice`` /
``attachToDevice``), which is PopTorch's engine switch.

Carried state (``engines.base.state_updates``): each state tensor is a buffer of the module, updated in
place (``engines.onnx_torch``), which PopTorch keeps on the device between calls. Only floating-point
buffers can be state: PopTorch makes every other one a constant (``integer_state = False``; the runtime
carries integer masks as float32). The state buffers are named in ``Options.updatableNamedBuffers`` in
registration order, which is also their names' order (``copyNamedBuffersToDevice`` relies on it:
``engines.onnx_torch.BUFFER_COUNTER_WIDTH``), so that ``write_state`` writes the host copies and uploads
those alone (``copyNamedBuffersToDevice``; graphcore/poptorch sdk-release-3.4,
python/_poplar_executor.py). An inference model never copies buffers back to the host, and every attach
uploads the host copies (``_on_device_attach``): before a switch detaches an executable with state, the
worker downloads its buffers (``copyWeightsToHost``), so the state survives the switch; a reset is not
retried (the worker).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optimum_ipu_backend.engines.base import EngineContractError
from optimum_ipu_backend.engines.probe import DEVICE_KINDS
from optimum_ipu_backend.engines.worker import WorkerEngine
from optimum_ipu_backend.engines.worker_server import Backend, recovery_action_name
from optimum_ipu_backend.errors import InstallationError

_IPU_VERSIONS = {"ipu2": 2, "ipu21": 21}
# PopTorch's environment switches to the IPU Model (popart_compiler Utils.cpp reads them at each device
# creation and in ipuHardwareVersion); the device provider option decides instead.
_MODEL_VARIABLES = ("POPTORCH_IPU_MODEL", "POPTORCH_SMALL_IPU_MODEL")
# PopTorch writes a compile error of more than 80 lines here, in its current directory, and its message
# says only "See poptorch_error.log for details".
_ERROR_LOG = "poptorch_error.log"


class PopTorchEngine(WorkerEngine):
    name = "poptorch"
    devices = ("ipu", "ipu-model")
    priority = 10
    sdk_module = "poptorch"
    sdk_label = "PopTorch"
    sdk_install = (
        "enable the SDK and install its PopTorch wheel (pip install optimum-ipu-backend[poptorch] for the "
        "host side)"
    )
    backend = "optimum_ipu_backend.engines.poptorch:PopTorchBackend"
    # PopTorch makes every parameter and buffer that is not floating point a constant (graphcore/poptorch
    # sdk-release-3.4, poptorch/source/dispatch_tracer/JITDispatch.cpp, addParameter).
    integer_state = False


# -- worker side ---------------------------------------------------------------------------------------


@dataclass
class _Executor:
    executor: Any
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    steps: int
    device_label: str
    module: Any = None
    # the state tensors' specs, and each one's buffer name in the module (PopTorch's name for it)
    state: list[dict[str, Any]] = field(default_factory=list)
    state_buffers: dict[str, str] = field(default_factory=dict)


@dataclass
class _DeviceShare:
    """PopTorch acquires IPUs itself; the worker only books how many each device slot takes."""

    ipus: int
    label: str


class PopTorchBackend(Backend[_Executor]):
    def __init__(self) -> None:
        import poptorch
        import torch

        self.poptorch, self.torch = poptorch, torch
        for name in _MODEL_VARIABLES:
            os.environ.pop(name, None)
        self._booked = 0
        self._capacity = 0

    def hello(self) -> dict[str, Any]:
        poptorch = self.poptorch
        ipus = 0
        while ipus < 1024 and poptorch.ipuHardwareIsAvailable(max(ipus * 2, 1)):
            ipus = max(ipus * 2, 1)
        self._capacity = ipus
        version = (
            {v: k for k, v in _IPU_VERSIONS.items()}.get(poptorch.ipuHardwareVersion()) if ipus else None
        )
        return {"sdk_version": poptorch.__version__, "ipus": ipus, "ipu_version": version}

    def open_device(
        self, device: str, ipus: int, offline: bool, ipu_version: str, options: dict, required: bool
    ) -> _DeviceShare | None:
        if offline or not DEVICE_KINDS[device].needs_hardware:
            return _DeviceShare(0, "offline target" if offline else "IPU Model")
        if self._booked + ipus > self._capacity and not required:
            return None
        # When required and short, PopTorch's own acquisition reports the failure at compile.
        self._booked += ipus
        return _DeviceShare(ipus, f"IPUs {self._booked - ipus}..{self._booked - 1}")

    def close_device(self, share: _DeviceShare) -> None:
        self._booked -= share.ipus

    def _options(
        self, options: dict, artifacts: str | None, device: str, offline: bool, ipu_version: str
    ) -> Any:
        poptorch, torch = self.poptorch, self.torch
        distributed = options.get("distributed")
        if distributed:
            opts = _popdist_options(distributed.get("ipus_per_replica", 1))
        else:
            opts = poptorch.Options()
            opts.replicationFactor(options["replicas"])
        opts.deviceIterations(options["device_iterations"])
        opts.outputMode(poptorch.OutputMode.All)
        opts.Precision.setPartialsType(torch.half if options["precision"] == "fp16" else torch.float)
        model = DEVICE_KINDS[device].simulated and not offline
        opts.useIpuModel(model)
        if artifacts is not None and not model:
            os.makedirs(artifacts, exist_ok=True)
            opts.enableExecutableCaching(artifacts)
        else:  # never a cache PopTorch's environment chose: its key ignores the weights' values
            opts.enableExecutableCaching(None)
        if offline:
            opts.useOfflineIpuTarget(_IPU_VERSIONS.get(ipu_version, 2))
        return opts

    def build(
        self, graph: str, artifacts: str | None, options: dict, device: Any, device_name: str, offline: bool
    ) -> _Executor:
        import onnx

        from optimum_ipu_backend.engines.onnx_torch import (
            OnnxGraphModule,
            ScalarsWithLeadingAxis,
            check_buffer_order,
        )

        torch = self.torch
        model = onnx.load(graph)  # external data resolves next to the file
        graph_module = OnnxGraphModule(model).eval()
        steps = options["device_iterations"] * options["replicas"]

        def specs(values, names) -> list[dict[str, Any]]:
            result = []
            for value in values:
                if value.name not in names:
                    continue
                shape = tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
                dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
                result.append({"name": value.name, "shape": shape, "dtype": np.dtype(dtype).name})
            return result

        inputs = specs(model.graph.input, graph_module.input_names)
        # every output is the executable's; forward returns those with elements (see OnnxGraphModule)
        outputs = specs(model.graph.output, [value.name for value in model.graph.output])
        returned = [spec for spec in outputs if spec["name"] in graph_module.output_names]
        # PopTorch's batch rule needs a dim 0 on every input and output: scalars travel as [steps]
        module = ScalarsWithLeadingAxis(
            graph_module,
            {index for index, spec in enumerate(inputs) if not spec["shape"]},
            {index for index, spec in enumerate(returned) if not spec["shape"]},
        ).eval()
        opts = self._options(options, artifacts, device_name, offline, options.get("ipu_version") or "ipu2")
        state, state_buffers = _state(model.graph, graph_module, module)
        if state_buffers:
            if options["replicas"] > 1:
                # PopTorch refuses an in-place buffer update with replicas unless broadcastBuffers(False)
                # (poptorch/source/InplaceOps.cpp), and then each replica keeps its own: not one state.
                raise EngineContractError(
                    "the PopTorch engine keeps state on the device for one replica; this graph carries state "
                    f"and was compiled for {options['replicas']} replicas"
                )
            # in registration order, whose names sort the same (engines.onnx_torch.BUFFER_COUNTER_WIDTH)
            names = set(state_buffers.values())
            registered = [name for name in _registration_order(module) if name in names]
            check_buffer_order(registered)
            opts.updatableNamedBuffers(registered)
        executor = self.poptorch.inferenceModel(module, opts)
        for spec in inputs:  # the shape PopTorch takes, fixed from here on
            spec["host_shape"] = _leading_axis(spec["shape"], steps)
        examples = [torch.zeros(spec["host_shape"], dtype=getattr(torch, spec["dtype"])) for spec in inputs]
        executor.compile(*examples)
        return _Executor(executor, inputs, outputs, steps, device.label, module, state, state_buffers)

    def write_state(self, built: _Executor, values: dict[str, np.ndarray]) -> None:
        torch = self.torch
        if not built.state_buffers:
            raise EngineContractError("this executable keeps no state on the device")
        # the host copies, which the executor's shallow copy of the module shares
        buffers = dict(built.module.named_buffers())
        with torch.no_grad():
            for name, value in values.items():
                buffers[built.state_buffers[name]].copy_(torch.from_numpy(np.ascontiguousarray(value)))
        built.executor.copyNamedBuffersToDevice()

    def run(self, built: _Executor, inputs: dict, outputs: dict) -> None:
        torch = self.torch
        args = [torch.from_numpy(inputs[spec["name"]].reshape(spec["host_shape"])) for spec in built.inputs]
        results = built.executor(*args)
        if isinstance(results, torch.Tensor):
            results = (results,)
        returned = [spec for spec in built.outputs if math.prod(spec["shape"])]  # the others hold nothing
        if len(results) != len(returned):
            raise EngineContractError(f"PopTorch returned {len(results)} outputs, not {len(returned)}")
        for spec, tensor in zip(returned, results):
            target = outputs[spec["name"]]
            if math.prod(tensor.shape) != target.size:
                raise EngineContractError(f"PopTorch returned {tuple(tensor.shape)} for {spec['name']!r}")
            target[...] = tensor.detach().numpy().reshape(target.shape)

    def load(self, built: _Executor) -> None:
        if not built.executor.isAttachedToDevice():
            built.executor.attachToDevice()

    def unload(self, built: _Executor) -> None:
        if built.executor.isAttachedToDevice():
            if built.state_buffers:
                # An inference model's detach keeps nothing, and the next attach uploads the host copies
                # (_poplar_executor.py, detachFromDevice, _on_device_attach): bring the state home first,
                # so that it survives the switch. copyWeightsToHost is PopTorch's only download (all weights).
                built.executor.copyWeightsToHost()
            built.executor.detachFromDevice()

    def reset(self, built: _Executor) -> None:
        self.unload(built)
        built.executor.attachToDevice()

    def release(self, built: _Executor) -> None:
        built.executor.destroy()

    def classify(self, exc: BaseException) -> dict[str, Any] | None:
        poptorch = self.poptorch
        if isinstance(exc, poptorch.RecoverableError):
            return {"kind": "recoverable", "recovery_action": recovery_action_name(exc.recovery_action)}
        if isinstance(exc, poptorch.UnrecoverableError):
            return {"kind": "unrecoverable"}
        if isinstance(exc, poptorch.Error):
            if _out_of_memory(getattr(exc, "type", ""), getattr(exc, "message", None) or str(exc)):
                return {"kind": "out_of_memory"}
            if "Failed to acquire" in str(exc):
                return {"kind": "acquisition"}
            return {"kind": "sdk"}
        return None


def _popdist_options(ipus_per_replica: int) -> Any:
    """PopDist's options for this PopRun instance: PopTorch says not to configure the process by hand
    under PopRun (``Options.Distributed``), and the device then comes from PopDist's assignment."""
    try:
        import popdist.poptorch
    except ImportError as exc:
        raise InstallationError(
            "this process runs under PopRun (POPDIST_* variables are set), where PopTorch needs PopDist's "
            f"popdist.poptorch.Options, but the worker's Python ({sys.executable}) cannot import popdist "
            f"({exc}). Install the popdist wheel that ships with the Poplar SDK into that environment, or "
            "serve this model with engine='popart'."
        ) from None
    return popdist.poptorch.Options(ipus_per_replica=ipus_per_replica)


# A compile-time out-of-memory reaches PopTorch as PopART's memory_allocation_err ("popart_exception") or
# as a Poplar memory error ("poplar_..._memory_allocation_error"), with Poplar's "Out of memory ..." text.
_OOM_TEXT = ("out of memory", "memory_allocation")


def _out_of_memory(kind: str, message: str) -> bool:
    if "memory_allocation" in kind:
        return True
    if message.strip().endswith(f"See {_ERROR_LOG} for details"):
        try:  # the whole message went to the log, in the worker's current directory
            with open(_ERROR_LOG, encoding="utf-8", errors="replace") as stream:
                message = stream.read(1 << 20)
        except OSError:
            return False
    lowered = message.lower()
    return any(text in lowered for text in _OOM_TEXT)


def _state(graph: Any, graph_module: Any, module: Any) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The state tensors' specs, and their buffers' names in ``module`` as ``named_buffers()`` gives them:
    the names PopTorch gives their PopART tensors, which ``updatableNamedBuffers`` takes
    (poptorch/source/LowerToPopart.cpp, getParameterName; python/_poplar_executor.py,
    copyNamedBuffersToDevice)."""
    if not graph_module.state_buffers:
        return [], {}
    names = {id(tensor): name for name, tensor in module.named_buffers()}
    specs, buffers = [], {}
    for initializer in graph.initializer:
        if initializer.name in graph_module.state_buffers:
            tensor = getattr(graph_module, graph_module.state_buffers[initializer.name])
            buffers[initializer.name] = names[id(tensor)]
            dtype = str(tensor.dtype).replace("torch.", "")
            specs.append({"name": initializer.name, "shape": tuple(tensor.shape), "dtype": dtype})
    return specs, buffers


def _registration_order(module: Any, prefix: str = "") -> list[str]:
    """The names of ``module``'s parameters and buffers in the order PopTorch registers their PopART
    tensors: the order in which ``module.to(ipu)`` moves them (poptorch python/_poplar_executor.py,
    _compileWithDispatch), which is torch's ``Module._apply``: the children first, depth first, then the
    module's own parameters, then its own buffers."""
    names = []
    for name, child in module.named_children():
        names += _registration_order(child, f"{prefix}{name}.")
    return names + [f"{prefix}{name}" for name in [*module._parameters, *module._buffers]]


def _leading_axis(shape: tuple[int, ...], steps: int) -> tuple[int, ...]:
    """The shape PopTorch takes for one step's ``steps`` micro-batches of an ONNX ``shape``: dim 0
    multiplied by the steps, and a scalar given a dim 0 of its own."""
    return (shape[0] * steps, *shape[1:]) if shape else (steps,)
