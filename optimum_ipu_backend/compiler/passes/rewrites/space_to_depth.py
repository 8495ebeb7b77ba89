"""SpaceToDepth-28 (the mode attribute) brought back to SpaceToDepth-1 (DCR order only)."""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, copy_attributes, text_attribute


class SpaceToDepthRewrite(Rewrite):
    """DCR stays SpaceToDepth without the attribute; CRD becomes Reshape, Transpose and Reshape."""

    op_types = frozenset({"SpaceToDepth"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        if since_version < 28:
            return None  # SpaceToDepth-13 only added bfloat16
        hint = node.name or "SpaceToDepth"
        mode = text_attribute(node, "mode", "DCR")
        if mode == "DCR":
            attributes = copy_attributes(node, drop=("mode",))
            return [scope.make_node("SpaceToDepth", [node.input[0]], [node.output[0]], hint, **attributes)]
        if mode != "CRD":
            raise CannotLower(f"mode '{mode}' is neither DCR nor CRD")
        block = int(attribute(node, "blocksize"))
        dims = scope.require_static_shape(node.input[0], "the CRD order is built from fixed reshapes")
        if len(dims) != 4 or dims[2] % block or dims[3] % block:
            raise CannotLower(f"input shape {dims} is not 4-D with height and width divisible by {block}")
        n, c, h, w = dims
        # CRD puts block offsets after the channel: output channel c * block^2 + row * block + column.
        blocks = scope.add_constant(
            np.array([n, c, h // block, block, w // block, block], np.int64), f"{hint}/blocks"
        )
        depth = scope.add_constant(
            np.array([n, c * block * block, h // block, w // block], np.int64), f"{hint}/depth"
        )
        split = scope.make_node("Reshape", [node.input[0], blocks], 1, f"{hint}/split")
        moved = scope.make_node("Transpose", split.output, 1, f"{hint}/moved", perm=[0, 1, 3, 5, 2, 4])
        return [split, moved, scope.make_node("Reshape", [moved.output[0], depth], [node.output[0]], hint)]
