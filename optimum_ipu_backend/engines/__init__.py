"""Engines turn a legalized, static-shaped ONNX graph into an executable and run it.

Sibling engines share one interface (``engines.base``) and are imported only when chosen:
``emulator`` (onnxruntime on the host CPU, no SDK), and, in a later release, ``popart`` and
``poptorch`` (Graphcore's Poplar SDK).
"""

from __future__ import annotations

import importlib

from optimum_ipu_backend.engines.base import Engine, EngineUnavailableError, Executable, TensorSpec

# name -> "module:class"; the module is imported only when the engine is selected.
ENGINES = {
    "emulator": "optimum_ipu_backend.engines.emulator:HostEmulatorEngine",
}
# Engines that have a place in the design but no implementation in this release.
PLANNED_ENGINES = ("popart", "poptorch")

__all__ = [
    "ENGINES",
    "Engine",
    "EngineUnavailableError",
    "Executable",
    "PLANNED_ENGINES",
    "TensorSpec",
    "load_engine",
]


def load_engine(name: str) -> Engine:
    """Instantiate the engine called ``name``."""
    target = ENGINES.get(name)
    if target is None:
        if name in PLANNED_ENGINES:
            raise EngineUnavailableError(
                f"the {name!r} engine is not part of optimum-ipu-backend {_version()} yet; on a machine "
                "without IPU hardware use provider_options={'device': 'emulator'}"
            )
        raise EngineUnavailableError(f"unknown engine {name!r}; known engines: {', '.join(ENGINES)}")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)()


def _version() -> str:
    from optimum_ipu_backend import __version__

    return __version__
