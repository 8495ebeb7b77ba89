"""ArgMax/ArgMin select_last_index=1 as a reversal along the axis: the same indices as onnxruntime CPU."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT32, INT64, assert_pass_preserves, run_ort
from hypothesis import strategies as st

from optimum_ipu_backend.compiler import find_unsupported_nodes, legalize
from optimum_ipu_backend.compiler.graphs import iter_nodes


def _arg_model(op_type, shape, elem_type=FLOAT, **attributes):
    return lt.one_node_model(op_type, [("x", elem_type, shape)], [("y", INT64, None)], **attributes)


def test_select_last_index_takes_the_last_of_tied_extremes():
    model = _arg_model("ArgMax", (2, 4), axis=1, select_last_index=1)
    x = np.array([[1, 3, 3, 0], [2, 2, 2, 2]], np.float32)
    lowered = lt.lower_and_compare(model, {"x": x})
    assert lt.op_types(lowered) == {"Gather", "ArgMax", "Sub"}
    assert run_ort(lowered, {"x": x})["y"].tolist() == [[2], [3]]


def test_select_last_index_zero_is_dropped():
    model = _arg_model("ArgMin", (3, 2), axis=0, select_last_index=0)
    lowered = lt.lower_and_compare(model, {"x": np.zeros((3, 2), np.float32)})
    assert lt.op_types(lowered) == {"ArgMin"}
    assert not [a for n in lowered.graph.node for a in n.attribute if a.name == "select_last_index"]


def test_an_axis_of_unknown_size_is_refused():
    model = _arg_model("ArgMax", ("n", 3), axis=0, select_last_index=1)
    lt.assert_refused(model, "the_ArgMax.*size of axis 0")


def test_the_legalized_index_is_int32_where_it_is_produced():
    """Int64ToInt32 narrows the reversed ArgMax (PopART computes it as INT32) and the index arithmetic."""
    model = _arg_model("ArgMin", (4, 50), axis=-1, keepdims=0, select_last_index=1)
    legalized = legalize(model, {})
    assert find_unsupported_nodes(legalized.model) == []
    (argmin,) = [n for n in legalized.model.graph.node if n.op_type == "ArgMin"]
    readers = [n for n in iter_nodes(legalized.model.graph) if argmin.output[0] in n.input]
    assert [(n.op_type, n.attribute[0].i) for n in readers] == [("Cast", INT32)]
    x = np.round(lt.random_array(3, (4, 50), np.float32, -3, 3))
    assert_pass_preserves(model, legalized.model, {"x": x}, atol=0.0)


def test_realistic_logits_match():
    """A vocabulary-sized last axis with ties (logits rounded to a coarse grid)."""
    shape = (4, 16, 4096)
    for op_type in ("ArgMax", "ArgMin"):
        model = _arg_model(op_type, shape, axis=-1, keepdims=1, select_last_index=1)
        lt.lower_and_compare(model, {"x": np.round(lt.random_array(7, shape, np.float32, -8, 8))})


@lt.property_test(
    shape=lt.shapes(1, 4),
    data=st.data(),
    seed=lt.seeds,
    elem=st.sampled_from([(FLOAT, np.float32), (INT32, np.int32), (INT64, np.int64)]),
)
def test_same_indices_as_onnxruntime(shape, data, seed, elem):
    op_type = data.draw(st.sampled_from(["ArgMax", "ArgMin"]))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    keepdims = data.draw(st.integers(0, 1))
    select_last_index = data.draw(st.integers(0, 1))
    elem_type, dtype = elem
    model = _arg_model(
        op_type, shape, elem_type, axis=axis, keepdims=keepdims, select_last_index=select_last_index
    )
    # Few distinct values, so ties (where select_last_index matters) are common.
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, dtype, -2, 2).round().astype(dtype)})
