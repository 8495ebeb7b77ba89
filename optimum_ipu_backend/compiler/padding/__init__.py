"""The padding proof: whether a graph's real outputs are unchanged when its inputs are padded, and its
JSON form (``PaddingProof.to_json``)."""

from .analyzer import PROOF_FORMAT, Obligation, PaddedInput, PaddingAnalyzer, PaddingProof
from .values import AxisMap, complete, inverse, real_positions

__all__ = [
    "PROOF_FORMAT",
    "AxisMap",
    "Obligation",
    "PaddedInput",
    "PaddingAnalyzer",
    "PaddingProof",
    "complete",
    "inverse",
    "real_positions",
]
