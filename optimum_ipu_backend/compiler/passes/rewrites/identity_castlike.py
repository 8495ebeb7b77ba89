"""CastLike, Cast and Identity: the opset-13+ forms brought back to Cast-9 and Identity-1."""

from __future__ import annotations

import onnx

from ...graphs import attribute
from .common import CannotLower, GraphScope, Rewrite

# Cast-19 added `saturate` (float8 targets only) and Cast-25 `round_mode` (float8/float4 targets only):
# their values never matter for the targets opset 11 can express, which the final type check enforces.
_FLOAT8_ONLY_ATTRIBUTES = frozenset({"saturate", "round_mode"})


class CastLikeRewrite(Rewrite):
    """CastLike becomes Cast to the element type of its second input; Cast drops float8-only attributes."""

    op_types = frozenset({"CastLike", "Cast"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        hint = node.name or node.op_type
        if node.op_type == "Cast":
            if not any(attr.name in _FLOAT8_ONLY_ATTRIBUTES for attr in node.attribute):
                return None
            return [
                scope.make_node("Cast", [node.input[0]], [node.output[0]], hint, to=attribute(node, "to"))
            ]
        target = scope.require_elem_type(node.input[1])
        return [scope.make_node("Cast", [node.input[0]], [node.output[0]], hint, to=target)]


class IdentityRewrite(Rewrite):
    """Identity stays (Identity-1 takes every tensor type); sequence or optional operands are refused."""

    op_types = frozenset({"Identity"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> None:
        found = scope.type_of(node.input[0])
        if found is not None and not found.HasField("tensor_type") and found.WhichOneof("value") is not None:
            raise CannotLower(
                f"Identity on a {found.WhichOneof('value')} value needs opset 14+; opset 11 has tensors only"
            )
        return None
