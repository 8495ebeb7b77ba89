"""Dropout-12+ (ratio and training_mode as inputs) in inference becomes Identity."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .common import CannotLower, GraphScope, Rewrite, input_at


class DropoutRewrite(Rewrite):
    """Inference Dropout-12+ becomes Identity (and an all-true mask when used); training is refused."""

    op_types = frozenset({"Dropout"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        if since_version < 12:
            return None
        training_mode = input_at(node, 2)
        if training_mode:
            reason = f"training_mode input '{training_mode}' must be a constant false for inference"
            value = scope.require_constant(training_mode, reason)
            if bool(np.asarray(value).reshape(())):
                raise CannotLower(
                    "training_mode is true; opset 11 (and PopART inference) run Dropout as identity"
                )
        hint = node.name or "Dropout"
        passed = scope.make_node("Identity", [node.input[0]], [node.output[0]], hint)
        mask_output = node.output[1] if len(node.output) > 1 and node.output[1] else None
        if mask_output is None:
            return [passed]
        # Outside training every element is kept. (Dropout-10 would return this mask too by the spec, but
        # onnxruntime's Dropout-10 kernel answers all-false, so the mask is built rather than delegated.)
        shape = scope.make_node("Shape", [node.input[0]], 1, f"{hint}/shape")
        keep_all = helper.make_tensor("keep", onnx.TensorProto.BOOL, [1], [True])
        mask = scope.make_node(
            "ConstantOfShape", [shape.output[0]], [mask_output], f"{hint}/mask", value=keep_all
        )
        return [passed, shape, mask]
