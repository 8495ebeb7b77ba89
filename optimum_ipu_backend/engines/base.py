"""The engine interface: ``compile`` a fixed-shape graph once, ``run`` the executable many times.

It is deliberately as small as onnx's ``Backend.prepare`` / ``BackendRep.run``: everything about
shapes, padding and caching lives in the runtime above, everything about ONNX rewriting in the
compiler above that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from optimum_ipu_backend.errors import DeviceError


class EngineUnavailableError(DeviceError):
    """The engine or device cannot be used on this machine."""


class EngineContractError(DeviceError, ValueError):
    """A graph or feed breaks what the device accepts (dynamic shape, forbidden dtype, ...)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class CompileOptions:
    """Engine-level options; the session fills them from provider options."""

    device: str = "emulator"
    precision: str = "fp32"
    threads: int | None = None
    # One device step runs device_iterations x replicas micro-batches (PopART's batchesPerStep and
    # replicated graphs); host buffers then have the layout [device_iterations, replicas, *shape].
    device_iterations: int = 1
    replicas: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


class Executable(ABC):
    """A graph compiled for one set of input shapes."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

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
        if device_iterations == replicas == 1:  # the common case: views, no copies of the outputs
            outputs = self.run({name: array[0, 0] for name, array in feed.items()})
            return {name: array[None, None] for name, array in outputs.items()}
        results = []
        for iteration in range(device_iterations):
            for replica in range(replicas):
                results.append(self.run({name: array[iteration, replica] for name, array in feed.items()}))
        return {
            name: np.stack([result[name] for result in results]).reshape(
                device_iterations, replicas, *results[0][name].shape
            )
            for name in results[0]
        }


class Engine(ABC):
    name: ClassVar[str]
    # True when results are computed somewhere other than an IPU; surfaced to users everywhere.
    emulated: ClassVar[bool]
    # Version of the vendor SDK the executables are built with; part of every cache key.
    sdk_version: ClassVar[str | None] = None

    @abstractmethod
    def compile(self, model_bytes: bytes, options: CompileOptions) -> Executable:
        """Compile a serialized, legalized, fully static ONNX model."""

    def export(self, executable: Executable) -> dict[str, bytes]:
        """Engine artifacts worth caching beside the legalized graph (PopART: the ``.popef``)."""
        return {}

    def load(self, graph_path: Path, artifacts: Mapping[str, Path], options: CompileOptions) -> Executable:
        """Rebuild an executable from a cached legalized graph and the artifacts ``export`` returned
        (files, so that an engine can hand them to its runtime without a copy through Python)."""
        return self.compile(graph_path.read_bytes(), options)

    def describe(self) -> str:
        return self.name
