"""Device steps: N samples as steps of micro_batch x device_iterations x replicas in PopART's host layout
``[batches_per_step, replicas, *onnx_shape]`` (PopART's documented anchor layout)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimum_ipu_backend.engines.base import Executable
from optimum_ipu_backend.runtime.device_steps import (
    from_device_layout,
    merge_outputs,
    plan_steps,
    split_feed,
    to_device_layout,
)

plans = st.builds(
    plan_steps,
    samples=st.integers(1, 40),
    micro_batch=st.integers(1, 4),
    device_iterations=st.integers(1, 4),
    replicas=st.integers(1, 3),
)


def test_plan_counts_steps_and_padding() -> None:
    plan = plan_steps(11, micro_batch=2, device_iterations=3, replicas=2)
    assert (plan.samples_per_step, plan.steps, plan.padded_samples, plan.padding) == (12, 1, 12, 1)
    plan = plan_steps(25, micro_batch=2, device_iterations=3, replicas=2)
    assert (plan.steps, plan.padding) == (3, 11)
    assert [plan.step_range(step) for step in range(plan.steps)] == [(0, 12), (12, 24), (24, 25)]
    assert plan_steps(0, 4).steps == 0
    with pytest.raises(IndexError):
        plan.step_range(3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"samples": 4, "micro_batch": 0},
        {"samples": 4, "micro_batch": 1, "device_iterations": -1},
        {"samples": 4, "micro_batch": 1, "replicas": 1.5},
        {"samples": -1, "micro_batch": 1},
        {"samples": 4, "micro_batch": True},
    ],
)
def test_plan_rejects_bad_sizes(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        plan_steps(**kwargs)


@settings(max_examples=200, deadline=None)
@given(plan=plans, feature=st.integers(1, 3), data=st.data())
def test_device_buffer_follows_popart_order(plan, feature: int, data: st.DataObject) -> None:
    """Iteration s of replica r reads host samples [(s * replicas + r) * micro_batch, + micro_batch) of the
    step, in C order, and the padding of the last step repeats its real samples."""
    host = np.arange(plan.samples * feature).reshape(plan.samples, feature)
    step = data.draw(st.integers(0, plan.steps - 1))
    buffer = to_device_layout(host, plan, step)
    assert buffer.shape == (plan.device_iterations, plan.replicas, plan.micro_batch, feature)
    assert buffer.flags.c_contiguous
    start, stop = plan.step_range(step)
    for iteration in range(plan.device_iterations):
        for replica in range(plan.replicas):
            for row in range(plan.micro_batch):
                offset = (iteration * plan.replicas + replica) * plan.micro_batch + row
                source = (
                    start + offset
                    if start + offset < stop
                    else start + (offset - (stop - start)) % (stop - start)
                )
                np.testing.assert_array_equal(buffer[iteration, replica, row], host[source])


@settings(max_examples=200, deadline=None)
@given(
    plan=plans,
    trailing=st.lists(st.integers(1, 3), max_size=2),
    batch_axis=st.integers(0, 2),
    fill=st.sampled_from(["repeat", "zeros"]),
)
def test_round_trip_through_device_steps(plan, trailing: list[int], batch_axis: int, fill: str) -> None:
    batch_axis = min(batch_axis, len(trailing))
    shape = list(trailing)
    shape.insert(batch_axis, plan.samples)
    rng = np.random.default_rng(plan.samples)
    host = rng.standard_normal(shape).astype(np.float32)
    steps = split_feed({"x": host}, plan, batch_axes={"x": batch_axis}, fill=fill)
    assert len(steps) == plan.steps
    for buffers in steps:
        expected = list(trailing)
        expected.insert(batch_axis, plan.micro_batch)
        assert buffers["x"].shape == (plan.device_iterations, plan.replicas, *expected)
    # An identity "device" returns its input as the output anchor.
    merged = merge_outputs(steps, plan, batch_axes={"x": batch_axis})
    np.testing.assert_array_equal(merged["x"], host)


def _model(feed: dict) -> dict:
    """Per sample: a masked sum and the table every sample reads; ``table`` comes without a batch axis."""
    score = (feed["ids"] * feed["mask"]).sum(axis=1, keepdims=True) + feed["table"].sum()
    return {"score": score.astype(np.float64), "table_copy": feed["table"].copy()}


class _PerSample(Executable):
    """An executable that runs ``_model``; its steps run the engines' own micro-batch loop."""

    def run(self, feed):
        return _model(feed)


@settings(max_examples=100, deadline=None)
@given(plan=plans)
def test_device_steps_split_run_and_merge_like_the_whole_batch(plan) -> None:
    """What the runtime runs: split_feed, an executable's run_step per step, merge_outputs. A per-sample
    function gives what it gives on the whole host batch; inputs without a batch axis reach every
    micro-batch whole, and outputs without one come back once."""
    rng = np.random.default_rng(plan.samples)
    feed = {
        "ids": rng.integers(0, 100, size=(plan.samples, 5)),
        "mask": rng.integers(0, 2, size=(plan.samples, 5)),
        "table": np.arange(3),
    }
    executable = _PerSample()
    step_outputs = []
    for device_feed in split_feed(feed, plan, batch_axes={"table": None}):
        assert device_feed["table"].shape == (plan.device_iterations, plan.replicas, 3)
        anchors = executable.run_step(device_feed, plan.device_iterations, plan.replicas)
        assert anchors["score"].shape == (plan.device_iterations, plan.replicas, plan.micro_batch, 1)
        step_outputs.append(anchors)
    merged = merge_outputs(step_outputs, plan, batch_axes={"table_copy": None})
    np.testing.assert_array_equal(merged["score"], _model(feed)["score"])
    np.testing.assert_array_equal(merged["table_copy"], feed["table"])


def test_from_device_layout_accepts_popart_buffers_with_unit_dimensions_dropped() -> None:
    plan = plan_steps(3, micro_batch=1, device_iterations=4, replicas=1)
    host = np.arange(3 * 2).reshape(3, 2)
    full = to_device_layout(host, plan)
    assert full.shape == (4, 1, 1, 2)
    dropped = full.reshape(4, 2)  # what PopART hands back: replicas = 1 and micro_batch = 1 omitted
    np.testing.assert_array_equal(from_device_layout(dropped, plan, anchor_shape=(1, 2)), host)
    with pytest.raises(ValueError, match="anchor_shape"):
        from_device_layout(dropped, plan)
    with pytest.raises(ValueError, match="cannot have shape"):
        from_device_layout(dropped, plan, anchor_shape=(1, 3))


def test_layout_checks_sample_counts() -> None:
    plan = plan_steps(4, micro_batch=2)
    with pytest.raises(ValueError, match="samples"):
        to_device_layout(np.zeros((3, 2)), plan)
    with pytest.raises(ValueError, match="micro-batch"):
        from_device_layout(np.zeros((1, 1, 3, 2)), plan)
    with pytest.raises(ValueError, match="outputs of 2 step"):
        merge_outputs([], plan)
