"""Split/Squeeze/Unsqueeze/Reduce* with axes (or split sizes) as inputs become their opset-11 attribute forms.

The opset-11 and opset-13/18 kernels of these operators are the same code in onnxruntime, so float outputs
are compared at atol 1e-6 (they come out bit-identical in practice) and integer outputs exactly.
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT64
from hypothesis import strategies as st

from optimum_ipu_backend.compiler.passes.rewrites.axes_to_attributes import REDUCE_OPS


def _attributes_of(model, op_type):
    node = next(n for n in model.graph.node if n.op_type == op_type)
    return {a.name: a for a in node.attribute}, list(node.input)


def test_unsqueeze_axes_become_an_attribute():
    model = lt.one_node_model(
        "Unsqueeze", [("x", FLOAT, (2, 3))], [("y", FLOAT, (2, 1, 3, 1))], {"axes": np.array([1, -1])}
    )
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(0, (2, 3), np.float32)})
    attributes, inputs = _attributes_of(lowered, "Unsqueeze")
    assert list(attributes["axes"].ints) == [1, -1] and inputs == ["x"]
    assert not lowered.graph.initializer, "the axes initializer only fed the replaced node"


def test_split_18_num_outputs_uneven_becomes_split_sizes():
    model = lt.one_node_model(
        "Split",
        [("x", FLOAT, (7, 2))],
        [("a", FLOAT, (3, 2)), ("b", FLOAT, (3, 2)), ("c", FLOAT, (1, 2))],
        axis=0,
        num_outputs=3,
    )
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(1, (7, 2), np.float32)})
    attributes, _ = _attributes_of(lowered, "Split")
    assert list(attributes["split"].ints) == [3, 3, 1] and "num_outputs" not in attributes


def test_reduce_with_no_axes_and_noop_becomes_identity():
    model = lt.one_node_model(
        "ReduceMax", [("x", FLOAT, (2, 3))], [("y", FLOAT, (2, 3))], noop_with_empty_axes=1
    )
    lowered = lt.lower_and_compare(model, {"x": lt.random_array(2, (2, 3), np.float32)})
    assert [n.op_type for n in lowered.graph.node] == ["Identity"]


def test_runtime_axes_are_refused_with_the_node_name():
    model = lt.one_node_model(
        "Unsqueeze", [("x", FLOAT, (2, 3)), ("axes", INT64, (1,))], [("y", FLOAT, None)], check=False
    )
    lt.assert_refused(model, r"the_Unsqueeze \(Unsqueeze\): its axes input 'axes' must be a constant")


@st.composite
def _axes_for(draw, rank, min_size=0):
    axes = draw(st.lists(st.integers(0, rank - 1), min_size=min_size, max_size=rank, unique=True))
    return [a - rank if draw(st.booleans()) else a for a in axes]


@lt.property_test(
    op_type=st.sampled_from(sorted(REDUCE_OPS)),
    shape=lt.shapes(1, 4),
    data=st.data(),
    keepdims=st.integers(0, 1),
    noop=st.integers(0, 1),
    integer=st.booleans(),
    seed=lt.seeds,
)
def test_reduce_ops_match(op_type, shape, data, keepdims, noop, integer, seed):
    axes = data.draw(_axes_for(len(shape)))
    integer = integer and op_type in ("ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd")
    opset = 13 if op_type == "ReduceSum" and data.draw(st.booleans()) else 18
    elem_type, dtype = (INT64, np.int64) if integer else (FLOAT, np.float32)
    positive = op_type in ("ReduceLogSum", "ReduceProd")
    initializers = {"axes": np.array(axes, np.int64)} if axes or data.draw(st.booleans()) else {}
    model = lt.one_node_model(
        op_type,
        [("x", elem_type, shape)],
        [("y", elem_type, None)],
        initializers,
        opset=opset,
        keepdims=keepdims,
        noop_with_empty_axes=noop,
    )
    x = lt.random_array(seed, shape, dtype, 0.5 if positive else -10, 2 if positive else 10)
    lt.lower_and_compare(model, {"x": x}, rtol=1e-6)


@lt.property_test(shape=lt.shapes(1, 4), data=st.data(), seed=lt.seeds, opset=st.sampled_from([13, 18]))
def test_split_matches(shape, data, seed, opset):
    axis = data.draw(st.integers(0, len(shape) - 1))
    size = shape[axis]
    # Split-18 needs the split input or num_outputs; Split-13 may have neither (equal parts).
    mode = data.draw(st.sampled_from(["sizes", "num_outputs"] if opset == 18 else ["sizes", "equal"]))
    attributes = {"axis": axis - len(shape) if data.draw(st.booleans()) else axis}
    initializers = {}
    if mode == "sizes":
        cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=3)))
        sizes = np.diff([0, *cuts, size])
        initializers["split"] = sizes.astype(np.int64)
        count = len(sizes)
    elif mode == "equal":
        count = data.draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
    else:
        count = data.draw(st.integers(1, size))
        chunk = -(-size // count)
        if chunk * (count - 1) >= size:  # onnxruntime (and the spec) need a non-empty last chunk
            count = 1
        attributes["num_outputs"] = count
    outputs = [(f"y{i}", FLOAT, None) for i in range(count)]
    model = lt.one_node_model(
        "Split", [("x", FLOAT, shape)], outputs, initializers, opset=opset, **attributes
    )
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)})


@lt.property_test(shape=lt.shapes(1, 4, 1, 3), data=st.data(), seed=lt.seeds)
def test_squeeze_matches(shape, data, seed):
    ones = [i for i, d in enumerate(shape) if d == 1]
    axes = data.draw(st.lists(st.sampled_from(ones), unique=True)) if ones else []
    rank = len(shape)
    axes = [a - rank if data.draw(st.booleans()) else a for a in axes]
    initializers = {"axes": np.array(axes, np.int64)} if axes else {}
    model = lt.one_node_model("Squeeze", [("x", FLOAT, shape)], [("y", FLOAT, None)], initializers, opset=13)
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.float32)})


@lt.property_test(shape=lt.shapes(0, 3), data=st.data(), seed=lt.seeds)
def test_unsqueeze_matches(shape, data, seed):
    out_rank = len(shape) + data.draw(st.integers(1, 2))
    axes = data.draw(_axes_for(out_rank, min_size=out_rank - len(shape)))[: out_rank - len(shape)]
    model = lt.one_node_model(
        "Unsqueeze", [("x", INT64, shape)], [("y", INT64, None)], {"axes": np.array(axes, np.int64)}
    )
    lt.lower_and_compare(model, {"x": lt.random_array(seed, shape, np.int64)})
