"""Resize-13/18/19 brought back to Resize-11 (roi and scales always present, no axes/antialias)."""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, copy_attributes, input_at, text_attribute

_OPSET11_COORDINATE_MODES = frozenset(
    {"half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize"}
)
_POST_11_ATTRIBUTES = ("antialias", "axes", "keep_aspect_ratio_policy")


class ResizeRewrite(Rewrite):
    """Resize-13+ becomes Resize-11: empty roi/scales where omitted, axes expanded; antialias refused."""

    op_types = frozenset({"Resize"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        if since_version < 13:
            return None
        if int(attribute(node, "antialias", 0)) != 0:
            raise CannotLower("antialias=1 has no opset-11 equivalent")
        policy = text_attribute(node, "keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            raise CannotLower(f"keep_aspect_ratio_policy='{policy}' has no opset-11 equivalent")
        mode = text_attribute(node, "coordinate_transformation_mode", "half_pixel")
        if mode not in _OPSET11_COORDINATE_MODES:
            raise CannotLower(f"coordinate_transformation_mode='{mode}' has no opset-11 equivalent")
        hint = node.name or "Resize"
        roi, scales, sizes = input_at(node, 1), input_at(node, 2), input_at(node, 3)
        axes = attribute(node, "axes")
        if axes is not None:
            roi, scales, sizes = _expand_to_all_axes(
                node, scope, [int(a) for a in axes], roi, scales, sizes, hint
            )
        # Resize-11 requires roi and scales as inputs; an empty tensor means "not given".
        empty = np.zeros((0,), dtype=np.float32)
        roi = roi or scope.add_constant(empty, f"{hint}/roi")
        scales = scales or scope.add_constant(empty, f"{hint}/scales")
        inputs = [node.input[0], roi, scales] + ([sizes] if sizes else [])
        attributes = copy_attributes(node, drop=_POST_11_ATTRIBUTES)
        return [scope.make_node("Resize", inputs, [node.output[0]], hint, **attributes)]


def _expand_to_all_axes(
    node: onnx.NodeProto,
    scope: GraphScope,
    axes: list[int],
    roi: str,
    scales: str,
    sizes: str,
    hint: str,
) -> tuple[str, str, str]:
    """Scales/sizes/roi given for `axes` only, rewritten for every axis (the others left unchanged)."""
    rank = scope.require_rank(node.input[0])
    axes = [a + rank if a < 0 else a for a in axes]
    if scales:
        value = scope.require_constant(scales, "with the axes attribute, scales must be a constant")
        full = np.ones(rank, dtype=np.float32)
        full[axes] = np.asarray(value, dtype=np.float32).reshape(-1)
        scales = scope.add_constant(full, f"{hint}/scales")
    if sizes:
        value = scope.require_constant(sizes, "with the axes attribute, sizes must be a constant")
        full_sizes = np.array(
            scope.require_static_shape(node.input[0], "fills sizes of the other axes"), np.int64
        )
        full_sizes[axes] = np.asarray(value, dtype=np.int64).reshape(-1)
        sizes = scope.add_constant(full_sizes, f"{hint}/sizes")
    if roi:
        value = scope.require_constant(roi, "with the axes attribute, roi must be a constant")
        given = np.asarray(value).reshape(2, len(axes))
        full_roi = np.concatenate([np.zeros(rank), np.ones(rank)]).astype(given.dtype).reshape(2, rank)
        full_roi[:, axes] = given
        roi = scope.add_constant(full_roi.reshape(-1), f"{hint}/roi")
    return roi, scales, sizes
