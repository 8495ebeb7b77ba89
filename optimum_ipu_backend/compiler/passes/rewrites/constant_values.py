"""Constant's value_float(s)/value_int(s)/value_string(s) attributes (opset 12) become a value tensor."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ...graphs import attribute, constant_node_value
from .common import CannotLower, GraphScope, Rewrite


class ConstantValueRewrite(Rewrite):
    """Constant-12+ written with value_* attributes becomes Constant with the equal `value` tensor."""

    op_types = frozenset({"Constant"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        names = {attr.name for attr in node.attribute}
        if names == {"value"}:
            return None
        if "sparse_value" in names:
            raise CannotLower("a sparse Constant has no dense opset-11 form here; densify it first")
        value = constant_node_value(node)
        if value is None:
            strings = attribute(node, "value_strings", attribute(node, "value_string"))
            if strings is None:
                raise CannotLower(f"Constant with attributes {sorted(names)} is not understood")
            value = np.array(strings, dtype=object)
        tensor = numpy_helper.from_array(value, node.output[0])
        return [scope.make_node("Constant", [], [node.output[0]], node.name or "Constant", value=tensor)]
