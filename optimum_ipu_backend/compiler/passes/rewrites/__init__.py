"""The opset-11 rewrites: one module per operator family, each rewrite declaring the operators it takes.

``REWRITE_FOR_OP`` (which rewrite owns each operator) is derived from the rewrites' own ``op_types``;
the lowering pass and the session pre-check both read it, so what is lowered and what is accepted
cannot drift apart. Each operator has exactly one owner.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ...op_table import operator_name
from .activations import ActivationRewrite
from .arg_extreme import ArgExtremeRewrite
from .attention import AttentionRewrite, MultiHeadAttentionRewrite
from .attribute_adapters import NeutralAttributeRewrite
from .average_pool import AveragePoolRewrite
from .axes_to_attributes import AxesToAttributesRewrite
from .bitwise import BitwiseNotRewrite
from .common import CannotLower, GraphScope, Rewrite
from .comparisons import ComparisonRewrite
from .constant_values import ConstantValueRewrite
from .dropout import DropoutRewrite
from .einsum import EinsumRewrite
from .fused_activations import BiasAddRewrite, FusedGeluRewrite
from .fused_normalizations import FusedNormalizationRewrite, SimplifiedLayerNormalizationRewrite
from .gather_scatter import GatherElementsRewrite, GatherNDRewrite, ScatterNDRewrite
from .hardmax import HardmaxRewrite
from .identity_castlike import CastLikeRewrite, IdentityRewrite
from .integer_min_max import IntegerMinMaxRewrite
from .layer_normalization import LayerNormalizationRewrite
from .mod import ModRewrite
from .negative_indices import NegativeIndicesRewrite
from .normalizations import (
    GroupNormalizationRewrite,
    LpNormalizationRewrite,
    MeanVarianceNormalizationRewrite,
    RMSNormalizationRewrite,
)
from .one_hot import OneHotRewrite
from .pad import PadRewrite
from .pow import PowRewrite
from .quantization import QuantizeLinearRewrite
from .range import RangeRewrite
from .recurrent_layout import RecurrentLayoutRewrite
from .resize import ResizeRewrite
from .reverse_sequence import ReverseSequenceRewrite
from .rotary_embedding import ContribRotaryEmbeddingRewrite, RotaryEmbeddingRewrite
from .shape_slice import ShapeSliceRewrite
from .size import SizeRewrite
from .softmax import SoftmaxRewrite
from .space_to_depth import SpaceToDepthRewrite
from .trilu import TriluRewrite
from .xor import XorRewrite

REWRITES: tuple[Rewrite, ...] = (
    LayerNormalizationRewrite(),
    AxesToAttributesRewrite(),
    SoftmaxRewrite(),
    ComparisonRewrite(),
    TriluRewrite(),
    RangeRewrite(),
    IntegerMinMaxRewrite(),
    CastLikeRewrite(),
    IdentityRewrite(),
    ConstantValueRewrite(),
    ShapeSliceRewrite(),
    NeutralAttributeRewrite(),
    ArgExtremeRewrite(),
    AveragePoolRewrite(),
    RecurrentLayoutRewrite(),
    DropoutRewrite(),
    PadRewrite(),
    ResizeRewrite(),
    PowRewrite(),
    GatherElementsRewrite(),
    GatherNDRewrite(),
    ScatterNDRewrite(),
    SizeRewrite(),
    XorRewrite(),
    OneHotRewrite(),
    EinsumRewrite(),
    ActivationRewrite(),
    GroupNormalizationRewrite(),
    RMSNormalizationRewrite(),
    MeanVarianceNormalizationRewrite(),
    LpNormalizationRewrite(),
    HardmaxRewrite(),
    ReverseSequenceRewrite(),
    BitwiseNotRewrite(),
    RotaryEmbeddingRewrite(),
    ContribRotaryEmbeddingRewrite(),
    ModRewrite(),
    SpaceToDepthRewrite(),
    NegativeIndicesRewrite(),
    QuantizeLinearRewrite(),
    FusedNormalizationRewrite(),
    SimplifiedLayerNormalizationRewrite(),
    FusedGeluRewrite(),
    BiasAddRewrite(),
    AttentionRewrite(),
    MultiHeadAttentionRewrite(),
)


def _owners(rewrites: tuple[Rewrite, ...]) -> dict[str, Rewrite]:
    table: dict[str, Rewrite] = {}
    for rewrite in rewrites:
        for op_type in rewrite.op_types:
            name = operator_name(rewrite.domain, op_type)
            if name in table:
                raise RuntimeError(f"two rewrites claim {name}: {table[name]!r} and {rewrite!r}")
            table[name] = rewrite
    return table


#: The rewrite that owns each operator it declares, by ``op_table.operator_name`` (``Op`` in the default
#: domain, ``domain::Op`` in another).
REWRITE_FOR_OP: Mapping[str, Rewrite] = MappingProxyType(_owners(REWRITES))
#: Every operator some rewrite lowers, named the same way.
LOWERED_OP_TYPES: frozenset[str] = frozenset(REWRITE_FOR_OP)

__all__ = ["LOWERED_OP_TYPES", "REWRITES", "REWRITE_FOR_OP", "CannotLower", "GraphScope", "Rewrite"]
