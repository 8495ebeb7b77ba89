"""The PopART engine: the legalized ONNX graph as a ``popart.InferenceSession``.

``PopARTEngine`` is the host side (no SDK import); ``PopARTBackend`` runs inside the worker process,
after ``import popart``, and follows the documented call order (the SDK's documented order):

1. ``GraphTransformer(path).convertINT64ToINT32(clip=True)``: a safety net, the compiler already
   made every tensor int32;
2. ``DataFlow(batches_per_step=device_iterations, {output: AnchorReturnType("All")})``; tensor types
   come from ``TensorInfo.data_type_lcase()`` ("float32" for FLOAT);
3. a new ``SessionOptions`` for every session (the default argument object is created at import and
   picks up ``POPART_CACHE_DIR``): replication; for a graph the compiler sharded over several IPUs per
   replica (``__ipu_number`` / ``__pipeline_stage`` on every node) ``virtualGraphMode = Manual`` and,
   with more than one stage, ``enablePipelining`` (the runtime made ``batchesPerStep`` cover the
   stages); under PopRun ``popdist.popart.configureSessionOptions`` (PopART's session imports
   ``popdist`` for distributed graphs, so PopRun needs the package); ``partialsTypeMatMuls`` from the
   precision, and engine caching into the (absolute) artifact directory of *our* cache entry, or
   explicitly off. PopART's own cache key ignores initializer values, so a shared ``cachePath`` would
   serve a binary with old weights; each entry of ours is keyed by content that includes the weights
   and has its own ``cachePath``, and the cache ``SessionOptions()`` turns on from ``POPART_CACHE_DIR``
   or ``POPXL_CACHE_DIR`` is turned off;
4. the device from ``DeviceManager``: ``acquireAvailableDevice(n)`` for ``ipu``,
   ``createIpuModelDevice({"numIPUs": n, "tilesPerIPU": 1472})`` for ``ipu-model`` (the default of 4
   tiles is far from a real IPU), ``createOfflineIPUDevice`` to compile without hardware;
5. ``prepareDevice()``, ``weightsFromHost()``, ``initAnchorArrays()``; each run is ``PyStepIO`` over
   C-contiguous arrays of exactly the declared dtypes, laid out ``[device_iterations, replicas,
   *shape]`` (only element counts are checked), then ``run()``; attached devices are detached on
   release (an offline device refuses ``detach()``).

Weights stay constants (``constantWeights`` True, the inference default), so an engine switch on a
shared device reloads them with the executable and needs no ``weightsFromHost``.

Carried state (``engines.base.state_updates``: an initializer an ``ai.graphcore`` ``CopyVarUpdate``
overwrites). Citations are graphcore/popart at branch sdk-release-3.4.

* The session is built with ``constantWeights = False``: in Inference with constantWeights every
  initializer is a Const (``Ir::registerInputTensors``, willow/src/ir.cpp), and only a Variable keeps a
  value written on the device. The option is per session, so **every** weight of such a graph becomes a
  Variable, not only the state. A graph without state keeps constant weights.
* Variables are undefined on the device until ``weightsFromHost`` (assumed: Poplar is closed source, and
  ``Session::run``, willow/src/session.cpp, asks for it only in training). So ``build`` and ``reset``
  call it, and so does ``load``: ``Devicex::loadEngineAndConnectStreams`` (willow/src/popx/devicex.cpp)
  writes no variable when an engine is loaded again after another session's (assumed lost).
* ``write_state`` is ``writeWeights`` (host copies only: ``Devicex::writeWeights``) then
  ``weightsFromHost``, which runs the WeightsFromHost program and streams **every** Variable, all weights
  included (``Devicex::weightsFromHost``). Python has no per-tensor upload: ``Session::buffersFromHost``
  exists in C++ (session.cpp) but python/popart/popart_core/popart.cpp binds only ``weightsToHost``,
  ``weightsFromHost``, ``readWeights`` and ``writeWeights``. Writing only some of the state would put the
  other state tensors back to their host copies, so their device values are first read back with
  ``weightsToHost`` (again every Variable) and ``readWeights``. Each upload therefore costs a transfer of
  all weights over the host link; an engine switch costs one too, and it puts the state back to the last
  values written (``Executable.state_epoch`` changes with every load, so the runtime writes it again).
* Only float32, float16 and int32 state: the types both the CopyVarUpdate schema (willow/src/defs.cpp)
  and its op definition (willow/src/op/copyvarupdate.cpp) allow.
* Not with replication or pipelining: replicas would each keep their own copy (assumed), where the
  contract has one state per executable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optimum_ipu_backend.engines.base import CompileOptions, EngineContractError, state_updates
from optimum_ipu_backend.engines.probe import DEVICE_KINDS
from optimum_ipu_backend.engines.worker import WorkerEngine
from optimum_ipu_backend.engines.worker_server import Backend, recovery_action_name
from optimum_ipu_backend.errors import InstallationError

# A Mk2/Bow or C600 IPU; createIpuModelDevice defaults to 4 tiles otherwise.
TILES_PER_IPU = 1472
# ``TensorInfo.data_type_lcase()`` names (the lower-case column of PopART's DataTypeInfo table: FLOAT is
# "float32", FLOAT16 "float16") of the types Poplar streams to and from the host, which numpy names alike.
_STREAMED_TYPES = ("float32", "float16", "int32", "uint32", "int16", "uint16", "int8", "uint8", "bool")
# The state types CopyVarUpdate takes: those both its ONNX schema (willow/src/defs.cpp) and its op definition
# (willow/src/op/copyvarupdate.cpp) allow, as data_type_lcase() names them.
_STATE_TYPES = ("float32", "float16", "int32")


class PopARTEngine(WorkerEngine):
    name = "popart"
    devices = ("ipu", "ipu-model")
    shards = True
    priority = 20
    sdk_module = "popart"
    sdk_label = "PopART"
    sdk_install = "enable the SDK in this environment (source <sdk>/enable)"
    backend = "optimum_ipu_backend.engines.popart:PopARTBackend"
    offline_binary_serves_device = True  # see engines.worker: the cache key hashes the target, not the device

    def key_settings(self, options: CompileOptions) -> dict[str, Any]:
        return {**super().key_settings(options), "tiles_per_ipu": TILES_PER_IPU}


# -- worker side ---------------------------------------------------------------------------------------


@dataclass
class _Session:
    session: Any
    device: Any
    anchor_shapes: dict[str, tuple[int, ...]]
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    device_label: str
    # The variables CopyVarUpdate overwrites (engines.base.state_updates), as specs; read by the worker.
    state: list[dict[str, Any]] = field(default_factory=list)


# The INT node attribute PopART reads a node's pipeline stage from (as the SDK documents); the compiler's
# shard_over_ipus pass writes it with the virtual graph (``__ipu_number``).
PIPELINE_STAGE_ATTRIBUTE = "__pipeline_stage"


def _graph_facts(graph: str) -> tuple[list[str], list[str], int, list[str]]:
    """The graph's inputs, outputs, number of pipeline stages (0: not sharded) and carried state."""
    import onnx  # after popart, in the worker: allowed

    model = onnx.load(graph, load_external_data=False)
    initializers = {tensor.name for tensor in model.graph.initializer}
    inputs = [value.name for value in model.graph.input if value.name not in initializers]
    stages = {
        attribute.i
        for node in model.graph.node
        for attribute in node.attribute
        if attribute.name == PIPELINE_STAGE_ATTRIBUTE
    }
    state = list(state_updates(model.graph))
    return inputs, [value.name for value in model.graph.output], len(stages), state


def _numpy_type(lcase: str, tensor: str) -> str:
    """The numpy dtype of a tensor PopART describes with ``data_type_lcase()``."""
    if lcase not in _STREAMED_TYPES:
        raise EngineContractError(
            f"PopART gives tensor {tensor!r} the data type {lcase!r}, which the PopART engine cannot "
            f"stream to or from the IPU (it streams {', '.join(_STREAMED_TYPES)})"
        )
    return lcase


def _state_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A state tensor's spec, refused when CopyVarUpdate cannot take its type."""
    if spec["dtype"] not in _STATE_TYPES:
        raise EngineContractError(
            f"state {spec['name']!r} is {spec['dtype']}; "
            f"PopART's CopyVarUpdate takes {', '.join(_STATE_TYPES)}"
        )
    return spec


def _popdist_popart() -> Any:
    """``popdist.popart``, or an ``InstallationError`` naming the fix. Under PopRun the sessions use
    distributed replicated graphs, and PopART's ``InferenceSession`` then imports ``popdist`` itself:
    without the package no distributed session can be built, whatever options are set by hand."""
    try:
        import popdist.popart
    except ModuleNotFoundError as exc:
        if exc.name not in ("popdist", "popdist.popart"):
            raise
        raise InstallationError(
            "this process runs under PopRun (the POPDIST_* variables are set), and PopART needs the popdist "
            "Python package for that: its InferenceSession imports popdist for distributed replicated "
            "graphs. popdist ships with the Poplar SDK as a wheel (popdist-*.whl in the SDK directory); "
            "pip install it into the Python that runs the PopART worker, or run without poprun."
        ) from exc
    return popdist.popart


class PopARTBackend(Backend[_Session]):
    def __init__(self) -> None:
        import popart

        self.popart = popart
        # onnx (which must come after popart) is imported at start-up, so a build's compile_timeout
        # measures the build, not a first import of onnx (seconds on a busy host).
        import onnx  # noqa: F401

    def hello(self) -> dict[str, Any]:
        devices = self.popart.DeviceManager().enumerateDevices()
        return {
            "sdk_version": self.popart.versionString(),
            "ipus": sum(device.numIpus for device in devices),
            "ipu_version": devices[0].ipuVersion if devices else None,
        }

    def open_device(
        self, device: str, ipus: int, offline: bool, ipu_version: str, options: dict, required: bool
    ) -> Any:
        manager = self.popart.DeviceManager()
        if offline:
            return manager.createOfflineIPUDevice({"numIPUs": ipus, "ipuVersion": ipu_version})
        if DEVICE_KINDS[device].simulated:
            return manager.createIpuModelDevice({"numIPUs": ipus, "tilesPerIPU": TILES_PER_IPU})
        distributed = options.get("distributed")
        if distributed:  # this instance's share of the PopRun partition
            return _popdist_popart().getDevice(distributed["ipus_per_replica"])
        if required:
            return manager.acquireAvailableDevice(ipus)
        return manager.tryAcquireAvailableDevice(ipus)

    def close_device(self, device: Any) -> None:
        # An offline device refuses detach() ("Cannot detach from offline device"); an IPU Model or an
        # on-demand device not attached yet holds nothing to release.
        if device.isAttached:
            device.detach()

    def _session_options(
        self, options: dict, artifacts: str | None, hardware: bool, stages: int, state: bool
    ) -> Any:
        popart = self.popart
        session_options = popart.SessionOptions()  # new every time, never the default argument object
        if state:
            if options["replicas"] > 1 or stages > 1:
                raise EngineContractError(
                    "a graph with carried state (CopyVarUpdate) runs on the PopART engine without "
                    "replication or pipelining: each replica would keep its own copy of the state"
                )
            # Only a Variable can be overwritten on the device; this makes every weight a Variable.
            session_options.constantWeights = False
        if int(options.get("ipus_per_replica", 1)) > 1:
            # Every node carries its IPU (``__ipu_number``) and stage: manual virtual graphs, pipelined when
            # there is more than one stage; inference needs batchesPerStep >= stages (as the SDK documents).
            session_options.virtualGraphMode = popart.VirtualGraphMode.Manual
            if stages > 1:
                if options["device_iterations"] < stages:
                    raise ValueError(
                        f"a pipeline of {stages} stages needs device_iterations >= {stages}, "
                        f"got {options['device_iterations']}"
                    )
                session_options.enablePipelining = True
        replicas = options["replicas"]
        if replicas > 1:
            session_options.enableReplicatedGraphs = True
            session_options.replicatedGraphCount = replicas
        if options.get("distributed"):
            _popdist_popart().configureSessionOptions(session_options)
        session_options.partialsTypeMatMuls = "half" if options["precision"] == "fp16" else "float"
        if artifacts is not None and hardware:  # PopART caches for IPU and offline targets only
            os.makedirs(artifacts, exist_ok=True)
            session_options.enableEngineCaching = True
            session_options.cachePath = artifacts
        else:
            # SessionOptions() turned PopART's own cache on if POPART_CACHE_DIR or POPXL_CACHE_DIR is set;
            # its key ignores weight values, so it could serve a binary with old weights.
            session_options.enableEngineCaching = False
        return session_options

    def build(
        self, graph: str, artifacts: str | None, options: dict, device: Any, device_name: str, offline: bool
    ) -> _Session:
        popart = self.popart
        input_names, output_names, stages, state_names = _graph_facts(graph)
        # PopART looks cachePath up when the session is built (inside the chdir below) and writes the
        # executable there in prepareDevice (after it): a relative path would name two directories.
        artifacts = None if artifacts is None else os.path.abspath(artifacts)
        here = os.getcwd()
        os.chdir(os.path.dirname(os.path.abspath(graph)))  # external data is found from the CWD
        try:
            transformer = popart.GraphTransformer(os.path.basename(graph))
            transformer.convertINT64ToINT32(clip=True)
            data_flow = popart.DataFlow(
                options["device_iterations"],
                {name: popart.AnchorReturnType("All") for name in output_names},
            )
            session = popart.InferenceSession(
                fnModel=transformer.getModelProto(),
                dataFlow=data_flow,
                deviceInfo=device,
                userOptions=self._session_options(
                    options,
                    artifacts,
                    offline or DEVICE_KINDS[device_name].needs_hardware,
                    stages,
                    bool(state_names),
                ),
            )
        finally:
            os.chdir(here)
        session.prepareDevice(loadEngine=not offline)
        if not offline:
            session.weightsFromHost()  # Variables (state graphs) are undefined until it runs
        anchors = session.initAnchorArrays()

        def spec(name: str) -> dict[str, Any]:
            info = session.getInfo(name)
            return {
                "name": name,
                "shape": tuple(info.shape()),
                "dtype": _numpy_type(info.data_type_lcase(), name),
            }

        return _Session(
            session=session,
            device=device,
            anchor_shapes={name: tuple(array.shape) for name, array in anchors.items()},
            inputs=[spec(name) for name in input_names],
            outputs=[spec(name) for name in output_names],
            device_label=f"{getattr(device.type, 'name', device.type)} {device.id} ({device.numIpus} IPU)",
            state=[_state_spec(spec(name)) for name in state_names],
        )

    def run(self, built: _Session, inputs: dict, outputs: dict) -> None:
        anchors = {name: outputs[name].reshape(shape) for name, shape in built.anchor_shapes.items()}
        built.session.run(self.popart.PyStepIO(inputs, anchors))

    def write_state(self, built: _Session, values: dict[str, np.ndarray]) -> None:
        """``writeWeights`` then ``weightsFromHost``, which uploads every Variable (see the module's notes):
        state not in ``values`` is read back from the device first, or the upload would put back its host
        copy."""
        specs = {spec["name"]: spec for spec in built.state}
        for name, value in values.items():
            spec = specs.get(name)
            if spec is None:
                raise EngineContractError(f"{name!r} is not state this executable keeps")
            if tuple(value.shape) != tuple(spec["shape"]) or value.dtype != np.dtype(spec["dtype"]):
                # PopART checks only the shape and the byte count (Tensor::verifyMutableVoidInfo,
                # TensorData::resetData) and would take another dtype's bytes as they are
                raise EngineContractError(
                    f"state {name!r} is {spec['dtype']}{list(spec['shape'])}, "
                    f"not {value.dtype}{list(value.shape)}"
                )
        popart = self.popart
        arrays = {name: np.ascontiguousarray(value) for name, value in values.items()}
        kept = [spec for name, spec in specs.items() if name not in arrays]
        if kept:
            built.session.weightsToHost()
            current = {spec["name"]: np.empty(spec["shape"], spec["dtype"]) for spec in kept}
            built.session.readWeights(popart.PyWeightsIO(current))
            arrays.update(current)
        built.session.writeWeights(popart.PyWeightsIO(arrays))
        built.session.weightsFromHost()

    def load(self, built: _Session) -> None:
        built.session.loadEngineAndConnectStreams()  # constant weights come back with the engine
        if built.state:
            # Variables do not (assumed): every weight of a state graph is one, so all go up again; the
            # state becomes its last written values, and the worker's epoch for this load tells the host.
            built.session.weightsFromHost()

    def unload(self, built: _Session) -> None:
        """Loading another session's engine replaces this one on a shared device; nothing to do."""

    def reset(self, built: _Session) -> None:
        built.device.detach()
        built.device.attach()
        built.session.loadEngineAndConnectStreams()
        built.session.weightsFromHost()

    def release(self, built: _Session) -> None:
        built.session = None

    def classify(self, exc: BaseException) -> dict[str, Any] | None:
        popart = self.popart
        if isinstance(exc, popart.OutOfMemoryException):
            return {"kind": "out_of_memory"}
        if isinstance(exc, popart.poplar_recoverable_runtime_error):
            # PopART sets recoveryAction on the exception class as it translates the error.
            return {"kind": "recoverable", "recovery_action": recovery_action_name(exc.recoveryAction)}
        if isinstance(exc, (popart.poplar_unrecoverable_runtime_error, popart.poplar_unknown_runtime_error)):
            return {"kind": "unrecoverable"}
        message = str(exc)
        if isinstance(exc, popart.popart_exception) and (
            "Failed to acquire" in message or "attach" in message
        ):
            return {"kind": "acquisition"}
        if isinstance(exc, (popart.popart_exception, popart.poplar_exception, popart.poplibs_exception)):
            return {"kind": "sdk"}
        return None
