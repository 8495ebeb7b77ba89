"""Gather and ScatterElements whose indices count from the end: mapped into [0, size - 1] first.

ONNX counts a negative index from the end of its axis (both operators accept [-size, size - 1]); PopART's
Gather and ScatterElements are not documented to. Constant indices are mapped at compile time; indices
computed on the device go through ``Where(index < 0, index + size, index)``, so the device only sees
[0, size - 1] for every value ONNX accepts (the per-call index check refuses the rest,
``compiler.analysis.index_ranges``). GatherElements, GatherND, ScatterND and ScatterElements with a
reduction map theirs in their own lowerings (``gather_scatter.py``).
"""

from __future__ import annotations

import numpy as np
import onnx

from ...graphs import attribute
from .common import GraphScope, Rewrite, copy_attributes, numpy_dtype
from .gather_scatter import _FlatIndexBuilder, lower_scatter_elements_reduction, scatter_reduction


class NegativeIndicesRewrite(Rewrite):
    """Gather and ScatterElements get indices in [0, size - 1]; ScatterElements-16 loses its neutral
    ``reduction='none'``, and any other reduction is lowered by ``gather_scatter`` (a mask and a Reduce*)."""

    op_types = frozenset({"Gather", "ScatterElements"})

    def lower(
        self, node: onnx.NodeProto, since_version: int, scope: GraphScope
    ) -> list[onnx.NodeProto] | None:
        reduction = scatter_reduction(node)
        if reduction != "none":
            # ScatterElements-11 overwrites: the reduction is a mask and a Reduce* over the updates,
            # which maps negative indices itself.
            return lower_scatter_elements_reduction(node, reduction, scope)
        indices = node.input[1]
        hint = node.name or node.op_type
        known = scope.constant(indices)
        if known is None:
            builder = _FlatIndexBuilder(scope, hint)
            dtype = numpy_dtype(scope.require_elem_type(indices))
            mapped = builder.non_negative(indices, np.array(_axis_size(node, scope)), dtype)
            return [*builder.nodes, _with_indices(node, mapped, scope)]
        if (known < 0).any():
            size = _axis_size(node, scope)
            mapped = scope.add_constant(np.where(known < 0, known + size, known).astype(known.dtype), hint)
        elif attribute(node, "reduction") is not None:
            mapped = indices  # only the attribute goes
        else:
            return None
        return [_with_indices(node, mapped, scope)]


def _axis_size(node: onnx.NodeProto, scope: GraphScope) -> int:
    dims = scope.require_static_shape(
        node.input[0],
        f"{node.op_type} needs the size of its indexed axis to count negative indices from the end",
    )
    return dims[int(attribute(node, "axis", 0))]  # an axis outside the rank already failed shape inference


def _with_indices(node: onnx.NodeProto, indices: str, scope: GraphScope) -> onnx.NodeProto:
    """The node reading ``indices``, without the attribute opset 11 lacks."""
    return scope.make_node(
        node.op_type,
        [node.input[0], indices, *node.input[2:]],
        list(node.output),
        node.name or node.op_type,
        **copy_attributes(node, drop=("reduction",)),
    )
