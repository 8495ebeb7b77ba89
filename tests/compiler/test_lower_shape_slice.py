"""Shape-15 start/end as Shape then Slice: the same int64 vector, including clamped bounds."""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
from graph_testing import FLOAT, INT64
from hypothesis import strategies as st


def test_plain_shape_is_kept():
    model = lt.one_node_model("Shape", [("x", FLOAT, (2, 3))], [("y", INT64, (2,))])
    assert lt.op_types(lt.lower(model)) == {"Shape"}


@lt.property_test(
    shape=lt.shapes(0, 5),
    start=st.one_of(st.none(), st.integers(-7, 7)),
    end=st.one_of(st.none(), st.integers(-7, 7)),
)
def test_start_end_match(shape, start, end):
    attributes = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    model = lt.one_node_model("Shape", [("x", FLOAT, shape)], [("y", INT64, None)], **attributes)
    lt.lower_and_compare(model, {"x": np.zeros(shape, np.float32)})
