"""Range as a constant (constant operands) or as arithmetic over its static length (runtime operands).

Floats are compared at atol 1e-6 but come out exact: the runtime form is a CumSum of [start, delta, ...],
which rounds like onnxruntime's Range loop (value += delta); start + i * delta would not.
"""

from __future__ import annotations

import lowering_testing as lt
import numpy as np
import pytest
from graph_testing import FLOAT, FLOAT16, INT32, INT64, run_ort
from hypothesis import assume
from hypothesis import strategies as st
from onnx.reference import ReferenceEvaluator

from optimum_ipu_backend.compiler.passes.rewrites.range import range_values

_TYPES = {INT32: np.int32, INT64: np.int64, FLOAT: np.float32}


def _operands(elem_type, start, limit, delta):
    dtype = _TYPES[elem_type]
    return {"start": np.array(start, dtype), "limit": np.array(limit, dtype), "delta": np.array(delta, dtype)}


def _constant_range(elem_type, start, limit, delta):
    operands = _operands(elem_type, start, limit, delta)
    # onnx's shape inference takes limit - start in float32 and can count one step more than onnxruntime
    # (e.g. -0.4f - -0.1f over -0.1f): declare onnxruntime's length and skip the checker on this input.
    length = len(range_values(operands["start"], operands["limit"], operands["delta"]))
    return lt.one_node_model("Range", [], [("y", elem_type, (length,))], operands, check=False)


def _runtime_range(elem_type, length):
    inputs = [(name, elem_type, ()) for name in ("start", "limit", "delta")]
    return lt.one_node_model("Range", inputs, [("y", elem_type, (length,))], check=False)


def test_constant_operands_become_a_constant():
    lowered = lt.lower_and_compare(_constant_range(INT64, 2, 11, 3), {})
    assert not lowered.graph.node
    assert [i.name for i in lowered.graph.initializer] == ["y"]


def test_runtime_operands_without_a_static_length_are_refused():
    inputs = [(name, INT64, ()) for name in ("start", "limit", "delta")]
    model = lt.one_node_model("Range", inputs, [("y", INT64, None)], check=False)
    lt.assert_refused(model, "the_Range.*not constants.*not known statically")


@lt.property_test(
    elem_type=st.sampled_from(sorted(_TYPES)),
    start=st.floats(-50, 50, width=32),
    delta=st.floats(0.125, 3, width=32),
    descending=st.booleans(),
    steps=st.integers(0, 300),
    overshoot=st.floats(0, 1, width=32),
    runtime=st.booleans(),
)
def test_same_values_as_range(elem_type, start, delta, descending, steps, overshoot, runtime):
    if elem_type != FLOAT:
        start, delta, overshoot = round(start), max(1, round(delta)), round(overshoot)
    delta = -delta if descending else delta
    # Long ranges are common here, so float rounding of the running sum is exercised.
    limit = start + delta * (steps + overshoot)
    operands = _operands(elem_type, start, limit, delta)
    length = len(range_values(operands["start"], operands["limit"], operands["delta"]))
    if runtime:
        assume(length > 0)  # onnxruntime cannot feed the lowered graph an empty static output anyway
        model = _runtime_range(elem_type, length)
        lowered = lt.lower_and_compare(model, operands)
    else:
        lowered = lt.lower_and_compare(_constant_range(elem_type, start, limit, delta), {})
    assert "Range" not in lt.op_types(lowered)


@pytest.mark.parametrize("runtime", [False, True])
def test_range_27_accumulates_float16_in_float32(runtime):
    # Onnx's reference is the oracle here: Range-27's stash_type is newer than onnxruntime's Range.
    operands = {
        name: np.array(v, np.float16) for name, v in (("start", 2000), ("limit", 2100), ("delta", 1.0))
    }
    wanted = np.arange(2000, 2100, 1.0, dtype=np.float32).astype(np.float16)
    # In float16 a running sum stops at 2048 (2048 + 1 rounds back to 2048); in float32 it does not.
    if runtime:
        inputs = [(name, FLOAT16, ()) for name in operands]
        model = lt.one_node_model("Range", inputs, [("y", FLOAT16, (100,))], opset=27, check=False)
        feeds = operands
    else:
        model = lt.one_node_model("Range", [], [("y", FLOAT16, (100,))], operands, opset=27, check=False)
        feeds = {}
    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, feeds)[0], wanted)
    lowered = lt.lower(model)
    lt.assert_lowered(lowered)
    np.testing.assert_array_equal(run_ort(lowered, feeds)["y"], wanted)
