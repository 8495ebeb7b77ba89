"""The IPU graph compiler: legalize exported ONNX graphs into what PopART (opset 11, static, int32) accepts.

onnxslim is imported only when a folding pass runs, so importing this package stays cheap.
"""

from .errors import LegalizationError, UnsupportedNode
from .memory import MemoryEstimate, estimate_memory
from .passes.fold_constants import bind_constant_inputs
from .passes.verify import find_unsupported_nodes
from .pipeline import LegalizedGraph, legalize

__all__ = [
    "LegalizationError",
    "LegalizedGraph",
    "MemoryEstimate",
    "UnsupportedNode",
    "bind_constant_inputs",
    "estimate_memory",
    "find_unsupported_nodes",
    "legalize",
]
