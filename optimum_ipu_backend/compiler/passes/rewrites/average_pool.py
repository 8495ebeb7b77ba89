"""AveragePool-19+ with dilations: window sums by a depthwise Conv, divided by compile-time window counts.

AveragePool-11 has no dilations; Conv-11 has. A Conv with all-one weights, one group per channel, sums
exactly the taps the pool averages (the zero padding adds nothing), and the shapes are static, so how
many taps each window divides by is a constant. The counts are onnxruntime's (the conformance oracle):
with ``count_include_pad=0`` the taps inside the input; with ``count_include_pad=1`` the taps inside
the padded input, a ceil_mode window being cut where the end padding ends. A window with no tap inside
the input is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import numpy as np
import onnx

from ...graphs import attribute
from .attribute_adapters import without_attributes
from .common import CannotLower, GraphScope, Rewrite, numpy_dtype, text_attribute

#: The element types Conv-11 takes.
_CONV_TYPES = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})


class AveragePoolRewrite(Rewrite):
    """Dilated AveragePool becomes Conv (unit weights, group = channels) and Div by the window counts;
    unit dilations are dropped."""

    op_types = frozenset({"AveragePool"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        dilations = attribute(node, "dilations")
        if since_version < 19 or dilations is None:
            return None
        if all(int(d) == 1 for d in dilations):
            return [without_attributes(node, {"dilations"}, scope)]
        return _dilated_average(node, [int(d) for d in dilations], scope)


@dataclass(frozen=True)
class _AxisWindows:
    """The pool's windows along one spatial axis."""

    #: Per window, its taps inside the input, and inside the padded input.
    taps_inside: np.ndarray
    taps_inside_padding: np.ndarray
    #: The zeros a ceil_mode last window reads past the end padding.
    extra_end_padding: int


def _axis_windows(
    size: int, kernel: int, stride: int, dilation: int, pad_begin: int, pad_end: int, ceil_mode: bool
) -> _AxisWindows:
    reach = size + pad_begin + pad_end - ((kernel - 1) * dilation + 1)
    if reach < 0:
        raise CannotLower(
            f"the dilated window ({kernel} taps {dilation} apart) is longer than the padded input "
            f"({size} + pads {pad_begin}, {pad_end})"
        )
    count = (-(-reach // stride) if ceil_mode else reach // stride) + 1
    if ceil_mode and (count - 1) * stride >= size + pad_begin:
        # onnxruntime (and ONNX's reference) drop such a window, ONNX shape inference counts it.
        raise CannotLower(
            "ceil_mode gives a last window that starts in the end padding, which onnxruntime drops and "
            "ONNX shape inference counts: the output shape is ambiguous"
        )
    taps = (np.arange(count) * stride - pad_begin)[:, None] + np.arange(kernel)[None, :] * dilation
    return _AxisWindows(
        taps_inside=((taps >= 0) & (taps < size)).sum(axis=1),
        taps_inside_padding=(taps < size + pad_end).sum(axis=1),
        extra_end_padding=max(0, int(taps[-1, -1]) + 1 - (size + pad_end)),
    )


def _dilated_average(node: onnx.NodeProto, dilations: list[int], scope: GraphScope) -> list[onnx.NodeProto]:
    x = node.input[0]
    dims = scope.require_static_shape(x, "a dilated AveragePool needs for its compile-time window counts")
    elem_type = scope.require_elem_type(x)
    if elem_type not in _CONV_TYPES:
        raise CannotLower(
            f"Conv-11, which sums a dilated window, takes no {onnx.TensorProto.DataType.Name(elem_type)}"
        )
    kernel = [int(k) for k in attribute(node, "kernel_shape")]
    spatial = len(kernel)
    strides = [int(s) for s in attribute(node, "strides", [1] * spatial)]
    pads = [int(p) for p in attribute(node, "pads", [0] * 2 * spatial)]
    auto_pad = text_attribute(node, "auto_pad", "NOTSET")
    if auto_pad == "VALID":
        pads = [0] * 2 * spatial
    elif auto_pad != "NOTSET":
        raise CannotLower(
            f"auto_pad={auto_pad} with dilations: onnxruntime pads for the undilated kernel, the ONNX "
            "specification for the dilated one"
        )
    if len(dims) != spatial + 2:
        raise CannotLower(f"input '{x}' of shape {dims} does not have {spatial} spatial axes")
    ceil_mode = bool(attribute(node, "ceil_mode", 0))
    axes = [
        _axis_windows(dims[2 + i], kernel[i], strides[i], dilations[i], pads[i], pads[spatial + i], ceil_mode)
        for i in range(spatial)
    ]
    inside = _outer_product([axis.taps_inside for axis in axes])
    if attribute(node, "count_include_pad", 0):
        counted = _outer_product([axis.taps_inside_padding for axis in axes])
    else:
        counted = inside
    # A window wholly in the padding sums to 0; dividing by 1 keeps it 0, as onnxruntime leaves it.
    counts = np.where(inside == 0, 1, counted).astype(numpy_dtype(elem_type))
    if np.all(counts == counts.flat[0]):
        counts = np.array(counts.flat[0])

    hint = node.name or "AveragePool"
    channels = dims[1]
    ones = scope.add_constant(np.ones((channels, 1, *kernel), numpy_dtype(elem_type)), f"{hint}/window")
    window_sums = scope.make_node(
        "Conv",
        [x, ones],
        1,
        f"{hint}/window_sums",
        kernel_shape=kernel,
        strides=strides,
        dilations=dilations,
        pads=pads[:spatial]
        + [end + axis.extra_end_padding for end, axis in zip(pads[spatial:], axes, strict=True)],
        group=channels,
    )
    divisor = scope.add_constant(counts, f"{hint}/window_counts")
    return [window_sums, scope.make_node("Div", [window_sums.output[0], divisor], [node.output[0]], hint)]


def _outer_product(per_axis: list[np.ndarray]) -> np.ndarray:
    """The product of one value per axis, for every combination: the per-window count grid."""
    return reduce(np.multiply.outer, per_axis)
