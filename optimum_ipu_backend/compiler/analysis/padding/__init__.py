"""The padding proof: whether a graph's real outputs are unchanged when its inputs are padded."""

from .analyzer import Obligation, PaddedInput, PaddingAnalyzer, PaddingProof
from .values import AxisMap, complete, inverse

__all__ = ["AxisMap", "Obligation", "PaddedInput", "PaddingAnalyzer", "PaddingProof", "complete", "inverse"]
