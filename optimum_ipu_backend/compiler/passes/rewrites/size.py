"""Size (absent from PopART) as the constant element count of a static shape."""

from __future__ import annotations

import numpy as np
import onnx

from .common import GraphScope, Rewrite


class SizeRewrite(Rewrite):
    """Size of a statically shaped tensor becomes an int64 scalar constant."""

    op_types = frozenset({"Size"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        dims = scope.require_static_shape(node.input[0], "Size needs to count its elements")
        scope.add_constant(
            np.array(int(np.prod(dims, dtype=np.int64)), np.int64), node.name, exact_name=node.output[0]
        )
        return []
