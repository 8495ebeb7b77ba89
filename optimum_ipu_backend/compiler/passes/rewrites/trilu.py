"""Trilu (opset 14) as a Where between the input and zero, selected by a mask over the last two dims."""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, input_at, numpy_dtype


class TriluRewrite(Rewrite):
    """Trilu (upper/lower, any k) on static last two dims becomes Where(mask, x, 0)."""

    op_types = frozenset({"Trilu"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x = node.input[0]
        dims = scope.require_static_shape(x, "Trilu needs to build its mask")
        if len(dims) < 2:
            raise CannotLower(f"Trilu needs an input of rank >= 2, got shape {dims}")
        upper = bool(attribute(node, "upper", 1))
        rows, cols = dims[-2], dims[-1]
        # The diagonal offset of element (i, j) is j - i; Trilu keeps j - i >= k (upper) or <= k (lower).
        offsets = np.arange(cols, dtype=np.int64)[None, :] - np.arange(rows, dtype=np.int64)[:, None]
        hint = node.name or "Trilu"
        k_name = input_at(node, 1)
        k_value = scope.constant(k_name) if k_name else np.array(0, dtype=np.int64)
        nodes: list[onnx.NodeProto] = []
        if k_value is not None:
            k = int(np.asarray(k_value).reshape(()))
            mask = scope.add_constant(offsets >= k if upper else offsets <= k, f"{hint}/mask")
        else:
            # A runtime k: compare it with the constant offsets (k is an int64 scalar by definition).
            offsets_name = scope.add_constant(offsets, f"{hint}/offsets")
            dropped = scope.make_node(
                "Less" if upper else "Greater", [offsets_name, k_name], 1, f"{hint}/dropped"
            )
            kept = scope.make_node("Not", [dropped.output[0]], 1, f"{hint}/kept")
            nodes += [dropped, kept]
            mask = kept.output[0]
        elem_type = scope.require_elem_type(x)
        if elem_type == onnx.TensorProto.BOOL:
            # Zeroing a boolean is And with the mask (onnxruntime has no boolean Where-9 kernel).
            return [*nodes, scope.make_node("And", [mask, x], [node.output[0]], hint)]
        zero = scope.add_constant(np.zeros((), dtype=numpy_dtype(elem_type)), f"{hint}/zero")
        return [*nodes, scope.make_node("Where", [mask, x, zero], [node.output[0]], hint)]
