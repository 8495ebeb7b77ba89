"""OneHot with integer values, computed in float32.

Once int64 is narrowed, an integer OneHot has int32 indices, depth and values. PopART takes it, but
onnxruntime, which runs the emulator and the conformance reference, has no OneHot kernel with int32
values, so the emulated graph would fail where the device graph runs. Constant values: the one-hot is
computed in float32 and cast to the declared type, exact while both values are integers within float32's
exact range, which is checked (other constant values are left as they are). Values known only at run
time: a float32 0/1 one-hot chooses, by Where, between the off and on values, exact for any integers.
"""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import INTEGER_TYPES
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
        if values is None:
            return _select_runtime_values(node, scope)
        if values.dtype.kind not in "iu":
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


def _select_runtime_values(node: onnx.NodeProto, scope: GraphScope) -> list[onnx.NodeProto] | None:
    """Integer values known only at run time: a float32 0/1 OneHot picks, by Where, off or on (exact)."""
    if scope.require_elem_type(node.input[2]) not in INTEGER_TYPES:
        return None
    hint = node.name or "OneHot"
    indicator_values = scope.add_constant(np.array([0, 1], np.float32), f"{hint}/indicator_values")
    indicator = scope.make_node(
        "OneHot",
        [node.input[0], node.input[1], indicator_values],
        1,
        f"{hint}/indicator",
        **copy_attributes(node),
    )
    chosen = scope.make_node("Cast", indicator.output, 1, f"{hint}/chosen", to=onnx.TensorProto.BOOL)
    off_on = []
    for position, which in enumerate(("off", "on")):
        bounds = [
            scope.add_constant(np.array([v], np.int64), f"{hint}/{which}_{end}")
            for end, v in (("start", position), ("end", position + 1))
        ]
        off_on.append(scope.make_node("Slice", [node.input[2], *bounds], 1, f"{hint}/{which}"))
    select = scope.make_node(
        "Where", [chosen.output[0], off_on[1].output[0], off_on[0].output[0]], [node.output[0]], hint
    )
    return [indicator, chosen, *off_on, select]
