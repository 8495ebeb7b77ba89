"""A cheap look at a graph's operators before anything is compiled.

Sessions run it at creation so that a graph the compiler can never take is refused (or handed to
the fallback providers the user listed) at load time, not on the first call. It does not prove a
graph legal: a folding or lowering step can still fail at compile time, with a full report.

What it accepts is derived from what the compiler does, never listed again here: PopART's operator
table, the operators the opset-11 rewrites declare (``Rewrite.op_types``), and the few operators that
only folding removes. What it refuses it refuses with the operator's reason from ``refused_operators``.
It runs when a graph is first described (a cold start), never on a warm one.
"""

from __future__ import annotations

import collections

import onnx

from .errors import PATTERN_CUSTOM_DOMAIN, PATTERN_MISSING_OPERATOR, PATTERN_QUANTIZATION, UnsupportedNode
from .graphs import iter_nodes
from .op_table import DEFAULT_DOMAINS, POPART_OPSET11_OPS, operator_name
from .passes.rewrites import LOWERED_OP_TYPES
from .refused_operators import (
    DYNAMIC_QUANTIZATION_OPS,
    DYNAMIC_QUANTIZATION_REASON,
    REPLACED_BELOW_OPSET11,
    refusal_reason,
)

# Operators neither PopART nor a rewrite takes, which the compiler removes by folding constants when
# their inputs are fixed at compile time (a static shape, a constant mask).
FOLDED_ONLY_OPS = frozenset({"NonZero", "EyeLike"})


def accepted_op_types() -> frozenset[str]:
    """Every operator the pre-check lets through (in a model of opset 11 or later), named as
    ``op_table.operator_name`` names them (``domain::Op`` outside ai.onnx)."""
    return POPART_OPSET11_OPS | LOWERED_OP_TYPES | FOLDED_ONLY_OPS


def _default_opset(model: onnx.ModelProto) -> int | None:
    return next((int(o.version) for o in model.opset_import if o.domain in DEFAULT_DOMAINS), None)


def precheck_operators(model: onnx.ModelProto) -> list[UnsupportedNode]:
    """Nodes whose operator is neither PopART's, nor lowered, nor folded away by the compiler.

    A dynamically quantized model is one refusal, first, whatever the number of its quantized nodes:
    the quantization, not each node, is what the IPU cannot compute."""
    known = accepted_op_types()
    opset = _default_opset(model)
    if opset is not None and opset < 11:
        known |= REPLACED_BELOW_OPSET11
    problems = []
    quantized: collections.Counter[str] = collections.Counter()
    for node in iter_nodes(model.graph):
        name = operator_name(node.domain, node.op_type)
        if name in DYNAMIC_QUANTIZATION_OPS:
            quantized[name] += 1
            continue
        if node.domain not in DEFAULT_DOMAINS:
            if operator_name(node.domain, node.op_type) in LOWERED_OP_TYPES:
                continue
            reason = f"custom domain {node.domain!r}: PopART runs only standard ONNX operators"
            pattern = PATTERN_CUSTOM_DOMAIN
        elif node.op_type not in known:
            reason, pattern = refusal_reason(node.op_type), PATTERN_MISSING_OPERATOR
        else:
            continue
        problems.append(UnsupportedNode(node.name, node.op_type, node.domain, reason, pattern))
    if quantized:
        found = ", ".join(f"{count} {name}" for name, count in sorted(quantized.items()))
        problems.insert(
            0,
            UnsupportedNode(
                "<model>",
                "quantized model",
                "",
                f"{DYNAMIC_QUANTIZATION_REASON} (found: {found})",
                PATTERN_QUANTIZATION,
            ),
        )
    return problems
