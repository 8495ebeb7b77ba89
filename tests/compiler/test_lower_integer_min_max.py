"""Integer Min/Max/Clip/Relu as Less/Greater + Where: exactly the same integers; float ones are kept."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT32, INT64
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

_INTEGERS = {INT32: np.int32, INT64: np.int64}


def test_float_min_is_kept():
    model = lt.one_node_model("Min", [("a", FLOAT, (3,)), ("b", FLOAT, (3,))], [("y", FLOAT, (3,))])
    assert lt.op_types(lt.lower(model)) == {"Min"}


def test_int64_min_becomes_where():
    model = lt.one_node_model("Min", [("a", INT64, (3,)), ("b", INT64, (1,))], [("y", INT64, (3,))])
    lowered = lt.lower_and_compare(model, {"a": np.array([1, 5, -2], np.int64), "b": np.array([2], np.int64)})
    assert lt.op_types(lowered) == {"Less", "Where"}


@lt.property_test(
    op_type=st.sampled_from(["Min", "Max"]),
    elem_type=st.sampled_from(sorted(_INTEGERS)),
    shapes_=hnp.mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3),
    count=st.integers(1, 3),
    data=st.data(),
)
def test_n_ary_integer_min_max_match(op_type, elem_type, shapes_, count, data):
    dtype = _INTEGERS[elem_type]
    names = [f"x{i}" for i in range(count)]
    in_shapes = shapes_.input_shapes[:count]
    inputs = [(n, elem_type, s) for n, s in zip(names, in_shapes, strict=True)]
    feeds = {
        n: data.draw(hnp.arrays(dtype, s, elements=st.integers(-50, 50)))
        for n, s in zip(names, in_shapes, strict=True)
    }
    model = lt.one_node_model(op_type, inputs, [("y", elem_type, None)])
    lowered = lt.lower_and_compare(model, feeds)
    assert op_type not in lt.op_types(lowered)


@lt.property_test(
    elem_type=st.sampled_from(sorted(_INTEGERS)),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    low=st.one_of(st.none(), st.integers(-20, 20)),
    high=st.one_of(st.none(), st.integers(-20, 20)),
    data=st.data(),
)
def test_integer_clip_matches(elem_type, shape, low, high, data):
    dtype = _INTEGERS[elem_type]
    initializers = {}
    node_inputs = ["x"]
    for name, bound in (("low", low), ("high", high)):
        node_inputs.append(name if bound is not None else "")
        if bound is not None:
            initializers[name] = np.array(bound, dtype)
    while node_inputs[-1] == "":
        node_inputs.pop()
    model = lt.one_node_model(
        "Clip", [("x", elem_type, shape)], [("y", elem_type, shape)], initializers, node_inputs=node_inputs
    )
    x = data.draw(hnp.arrays(dtype, shape, elements=st.integers(-30, 30)))
    lowered = lt.lower_and_compare(model, {"x": x})
    assert "Clip" not in lt.op_types(lowered)


@lt.property_test(
    elem_type=st.sampled_from(sorted(_INTEGERS)),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    data=st.data(),
)
def test_integer_relu_matches(elem_type, shape, data):
    dtype = _INTEGERS[elem_type]
    model = lt.one_node_model("Relu", [("x", elem_type, shape)], [("y", elem_type, shape)])
    x = data.draw(hnp.arrays(dtype, shape, elements=st.integers(-30, 30)))
    lowered = lt.lower_and_compare(model, {"x": x})
    assert "Relu" not in lt.op_types(lowered)
