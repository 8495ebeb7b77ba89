"""Engines turn a legalized, static-shaped ONNX graph into an executable and run it.

``ENGINE_CLASSES`` is the one list of engines. Each class declares its name, the devices it serves, a
cheap availability probe and a priority (``engines.base.Engine``); device
resolution, the ``engine`` provider option and the CLI all derive from this list. Engine modules are
light on the host side: the Poplar SDK is imported only inside a worker process (``engines.worker``).
"""

from __future__ import annotations

import functools
import importlib

from optimum_ipu_backend.engines.base import (
    Availability,
    CompileOptions,
    Engine,
    EngineClosedError,
    EngineUnavailableError,
    Executable,
    TensorSpec,
)

# "module:class" of every engine, in no particular order (priority decides the default).
ENGINE_CLASSES = (
    "optimum_ipu_backend.engines.popart:PopARTEngine",
    "optimum_ipu_backend.engines.poptorch:PopTorchEngine",
    "optimum_ipu_backend.engines.emulator:HostEmulatorEngine",
)

__all__ = [
    "ENGINE_CLASSES",
    "Availability",
    "CompileOptions",
    "Engine",
    "EngineClosedError",
    "EngineUnavailableError",
    "Executable",
    "TensorSpec",
    "engine_class",
    "engine_classes",
    "engine_names",
    "load_engine",
]


@functools.lru_cache(maxsize=None)  # not functools.cache: the worker runs on Python 3.8
def engine_classes() -> tuple[type[Engine], ...]:
    """The engine classes, highest priority first."""
    classes = []
    for target in ENGINE_CLASSES:
        module_name, _, class_name = target.partition(":")
        classes.append(getattr(importlib.import_module(module_name), class_name))
    return tuple(sorted(classes, key=lambda cls: -cls.priority))


def engine_names() -> tuple[str, ...]:
    return tuple(cls.name for cls in engine_classes())


def engine_class(name: str) -> type[Engine]:
    for cls in engine_classes():
        if cls.name == name:
            return cls
    raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(engine_names())}")


def load_engine(
    name: str, device: str = "emulator", *, offline: bool = False, sdk_python: str | None = None
) -> Engine:
    """An instance of the engine called ``name`` serving ``device``. Engines with a worker process start
    it here, on the interpreter ``sdk_python`` (default: ``OPTIMUM_IPU_SDK_PYTHON``, else this one), and
    raise ``EngineUnavailableError`` when the SDK finds no usable device."""
    return engine_class(name)(device, offline=offline, sdk_python=sdk_python)
