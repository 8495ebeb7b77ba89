"""The IPU graph compiler: legalize exported ONNX graphs into what PopART (opset 11, static, int32) accepts.

The names below load on first use (PEP 562), so that ``compiler.errors`` or ``compiler.precheck`` can be
imported without the passes: a warm session start needs the former and never the latter. onnxslim is
imported only when a folding pass runs.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LegalizationError": ".errors",
    "UnsupportedNode": ".errors",
    "MemoryEstimate": ".memory",
    "estimate_memory": ".memory",
    "bind_constant_inputs": ".passes.fold_constants",
    "find_unsupported_nodes": ".passes.verify",
    "LegalizedGraph": ".pipeline",
    "build_passes": ".pipeline",
    "legalize": ".pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
