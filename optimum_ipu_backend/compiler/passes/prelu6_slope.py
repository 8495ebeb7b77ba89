"""PRelu-6's slope, given PRelu-7's meaning before ``onnx.version_converter`` takes a graph to opset 7+.

PRelu-6 says only that a slope of size 1 is shared across the channels. PyTorch exports its PReLU, one
slope per channel, as a slope [C] on an input [N, C, ...]; ONNX's reference evaluator broadcasts the slope
numpy-style (from the last axis) and falls back to the one axis of size C. PRelu-7 broadcasts numpy-style,
and onnx's PRelu 6->7 adapter changes nothing. So, for a rank-1 slope of size C on an input of rank 3 or
more:

* C the size of the channel axis and not of the last: every reading that runs means the channel axis
  (numpy broadcasting would fail), and the slope becomes [C, 1, ..., 1]; so too where C is the size of
  both and every slope is equal, as all readings then give the same result;
* C the size of the last axis and not of the channel axis: all readings mean the last axis, which PRelu-7
  broadcasts along already;
* C the size of both, with different slopes: the readings disagree, and the node is refused.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ..errors import PATTERN_NO_LOWERING, LegalizationError, UnsupportedNode
from ..graphs import GraphView, NameAllocator, iter_graphs

#: The first PRelu that broadcasts its slope numpy-style.
PRELU_BROADCASTS_SINCE = 7


def keep_prelu6_channels(model: onnx.ModelProto, source_opset: int) -> None:
    """Rewrite every PRelu-6 of ``model`` (ai.onnx ``source_opset``; in place) as described above."""
    if source_opset >= PRELU_BROADCASTS_SINCE:
        return
    view: GraphView | None = None
    names = NameAllocator.for_model(model)
    refused: list[UnsupportedNode] = []
    for graph in iter_graphs(model.graph):
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            if node.op_type == "PRelu" and node.domain in ("", "ai.onnx"):
                view = view or GraphView.of_model(model, subgraphs=True)
                reading = _channel_reading(view, node)
                if reading == "ambiguous":
                    refused.append(_ambiguous(node))
                elif reading == "per channel":
                    rank = len(view.shape(node.input[0]) or ())
                    per_channel = names.fresh(f"{node.name or node.output[0]}/slope_per_channel")
                    axes = list(range(1, rank - 1))
                    nodes.append(helper.make_node("Unsqueeze", [node.input[1]], [per_channel], axes=axes))
                    node.input[1] = per_channel
            nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)
    if refused:
        raise LegalizationError("PRelu-6 nodes whose slope opset 6 leaves ambiguous.", refused)


def _channel_reading(view: GraphView, node: onnx.NodeProto) -> str:
    """'per channel', 'as is' (numpy broadcasting, which PRelu-7 does) or 'ambiguous'."""
    x_shape, slope_shape = view.shape(node.input[0]), view.shape(node.input[1])
    if x_shape is None or slope_shape is None or len(x_shape) < 3 or len(slope_shape) != 1:
        return "as is"
    size = slope_shape[0]
    if size == 1:
        return "as is"
    if size != x_shape[1]:
        return "as is"
    slope = view.constant(node.input[1])
    if size != x_shape[-1] or (slope is not None and bool(np.all(slope == slope.reshape(-1)[0]))):
        return "per channel"
    return "ambiguous"


def _ambiguous(node: onnx.NodeProto) -> UnsupportedNode:
    return UnsupportedNode(
        node.name or node.output[0],
        node.op_type,
        node.domain,
        "PRelu-6's slope has the size of both the channel axis and the last axis, and opset 6 does not say "
        "which it applies along (PyTorch exports one slope per channel; ONNX's reference and PRelu-7 "
        "broadcast from the last axis); export the model at opset 7 or later, where broadcasting is defined",
        PATTERN_NO_LOWERING,
    )
