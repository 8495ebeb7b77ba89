"""Xor (absent from PopART) on booleans as Not(Equal)."""

from __future__ import annotations

import onnx

from .common import GraphScope, Rewrite


class XorRewrite(Rewrite):
    """Xor(a, b) becomes Not(Equal(a, b)) (Equal-11 takes bool and broadcasts like Xor)."""

    op_types = frozenset({"Xor"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        hint = node.name or "Xor"
        equal = scope.make_node("Equal", [node.input[0], node.input[1]], 1, f"{hint}/equal")
        return [equal, scope.make_node("Not", [equal.output[0]], [node.output[0]], hint)]
