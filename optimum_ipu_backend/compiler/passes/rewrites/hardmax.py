"""Hardmax (absent from PopART's opset 11): a one-hot of the first maximum, ArgMax then OneHot."""

from __future__ import annotations

import math

import numpy as np
import onnx

from ...graphs import attribute
from .common import GraphScope, Rewrite, numpy_dtype
from .emit import NodeEmitter


class HardmaxRewrite(Rewrite):
    """Hardmax-13 over one axis; Hardmax-1/11 over the input flattened to 2-D at ``axis``."""

    op_types = frozenset({"Hardmax"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        x, y = node.input[0], node.output[0]
        dims = scope.require_static_shape(x, "Hardmax needs the size of its axis as OneHot's depth")
        rank = len(dims)
        axis = int(attribute(node, "axis", -1 if since_version >= 13 else 1))
        axis = axis + rank if axis < 0 else axis
        emit = NodeEmitter(node, scope)
        # ArgMax keeps the first maximum (select_last_index=0), as Hardmax does; OneHot puts the depth
        # axis back where ArgMax removed it. The values tensor gives the output its element type.
        values = emit.constant([0, 1], numpy_dtype(scope.require_elem_type(x)), "values")
        # A rank-1 input takes the 2-D form too (OneHot needs indices of rank 1 or more); both forms agree.
        if rank > 1 and (since_version >= 13 or axis == rank - 1):
            depth = emit.constant(dims[axis], np.int64, "depth")
            argmax = emit("ArgMax", [x], "argmax", axis=axis, keepdims=0)
            emit("OneHot", [argmax, depth, values], "one_hot", y, axis=axis)
        else:
            # The opset-11 form picks one maximum per row of [prod(dims[:axis]), prod(dims[axis:])].
            rows = emit("Flatten", [x], "rows", axis=axis)
            argmax = emit("ArgMax", [rows], "argmax", axis=1, keepdims=0)
            depth = emit.constant(math.prod(dims[axis:]), np.int64, "depth")
            one_hot = emit("OneHot", [argmax, depth, values], "one_hot", axis=-1)
            emit("Reshape", [one_hot, emit.shape(dims, "shape")], "restored", y)
        return emit.nodes
