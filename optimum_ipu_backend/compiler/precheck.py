"""A cheap look at a graph's operators before anything is compiled.

Sessions run it at creation so that a graph the compiler can never take is refused (or handed to
the fallback providers the user listed) at load time, not on the first call. It does not prove a
graph legal: a folding or lowering step can still fail at compile time, with a full report.
"""

from __future__ import annotations

import onnx

from .errors import UnsupportedNode
from .op_table import DEFAULT_DOMAINS, POPART_OPSET11_OPS

# Ops that only compute shapes, indices or masks: with every dimension static they fold away.
FOLDABLE_OPS = frozenset(
    {"Shape", "Size", "ConstantOfShape", "Expand", "Range", "Trilu", "ScatterND", "NonZero", "EyeLike"}
)
# Ops the opset-11 lowering rewrites into PopART operators (see docs/compiler.md).
LOWERED_OPS = frozenset(
    {
        "LayerNormalization",
        "LessOrEqual",
        "GreaterOrEqual",
        "CastLike",
        "Trilu",
        "Range",
        "Split",
        "Squeeze",
        "Unsqueeze",
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceSumSquare",
        "Softmax",
        "LogSoftmax",
        "Min",
        "Max",
        "Einsum",
    }
)


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attribute.g)
            for sub in attribute.graphs:
                yield from _graphs(sub)


def precheck_operators(model: onnx.ModelProto) -> list[UnsupportedNode]:
    """Nodes whose operator is neither PopART's, nor lowered, nor folded away by the compiler."""
    known = POPART_OPSET11_OPS | FOLDABLE_OPS | LOWERED_OPS
    problems = []
    for graph in _graphs(model.graph):
        for node in graph.node:
            if node.domain not in DEFAULT_DOMAINS:
                reason = f"custom domain {node.domain!r}: PopART runs only standard ONNX operators"
            elif node.op_type not in known:
                reason = "no PopART implementation and no rewrite into one"
            else:
                continue
            problems.append(UnsupportedNode(node.name, node.op_type, node.domain, reason))
    return problems
