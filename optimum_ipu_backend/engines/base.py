"""The engine interface: ``compile`` a fixed-shape graph once, ``run`` the executable many times.

It is deliberately as small as onnx's ``Backend.prepare`` / ``BackendRep.run``: everything about
shapes, padding and caching lives in the runtime above, everything about ONNX rewriting in the
compiler above that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np


class EngineUnavailableError(RuntimeError):
    """The engine or device cannot be used on this machine."""


class EngineContractError(ValueError):
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
    extra: dict[str, Any] = field(default_factory=dict)


class Executable(ABC):
    """A graph compiled for one set of input shapes."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @abstractmethod
    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on host arrays whose shapes and dtypes equal ``inputs``; returns every output."""


class Engine(ABC):
    name: ClassVar[str]
    # True when results are computed somewhere other than an IPU; surfaced to users everywhere.
    emulated: ClassVar[bool]

    @abstractmethod
    def compile(self, model_bytes: bytes, options: CompileOptions) -> Executable:
        """Compile a serialized, legalized, fully static ONNX model."""

    def describe(self) -> str:
        return self.name
