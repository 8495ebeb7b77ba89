"""Attributes added after opset 11 that change nothing at their neutral value are dropped; others refused."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite, as_text, copy_attributes, input_at


def _equals(neutral: Any) -> Callable[[Any], bool]:
    def is_neutral(value: Any) -> bool:
        return as_text(value) == neutral

    return is_neutral


# op -> (version that added the attributes, {attribute: is its value neutral?}). ArgMax/ArgMin,
# AveragePool and GRU/LSTM/RNN have rewrites of their own for the other values (arg_extreme.py,
# average_pool.py, recurrent_layout.py).
_NEUTRAL_ATTRIBUTES: dict[str, tuple[int, dict[str, Callable[[Any], bool]]]] = {
    "Reshape": (14, {"allowzero": _equals(0)}),
    "BatchNormalization": (14, {"training_mode": _equals(0)}),
    "RoiAlign": (16, {"coordinate_transformation_mode": _equals("output_half_pixel")}),
}


class NeutralAttributeRewrite(Rewrite):
    """Reshape, BatchNormalization and RoiAlign lose post-opset-11 attributes that are at
    their no-op value; any other value is refused."""

    op_types = frozenset(_NEUTRAL_ATTRIBUTES)

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        added_in, neutral = _NEUTRAL_ATTRIBUTES[node.op_type]
        if since_version < added_in:
            return None
        if node.op_type == "BatchNormalization" and len([o for o in node.output if o]) > 1:
            raise CannotLower(
                "BatchNormalization with running-statistics outputs is training; opset 11 infers only"
            )
        if node.op_type == "RoiAlign" and attribute(node, "coordinate_transformation_mode") is None:
            # RoiAlign-16 defaults to half_pixel; RoiAlign-10 can only do output_half_pixel.
            raise CannotLower(
                "RoiAlign-16 defaults to coordinate_transformation_mode='half_pixel', which RoiAlign-10 lacks"
            )
        present = {attr.name for attr in node.attribute} & set(neutral)
        if not present:
            return None
        for name in sorted(present):
            value = as_text(attribute(node, name))
            if not neutral[name](value) and not _allowzero_is_harmless(node, name, scope):
                raise CannotLower(f"attribute {name}={value!r} has no opset-11 equivalent")
        return [without_attributes(node, present, scope)]


def without_attributes(node: onnx.NodeProto, names: Iterable[str], scope: GraphScope) -> onnx.NodeProto:
    """``node``, same operands and outputs, without the attributes ``names`` (at their neutral value)."""
    return scope.make_node(
        node.op_type,
        list(node.input),
        list(node.output),
        node.name or node.op_type,
        **copy_attributes(node, drop=names),
    )


def _allowzero_is_harmless(node: onnx.NodeProto, name: str, scope: GraphScope) -> bool:
    """Reshape's allowzero=1 only differs when the target shape holds a 0."""
    if node.op_type != "Reshape" or name != "allowzero":
        return False
    shape = scope.constant(input_at(node, 1))
    return shape is not None and not np.any(np.asarray(shape) == 0)
