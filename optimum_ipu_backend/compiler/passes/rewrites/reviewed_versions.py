"""Which later versions of PopART's opset-11 operators mean the same as their opset-11 version.

For each operator, the versions (``since_version`` values) introduced after its opset-11 version that
only added element types (bfloat16, int8/16, float8, sequences, ...) or documentation. A node of such a
version is kept as it is when the operator is re-imported at opset 11; its element types are then
checked against the opset-11 schema. Versions that changed attributes or inputs are not listed here:
their rewrite handles them (or the node is refused). Reviewed against onnx's operator changelog.
"""

from __future__ import annotations

#: The newest ``since_version`` of any operator that has been reviewed here or in a rewrite.
#: Reviewed up to opset 28: of the versions 26 to 28, Range-27 (RangeRewrite), Einsum-28 (EinsumRewrite),
#: Mod-28 (ModRewrite), SpaceToDepth-28 (SpaceToDepthRewrite) and ReduceLogSum/ReduceLogSumExp-28
#: (AxesToAttributesRewrite) have rewrites that handle them, those below only added or removed element
#: types, and every other one is an operator PopART lacks and no rewrite lowers, so it stays refused.
NEWEST_REVIEWED_VERSION = 28

_TYPES_ONLY_SINCE_22 = (
    "Acos",
    "Acosh",
    "Asin",
    "Asinh",
    "Atan",
    "Atanh",
    "Cos",
    "Cosh",
    "Sin",
    "Sinh",
    "Tan",
)
_LATER_TYPE_ADDITIONS = frozenset({21, 23, 24, 25})

SAME_AS_OPSET11: dict[str, frozenset[int]] = {
    **{op: frozenset({22}) for op in _TYPES_ONLY_SINCE_22},
    "Abs": frozenset({13}),
    "Add": frozenset({13, 14}),
    "ArgMax": frozenset({12, 13}),  # select_last_index: ArgExtremeRewrite
    "ArgMin": frozenset({12, 13}),
    "AveragePool": frozenset({19, 22}),  # dilations: AveragePoolRewrite
    "BatchNormalization": frozenset({14, 15}),  # training_mode: NeutralAttributeRewrite
    "Cast": frozenset({13, 19, 28}) | _LATER_TYPE_ADDITIONS,  # saturate/round_mode: CastLikeRewrite
    "Ceil": frozenset({13}),
    "Clip": frozenset({12, 13}),  # integer Clip: IntegerMinMaxRewrite
    "Concat": frozenset({13}),
    "Constant": frozenset({12, 13, 19}) | _LATER_TYPE_ADDITIONS,  # value_*: ConstantValueRewrite
    "ConstantOfShape": frozenset({20}) | _LATER_TYPE_ADDITIONS,
    "Conv": frozenset({22}),
    "ConvTranspose": frozenset({22}),
    "CumSum": frozenset({14}),
    "DepthToSpace": frozenset({13, 28}),
    "Div": frozenset({13, 14}),
    "Elu": frozenset({22}),
    "Equal": frozenset({13, 19}),
    "Erf": frozenset({13}),
    "Exp": frozenset({13}),
    "Expand": frozenset({13}),
    "Flatten": frozenset({13}) | _LATER_TYPE_ADDITIONS,
    "Floor": frozenset({13}),
    "GRU": frozenset({14, 22}),  # layout (GRU, LSTM, RNN): RecurrentLayoutRewrite
    "Gather": frozenset({13}),
    "Gemm": frozenset({13}),
    "GlobalAveragePool": frozenset({22}),
    "GlobalMaxPool": frozenset({22}),
    "Greater": frozenset({13}),
    "HardSigmoid": frozenset({22}),
    "Identity": frozenset({13, 14, 16, 19}) | _LATER_TYPE_ADDITIONS,
    "If": frozenset({13, 16, 19}) | _LATER_TYPE_ADDITIONS,
    "InstanceNormalization": frozenset({22}),
    "IsInf": frozenset({20}),
    "IsNaN": frozenset({13, 20}),
    "LRN": frozenset({13}),
    "LSTM": frozenset({14, 22}),
    "LeakyRelu": frozenset({16}),
    "Less": frozenset({13}),
    "Log": frozenset({13}),
    "Loop": frozenset({13, 16, 19}) | _LATER_TYPE_ADDITIONS,
    "MatMul": frozenset({13}),
    "Max": frozenset({12, 13}),  # integer Max: IntegerMinMaxRewrite
    "MaxPool": frozenset({12, 22}),
    "Mean": frozenset({13}),
    "Min": frozenset({12, 13}),
    "Mod": frozenset({13, 28}),  # fmod=0 on floats: ModRewrite
    "Mul": frozenset({13, 14}),
    "Neg": frozenset({13}),
    "OneHot": frozenset({28}),
    "PRelu": frozenset({16}),
    "Pad": frozenset({13}),
    "Pow": frozenset({12, 13, 15}),  # mixed types: PowRewrite
    "RNN": frozenset({14, 22}),
    "RandomNormal": frozenset({22}),
    "RandomNormalLike": frozenset({22}),
    "RandomUniform": frozenset({22}),
    "RandomUniformLike": frozenset({22}),
    "Reciprocal": frozenset({13}),
    "ReduceL1": frozenset({13}),
    "ReduceL2": frozenset({13}),
    "ReduceLogSum": frozenset({13}),
    "ReduceLogSumExp": frozenset({13}),
    "ReduceMax": frozenset({12, 13}),
    "ReduceMean": frozenset({13}),
    "ReduceMin": frozenset({12, 13}),
    "ReduceProd": frozenset({13}),
    "ReduceSumSquare": frozenset({13}),
    "Relu": frozenset({13, 14}),  # integer Relu: IntegerMinMaxRewrite
    "Reshape": frozenset({13, 14, 19}) | _LATER_TYPE_ADDITIONS,  # allowzero: NeutralAttributeRewrite
    "RoiAlign": frozenset({16, 22}),
    "Round": frozenset({22}),
    "Scan": frozenset({16, 19}) | _LATER_TYPE_ADDITIONS,
    "ScatterElements": frozenset({13, 16, 18}),  # reduction: NegativeIndicesRewrite, gather_scatter
    "Selu": frozenset({22}),
    "Shape": frozenset({13, 15, 19}) | _LATER_TYPE_ADDITIONS,  # start/end: ShapeSliceRewrite
    "Sigmoid": frozenset({13}),
    "Sign": frozenset({13}),
    "Slice": frozenset({13}),
    "Softplus": frozenset({22}),
    "Softsign": frozenset({22}),
    "SpaceToDepth": frozenset({13}),  # mode (28): SpaceToDepthRewrite
    "Sqrt": frozenset({13}),
    "Sub": frozenset({13, 14}),
    "Sum": frozenset({13}),
    "Tanh": frozenset({13}),
    "ThresholdedRelu": frozenset({22}),
    "Tile": frozenset({13}),
    "Transpose": frozenset({13}) | _LATER_TYPE_ADDITIONS,
    "Where": frozenset({16}),
}
