"""Einsum (opset 12+) lowered to ReduceSum, Transpose, Reshape and MatMul, compared with onnxruntime's own
Einsum on random equations of one to three operands (hypothesis), ellipses and broadcasting included."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from graph_testing import FLOAT
from hypothesis import assume
from hypothesis import strategies as st

LABELS = "abcdef"


def _model(equation: str, shapes: list[tuple[int, ...]], output_shape: tuple[int, ...] | None = None):
    inputs = [(f"x{i}", FLOAT, shape) for i, shape in enumerate(shapes)]
    return lt.one_node_model("Einsum", inputs, [("y", FLOAT, output_shape)], opset=13, equation=equation)


def _feeds(shapes, seed):
    return {f"x{i}": lt.random_array(seed + i, shape, np.float32, -2, 2) for i, shape in enumerate(shapes)}


@pytest.mark.parametrize(
    ("equation", "shapes"),
    [
        ("i,j->ij", [(5,), (3,)]),  # a rotary embedding's outer product
        ("bhqd,bhkd->bhqk", [(2, 4, 5, 8), (2, 4, 7, 8)]),  # attention scores
        ("bhqk,bhkd->bhqd", [(2, 4, 5, 7), (2, 4, 7, 8)]),  # attention context
        ("...qhd,...khd->...hqk", [(2, 3, 5, 4, 8), (2, 3, 6, 4, 8)]),  # local attention blocks
        ("ij->ji", [(3, 4)]),
        ("ij->", [(3, 4)]),
        ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
        ("...i,...i->...", [(1, 3, 4), (5, 1, 4)]),  # broadcast batch axes
        ("ab,ab->ab", [(2, 3), (2, 3)]),  # elementwise
    ],
)
def test_known_equations_match_onnxruntime(equation, shapes):
    lowered = lt.lower_and_compare(_model(equation, shapes), _feeds(shapes, 0), atol=1e-5)
    assert "Einsum" not in lt.op_types(lowered)


def test_a_diagonal_is_refused_with_the_reason():
    lt.assert_refused(_model("ii->i", [(3, 3)]), "diagonal")


@st.composite
def equations(draw):
    count = draw(st.integers(1, 3))
    sizes = {label: draw(st.integers(1, 4)) for label in LABELS}
    terms = []
    for _ in range(count):
        term = draw(st.lists(st.sampled_from(LABELS), min_size=0, max_size=4, unique=True))
        terms.append("".join(term))
    used = sorted(set("".join(terms)))
    output = "".join(draw(st.permutations(draw(st.lists(st.sampled_from(used or ["a"]), unique=True)))))
    assume(set(output) <= set("".join(terms)))
    shapes = [tuple(sizes[label] for label in term) for term in terms]
    return f"{','.join(terms)}->{output}", shapes


@lt.property_test(case=equations(), seed=lt.seeds)
def test_random_equations_match_onnxruntime(case, seed):
    equation, shapes = case
    lowered = lt.lower_and_compare(
        _model(equation, shapes), _feeds(shapes, seed % 1000), atol=1e-5, rtol=1e-5
    )
    assert "Einsum" not in lt.op_types(lowered)
