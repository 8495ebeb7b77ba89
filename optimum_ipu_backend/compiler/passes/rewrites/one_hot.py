"""OneHot with integer values, computed in float32 and cast back.

Once int64 is narrowed, an integer OneHot has int32 indices, depth and values. PopART takes it, but
onnxruntime, which runs the emulator and the conformance reference, has no OneHot kernel with int32
values, so the emulated graph would fail where the device graph runs. Computing the one-hot in float32
and casting to the declared type is exact while both values are integers within float32's exact range,
which is checked; other OneHots are left as they are.
"""

from __future__ import annotations

import numpy as np
import onnx

from .common import FLOAT_TYPES, GraphScope, Rewrite, copy_attributes

# Integers of at most 24 significant bits are exact in float32.
_FLOAT32_EXACT = 2**24


class OneHotRewrite(Rewrite):
    """OneHot(indices, depth, integer values) becomes Cast(OneHot(indices, depth, float values))."""

    op_types = frozenset({"OneHot"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        values = scope.constant(node.input[2])
        if values is None or values.dtype.kind not in "iu":
            return None
        if np.abs(values.astype(np.int64)).max(initial=0) > _FLOAT32_EXACT:
            return None
        elem_type = scope.require_elem_type(node.input[2])
        if elem_type in FLOAT_TYPES:
            return None
        hint = node.name or "OneHot"
        float_values = scope.add_constant(values.astype(np.float32), f"{hint}/float_values")
        one_hot = scope.make_node(
            "OneHot",
            [node.input[0], node.input[1], float_values],
            1,
            f"{hint}/float",
            **copy_attributes(node),
        )
        cast = scope.make_node("Cast", [one_hot.output[0]], [node.output[0]], hint, to=elem_type)
        return [one_hot, cast]
