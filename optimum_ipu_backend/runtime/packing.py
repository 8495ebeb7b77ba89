"""Packed rows: the sequences of many calls share device rows (the runtime side of
``compiler.graph_rewrites.packing``).

A group of encoder calls (gathered by the dynamic batcher, ``runtime.batched_serving``) is split into its
sequences. Each is cut to its real length where its row has padding, which is the padding proof read
backwards (as ``trim_padding``: outputs at masked positions are then zeros). The sequences are packed
first-fit-decreasing into rows, and the step is run at the compiled row length and row count that compute
the fewest tokens. Every output is cut back per sequence by the axes the rewrite reports, never by names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from optimum_ipu_backend.runtime.boundary import to_host_dtype
from optimum_ipu_backend.runtime.device_steps import merge_outputs, plan_steps, split_feed
from optimum_ipu_backend.runtime.executables import ExecutableTable
from optimum_ipu_backend.runtime.row_placement import Placement, first_fit_decreasing
from optimum_ipu_backend.runtime.serving import ExecutableLimitError

if TYPE_CHECKING:
    from optimum_ipu_backend.runtime.serving_plan import ServingPlanner

#: A pooled graph's row holds at most ``tokens // TOKENS_PER_SEGMENT`` sequences: the pooled outputs are
#: computed for every slot, and real sequences are at least a [CLS] and a [SEP] token long.
TOKENS_PER_SEGMENT = 4


@dataclass(frozen=True)
class PackedGraphInterface:
    """What the runtime needs of a packed graph (``compiler.graph_rewrites.packing.PackedEncoder``)."""

    mask_input: str
    token_inputs: tuple[str, ...]
    token_outputs: dict[str, int]
    pooled_outputs: dict[str, int]
    #: The packed graph's inputs and their host dtypes (the token inputs and the packing inputs it uses).
    input_dtypes: dict[str, np.dtype]
    segment_ids: str
    position_ids: str
    segment_starts: str


@dataclass(frozen=True)
class RowLayout:
    """The shape of one packed run: ``rows`` rows of ``tokens`` tokens, ``segments`` slots per row (pooled
    graphs), the placement of each sequence, the compiled micro-batch of rows, and the rows the device
    computes (the last step filled up)."""

    tokens: int
    segments: int
    placements: tuple[Placement, ...]
    rows: int
    micro_batch: int
    computed_rows: int


def choose_layout(
    lengths: Sequence[int],
    row_counts: Sequence[int],
    row_lengths: Sequence[int],
    segments_per_row: Callable[[int], int | None],
    device_iterations: int = 1,
    replicas: int = 1,
    allowed: Callable[[int, int], bool] | None = None,
) -> RowLayout | None:
    """Of the compiled row lengths and counts, the layout that computes the fewest tokens for sequences of
    these ``lengths`` (first-fit-decreasing into each row length; rows beyond the largest count run as
    further device steps, the last one filled up to a compiled count). ``allowed(tokens, micro_batch)``
    limits the choice (to executables the session may still compile); None when no layout is allowed."""
    per_step = device_iterations * replicas
    best: RowLayout | None = None
    for tokens in row_lengths:
        segments = segments_per_row(tokens)
        placements = first_fit_decreasing(lengths, tokens, segments)
        if placements is None:
            continue
        rows = 1 + max(p.row for p in placements)
        wanted = min(-(-rows // per_step), row_counts[-1])
        for micro in (size for size in row_counts if size >= wanted):
            if allowed is not None and not allowed(tokens, micro):
                continue
            layout = _row_layout(tokens, segments, placements, micro, device_iterations, replicas)
            if best is None or layout.computed_rows * tokens < best.computed_rows * best.tokens:
                best = layout
            break
    return best


def layout_at(
    lengths: Sequence[int],
    tokens: int,
    micro_batch: int,
    segments_per_row: Callable[[int], int | None],
    device_iterations: int = 1,
    replicas: int = 1,
) -> RowLayout | None:
    """These sequences in rows of ``tokens`` at ``micro_batch`` rows per micro-batch, however many rows they
    fill (the rows beyond one step run as further steps); None when one is longer than the row."""
    segments = segments_per_row(tokens)
    placements = first_fit_decreasing(lengths, tokens, segments)
    if placements is None:
        return None
    return _row_layout(tokens, segments, placements, micro_batch, device_iterations, replicas)


def _row_layout(
    tokens: int,
    segments: int | None,
    placements: Sequence[Placement],
    micro: int,
    device_iterations: int,
    replicas: int,
) -> RowLayout:
    rows = 1 + max(p.row for p in placements)
    computed = plan_steps(rows, micro, device_iterations, replicas).padded_samples
    return RowLayout(tokens, segments or 1, tuple(placements), rows, micro, computed)


class PackedRunner:
    """Runs the sequences of a group of calls as packed rows of one compiled packed graph."""

    def __init__(
        self,
        interface: PackedGraphInterface,
        table: ExecutableTable,
        *,
        row_counts: Sequence[int],
        row_lengths: Sequence[int],
        fills: Mapping[str, int],
        output_dtypes: Mapping[str, np.dtype],
        device_iterations: int = 1,
        replicas: int = 1,
        trimming_proven: Callable[[], bool],
        may_compile: Callable[[Mapping[str, tuple[int, ...]]], bool] = lambda shapes: True,
        planner: ServingPlanner | None = None,
    ) -> None:
        self.interface = interface
        self._table = table
        self._row_counts = tuple(sorted(row_counts))
        self._row_lengths = tuple(sorted(row_lengths))
        self._fills = dict(fills)
        self._output_dtypes = dict(output_dtypes)
        self._device_iterations = device_iterations
        self._replicas = replicas
        self._trimming_proven = trimming_proven
        self._may_compile = may_compile
        #: With ``serving_plan="cost"``: the few fixed layouts groups are packed into.
        self._plan = (
            None
            if planner is None
            else planner.packed_plan(
                self._row_lengths,
                self._row_counts,
                lambda rows, micro: plan_steps(rows, micro, device_iterations, replicas).padded_samples,
            )
        )

    @property
    def table(self) -> ExecutableTable:
        return self._table

    @property
    def plan(self):  # -> serving_plan.PackedPlan | None
        """The serving plan's packed layouts (``serving_plan="cost"``), or None."""
        return self._plan

    @property
    def longest_row(self) -> int:
        return self._row_lengths[-1]

    def segments_per_row(self, tokens: int) -> int | None:
        """Slots per row of a graph with pooled outputs; None (no limit) for one without."""
        return max(1, tokens // TOKENS_PER_SEGMENT) if self.interface.pooled_outputs else None

    # -- which calls pack --------------------------------------------------------------------------

    def lengths(self, feed: Mapping[str, np.ndarray]) -> list[int] | None:
        """The real length of each row of ``feed``, or None when the call cannot be packed (it then runs
        unpacked): inputs other than the token inputs and the mask, rows that are not right-padded, a
        padded row where the padding proof does not hold, or a row longer than the longest packed row."""
        interface = self.interface
        if set(feed) != {*interface.token_inputs, interface.mask_input}:
            return None
        mask = np.asarray(feed[interface.mask_input])
        if mask.ndim != 2 or mask.shape[0] == 0 or mask.shape[1] == 0:
            return None
        if any(np.asarray(feed[name]).shape != mask.shape for name in interface.token_inputs):
            return None
        real = mask != 0
        lengths = real.sum(axis=1)
        if not (real == (np.arange(mask.shape[1])[None, :] < lengths[:, None])).all() or lengths.min() == 0:
            return None
        if lengths.max() > self.longest_row:
            return None
        if lengths.min() < mask.shape[1] and not self._trimming_proven():
            return None
        return [int(length) for length in lengths]

    # -- one packed run ----------------------------------------------------------------------------

    def layout(self, lengths: Sequence[int]) -> RowLayout:
        """The compiled row length and count that compute the fewest tokens for these sequences, among the
        executables the session may still compile (``max_executables``)."""
        if max(lengths) > self.longest_row:
            raise ValueError(f"a sequence is longer than the longest packed row ({self.longest_row} tokens)")
        if self._plan is not None:
            return self._planned_layout(lengths)
        layout = self._best_layout(
            lengths, lambda tokens, micro: self._may_compile(self._shapes(tokens, micro))
        )
        if layout is None:
            raise ExecutableLimitError(
                f"packed rows for sequences of {sorted(lengths, reverse=True)} tokens need a new executable, "
                f"and the session may compile no more (max_executables); raise max_executables"
            )
        return layout

    def _best_layout(self, lengths: Sequence[int], allowed: Callable[[int, int], bool]) -> RowLayout | None:
        """``choose_layout`` over this runner's row counts and lengths, among the layouts ``allowed``."""
        return choose_layout(
            lengths,
            self._row_counts,
            self._row_lengths,
            self.segments_per_row,
            self._device_iterations,
            self._replicas,
            allowed=allowed,
        )

    def _planned_layout(self, lengths: Sequence[int]) -> RowLayout:
        """The planned layout of these sequences when it is compiled (or kept in the cache); else the best
        compiled one while the planned one compiles in the background; else the first layout, which
        serves every group (``serving_plan.PackedPlan.first_layout``)."""
        plan = self._plan
        assert plan is not None
        layouts = plan.plan

        def best(allowed: Callable[[int, int], bool]) -> RowLayout | None:
            return self._best_layout(lengths, allowed)

        def ready(tokens: int, micro: int) -> bool:
            return self._table.has(self._shapes(tokens, micro), {})

        ideal = best(lambda tokens, micro: (tokens, micro) in layouts)
        if ideal is not None and (
            (ideal.tokens, ideal.micro_batch) in plan.from_cache or ready(ideal.tokens, ideal.micro_batch)
        ):
            return ideal
        compiled = best(ready)
        if compiled is None:  # the first layout serves any group, its rows as further steps
            tokens, micro = plan.first_layout
            first = layout_at(
                lengths, tokens, micro, self.segments_per_row, self._device_iterations, self._replicas
            )
            assert first is not None, "the longest rows hold every sequence that packs"
            if not ready(tokens, micro):
                # the planned layout starts once this one is built (the next group finds it compiled)
                return first
            compiled = first
        if ideal is not None:
            shapes = self._shapes(ideal.tokens, ideal.micro_batch)
            plan.compile_later(
                ("packed", ideal.tokens, ideal.micro_batch),
                lambda: self._table.entry_for(shapes, {}, background=True),
            )
        return compiled

    def _shapes(self, tokens: int, micro: int) -> dict[str, tuple[int, ...]]:
        """The compiled input shapes of packed steps of ``micro`` rows of ``tokens`` tokens."""
        segments = self.segments_per_row(tokens) or 1
        return {
            name: (micro, segments) if name == self.interface.segment_starts else (micro, tokens)
            for name in self.interface.input_dtypes
        }

    def run(
        self,
        calls: Sequence[tuple[Mapping[str, np.ndarray], Sequence[str], Sequence[int]]],
        clients: int | None = None,
    ) -> list[list[np.ndarray]]:
        """The outputs of each call ``(feed, output names, row lengths)``, all run as packed rows.
        ``clients``: how many callers the dynamic batcher counted outstanding at once (the serving plan
        replays its traffic with that many)."""
        sequences = [
            (call, row, length)
            for call, (_, _, lengths) in enumerate(calls)
            for row, length in enumerate(lengths)
        ]
        if self._plan is not None:  # the plan learns from every group; what it dropped is released
            for tokens, micro in sorted(
                self._plan.record([tuple(lengths) for _, _, lengths in calls], clients)
            ):
                if self._table.has(self._shapes(tokens, micro), {}):
                    self._table.release(self._shapes(tokens, micro), {})
        layout = self.layout([length for _, _, length in sequences])
        packed = self._packed_feed(calls, sequences, layout)
        outputs = self._run_rows(packed, layout)
        return [
            self._call_outputs(call, feed, names, lengths, sequences, layout, outputs)
            for call, (feed, names, lengths) in enumerate(calls)
        ]

    def _packed_feed(
        self,
        calls: Sequence[tuple[Mapping[str, np.ndarray], Sequence[str], Sequence[int]]],
        sequences: Sequence[tuple[int, int, int]],
        layout: RowLayout,
    ) -> dict[str, np.ndarray]:
        interface = self.interface
        shape = (layout.rows, layout.tokens)
        feed = {
            name: np.full(shape, self._fills.get(name, 0), dtype=interface.input_dtypes[name])
            for name in interface.token_inputs
        }
        segment_ids = np.zeros(shape, dtype=np.int64)
        positions = np.zeros(shape, dtype=np.int64)
        starts = np.zeros((layout.rows, layout.segments), dtype=np.int64)
        for (call, row, length), place in zip(sequences, layout.placements, strict=True):
            span = slice(place.start, place.start + length)
            for name in interface.token_inputs:
                feed[name][place.row, span] = np.asarray(calls[call][0][name])[row, :length]
            segment_ids[place.row, span] = place.segment + 1
            positions[place.row, span] = np.arange(length)
            if interface.pooled_outputs:
                starts[place.row, place.segment] = place.start
        made = {interface.segment_ids: segment_ids, interface.position_ids: positions}
        if interface.pooled_outputs:
            made[interface.segment_starts] = starts
        for name, array in made.items():
            if name in interface.input_dtypes:
                feed[name] = array.astype(interface.input_dtypes[name], copy=False)
        return feed

    def _run_rows(self, feed: dict[str, np.ndarray], layout: RowLayout) -> dict[str, np.ndarray]:
        micro = layout.micro_batch
        plan = plan_steps(layout.rows, micro, self._device_iterations, self._replicas)
        shapes = {name: (micro, *array.shape[1:]) for name, array in feed.items()}
        steps = [self._table.run_step(shapes, {}, step) for step in split_feed(feed, plan)]
        return merge_outputs(steps, plan)

    def _call_outputs(
        self,
        call: int,
        feed: Mapping[str, np.ndarray],
        names: Sequence[str],
        lengths: Sequence[int],
        sequences: Sequence[tuple[int, int, int]],
        layout: RowLayout,
        outputs: Mapping[str, np.ndarray],
    ) -> list[np.ndarray]:
        interface = self.interface
        width = np.asarray(feed[interface.mask_input]).shape[1]
        mine = [
            (row, length, place)
            for (c, row, length), place in zip(sequences, layout.placements, strict=True)
            if c == call
        ]
        results = []
        for name in names:
            packed = outputs[name]
            if name in interface.token_outputs:
                axis = interface.token_outputs[name]
                shape = list(packed.shape)
                shape[0], shape[axis] = len(lengths), width
                result = np.zeros(shape, dtype=packed.dtype)  # masked positions: zeros, as trim_padding
                for row, length, place in mine:
                    source = [place.row] + [slice(None)] * (packed.ndim - 1)
                    source[axis] = slice(place.start, place.start + length)
                    target = [row] + [slice(None)] * (packed.ndim - 1)
                    target[axis] = slice(0, length)
                    result[tuple(target)] = packed[tuple(source)]
            else:
                axis = interface.pooled_outputs[name]
                result = np.stack(
                    [np.take(packed[place.row], place.segment, axis=axis - 1) for _, _, place in mine]
                )
            results.append(to_host_dtype(np.ascontiguousarray(result), self._output_dtypes[name]))
        return results
