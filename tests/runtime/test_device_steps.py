"""Device steps: N samples as steps of micro_batch x device_iterations x replicas in PopART's host layout
``[batches_per_step, replicas, *onnx_shape]`` (graphcore-sdk-api.md §1.5)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimum_ipu_backend.runtime.device_steps import (
    from_device_layout,
    iter_micro_batches,
    merge_outputs,
    plan_steps,
    split_feed,
    stack_micro_batches,
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


@settings(max_examples=100, deadline=None)
@given(plan=plans)
def test_emulated_device_runs_micro_batches_and_drops_padding(plan) -> None:
    """A per-sample function run one micro-batch at a time over the device buffers equals running it on
    the whole host batch; outputs may have other shapes than inputs."""
    rng = np.random.default_rng(plan.samples)
    ids = rng.integers(0, 100, size=(plan.samples, 5))
    mask = rng.integers(0, 2, size=(plan.samples, 5))

    def model(feed: dict) -> dict:
        return {"score": (feed["ids"] * feed["mask"]).sum(axis=1, keepdims=True).astype(np.float64)}

    step_outputs = []
    for device_feed in split_feed({"ids": ids, "mask": mask}, plan):
        results = [model(micro) for _, _, micro in iter_micro_batches(device_feed, plan)]
        anchors = stack_micro_batches(results, plan)
        assert anchors["score"].shape == (plan.device_iterations, plan.replicas, plan.micro_batch, 1)
        step_outputs.append(anchors)
    merged = merge_outputs(step_outputs, plan)
    np.testing.assert_array_equal(merged["score"], model({"ids": ids, "mask": mask})["score"])


def test_inputs_without_a_batch_axis_go_to_every_step() -> None:
    plan = plan_steps(5, micro_batch=2)
    table = np.arange(3)
    steps = split_feed({"x": np.zeros((5, 1)), "table": table}, plan, batch_axes={"table": None})
    assert len(steps) == 3 and all(step["table"] is table for step in steps)


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
