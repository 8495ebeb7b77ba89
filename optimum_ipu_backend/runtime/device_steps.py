"""Run N samples as device steps of ``micro_batch x device_iterations x replicas`` samples.

PopART consumes one step's input as a host buffer of logical shape ``[batches_per_step, replicas,
*onnx_input_shape]``, where ``batches_per_step`` is the device-iteration count and the ONNX input shape
carries the micro-batch on its batch axis; it reads the buffer in C order, iteration-major then replica,
so iteration ``s`` of replica ``r`` gets ``buffer[s, r]``, i.e. host samples
``[(s * replicas + r) * micro_batch, ... + micro_batch)`` of the step. Output ("anchor") buffers come
back as ``[batches_per_step, replicas, *onnx_output_shape]`` (as PopART documents its anchors). PopART drops
dimensions equal to 1 by convention and only checks element counts; the functions here always use the
full rank and accept dropped dimensions back through ``anchor_shape``.

The last step of a call is usually partial: it is filled up by repeating its real samples (a real sample
is always a valid input, whereas all-zero rows may not be) or with zeros, and the padding is dropped from
the outputs. ``split_feed`` and ``merge_outputs`` are what the runtime runs; an engine without native
steps runs the buffers one micro-batch at a time (``engines.base.Executable.run_step``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

BatchFill = Literal["repeat", "zeros"]


@dataclass(frozen=True)
class StepPlan:
    """How ``samples`` host samples map onto device steps."""

    samples: int
    micro_batch: int
    device_iterations: int = 1
    replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("micro_batch", "device_iterations", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 0:
            raise ValueError(f"the number of samples must be a non-negative integer, got {self.samples!r}")

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch * self.device_iterations * self.replicas

    @property
    def steps(self) -> int:
        return -(-self.samples // self.samples_per_step)

    @property
    def padded_samples(self) -> int:
        return self.steps * self.samples_per_step

    @property
    def padding(self) -> int:
        """Padded samples added to the last step."""
        return self.padded_samples - self.samples

    def step_range(self, step: int) -> tuple[int, int]:
        """Host sample range ``[start, stop)`` of the real samples in ``step``."""
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} out of range for {self.steps} step(s)")
        start = step * self.samples_per_step
        return start, min(start + self.samples_per_step, self.samples)


def plan_steps(samples: int, micro_batch: int, device_iterations: int = 1, replicas: int = 1) -> StepPlan:
    """Plan ``samples`` samples as steps of ``micro_batch x device_iterations x replicas``.

    ``ValueError`` for non-positive sizes or a negative sample count. Zero samples make zero steps.
    """
    return StepPlan(samples, micro_batch, device_iterations, replicas)


def to_device_layout(
    array: np.ndarray,
    plan: StepPlan,
    step: int = 0,
    *,
    batch_axis: int = 0,
    fill: BatchFill = "repeat",
) -> np.ndarray:
    """The host buffer of ``step``: shape ``[device_iterations, replicas, *sample_shape]`` where the sample
    shape has ``micro_batch`` on ``batch_axis``.

    ``array`` holds all ``plan.samples`` samples along ``batch_axis``. The real samples of a partial step
    are followed by padding samples (``fill="repeat"`` repeats the step's real samples cyclically,
    ``"zeros"`` writes zeros).
    """
    return _step_buffer(*_samples_first(array, plan, batch_axis), plan, step, fill)


def _samples_first(array: np.ndarray, plan: StepPlan, batch_axis: int) -> tuple[np.ndarray, int]:
    """``array`` with its samples on axis 0 (a view), and its batch axis, checked once for every step."""
    if array.ndim == 0:
        raise ValueError("a batched input needs at least one dimension")
    batch_axis = _normalize_axis(batch_axis, array.ndim)
    if array.shape[batch_axis] != plan.samples:
        raise ValueError(
            f"the array has {array.shape[batch_axis]} samples on axis {batch_axis}, the plan {plan.samples}"
        )
    return np.moveaxis(array, batch_axis, 0), batch_axis


def _step_buffer(
    all_samples: np.ndarray, batch_axis: int, plan: StepPlan, step: int, fill: BatchFill
) -> np.ndarray:
    start, stop = plan.step_range(step)
    samples = all_samples[start:stop]
    missing = plan.samples_per_step - len(samples)
    if missing:
        if fill == "repeat":
            extra = samples[np.arange(missing) % len(samples)]
        elif fill == "zeros":
            extra = np.zeros((missing, *samples.shape[1:]), dtype=samples.dtype)
        else:
            raise ValueError(f"fill must be 'repeat' or 'zeros', got {fill!r}")
        samples = np.concatenate([samples, extra])
    grouped = samples.reshape(plan.device_iterations, plan.replicas, plan.micro_batch, *samples.shape[1:])
    return np.ascontiguousarray(np.moveaxis(grouped, 2, 2 + batch_axis))


def from_device_layout(
    array: np.ndarray,
    plan: StepPlan,
    step: int = 0,
    *,
    batch_axis: int = 0,
    anchor_shape: Sequence[int] | None = None,
) -> np.ndarray:
    """The real samples of ``step`` from its output buffer, stacked along ``batch_axis``.

    ``array`` has shape ``[device_iterations, replicas, *anchor_shape]`` with ``micro_batch`` on
    ``batch_axis`` of the anchor shape. Give ``anchor_shape`` (one micro-batch's output shape) when
    dimensions equal to 1 were dropped from the buffer, as PopART does; it is reshaped first.
    """
    prefix = (plan.device_iterations, plan.replicas)
    if anchor_shape is not None:
        full_shape = (*prefix, *anchor_shape)
        if int(np.prod(full_shape)) != array.size:
            raise ValueError(f"a buffer of {array.size} elements cannot have shape {full_shape}")
        array = array.reshape(full_shape)
    if array.shape[:2] != prefix:
        raise ValueError(
            f"expected a buffer starting with (device_iterations, replicas) = {prefix}, got shape "
            f"{array.shape}; pass anchor_shape if dimensions equal to 1 were dropped"
        )
    batch_axis = _normalize_axis(batch_axis, array.ndim - 2)
    if array.shape[2 + batch_axis] != plan.micro_batch:
        raise ValueError(
            f"axis {batch_axis} of the anchor shape {array.shape[2:]} should be the micro-batch "
            f"{plan.micro_batch}"
        )
    sample_shape = [size for axis, size in enumerate(array.shape[2:]) if axis != batch_axis]
    samples = np.moveaxis(array, 2 + batch_axis, 2).reshape(plan.samples_per_step, *sample_shape)
    start, stop = plan.step_range(step)
    return np.moveaxis(samples[: stop - start], 0, batch_axis)


def split_feed(
    feed: Mapping[str, np.ndarray],
    plan: StepPlan,
    *,
    batch_axes: Mapping[str, int | None] | None = None,
    fill: BatchFill = "repeat",
) -> list[dict[str, np.ndarray]]:
    """One device-layout feed per step. ``batch_axes`` gives each input's batch axis (default 0); an input
    mapped to None has no batch axis: every micro-batch of every step gets it whole, so its buffer is
    ``[device_iterations, replicas, *shape]`` like every other (a broadcast view, no copy)."""
    batch_axes = batch_axes or {}
    if not plan.steps:
        return []
    batched = {
        name: _samples_first(array, plan, axis)
        for name, array in feed.items()
        if (axis := batch_axes.get(name, 0)) is not None
    }
    return [
        {
            name: np.broadcast_to(array, (plan.device_iterations, plan.replicas, *array.shape))
            if name not in batched
            else _step_buffer(*batched[name], plan, step, fill)
            for name, array in feed.items()
        }
        for step in range(plan.steps)
    ]


def merge_outputs(
    step_outputs: Sequence[Mapping[str, np.ndarray]],
    plan: StepPlan,
    *,
    batch_axes: Mapping[str, int | None] | None = None,
    anchor_shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    """Join the output buffers of all steps back into ``plan.samples`` samples per output, padding
    dropped. An output mapped to None in ``batch_axes`` has no batch axis (or is a placeholder whose batch
    axis is not the micro-batch): every micro-batch computes the same, and the first one is kept."""
    if len(step_outputs) != plan.steps:
        raise ValueError(f"expected outputs of {plan.steps} step(s), got {len(step_outputs)}")
    if not step_outputs:
        return {}
    batch_axes = batch_axes or {}
    anchor_shapes = anchor_shapes or {}
    merged = {}
    for name, first in step_outputs[0].items():
        axis = batch_axes.get(name, 0)
        if axis is None or (anchor_shapes.get(name) is None and first.shape[2 + axis] != plan.micro_batch):
            merged[name] = first[0, 0]
            continue
        parts = [
            from_device_layout(
                outputs[name], plan, step, batch_axis=axis, anchor_shape=anchor_shapes.get(name)
            )
            for step, outputs in enumerate(step_outputs)
        ]
        merged[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
    return merged


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"batch axis {axis} is out of range for {ndim} dimension(s)")
    return axis % ndim
