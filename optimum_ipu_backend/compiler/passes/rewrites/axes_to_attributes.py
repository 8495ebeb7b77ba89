"""Split, Squeeze, Unsqueeze and the Reduce ops: operands that opset 13/18 made inputs become attributes."""

from __future__ import annotations

import math

import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, copy_attributes, input_at

REDUCE_OPS: frozenset[str] = frozenset(
    {
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceMax",
        "ReduceMean",
        "ReduceMin",
        "ReduceProd",
        "ReduceSum",
        "ReduceSumSquare",
    }
)
# The opset where each operator's axes moved to an input (ReduceSum first, the others at 18).
_AXES_INPUT_SINCE = {op: 18 for op in REDUCE_OPS} | {"ReduceSum": 13, "Squeeze": 13, "Unsqueeze": 13}
# Reductions whose value over a single element is that element.
_IDENTITY_ON_ONE_ELEMENT = frozenset({"ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum"})
# Later versions of the Reduce ops only change element types (bool for ReduceMax/ReduceMin at 20, no
# integers for ReduceLogSum/ReduceLogSumExp at 28), which the final type check covers; anything newer has
# not been reviewed.
_LAST_REVIEWED_REDUCE_VERSION = 28


class AxesToAttributesRewrite(Rewrite):
    """Split-13/18, Squeeze/Unsqueeze-13 and Reduce*-13/18 take their constant axes/split as attributes."""

    op_types = frozenset({"Split", "Squeeze", "Unsqueeze"}) | REDUCE_OPS

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        if node.op_type == "Split":
            return _lower_split(node, since_version, scope)
        if node.op_type in REDUCE_OPS and since_version > _LAST_REVIEWED_REDUCE_VERSION:
            raise CannotLower(f"{node.op_type}-{since_version} has not been reviewed against opset 11")
        if since_version < _AXES_INPUT_SINCE[node.op_type]:
            return None  # axes are already an attribute
        if node.op_type == "Unsqueeze":
            axes = scope.require_constant_ints(node, 1, "axes")
            return [_with_axes(node, scope, axes)]
        axes = scope.require_constant_ints(node, 1, "axes") if input_at(node, 1) else []
        if node.op_type == "Squeeze":
            # No axes means "every dimension of size 1" in both versions.
            return [_with_axes(node, scope, axes or None)]
        if not axes and attribute(node, "noop_with_empty_axes", 0):
            return _reduce_nothing(node, scope)
        # Without an axes attribute, an opset-11 Reduce reduces over every dimension.
        return [_with_axes(node, scope, axes or None, drop=("noop_with_empty_axes",))]


def _reduce_nothing(node: onnx.NodeProto, scope: GraphScope) -> list[onnx.NodeProto]:
    """noop_with_empty_axes: each element reduced alone (ReduceL1 -> |x|, ReduceSumSquare -> x*x, ...)."""
    hint = node.name or node.op_type
    if node.op_type in _IDENTITY_ON_ONE_ELEMENT:
        return [scope.make_node("Identity", [node.input[0]], [node.output[0]], hint)]
    # A new axis of size 1 reduced away applies the reduction to every element alone, as onnxruntime does.
    singleton = scope.make_node("Unsqueeze", [node.input[0]], 1, f"{hint}/singleton", axes=[0])
    reduced = scope.make_node(
        node.op_type, [singleton.output[0]], [node.output[0]], hint, axes=[0], keepdims=0
    )
    return [singleton, reduced]


def _with_axes(
    node: onnx.NodeProto, scope: GraphScope, axes: list[int] | None, drop: tuple[str, ...] = ()
) -> onnx.NodeProto:
    attributes = copy_attributes(node, drop=drop)
    if axes is not None:
        attributes["axes"] = axes
    return scope.make_node(
        node.op_type, [node.input[0]], list(node.output), node.name or node.op_type, **attributes
    )


def _lower_split(node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto] | None:
    if since_version < 13:
        return None
    axis = int(attribute(node, "axis", 0))
    num_outputs = attribute(node, "num_outputs")
    attributes = copy_attributes(node, drop=("num_outputs",))
    if input_at(node, 1):
        attributes["split"] = scope.require_constant_ints(node, 1, "split")
    elif num_outputs is not None:
        sizes = _split_sizes_for(node, scope, axis, int(num_outputs))
        if sizes is not None:
            attributes["split"] = sizes
    # With neither, both versions split into len(outputs) equal parts.
    return [scope.make_node("Split", [node.input[0]], list(node.output), node.name or "Split", **attributes)]


def _split_sizes_for(
    node: onnx.NodeProto, scope: GraphScope, axis: int, num_outputs: int
) -> list[int] | None:
    """Split-18's num_outputs as sizes: equal parts, the last one smaller when the size does not divide."""
    if num_outputs != len(node.output):
        raise CannotLower(f"num_outputs={num_outputs} but the node has {len(node.output)} outputs")
    dims = scope.shape(node.input[0])
    rank = scope.require_rank(node.input[0])
    size = dims[axis + rank if axis < 0 else axis] if dims is not None else None
    if size is None:
        raise CannotLower(
            f"num_outputs={num_outputs} needs the size of axis {axis} of '{node.input[0]}' to know whether "
            "it divides evenly; fix the input shapes first"
        )
    if size % num_outputs == 0:
        return None
    chunk = math.ceil(size / num_outputs)
    sizes = [chunk] * (num_outputs - 1) + [size - chunk * (num_outputs - 1)]
    if sizes[-1] < 0:
        raise CannotLower(f"axis {axis} of size {size} cannot be split into {num_outputs} parts")
    return sizes
