"""Resize-13/18/19 brought back to Resize-11 (roi and scales always present, no axes/antialias).

keep_aspect_ratio_policy (18) with constant sizes resizes the given axes by one scale, the smallest
(not_larger) or largest (not_smaller) of sizes/input, to round(scale * input) elements. Where those
lengths divided by the input's give back that scale, they are Resize-11's sizes. Otherwise Resize-11 is
given the scale, which makes floor(scale * input) elements at the same coordinates: the input is first
extended with copies of its edge (the values a clamped coordinate reads anyway) so that enough elements
are made, and the result is sliced to length. That needs coordinates that do not depend on the input's
length; align_corners and tf_crop_and_resize are then refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, copy_attributes, input_at, text_attribute

_OPSET11_COORDINATE_MODES = frozenset(
    {"half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize"}
)
_POST_11_ATTRIBUTES = ("antialias", "axes", "keep_aspect_ratio_policy")
_POLICY_SCALE: dict[str, Callable[[np.ndarray], np.float32]] = {"not_larger": np.min, "not_smaller": np.max}
# Modes whose source coordinate of an output element depends on the scale, not on the input's length
# (pytorch_half_pixel's differs for an output of length 1, which _edge_copies keeps at 1).
_LENGTH_FREE_COORDINATE_MODES = frozenset({"half_pixel", "pytorch_half_pixel", "asymmetric"})


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
        mode = text_attribute(node, "coordinate_transformation_mode", "half_pixel")
        if mode not in _OPSET11_COORDINATE_MODES:
            raise CannotLower(f"coordinate_transformation_mode='{mode}' has no opset-11 equivalent")
        hint = node.name or "Resize"
        roi, scales, sizes = input_at(node, 1), input_at(node, 2), input_at(node, 3)
        axes = attribute(node, "axes")
        rank = scope.require_rank(node.input[0])
        resized_axes = [a + rank if a < 0 else a for a in axes] if axes is not None else list(range(rank))
        if axes is not None:
            roi, scales, sizes = _expand_to_all_axes(node, scope, resized_axes, roi, scales, sizes, hint)
        # Resize-11 requires roi and scales as inputs; an empty tensor means "not given".
        empty = np.zeros((0,), dtype=np.float32)
        roi = roi or scope.add_constant(empty, f"{hint}/roi")
        attributes = copy_attributes(node, drop=_POST_11_ATTRIBUTES)
        policy = text_attribute(node, "keep_aspect_ratio_policy", "stretch")
        if sizes and policy != "stretch":  # the policy only applies to sizes
            return _keep_aspect_ratio(node, scope, policy, resized_axes, roi, sizes, attributes, hint)
        scales = scales or scope.add_constant(empty, f"{hint}/scales")
        inputs = [node.input[0], roi, scales] + ([sizes] if sizes else [])
        return [scope.make_node("Resize", inputs, [node.output[0]], hint, **attributes)]


def _keep_aspect_ratio(
    node: onnx.NodeProto,
    scope: GraphScope,
    policy: str,
    axes: list[int],
    roi: str,
    sizes: str,
    attributes: dict[str, Any],
    hint: str,
) -> list[onnx.NodeProto]:
    """Resize-11 by the policy's one scale (see the module's docstring)."""
    if policy not in _POLICY_SCALE:
        raise CannotLower(f"keep_aspect_ratio_policy='{policy}' is not one ONNX defines")
    dims = np.array(scope.require_static_shape(node.input[0], "keep_aspect_ratio_policy scales from it"))
    wanted = scope.require_constant(sizes, "with keep_aspect_ratio_policy, sizes must be a constant")
    wanted = np.asarray(wanted, np.int64).reshape(-1)
    # In float32, as onnxruntime computes them: the scale, then each axis's length round(scale * input).
    scale = _POLICY_SCALE[policy](np.float32(wanted[axes]) / np.float32(dims[axes]))
    lengths = dims.copy()
    lengths[axes] = np.floor(np.float64(scale * np.float32(dims[axes])) + 0.5)
    if all(np.float32(lengths[a]) / np.float32(dims[a]) == scale for a in axes):
        # Resize-11 given these sizes derives exactly the policy's scale on every axis.
        empty = scope.add_constant(np.zeros((0,), np.float32), f"{hint}/scales")
        given = scope.add_constant(lengths, f"{hint}/sizes")
        return [
            scope.make_node(
                "Resize", [node.input[0], roi, empty, given], [node.output[0]], hint, **attributes
            )
        ]
    mode = text_attribute(node, "coordinate_transformation_mode", "half_pixel")
    if mode not in _LENGTH_FREE_COORDINATE_MODES or (
        text_attribute(node, "mode", "nearest") == "cubic" and int(attributes.get("exclude_outside", 0))
    ):
        raise CannotLower(
            f"keep_aspect_ratio_policy='{policy}' gives lengths {lengths.tolist()} at scale {scale}, which "
            f"Resize-11 cannot make at that scale with coordinate_transformation_mode='{mode}' (or cubic "
            "exclude_outside), whose coordinates depend on the input length"
        )
    extra = np.zeros(2 * len(dims), np.int64)
    for axis in axes:
        extra[len(dims) + axis] = _edge_copies(scale, int(dims[axis]), int(lengths[axis]))
    pads = scope.add_constant(extra, f"{hint}/edge_pads")
    scales = np.ones(len(dims), np.float32)
    scales[axes] = scale
    extended = scope.make_node("Pad", [node.input[0], pads], 1, f"{hint}/edge", mode="edge")
    resized = scope.make_node(
        "Resize",
        [extended.output[0], roi, scope.add_constant(scales, f"{hint}/scales")],
        1,
        f"{hint}/longer",
        **attributes,
    )
    starts = scope.add_constant(np.zeros(len(dims), np.int64), f"{hint}/starts")
    ends = scope.add_constant(lengths, f"{hint}/ends")
    cut = scope.make_node("Slice", [resized.output[0], starts, ends], [node.output[0]], hint)
    return [extended, resized, cut]


def _edge_copies(scale: np.float32, size: int, length: int) -> int:
    """How many copies of its edge an axis of ``size`` needs for Resize-11 by ``scale`` to make ``length``.

    Resize-11 makes floor(scale * input) elements: the fewest copies that make at least ``length`` (exactly
    1 when ``length`` is 1, where pytorch_half_pixel's coordinates differ), with a product far enough from
    a whole number that float32 and exact arithmetic agree on its floor.
    """
    for copies in range(4 * size + 4):
        made = np.floor(scale * np.float32(size + copies))
        if made >= length and (length != 1 or made == 1) and made == np.floor(float(scale) * (size + copies)):
            return copies
    raise CannotLower(f"no extension of an axis of {size} makes {length} elements at scale {scale}")


def _expand_to_all_axes(
    node: onnx.NodeProto,
    scope: GraphScope,
    axes: list[int],
    roi: str,
    scales: str,
    sizes: str,
    hint: str,
) -> tuple[str, str, str]:
    """Scales/sizes/roi given for (non-negative) `axes` only, rewritten for every axis (others unchanged)."""
    rank = scope.require_rank(node.input[0])
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
