"""The opset-11 rewrites, in the order LowerToOpset11 consults them (each owns distinct operators)."""

from __future__ import annotations

from .attribute_adapters import NeutralAttributeRewrite
from .axes_to_attributes import AxesToAttributesRewrite
from .common import CannotLower, GraphScope, Rewrite
from .comparisons import ComparisonRewrite
from .constant_values import ConstantValueRewrite
from .dropout import DropoutRewrite
from .einsum import EinsumRewrite
from .gather_scatter import GatherElementsRewrite, GatherNDRewrite, ScatterNDRewrite
from .identity_castlike import CastLikeRewrite, IdentityRewrite
from .integer_min_max import IntegerMinMaxRewrite
from .layer_normalization import LayerNormalizationRewrite
from .pad import PadRewrite
from .pow import PowRewrite
from .range import RangeRewrite
from .resize import ResizeRewrite
from .shape_slice import ShapeSliceRewrite
from .size import SizeRewrite
from .softmax import SoftmaxRewrite
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
    DropoutRewrite(),
    PadRewrite(),
    ResizeRewrite(),
    PowRewrite(),
    GatherElementsRewrite(),
    GatherNDRewrite(),
    ScatterNDRewrite(),
    SizeRewrite(),
    XorRewrite(),
    EinsumRewrite(),
)

__all__ = ["REWRITES", "CannotLower", "GraphScope", "Rewrite"]
