"""Shape-15 start/end as Shape then Slice: the same int64 vector, including clamped bounds."""

from __future__ import annotations

import numpy as np
from graph_testing import FLOAT, INT64
from hypothesis import strategies as st
from lowering_testing import lower, lower_and_compare, one_node_model, op_types, property_test, shapes


def test_plain_shape_is_kept():
    model = one_node_model("Shape", [("x", FLOAT, (2, 3))], [("y", INT64, (2,))])
    assert op_types(lower(model)) == {"Shape"}


@property_test(
    shape=shapes(0, 5),
    start=st.one_of(st.none(), st.integers(-7, 7)),
    end=st.one_of(st.none(), st.integers(-7, 7)),
)
def test_start_end_match(shape, start, end):
    attributes = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    model = one_node_model("Shape", [("x", FLOAT, shape)], [("y", INT64, None)], **attributes)
    lower_and_compare(model, {"x": np.zeros(shape, np.float32)})
