"""Pad-18 (axes input) and Pad-19 brought back to Pad-11 (pads over every axis)."""

from __future__ import annotations

import numpy as np
import onnx

from .common import CannotLower, GraphScope, Rewrite, copy_attributes, input_at, text_attribute

_OPSET11_MODES = frozenset({"constant", "reflect", "edge"})


class PadRewrite(Rewrite):
    """Pad-18/19 with constant axes and pads becomes Pad-11 with pads for every axis; wrap mode is refused."""

    op_types = frozenset({"Pad"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        if since_version < 18:
            return None  # Pad-13 only added bfloat16
        mode = text_attribute(node, "mode", "constant")
        if mode not in _OPSET11_MODES:
            raise CannotLower(f"mode '{mode}' does not exist at opset 11 (only {sorted(_OPSET11_MODES)})")
        hint = node.name or "Pad"
        inputs = [node.input[0], node.input[1], input_at(node, 2)]
        if input_at(node, 3):
            rank = scope.require_rank(node.input[0])
            axes = [a + rank if a < 0 else a for a in scope.require_constant_ints(node, 3, "axes")]
            pads = scope.require_constant_ints(node, 1, "pads")
            full = np.zeros(2 * rank, dtype=np.int64)
            for position, axis in enumerate(axes):
                full[axis] = pads[position]
                full[axis + rank] = pads[position + len(axes)]
            inputs[1] = scope.add_constant(full, f"{hint}/pads")
        while inputs and not inputs[-1]:
            inputs.pop()
        return [scope.make_node("Pad", inputs, [node.output[0]], hint, **copy_attributes(node))]
