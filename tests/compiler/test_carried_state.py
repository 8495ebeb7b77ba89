"""``compiler.carried_state``: a decode graph rewritten to keep its cache as device state gives, step by
step, what the original graph gives on the unpadded growing cache (padded on either side, rows reordered
between steps), and graphs of another form are refused, naming why."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import pytest
from onnx import TensorProto, helper, numpy_helper

from optimum_ipu_backend.compiler.carried_state import (
    APPENDED_STATE_PREFIX,
    LENGTH_INPUT,
    ROWS_INPUT,
    CarriedStateRefused,
    CarryRequest,
    carried_state_plan,
    carry_state,
)
from optimum_ipu_backend.engines.base import CompileOptions
from optimum_ipu_backend.engines.emulator import HostEmulatorEngine

B, H, D = 3, 2, 4


def decode_graph(positions: int, *, new_first: bool = False) -> onnx.ModelProto:
    """present = Concat(past, x * 2) over positions; y = sum over positions of present * weights, masked by
    ``mask`` (past + new positions). The weights differ per position, so a value in the wrong slot of the
    padded cache changes y; zeros in the padded slots do not."""
    weights = numpy_helper.from_array(
        np.linspace(0.5, 1.5, (positions + 1) * D, dtype=np.float32).reshape(1, 1, positions + 1, D), "w"
    )
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "axes")
    order = ["new", "past"] if new_first else ["past", "new"]
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["new"]),
        helper.make_node("Concat", order, ["present"], axis=2),
        helper.make_node("Unsqueeze", ["mask"], ["mask3"], axes=[1]),
        helper.make_node("Unsqueeze", ["mask3"], ["mask4"], axes=[3]),
        helper.make_node("Cast", ["mask4"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["present", "w"], ["weighted"]),
        helper.make_node("Mul", ["weighted", "maskf"], ["masked"]),
        helper.make_node("ReduceSum", ["masked"], ["y"], axes=[2, 3], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "decode",
        [
            helper.make_tensor_value_info("past", TensorProto.FLOAT, [B, H, positions, D]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, H, 1, D]),
            helper.make_tensor_value_info("mask", TensorProto.INT32, [B, positions + 1]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, H]),
            helper.make_tensor_value_info("present", TensorProto.FLOAT, [B, H, positions + 1, D]),
        ],
        [weights, two, axes],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def padded(array: np.ndarray, size: int, axis: int, side: str) -> np.ndarray:
    widths = [(0, 0)] * array.ndim
    widths[axis] = (size - array.shape[axis], 0) if side == "left" else (0, size - array.shape[axis])
    return np.pad(array, widths)


@pytest.mark.parametrize("integer_state", [True, False], ids=["int32 mask state", "float32 mask state"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_steps_on_device_state_equal_the_growing_cache(tmp_path, side, integer_state):
    """An engine without integer state (PopTorch) keeps the int32 mask as float32 and reads it back as
    int32: the steps are the same."""
    capacity = 9
    request = CarryRequest({"past": 0}, {"mask": (0, 1)}, side, integer_state=integer_state)
    model, plan = carry_state(decode_graph(capacity), request)
    assert carried_state_plan(model) == plan
    assert [(s.kind, s.input) for s in plan.states] == [("grows", "past"), ("appended", "mask")]
    mask_state = next(t for t in model.graph.initializer if t.name == APPENDED_STATE_PREFIX + "mask")
    assert mask_state.data_type == (TensorProto.INT32 if integer_state else TensorProto.FLOAT)
    assert plan.states[1].exact_within == (None if integer_state else 2**24)
    onnx.checker.check_model(model)
    onnx.save(model, tmp_path / "carried.onnx")
    reference = onnx.reference.ReferenceEvaluator(decode_graph(capacity))
    rng = np.random.default_rng(0)
    with HostEmulatorEngine("emulator") as engine:
        executable = engine.compile(tmp_path / "carried.onnx", CompileOptions())
        assert {spec.name for spec in executable.state} == {"past", APPENDED_STATE_PREFIX + "mask"}
        past = rng.standard_normal((B, H, 2, D)).astype(np.float32)
        mask = np.ones((B, 2), np.int32)
        mask[1, 0] = 0
        executable.write_state(
            {
                "past": padded(past, capacity, 2, side),
                APPENDED_STATE_PREFIX + "mask": padded(mask, capacity, 1, side).astype(
                    np.int32 if integer_state else np.float32
                ),
            }
        )
        rows = np.arange(B, dtype=np.int32)
        for step in range(capacity - 2):
            if step == 3:  # a beam reorder: the device gathers rows, the caller reorders its cache
                rows = np.array([2, 0, 0], np.int32)
                past, mask = past[rows], mask[rows]
            x = rng.standard_normal((B, H, 1, D)).astype(np.float32)
            new_mask = np.ones((B, 1), np.int32)
            full_mask = np.concatenate([mask, new_mask], axis=1)
            padded_mask = np.concatenate([padded(mask, capacity, 1, side), new_mask], axis=1)
            expected_y, _ = reference.run(
                None, {"past": padded(past, capacity, 2, side), "x": x, "mask": padded_mask}
            )
            feed = {"x": x, "mask": new_mask, ROWS_INPUT: rows}
            if side == "right":
                feed[LENGTH_INPUT] = np.array(past.shape[2], np.int32)
            got = executable.run(feed)
            np.testing.assert_allclose(got["y"], expected_y, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(got["present"], x * 2)  # only the new position comes back
            past = np.concatenate([past, x * 2], axis=2)
            mask = full_mask
            rows = np.arange(B, dtype=np.int32)


def test_an_integer_past_is_refused_where_the_engine_keeps_no_integer_state():
    """The graph computes an integer past's new positions itself: nothing bounds them, so float32 state is
    not proven exact and the cache is streamed instead."""
    model = decode_graph(5)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT32
    with pytest.raises(CarriedStateRefused, match="past 'past' is not floating point"):
        carry_state(model, CarryRequest({"past": 0}, {}, "right", integer_state=False))


def test_a_concat_with_the_new_positions_first_is_refused():
    with pytest.raises(CarriedStateRefused, match="not the past first"):
        carry_state(decode_graph(5, new_first=True), CarryRequest({"past": 0}, {}, "left"))


def test_a_mask_that_does_not_cover_the_past_is_refused():
    model = decode_graph(5)
    with pytest.raises(CarriedStateRefused, match="input 'x' has 4 positions"):
        carry_state(model, CarryRequest({"past": 0}, {"x": (0, 3)}, "left"))


def test_a_graph_returning_its_past_is_refused():
    model = decode_graph(5)
    model.graph.output.append(helper.make_tensor_value_info("past", TensorProto.FLOAT, [B, H, 5, D]))
    with pytest.raises(CarriedStateRefused, match="returns its past input"):
        carry_state(model, CarryRequest({"past": 0}, {}, "right"))
