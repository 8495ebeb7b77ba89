"""Why each ai.onnx operator the compiler neither passes through nor lowers is refused: the one list.

The session pre-check and the lowering pass (so ``optimum-ipu check`` too) quote these reasons,
``tools/operators_table.py`` writes them to docs/operators.md, and a test checks that every operator of
the default domain up to ``NEWEST_EXPORTED_OPSET`` is either accepted by the compiler or listed here.
A reason that starts with ``planned`` names the plan; the operators transformers models are built from
(activations, normalisations, attention) are refused only with one.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

#: The newest ai.onnx opset an optimum export can carry: torch.onnx's newest, which optimum passes on
#: when asked (its model configs default to 18 or less).
NEWEST_EXPORTED_OPSET = 23
#: How a reason that names its plan begins.
PLANNED = "planned"

_UNUSED = "not written: no architecture optimum exports uses it"
#: The quantization a dynamically quantized model (ORTQuantizer with ``is_static=False``) is refused for.
DYNAMIC_QUANTIZATION = "dynamic int8 quantization (DynamicQuantizeLinear + MatMulInteger)"
#: Why, and what to do instead: the one message, quoted at session creation and by the lowering pass.
DYNAMIC_QUANTIZATION_REASON = (
    f"{DYNAMIC_QUANTIZATION} cannot run on the IPU: its integer matrix products take scales computed on "
    "every call from the data, PopART's opset 11 has no int8 matrix multiply to compute them, and emulating "
    "them in float would change the results, which this backend never does silently. Load the unquantized "
    'model instead, with provider_options={"precision": "fp16"}'
)
#: The operators of dynamic quantization (ai.onnx's and onnxruntime's fused ones), named as
#: ``op_table.operator_name`` names them: a model with any of them is refused with the message above.
DYNAMIC_QUANTIZATION_OPS: frozenset[str] = frozenset(
    {
        "DynamicQuantizeLinear",
        "MatMulInteger",
        "ConvInteger",
        "com.microsoft::DynamicQuantizeLinear",
        "com.microsoft::DynamicQuantizeMatMul",
        "com.microsoft::DynamicQuantizeLSTM",
        "com.microsoft::MatMulIntegerToFloat",
        "com.microsoft::QAttention",
    }
)
_QOPERATOR = (
    "static int8 quantization in operator form (QOperator format): integer products requantized inside the "
    "operator, which PopART's opset 11 cannot express (no int8 MatMul or Conv) and float does not reproduce "
    "exactly; quantize in the QDQ format instead (QuantizeLinear/DequantizeLinear with constant scales are "
    'lowered to exact float arithmetic), or load the unquantized model with provider_options={"precision": '
    '"fp16"}'
)
_SEQUENCE = "takes or makes a sequence of tensors: Poplar holds tensors only (PopART has no sequence type)"
_OPTIONAL = "takes or makes an optional value: Poplar holds tensors only (PopART has no optional type)"
_STRING = "operates on strings: Poplar has no string type (text is tokenized on the host)"
_RANDOM = (
    "draws random samples: not in PopART, and no IPU draw can be checked against onnxruntime's (a "
    "different generator); inference exports of transformers models do not sample inside the graph"
)
_DATA_DEPENDENT_SHAPE = "its output shape depends on input values: an IPU graph has static shapes only"
_LOSS = "a training loss: not in PopART's inference operators, and optimum's inference exports compute none"
_SIGNAL_GENERATOR = (
    "generates a window or mel filter bank from scalar inputs: not in PopART; transformers' audio models "
    "compute their spectrograms on the host (feature extractors), so their exports do not contain it"
)
_FOURIER = (
    "a Fourier transform: not in PopART; at a static length a MatMul by a constant DFT matrix would express "
    "it, not written: transformers' audio models take spectrograms computed on the host"
)
_LP_POOL = (
    "p-norm pooling: not in PopART; expressible with Pow and AveragePool times the window size, " + _UNUSED
)
_DEPRECATED = (
    "deprecated in opset {since}, replaced by {by}: accepted in a model of an older opset, which the "
    "compiler converts to opset 11 with onnx.version_converter (turning it into {by}); refused in later "
    "opsets"
)
_BITWISE = (
    "integer bitwise operation: PopART's opset 11 has none (the compiler emits ai.onnx only), and an exact "
    "emulation costs a division, remainder and product per bit (BitwiseNot, a subtraction, is lowered); "
    "torch exports bitwise operations on booleans as And, Or, Not and Xor, which are accepted"
)

#: Every ai.onnx operator (up to NEWEST_EXPORTED_OPSET, deprecated ones too) that the pre-check refuses.
REFUSAL_REASONS: Mapping[str, str] = MappingProxyType(
    {
        "AffineGrid": ("builds the sampling grid of a spatial transformer: not in PopART, " + _UNUSED),
        "Attention": (
            "planned: Attention-23 decomposed into MatMul, Softmax, Where and Add as its ONNX function body "
            "(masks, is_causal, grouped key/value heads, softcap, past key/value), as RotaryEmbedding-23 "
            "already is (rewrites/rotary_embedding.py), together with the contrib "
            "Attention of issue 24; optimum's exports up to opset 18 spell attention in MatMul and Softmax, "
            "which are accepted"
        ),
        "Bernoulli": _RANDOM,
        "BitShift": (
            "unsigned integer shift: PopART's opset 11 has no shift, and its integer Mul and Div do not wrap "
            "and truncate as unsigned shifts do for every operand; no transformers export uses it"
        ),
        "BitwiseAnd": _BITWISE,
        "BitwiseOr": _BITWISE,
        "BitwiseXor": _BITWISE,
        "BlackmanWindow": _SIGNAL_GENERATOR,
        "CenterCropPad": (
            "not in PopART; with a constant shape input it is Slice and Pad, not written: transformers crop "
            "images on the host (image processors)"
        ),
        "Col2Im": ("the inverse of im2col (a sum of overlapping patches): not in PopART, " + _UNUSED),
        "Compress": _DATA_DEPENDENT_SHAPE + " (with a constant condition it would be a Gather, not written)",
        "ConcatFromSequence": _SEQUENCE,
        "ConvInteger": DYNAMIC_QUANTIZATION_REASON,
        "DFT": _FOURIER,
        "DeformConv": ("convolution sampled at per-element learned offsets: not in PopART, " + _UNUSED),
        "Det": "matrix determinant: needs a pivoted factorisation with data-dependent control; not in PopART",
        "DynamicQuantizeLinear": DYNAMIC_QUANTIZATION_REASON,
        "GlobalLpPool": _LP_POOL,
        "GridSample": (
            "sampling at data-dependent coordinates: not in PopART; a Floor/GatherElements lowering at "
            "static shapes is possible, not written: only deformable-attention detection models use it"
        ),
        "HammingWindow": _SIGNAL_GENERATOR,
        "HannWindow": _SIGNAL_GENERATOR,
        "ImageDecoder": (
            "decodes compressed image bytes into an image whose shape depends on the bytes; images are "
            "decoded on the host"
        ),
        "LpPool": _LP_POOL,
        "MatMulInteger": DYNAMIC_QUANTIZATION_REASON,
        "MaxRoiPool": ("not in PopART (RoiAlign is, and is accepted), " + _UNUSED),
        "MaxUnpool": (
            "scatters to the positions a MaxPool's indices output chose: not in PopART, " + _UNUSED
        ),
        "MelWeightMatrix": _SIGNAL_GENERATOR,
        "Multinomial": _RANDOM,
        "NegativeLogLikelihoodLoss": _LOSS,
        "NonMaxSuppression": _DATA_DEPENDENT_SHAPE,
        "Optional": _OPTIONAL,
        "OptionalGetElement": _OPTIONAL,
        "OptionalHasElement": _OPTIONAL,
        "QLinearConv": _QOPERATOR,
        "QLinearMatMul": _QOPERATOR,
        "RegexFullMatch": _STRING,
        "STFT": _FOURIER,
        "Scatter": _DEPRECATED.format(since=11, by="ScatterElements"),
        "SequenceAt": _SEQUENCE,
        "SequenceConstruct": _SEQUENCE,
        "SequenceEmpty": _SEQUENCE,
        "SequenceErase": _SEQUENCE,
        "SequenceInsert": _SEQUENCE,
        "SequenceLength": _SEQUENCE,
        "SequenceMap": _SEQUENCE,
        "SoftmaxCrossEntropyLoss": _LOSS,
        "SplitToSequence": _SEQUENCE,
        "StringConcat": _STRING,
        "StringNormalizer": _STRING,
        "StringSplit": _STRING,
        "TfIdfVectorizer": (
            "n-gram counting of classic text pipelines: not in PopART, not written: transformers tokenize on "
            "the host"
        ),
        "Unique": _DATA_DEPENDENT_SHAPE,
        "Upsample": _DEPRECATED.format(since=10, by="Resize"),
    }
)

#: Deprecated operators that the compiler's conversion of a model below opset 11 replaces.
REPLACED_BELOW_OPSET11: frozenset[str] = frozenset({"Scatter", "Upsample"})

_NO_LOWERING = "no PopART implementation and no rewrite into one"


def refusal_reason(op_type: str) -> str:
    """What the pre-check says of an ai.onnx ``op_type`` it refuses: the listed reason, when there is one."""
    reason = REFUSAL_REASONS.get(op_type)
    return f"{_NO_LOWERING}: {reason}" if reason else _NO_LOWERING


def is_planned(reason: str) -> bool:
    """Whether ``reason`` names a plan."""
    return reason.startswith(PLANNED)
