"""ArgMax/ArgMin-12+: the last of tied extremes is the first one of the input reversed along the axis."""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .attribute_adapters import without_attributes
from .common import CannotLower, GraphScope, Rewrite, copy_attributes

_LAST_INDEX = "select_last_index"


class ArgExtremeRewrite(Rewrite):
    """``select_last_index=1``: Gather along the axis with constant reversed indices, the opset-11 op (the
    first extreme), then ``size - 1 - index``. ``select_last_index=0`` is dropped."""

    op_types = frozenset({"ArgMax", "ArgMin"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        select_last = attribute(node, _LAST_INDEX)
        if since_version < 12 or select_last is None:
            return None
        if not select_last:
            return [without_attributes(node, {_LAST_INDEX}, scope)]
        x = node.input[0]
        rank = scope.require_rank(x)
        axis = int(attribute(node, "axis", 0))
        axis = axis + rank if axis < 0 else axis
        size = scope.shape(x)[axis]  # type: ignore[index]  # the rank is known
        if size is None:
            raise CannotLower(
                f"the size of axis {axis} of '{x}' is unknown; reversing the axis needs it, fix the shapes"
            )
        hint = node.name or node.op_type
        # Gather with constant indices, not Slice with step -1: nothing we have says PopART's Slice takes
        # negative steps.
        reversed_order = scope.add_constant(np.arange(size - 1, -1, -1, dtype=np.int64), f"{hint}/reversed")
        flipped = scope.make_node("Gather", [x, reversed_order], 1, f"{hint}/flip", axis=axis)
        first = scope.make_node(
            node.op_type, [flipped.output[0]], 1, hint, **copy_attributes(node, drop={_LAST_INDEX})
        )
        # int64 as ONNX types the index; Int64ToInt32 narrows the ArgMax output and this constant together.
        last_position = scope.add_constant(np.array(size - 1, dtype=np.int64), f"{hint}/last_position")
        unflip = scope.make_node("Sub", [last_position, first.output[0]], [node.output[0]], f"{hint}/unflip")
        return [flipped, first, unflip]
