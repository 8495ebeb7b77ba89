"""PRelu-6's per-channel slope, kept when ``onnx.version_converter`` takes a graph to opset 7 or later.

PRelu-6 shares a slope of size 1 across the channels and otherwise takes one slope per channel (axis 1),
as PyTorch's PReLU does and exports it: a slope of shape [C] for an input [N, C, ...]. PRelu-7 broadcasts
the slope numpy-style instead, from the last axis, and onnx's PRelu 6->7 adapter changes nothing, so the
converted graph would apply [C] along the last axis: an error where the sizes differ, a silently wrong
answer where they happen to agree. Unsqueezing the slope to [C, 1, ..., 1] before converting gives
PRelu-7 exactly the per-channel meaning.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ..graphs import GraphView, NameAllocator, iter_graphs

#: The first PRelu that broadcasts its slope numpy-style.
PRELU_BROADCASTS_SINCE = 7


def keep_prelu6_channels(model: onnx.ModelProto, source_opset: int) -> None:
    """Give every PRelu-6 of ``model`` (ai.onnx ``source_opset``; in place) a rank-1 slope of size C > 1 on
    an input of rank 3 or more the shape [C, 1, ..., 1], so that the converter's PRelu-7 keeps its
    meaning."""
    if source_opset >= PRELU_BROADCASTS_SINCE:
        return
    view: GraphView | None = None
    names = NameAllocator.for_model(model)
    for graph in iter_graphs(model.graph):
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            if node.op_type == "PRelu" and node.domain in ("", "ai.onnx"):
                view = view or GraphView.of_model(model, subgraphs=True)
                x_shape, slope_shape = view.shape(node.input[0]), view.shape(node.input[1])
                if x_shape is not None and slope_shape is not None and len(x_shape) >= 3:
                    if len(slope_shape) == 1 and slope_shape[0] != 1:
                        per_channel = names.fresh(f"{node.name or node.output[0]}/slope_per_channel")
                        axes = list(range(1, len(x_shape) - 1))
                        nodes.append(helper.make_node("Unsqueeze", [node.input[1]], [per_channel], axes=axes))
                        node.input[1] = per_channel
            nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
