"""Calls from many threads served as shared device steps (provider option ``dynamic_batching``).

Each ``run`` call is checked in its caller's thread, then queued in the dynamic batcher
(``runtime.batcher``), which gathers calls for up to ``max_queue_delay_ms`` or until a device step is
full. A gathered group runs as:

* packed rows (``runtime.packing``) for the calls an encoder's proven packed graph can take;
* the other calls batched by shape: calls whose inputs agree in every size but the batch run as one call
  of the runner, and their outputs are split along the batch axes the padding proof finds by dataflow.

A call's error is its own: a combined run that fails is run again call by call, so each caller gets its
own result or its own exception. Closing the session releases every queued call with an error.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from optimum_ipu_backend.runtime.batcher import DynamicBatcher
from optimum_ipu_backend.runtime.packing import PackedRunner
from optimum_ipu_backend.runtime.serving import StaticShapeRunner

_logger = logging.getLogger(__name__)

Outcome = list[np.ndarray] | BaseException


@dataclass(frozen=True)
class QueuedCall:
    """One ``run`` call: its feed, the outputs it asked for and, when it packs, the real length of each of
    its rows (None: it runs unpacked)."""

    feed: Mapping[str, np.ndarray]
    names: tuple[str, ...]
    lengths: tuple[int, ...] | None


class BatchedServing:
    """The dynamic batcher in front of one session's runner, and its packed runner where proven."""

    def __init__(
        self,
        runner: StaticShapeRunner,
        packed: PackedRunner | None,
        *,
        max_delay_s: float,
        packing_verdict: str,
    ) -> None:
        self._runner = runner
        self._packed = packed
        self.packing_verdict = packing_verdict
        plan = None if packed is None else packed.plan
        self._batcher: DynamicBatcher[QueuedCall, list[np.ndarray]] = DynamicBatcher(
            self._run_group,
            max_delay_s=max_delay_s,
            is_full=self._is_full,
            name="ipu-dynamic-batcher",
            # with a serving plan, packed groups fill one step of its fill layout; the calls left out
            # wait for the next one
            choose=None if plan is None else self._choose,
        )
        self._rows_per_step = runner.rows_per_step()

    @property
    def packed(self) -> PackedRunner | None:
        return self._packed

    def run(self, feed: Mapping[str, np.ndarray], names: Sequence[str]) -> list[np.ndarray]:
        """The outputs ``names`` of ``feed``, computed in a device step shared with other callers."""
        lengths = None if self._packed is None else self._packed.lengths(feed)
        call = QueuedCall(feed, tuple(names), None if lengths is None else tuple(lengths))
        return self._batcher.submit(call)

    def close(self) -> None:
        """Release every queued call with an error and stop the batcher's thread."""
        self._batcher.close()

    # -- a group ----------------------------------------------------------------------------------

    def _is_full(self, calls: list[QueuedCall]) -> bool:
        """A group is full when its packed tokens fill a step of the longest rows, or its unpacked samples
        fill a step of the largest micro-batch."""
        tokens = sum(sum(call.lengths) for call in calls if call.lengths is not None)
        axes = self._runner.input_batch_axes
        samples = sum(_samples(call, axes) for call in calls if call.lengths is None)
        packed_capacity = 0 if self._packed is None else self._packed.longest_row * self._rows_per_step
        return (packed_capacity > 0 and tokens >= packed_capacity) or samples >= self._rows_per_step

    def _choose(self, calls: list[QueuedCall]) -> list[int]:
        """The queued calls the next group takes: the packed ones that fill one step of the serving plan's
        fill layout best (``PackedPlan.choose``), and every call that runs unpacked."""
        assert self._packed is not None and self._packed.plan is not None
        packed = [index for index, call in enumerate(calls) if call.lengths is not None]
        chosen = self._packed.plan.choose([calls[index].lengths or () for index in packed]) if packed else []
        taken = {packed[position] for position in chosen}
        return [index for index, call in enumerate(calls) if call.lengths is None or index in taken]

    def _run_group(self, calls: list[QueuedCall]) -> list[Outcome]:
        outcomes: list[Outcome | None] = [None] * len(calls)
        packable = [index for index, call in enumerate(calls) if call.lengths is not None]
        if packable:
            for index, outcome in zip(packable, self._run_packed([calls[i] for i in packable]), strict=True):
                outcomes[index] = outcome
        by_shape: dict[tuple, list[int]] = {}
        for index, call in enumerate(calls):
            if call.lengths is None:
                by_shape.setdefault(self._signature(call), []).append(index)
        for indices in by_shape.values():
            for index, outcome in zip(indices, self._run_unpacked([calls[i] for i in indices]), strict=True):
                outcomes[index] = outcome
        return outcomes  # type: ignore[return-value]

    def _run_packed(self, calls: list[QueuedCall]) -> list[Outcome]:
        packed = self._packed
        assert packed is not None
        requests = [(call.feed, call.names, call.lengths or ()) for call in calls]
        try:
            return list(packed.run(requests, clients=self._batcher.outstanding))
        except Exception as exc:
            if len(calls) == 1:
                return [exc]  # its own error; the group's unpacked calls are not failed with it
        # One call's failure must not become the others': each runs alone, and fails alone.
        return [_outcome(lambda request=request: packed.run([request])[0]) for request in requests]

    def _run_unpacked(self, calls: list[QueuedCall]) -> list[Outcome]:
        runner = self._runner
        if len(calls) > 1:
            try:
                return self._run_concatenated(calls)
            except Exception as exc:
                _logger.debug("a batch of %d calls failed (%s); running them one by one", len(calls), exc)
        return [_outcome(lambda call=call: runner.run(call.feed, call.names)) for call in calls]

    def _run_concatenated(self, calls: list[QueuedCall]) -> list[Outcome]:
        """Calls of one shape as one call of the runner, split back along the outputs' batch axes."""
        runner = self._runner
        axes = runner.input_batch_axes
        feed = {
            name: np.concatenate([np.asarray(call.feed[name]) for call in calls], axis=axis or 0)
            for name, axis in ((name, axes.get(name)) for name in calls[0].feed)
        }
        names = sorted({name for call in calls for name in call.names})
        outputs = dict(zip(names, runner.run(feed, names), strict=True))
        output_axes = runner.output_batch_axes(feed)
        bounds = np.cumsum([0, *(_samples(call, axes) for call in calls)])
        results: list[Outcome] = []
        for index, call in enumerate(calls):
            part = []
            for name in call.names:
                axis = output_axes[name]
                assert axis is not None  # _signature lets only calls with batched outputs share a run
                part.append(np.take(outputs[name], np.arange(bounds[index], bounds[index + 1]), axis=axis))
            results.append(part)
        return results

    def _signature(self, call: QueuedCall) -> tuple:
        """Calls with equal signatures can run as one call: the same inputs, equal in every size but the
        batch, and every input and output batched. A call that cannot share gets a signature of its own."""
        axes = self._runner.input_batch_axes
        if any(axes.get(name) is None for name in call.feed):
            return ("alone", id(call))
        shapes = []
        for name in sorted(call.feed):
            array = np.asarray(call.feed[name])
            shape = list(array.shape)
            axis = axes[name]
            assert axis is not None
            if axis >= len(shape):
                return ("alone", id(call))
            shape[axis] = -1
            shapes.append((name, tuple(shape), array.dtype.str))
        try:
            output_axes = self._runner.output_batch_axes(call.feed)
        except Exception:
            return ("alone", id(call))
        if any(output_axes.get(name) is None for name in call.names):
            return ("alone", id(call))
        return tuple(shapes)


def _samples(call: QueuedCall, axes: Mapping[str, int | None] | None = None) -> int:
    """How many samples a call holds: the size of its first input's batch axis (its rows when packed)."""
    if call.lengths is not None:
        return len(call.lengths)
    name = next(iter(call.feed))
    axis = (axes or {}).get(name) or 0
    array = np.asarray(call.feed[name])
    return int(array.shape[axis]) if array.ndim else 1


def _outcome(work) -> Outcome:
    try:
        return work()
    except Exception as exc:  # this call's own error, raised in its caller's thread
        return exc
