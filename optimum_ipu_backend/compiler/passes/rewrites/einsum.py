"""Einsum (opset 12) as ReduceSum, Transpose, Reshape and MatMul, for every equation with static shapes.

Two operands are brought into the batched-matrix form ``[batch..., kept_a, summed] x [batch..., summed,
kept_b]``: labels only one operand has and the output lacks are summed away first, the operands are
transposed so their labels are grouped as batch / kept / summed, each group is flattened into one axis,
one MatMul contracts the summed labels (an outer product when there are none, as in a rotary
``i,j->ij``), and the result is unflattened and transposed into the output's order. One operand is a
sum and a transpose. Three or more are contracted left to right, each step keeping the labels a later
operand or the output still needs. Repeated labels inside one operand (diagonals) are refused.
"""

from __future__ import annotations

import string

import numpy as np
import onnx

from .common import CannotLower, GraphScope, Rewrite, text_attribute

_SPARE_LABELS = string.ascii_letters


def parse_equation(equation: str, ranks: list[int]) -> tuple[list[str], str]:
    """Operand labels and output labels with ``...`` expanded into letters the equation does not use."""
    equation = equation.replace(" ", "")
    left, arrow, right = equation.partition("->")
    terms = left.split(",")
    if len(terms) != len(ranks):
        raise CannotLower(f"equation {equation!r} names {len(terms)} operands, the node has {len(ranks)}")
    used = set(equation) - set(",->.")
    spare = [c for c in _SPARE_LABELS if c not in used]
    ellipsis_rank = 0
    for term, rank in zip(terms, ranks, strict=True):
        if "..." in term:
            ellipsis_rank = max(ellipsis_rank, rank - len(term.replace("...", "")))
    ellipsis = "".join(spare[:ellipsis_rank])
    labels = []
    for term, rank in zip(terms, ranks, strict=True):
        if "..." in term:
            own = rank - len(term.replace("...", ""))
            term = term.replace("...", ellipsis[ellipsis_rank - own :])
        if len(term) != rank:
            raise CannotLower(
                f"equation {equation!r}: term {term!r} does not match an operand of rank {rank}"
            )
        labels.append(term)
    if arrow:
        output = right.replace("...", ellipsis)
    else:  # implicit output: the ellipsis, then every label used once, alphabetically
        counts = {c: "".join(labels).count(c) for c in set("".join(labels))}
        output = ellipsis + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ellipsis))
    for term in [*labels, output]:
        if len(set(term)) != len(term):
            raise CannotLower(f"equation {equation!r} repeats a label inside one term (a diagonal)")
    return labels, output


class EinsumRewrite(Rewrite):
    """Einsum into opset-11 operators; refuses only diagonals and shapes that are not static."""

    op_types = frozenset({"Einsum"})

    def lower(self, node: onnx.NodeProto, since_version: int, scope: GraphScope) -> list[onnx.NodeProto]:
        shapes = [
            scope.require_static_shape(name, "Einsum needs to be rewritten into fixed reshapes")
            for name in node.input
        ]
        equation = text_attribute(node, "equation", "")
        if not equation:
            raise CannotLower("it has no equation attribute")
        labels, output = parse_equation(equation, [len(s) for s in shapes])
        builder = _Builder(scope, node.name or "Einsum")
        current = _Term(node.input[0], labels[0], dict(zip(labels[0], shapes[0], strict=True)))
        for index in range(1, len(labels)):
            still_needed = set(output).union(*labels[index + 1 :])
            other = _Term(
                node.input[index], labels[index], dict(zip(labels[index], shapes[index], strict=True))
            )
            current = builder.contract(current, other, still_needed)
        current = builder.reduce(current, set(output))
        builder.transpose_to(current, output, node.output[0])
        return builder.nodes


class _Term:
    """A tensor of the rewrite with the label of each axis and each axis's size."""

    def __init__(self, name: str, labels: str, sizes: dict[str, int]) -> None:
        self.name = name
        self.labels = labels
        self.sizes = sizes


class _Builder:
    """Emits the nodes of one Einsum's rewrite."""

    def __init__(self, scope: GraphScope, hint: str) -> None:
        self.scope = scope
        self.hint = hint
        self.nodes: list[onnx.NodeProto] = []

    def _node(self, op_type: str, inputs: list[str], suffix: str, output: str | None = None, **attrs) -> str:
        made = self.scope.make_node(
            op_type, inputs, [output] if output else 1, f"{self.hint}/{suffix}", **attrs
        )
        self.nodes.append(made)
        return made.output[0]

    def _shape_constant(self, shape: list[int], suffix: str) -> str:
        return self.scope.add_constant(np.array(shape, dtype=np.int64), f"{self.hint}/{suffix}_shape")

    def reduce(self, term: _Term, keep: set[str]) -> _Term:
        """Sum over the labels of ``term`` outside ``keep``."""
        axes = [i for i, label in enumerate(term.labels) if label not in keep]
        if not axes:
            return term
        summed = self._node("ReduceSum", [term.name], "sum", axes=axes, keepdims=0)
        labels = "".join(label for label in term.labels if label in keep)
        return _Term(summed, labels, {label: term.sizes[label] for label in labels})

    def transpose_to(self, term: _Term, order: str, output: str | None = None) -> _Term:
        perm = [term.labels.index(label) for label in order]
        if perm == list(range(len(perm))):
            if output is None:
                return term
            return _Term(self._node("Identity", [term.name], "identity", output), order, term.sizes)
        name = self._node("Transpose", [term.name], "transpose", output, perm=perm)
        return _Term(name, order, term.sizes)

    def contract(self, a: _Term, b: _Term, needed: set[str]) -> _Term:
        # Labels one operand has alone and nothing later needs are summed away first.
        a = self.reduce(a, needed | set(b.labels))
        b = self.reduce(b, needed | set(a.labels))
        batch = [label for label in a.labels if label in b.labels and label in needed]
        summed = [label for label in a.labels if label in b.labels and label not in needed]
        kept_a = [label for label in a.labels if label not in b.labels]
        kept_b = [label for label in b.labels if label not in a.labels]
        for label in summed:
            if a.sizes[label] != b.sizes[label]:
                raise CannotLower(
                    f"axis {label!r} is summed with sizes {a.sizes[label]} and {b.sizes[label]}"
                )
        a = self.transpose_to(a, "".join(batch + kept_a + summed))
        b = self.transpose_to(b, "".join(batch + summed + kept_b))
        inner = _product(a.sizes, summed)
        rows, cols = _product(a.sizes, kept_a), _product(b.sizes, kept_b)
        # Batch axes may broadcast (size 1 in one operand): each keeps its own size; MatMul broadcasts.
        a_matrix = self._node(
            "Reshape",
            [a.name, self._shape_constant([*(a.sizes[x] for x in batch), rows, inner], "a")],
            "a_matrix",
        )
        b_matrix = self._node(
            "Reshape",
            [b.name, self._shape_constant([*(b.sizes[x] for x in batch), inner, cols], "b")],
            "b_matrix",
        )
        product = self._node("MatMul", [a_matrix, b_matrix], "matmul")
        sizes = {label: max(a.sizes.get(label, 1), b.sizes.get(label, 1)) for label in batch}
        sizes.update({label: a.sizes[label] for label in kept_a})
        sizes.update({label: b.sizes[label] for label in kept_b})
        labels = "".join(batch + kept_a + kept_b)
        shape = self._shape_constant([sizes[label] for label in labels], "result")
        return _Term(self._node("Reshape", [product, shape], "result"), labels, sizes)


def _product(sizes: dict[str, int], labels: list[str]) -> int:
    return int(np.prod([sizes[label] for label in labels], dtype=np.int64))
