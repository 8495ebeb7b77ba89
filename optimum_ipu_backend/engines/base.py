"""The engine interface: ``compile`` a fixed-shape graph once, ``run`` the executable many times.

It is deliberately small, like onnx's ``Backend.prepare`` / ``BackendRep.run``: everything about
shapes, padding and caching lives in the runtime above, everything about ONNX rewriting in the
compiler above that. What an engine adds to that minimum is what real devices need:

* **Lifecycle.** Executables and engines hold devices and processes. ``close()`` releases them; both are
  context managers, and ``close`` also runs when they are garbage-collected and at interpreter exit.
* **Paths, not bytes.** ``compile`` and ``load`` take the legalized graph as a file and an artifact
  directory the engine writes into (PopART's ``.popef``), so nothing is serialized whole in memory.
* **Identity.** Each engine class declares its name, the devices it serves, a cheap availability probe
  (which imports no SDK) and a priority among engines serving one device;
  ``engines.ENGINE_CLASSES`` lists the classes. An instance knows its SDK version (a worker process
  reports it), and ``key_settings`` names every engine setting that changes a binary: both go into every
  cache key.
* **Residency.** An IPU holds one loaded executable at a time; an executable that shares a device
  with others counts the reloads (``switches``) its runs caused.
* **Thread safety** is declared (``thread_safe``); the runtime serializes calls to engines that are not.
* **Carried state.** A graph may keep tensors on the device from one run to the next, in PopART's own
  form: an initializer that an ``ai.graphcore`` ``CopyVarUpdate`` node overwrites (``state_updates``).
  Every run reads the values the previous run left; ``write_state`` uploads new ones; ``state_epoch``
  changes whenever the device may have lost them (a reload, a reset), so the runtime uploads again.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from optimum_ipu_backend.errors import DeviceError


class EngineUnavailableError(DeviceError):
    """The engine or device cannot be used on this machine."""


class EngineContractError(DeviceError, ValueError):
    """A graph or feed breaks what the device accepts (dynamic shape, forbidden dtype, ...)."""


class EngineClosedError(DeviceError):
    """An executable or engine was used after ``close()``."""


#: PopART's operator that overwrites a variable on the device at the end of a run (PopART
#: ``AiGraphcoreOpset1::copyvarupdate``: inputs ``[variable, updater]``, the variable an initializer).
STATE_UPDATE_DOMAIN = "ai.graphcore"
STATE_UPDATE_OP = "CopyVarUpdate"


def state_updates(graph: Any) -> dict[str, str]:
    """The carried state of an ONNX ``GraphProto``: each initializer a ``CopyVarUpdate`` overwrites, mapped to
    the tensor that replaces it after a run. Runs read the state as it was before the run."""
    initializers = {tensor.name for tensor in graph.initializer}
    updates = {}
    for node in graph.node:
        if node.domain == STATE_UPDATE_DOMAIN and node.op_type == STATE_UPDATE_OP:
            variable, updater = node.input[0], node.input[1]
            if variable not in initializers:
                raise EngineContractError(
                    f"CopyVarUpdate {node.name!r} updates {variable!r}, not an initializer"
                )
            updates[variable] = updater
    return updates


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass(frozen=True)
class Availability:
    """What a probe (an engine's, or a provider plugin's) found: usable or not, and why, in words a user
    can act on.

    ``emulated`` says the default device would be a host emulator or simulator rather than the
    hardware: usable when named, never chosen by ``provider="auto"``.
    """

    available: bool
    detail: str = ""
    emulated: bool = False


@dataclass(frozen=True)
class DistributedReplicas:
    """This process's share of a replicated graph spread over several processes (PopRun/PopDist):
    ``total`` replicas in all, this instance runs ``CompileOptions.replicas`` of them from ``offset``."""

    total: int
    offset: int
    ipus_per_replica: int = 1
    device_id: int | None = None  # the IPU group PopDist assigns this instance, when it says


@dataclass
class CompileOptions:
    """Engine-level options; ``runtime.open`` fills them from the session's configuration."""

    device: str = "emulator"
    precision: str = "fp32"
    threads: int | None = None
    # One device step runs device_iterations x replicas micro-batches (PopART's batchesPerStep and
    # replicated graphs); host buffers then have the layout [device_iterations, replicas, *shape].
    device_iterations: int = 1
    replicas: int = 1
    distributed: DistributedReplicas | None = None
    # Compile for the device without running on it (an offline IPU target): fills the cache entry a
    # later process on the device reads, so it is not part of the key.
    offline: bool = False
    # IPU architecture to compile for when it cannot be asked of the hardware (offline compiles).
    ipu_version: str | None = None
    # Seconds a compile may take before the engine gives up (None: no limit).
    compile_timeout: float | None = None
    # Engine settings that change the binary, passed through to the engine; part of every cache key.
    extra: dict[str, Any] = field(default_factory=dict)
    # IPUs one replica is sharded over, and optimum-graphcore's layers per IPU (None: balanced by memory).
    # The compiler annotates the graph (compiler.passes.shard_over_ipus); an engine on IPUs acquires
    # ``replicas x ipus_per_replica`` IPUs and runs the annotated graph with manual virtual graphs, pipelined
    # when there is more than one stage (``device_iterations`` then covers the stages).
    ipus_per_replica: int = 1
    layers_per_ipu: tuple[int, ...] | None = None
    # IPU groups (of ``ipus`` IPUs) executables of this size may hold; beyond, they share the least-used
    # one (None: one per executable while free IPUs remain). Not part of the binary.
    device_groups: int | None = None

    @property
    def ipus(self) -> int:
        """IPUs the executable runs on: replicas x IPUs per replica."""
        return self.replicas * self.ipus_per_replica

    def binary_settings(self) -> dict[str, Any]:
        """Everything here that changes a compiled binary (threads, offline and timeouts do not; nor
        does a distributed instance's replica offset, so instances share one binary)."""
        settings: dict[str, Any] = {
            "device": self.device,
            "precision": self.precision,
            "device_iterations": self.device_iterations,
            "replicas": self.replicas,
            "extra": dict(sorted(self.extra.items())),
        }
        if self.ipus_per_replica > 1:
            layers = None if self.layers_per_ipu is None else list(self.layers_per_ipu)
            settings["sharding"] = {"ipus_per_replica": self.ipus_per_replica, "layers_per_ipu": layers}
        if self.distributed is not None:
            settings["global_replicas"] = self.distributed.total
            settings["ipus_per_replica"] = self.distributed.ipus_per_replica
        return settings


class _Closable:
    """Close once, explicitly, on garbage collection or at interpreter exit (``weakref.finalize`` runs
    at exit unless already called), and work as a context manager."""

    _finalizer: weakref.finalize | None = None
    _closed = False

    def _on_close(self, release: Callable[..., Any], *args: Any) -> None:
        """Register ``release(*args)``; it must not reference ``self``, or ``self`` is never collected."""
        self._finalizer = weakref.finalize(self, release, *args)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError(f"{type(self).__name__} was closed; create a new session to run again")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Executable(_Closable, ABC):
    """A graph compiled for one set of input shapes."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # Engine reloads this executable's runs caused on a device it shares with other executables.
    switches: int = 0
    #: The tensors it keeps on the device between runs (``state_updates``); empty for most graphs.
    state: tuple[TensorSpec, ...] = ()

    @property
    def state_epoch(self) -> int:
        """Changes whenever the device state may no longer be what the last runs left (the executable was
        reloaded, reset or rebuilt); the runtime then uploads it again before it relies on it."""
        return 0

    def write_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Upload new values of some of ``state`` (shapes and dtypes as ``state`` says); the next run reads
        them."""
        self._check_state(values)
        raise NotImplementedError(f"{type(self).__name__} does not upload state")

    def _check_state(self, values: Mapping[str, np.ndarray]) -> None:
        """``EngineContractError`` unless every value is state this executable keeps, at its shape and
        dtype."""
        if not self.state:
            raise EngineContractError(f"{type(self).__name__} keeps no state on the device")
        specs = {spec.name: spec for spec in self.state}
        for name, value in values.items():
            spec = specs.get(name)
            if spec is None:
                raise EngineContractError(f"{name!r} is not state this executable keeps")
            if value.shape != spec.shape or value.dtype != spec.dtype:
                raise EngineContractError(
                    f"state {name!r} is {spec.dtype}{list(spec.shape)}, not {value.dtype}{list(value.shape)}"
                )

    def load(self) -> None:
        """Load this executable onto its IPUs now, unloading the one they hold (counted as a switch when
        another was loaded), so that its next run does not wait for the load. Engines without residency
        (the emulator) have nothing to do."""

    @abstractmethod
    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one micro-batch: host arrays whose shapes and dtypes equal ``inputs``; returns every output."""

    def run_step(
        self, feed: Mapping[str, np.ndarray], device_iterations: int, replicas: int
    ) -> dict[str, np.ndarray]:
        """Run one device step on buffers laid out ``[device_iterations, replicas, *input_shape]``, in the
        order PopART consumes them (step-major, then replica); outputs come back in the same layout.

        Engines with a native notion of steps (PopART's ``batchesPerStep``) override this; the default
        runs the micro-batches one after the other, which is what the emulator does.
        """
        # `...` keeps a scalar input (a diffusion UNet's timestep) a 0-d array, not a numpy scalar
        if device_iterations == replicas == 1:  # the common case: views, no copies of the outputs
            outputs = self.run({name: array[0, 0, ...] for name, array in feed.items()})
            return {name: array[None, None] for name, array in outputs.items()}
        results = []
        for iteration in range(device_iterations):
            for replica in range(replicas):
                results.append(
                    self.run({name: array[iteration, replica, ...] for name, array in feed.items()})
                )
        return {
            name: np.stack([result[name] for result in results]).reshape(
                device_iterations, replicas, *results[0][name].shape
            )
            for name in results[0]
        }

    def relocated(self, graph: Path, artifacts: Path | None) -> None:
        """The files it was compiled from moved (its cache entry was committed); an engine that may have to
        build it again (after its worker process restarted) keeps the new location."""

    def residency(self) -> dict[str, object]:
        """Where the executable lives and how often it was reloaded there (reported to users)."""
        return {"switches": self.switches}


class Engine(_Closable, ABC):
    # -- declared by each engine class; read by the registry without instantiating anything ----------
    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]]
    # Among the available engines serving a device, the highest priority is the default.
    priority: ClassVar[int] = 0
    # False: the runtime serializes calls into the engine's executables.
    thread_safe: ClassVar[bool] = False
    # True when the engine runs a graph sharded over several IPUs per replica (``ipus_per_replica``).
    shards: ClassVar[bool] = False
    # False when the engine keeps only floating-point state (``state_updates``): the runtime then carries
    # integer state as float32 where that is exact (``compiler.carried_state``).
    integer_state: ClassVar[bool] = True

    @classmethod
    @abstractmethod
    def probe(cls) -> Availability:
        """Can this engine run here? Cheap (``importlib.util.find_spec``, environment variables): it
        never imports the SDK."""

    def __init__(self, device: str, *, offline: bool = False, sdk_python: str | None = None) -> None:
        """``sdk_python``: the interpreter an engine with an SDK worker process runs it on (the provider
        option of that name; ``engines.probe.resolve_sdk_python`` gives the default); others ignore it."""
        if device not in self.devices:
            raise EngineUnavailableError(
                f"the {self.name!r} engine serves device(s) {', '.join(self.devices)}, not {device!r}"
            )
        self.device = device
        self.offline = offline
        # Version of the vendor SDK the executables are built with, known once the engine has started;
        # part of every cache key.
        self.sdk_version: str | None = None
        # The interpreter the SDK runs on (engines with a worker process); not part of cache keys.
        self.sdk_python: str | None = None
        self._executables: weakref.WeakSet[Executable] = weakref.WeakSet()

    def _track(self, executable: Executable) -> Executable:
        """Remember ``executable`` so that closing the engine closes it."""
        self._executables.add(executable)
        return executable

    def close(self) -> None:
        for executable in list(self._executables):
            executable.close()
        super().close()

    @abstractmethod
    def compile(self, graph: Path, options: CompileOptions, artifacts: Path | None = None) -> Executable:
        """Compile the legalized, fully static ONNX file ``graph``. Engine artifacts worth caching (PopART:
        the ``.popef``) are written into the directory ``artifacts`` when it is given."""

    def load(self, graph: Path, artifacts: Path, options: CompileOptions) -> Executable:
        """Rebuild an executable from a cached legalized graph and the artifact directory ``compile``
        wrote; the engine reads its files itself, without a copy through Python."""
        return self.compile(graph, options, artifacts)

    def build_aside(self, graph: Path, options: CompileOptions, artifacts: Path) -> Executable:
        """``compile`` (or ``load``, when ``artifacts`` holds a build already) for a background compile:
        an engine whose compile would hold the device its executables run on builds elsewhere, and the
        executable goes onto its IPUs at its first use (``engines.worker``). Others just compile."""
        return self.compile(graph, options, artifacts)

    def key_settings(self, options: CompileOptions) -> dict[str, Any]:
        """Engine settings beyond ``options.binary_settings()`` that change the binary (the target IPU
        architecture, tile count, ...). The runtime puts them, and ``sdk_version``, into the cache key."""
        return {}

    def describe(self) -> str:
        return self.name
