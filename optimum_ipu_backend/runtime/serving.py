"""Serving dynamic callers from a few compiled shapes.

Per call: infer every dimension from the feed; pick for each the smallest compiled size that holds it;
keep only the padding the padding proof shows invisible in every real output element
(``runtime.padding``); pad; cut the batch into device steps of ``micro_batch x
device_iterations x replicas`` laid out as PopART takes them; run each step; and keep, in every
output, the elements the proof says are real. Which axes of an output carry which dimension is found
by dataflow, never from the names the exporter gave them; inputs that share a dimension name at
different sizes are served with those axes as dimensions of their own (``padding.separate_labels``).
A dimension compiled at exact sizes is bounded only by the model's own limit, and whether a call is
served never depends on what the cache holds (``runtime.padding``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from optimum_ipu_backend.errors import DeviceError
from optimum_ipu_backend.runtime.boundary import to_host_dtype
from optimum_ipu_backend.runtime.buckets import BucketPlan
from optimum_ipu_backend.runtime.carried_state import CarriedState
from optimum_ipu_backend.runtime.device_steps import merge_outputs, plan_steps, split_feed
from optimum_ipu_backend.runtime.executables import ExecutableTable
from optimum_ipu_backend.runtime.feed_preconditions import check_token_counts
from optimum_ipu_backend.runtime.padding import (
    EXACT_PREFIX,
    DimensionMismatchError,
    PaddingDecisions,
    SymbolicShape,
    cut_output,
    generated_mask,
    infer_dims,
    inputs_for_dims,
    pad_feed,
    separate_labels,
)
from optimum_ipu_backend.runtime.roles import InputRole, input_role, is_batch_dim, is_past_dim, text_dims

if TYPE_CHECKING:
    from optimum_ipu_backend.compiler.graph_rewrites.eos_selection import SameTokenCount
    from optimum_ipu_backend.runtime.serving_plan import GroupKey, ServingPlanner


class ExecutableLimitError(DeviceError):
    """A call needs a new executable and the session may compile no more (``max_executables``)."""


@dataclass(frozen=True)
class ServingConfig:
    plan: BucketPlan
    #: What a padded position of each input holds (``roles.fill_value``).
    fills: dict[str, int | str] = field(default_factory=dict)
    max_position_id: int | None = None
    device_iterations: int = 1
    replicas: int = 1
    left_padded_dims: tuple[str, ...] = ()
    # inputs the runtime itself adds (e.g. the past-padding mask): name -> dimension it masks
    generated_masks: tuple[tuple[str, str], ...] = ()
    # Opt-in: group rows by real length and skip the padding they share. Outputs at masked positions
    # are then zeros instead of what the model computes for padding tokens.
    trim_padding: bool = False
    #: How many executables the session may compile; None: no cap.
    max_executables: int | None = None
    #: Token counts the served graph needs of every call (``feed_preconditions``; a dense end-of-sentence
    #: selection).
    token_counts: tuple[SameTokenCount, ...] = ()
    #: Keep a decoder's key/value cache on the device between steps (``runtime.carried_state``).
    kv_cache_on_device: bool = True


def _batch_axis(shape: SymbolicShape) -> int | None:
    for axis, dim in enumerate(shape):
        if isinstance(dim, str) and is_batch_dim(dim):
            return axis
    return None


def aligned_samples(actual: Mapping[str, int]) -> int | None:
    """The samples a call's batch dimensions share, which device steps cut and fill up; None when it has no
    batch dimension, or when its batch dimensions differ in size (CLIP scores 2 images against 3 texts:
    ``image_batch_size`` and ``text_batch_size``), whose rows do not belong together, so that cutting or
    repeating them along one axis would pair an image with the wrong texts. Such a call runs whole in
    one micro-batch, each batch dimension compiled at the size it comes in."""
    sizes = {size for dim, size in actual.items() if is_batch_dim(dim)}
    return sizes.pop() if len(sizes) == 1 else None


class StaticShapeRunner:
    """Runs a feed of any supported size on fixed-shape executables and returns exact results."""

    def __init__(
        self,
        table: ExecutableTable,
        input_shapes: Mapping[str, SymbolicShape],
        output_dtypes: Mapping[str, np.dtype],
        config: ServingConfig,
        decisions: PaddingDecisions,
        planner: ServingPlanner | None = None,
    ) -> None:
        self._table = table
        #: With ``serving_plan="cost"``: which compiled size serves each call (``runtime.serving_plan``).
        self.planner = planner
        self._input_shapes = dict(input_shapes)
        self._output_dtypes = dict(output_dtypes)
        self._config = config
        self._decisions = decisions
        self._carriers = inputs_for_dims(self._input_shapes)
        self._batch_axes = {name: _batch_axis(shape) for name, shape in self._input_shapes.items()}
        self._past_inputs = [name for name in self._input_shapes if input_role(name) is InputRole.PAST]
        masks = [name for name in self._input_shapes if input_role(name) is InputRole.ATTENTION_MASK]
        # trim_padding applies to encoders: one [batch, sequence] attention mask and no past
        self._trim_mask = (
            masks[0]
            if len(masks) == 1
            and len(self._input_shapes[masks[0]]) == 2
            and _batch_axis(self._input_shapes[masks[0]]) == 0
            and not self._past_inputs
            else None
        )
        if not self._table.branch_inputs:
            # Verdicts now, where every dimension has compiled sizes: an axis compiled per length is
            # reported (at WARNING) when the session is created, not at its first call. Text dimensions
            # wait for the first call: proving them here would cost a text model's session most of a
            # second on a cold cache (tiny BERT 1.4 s, all-MiniLM-L6-v2 0.7 s).
            generated = dict(config.generated_masks)  # masks the runtime makes carry no text
            text = text_dims(
                {name: shape for name, shape in self._input_shapes.items() if name not in generated}
            )
            self._decisions.settle(dims=[dim for dim in config.plan.dims if dim not in text])
        self._carried = CarriedState.for_runner(self) if config.kv_cache_on_device else None
        self._token_input = next(
            (name for name in self._input_shapes if input_role(name) is InputRole.TOKEN_IDS), None
        )
        if planner is not None:
            planner.positions = self._planned_positions
            if self._carried is not None:
                planner.reserved = 1  # the decode executable stays resident beside the planned ones
                planner.steps_refused = self._steps_refused

    @property
    def plan(self) -> BucketPlan:
        return self._config.plan

    @property
    def config(self) -> ServingConfig:
        return self._config

    @property
    def input_shapes(self) -> dict[str, SymbolicShape]:
        return self._input_shapes

    @property
    def output_dtypes(self) -> dict[str, np.dtype]:
        return self._output_dtypes

    @property
    def decisions(self) -> PaddingDecisions:
        return self._decisions

    @property
    def cache_description(self) -> str:
        return self._table.cache_description

    @property
    def executables(self) -> ExecutableTable:
        """The runner's table: its cache keys are the ones calls look up (ahead-of-time compiles use it)."""
        return self._table

    @property
    def input_batch_axes(self) -> dict[str, int | None]:
        """Which axis of each input carries the batch (None: none), from the declared shapes."""
        return dict(self._batch_axes)

    def output_batch_axes(self, feed: Mapping[str, np.ndarray]) -> dict[str, int | None]:
        """Which axis of each output carries the batch for calls like ``feed``, found by dataflow (the
        batch's padding proof); empty when the graph mixes the samples of a batch."""
        _, actual = self.call_dims(feed)
        return self._decisions.output_batch_axes(actual, {})

    def rows_per_step(self) -> int:
        """The samples one device step holds: the largest micro-batch times device iterations and
        replicas (1 for a graph without a batch dimension)."""
        config = self._config
        batch = [self.plan.largest(dim) for dim in self.plan.sizes if is_batch_dim(dim)]
        return max(batch, default=1) * config.device_iterations * config.replicas

    def statistics(self) -> list[dict[str, object]]:
        """Each compiled executable with its shapes, origin, load time and the calls it served."""
        return self._table.statistics()

    def padding_verdicts(self) -> dict[str, str]:
        """Per dimension tried so far, whether it is padded (proven) or compiled exactly, and why."""
        return self._decisions.verdicts()

    def kv_cache_verdict(self) -> str | None:
        """Where a decoder's key/value cache is kept between steps, and why; None for other graphs."""
        return None if self._carried is None else self._carried.verdict

    def run(self, feed: Mapping[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        check_token_counts(self._config.token_counts, feed)  # the caller's own rows, before anything
        if self._carried is not None:
            if self._steps_shared():
                self._carried.release()  # its IPUs go to the planned executables
            else:
                outputs = self._carried.run(feed, output_names)
                if outputs is not None:
                    if self.planner is not None:
                        self._count_step(feed)
                    return outputs
        lengths = self._row_lengths(feed) if self._config.trim_padding else None
        if lengths is not None:
            return self._run_regrouped(feed, output_names, lengths)
        return self._run_exact(feed, output_names)

    # -- one call ---------------------------------------------------------------------------------

    def _run_exact(
        self,
        feed: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        dims: tuple[dict[str, SymbolicShape], dict[str, int]] | None = None,
    ) -> list[np.ndarray]:
        """``dims``: the call's shapes and dimension sizes (``call_dims``) when the caller found them."""
        branches = {name: bool(np.asarray(feed[name]).reshape(-1)[0]) for name in self._table.branch_inputs}
        feed = {name: array for name, array in feed.items() if name not in branches}
        if branches and not all(branches.values()):
            feed = self._placeholder_past(feed)  # a merged decoder called without its cache
        shapes, actual = self.call_dims(feed) if dims is None else dims
        samples = aligned_samples(actual)
        wanted = self.compiled_sizes(actual, branches)
        proof_actual = dict(actual)
        micro = None
        if samples is not None:
            micro = self._micro_batch(samples)
            for dim in (d for d in actual if is_batch_dim(d)):
                # The micro-batch with the fewest real samples is the one whose padding matters.
                proof_actual[dim] = samples if samples < micro else (samples % micro or micro)
                wanted[dim] = micro
        if self.planner is not None and shapes is self._input_shapes and all(branches.values()):
            step = self._carried is not None and self._carried.is_step(actual)
            wanted = self._planned(wanted, actual, micro, branches, step)
        call = self._decisions.decide(proof_actual, wanted, feed, branches, shapes)
        if samples is not None and not call.batch_paddable:
            micro = samples  # the graph mixes samples: run them all in one micro-batch, no repeats
        targets = {dim: size for dim, size in call.dims.items() if not is_batch_dim(dim)}
        padded_feed = {
            **self.padded(feed, shapes, targets, actual),
            **self.generated_masks(shapes, actual, targets),
        }
        outputs = self._run_batched(padded_feed, samples, micro, branches, proof_actual, call.batch_paddable)
        return [
            to_host_dtype(
                np.asarray(cut_output(outputs[name], call.cuts.get(name, ())), order="C"),
                self._output_dtypes[name],
            )
            for name in output_names
        ]

    def _planned(
        self,
        wanted: dict[str, int],
        actual: Mapping[str, int],
        micro: int | None,
        branches: Mapping[str, bool],
        step: bool = False,
    ) -> dict[str, int]:
        """``wanted`` with the padded sizes the serving plan serves this call at: its planned executable,
        or one already compiled that holds it while the planned one compiles in the background. ``step``:
        a decoding step (served by the plan in the SHARED arrangement)."""
        assert self.planner is not None
        key = self._plan_key(wanted, actual, micro, branches)
        if key is None:
            return wanted
        padded = key.padded
        batch = {dim: micro for dim in actual if is_batch_dim(dim) and micro is not None}

        def shapes_of(sizes: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
            return self.shapes_at({**key.values(sizes), **batch}, branches)

        def build(sizes: tuple[int, ...]) -> None:
            self._table.entry_for(shapes_of(sizes), branches, background=True)

        sizes = self.planner.targets(
            key,
            tuple(wanted[dim] for dim in padded),
            ready=lambda sizes: self._table.has(shapes_of(sizes), branches),
            build=build,
            release=lambda sizes: self._table.release(shapes_of(sizes), branches),
            load=lambda sizes: self._table.load(shapes_of(sizes), branches),
            step=step,
        )
        return {**wanted, **dict(zip(padded, sizes, strict=True))}

    def _plan_key(
        self,
        wanted: Mapping[str, int],
        actual: Mapping[str, int],
        micro: int | None,
        branches: Mapping[str, bool],
    ) -> GroupKey | None:
        """The serving plan's group of a call (None: it pads no dimension but the batch)."""
        from optimum_ipu_backend.runtime.serving_plan import GroupKey

        padded = tuple(sorted(dim for dim in wanted if not is_batch_dim(dim)))
        if not padded:
            return None
        exact = tuple(sorted((d, s) for d, s in actual.items() if d not in wanted and not is_batch_dim(d)))
        return GroupKey(micro, tuple(sorted(branches.items())), exact, padded)

    def _planned_positions(self, key: GroupKey, sizes: tuple[int, ...]) -> int:
        """Positions one run of the group's executable at ``sizes`` computes: its token input's elements
        (the product of its sizes and the micro-batch when it has none, or its shape is not known)."""
        from optimum_ipu_backend.runtime.dim_expressions import DimExpression

        values = key.values(sizes)
        micro = key.micro or 1
        shape = () if self._token_input is None else self._input_shapes[self._token_input]
        if not shape or any(dim is None for dim in shape):
            return math.prod(values.values()) * micro
        batch = {dim: micro for dim in self.plan.sizes if is_batch_dim(dim)}
        try:
            return math.prod(
                dim if isinstance(dim, int) else DimExpression.parse(dim).evaluate({**values, **batch})
                for dim in shape
            )
        except KeyError:  # a dimension the group does not size
            return math.prod(values.values()) * micro

    # -- decoding steps and the serving plan --------------------------------------------------------

    def _steps_shared(self) -> bool:
        """Whether the serving plan serves decoding steps on its own executables (``serving_plan``'s
        SHARED arrangement) instead of the decode executable."""
        from optimum_ipu_backend.runtime.serving_plan import SHARED

        return self.planner is not None and self.planner.decode_arrangement == SHARED

    def _steps_refused(self) -> str | None:
        """Why decoding steps cannot run on the executables that serve the prompts: the padding proof keeps
        the new tokens (a step brings one, a prompt many) or the past (a prompt brings none) exact."""
        assert self._carried is not None
        for dim in sorted(self._carried.padded_dims):
            if self._decisions.is_exact(dim):
                return f"{dim} is compiled at the size it comes in ({self._decisions.verdicts().get(dim)})"
        return None

    def _count_step(self, feed: Mapping[str, np.ndarray]) -> None:
        """Count a step the decode executable served in the plan's group its call would join."""
        assert self.planner is not None
        branches = {name: bool(np.asarray(feed[name]).reshape(-1)[0]) for name in self._table.branch_inputs}
        _, actual = self.call_dims({name: array for name, array in feed.items() if name not in branches})
        samples = aligned_samples(actual)
        wanted = self.compiled_sizes(actual, branches)
        micro = None if samples is None else self._micro_batch(samples)
        key = self._plan_key(wanted, actual, micro, branches)
        if key is not None:
            self.planner.count_step(key, tuple(wanted[dim] for dim in key.padded))

    def shapes_at(
        self, values: Mapping[str, int], branches: Mapping[str, bool]
    ) -> dict[str, tuple[int, ...]]:
        """The input shapes of the executable at these dimension sizes (branch inputs are not fed)."""
        from optimum_ipu_backend.runtime.dim_expressions import DimExpression

        return {
            name: tuple(
                dim if isinstance(dim, int) else DimExpression.parse(dim).evaluate(values) for dim in shape
            )
            for name, shape in self._input_shapes.items()
            if name not in branches
        }

    def padded(
        self,
        feed: Mapping[str, np.ndarray],
        shapes: Mapping[str, SymbolicShape],
        targets: Mapping[str, int],
        actual: Mapping[str, int],
    ) -> dict[str, np.ndarray]:
        """``feed`` padded to the ``targets`` sizes of its dimensions, each input with the fill its role
        gives (``ServingConfig.fills``), on the side its dimension is padded."""
        config = self._config
        return pad_feed(
            feed,
            shapes,
            targets,
            actual_dims=actual,
            fill_values=config.fills,
            left_padded_dims=config.left_padded_dims,
            max_position_id=config.max_position_id,
        ).feed

    def generated_masks(
        self, shapes: Mapping[str, SymbolicShape], actual: Mapping[str, int], targets: Mapping[str, int]
    ) -> dict[str, np.ndarray]:
        """The masks the runtime makes itself, made at once at the sizes this call runs at (the batch
        unpadded: device steps fill it up)."""
        left = self._config.left_padded_dims
        return {
            name: generated_mask(shapes[name], actual, targets, left)
            for name, _ in self._config.generated_masks
        }

    def call_dims(self, feed: Mapping[str, np.ndarray]) -> tuple[dict[str, SymbolicShape], dict[str, int]]:
        """The inputs' shapes for this call and the size of every dimension. Inputs that share a
        dimension name but disagree in size are served with those axes as dimensions of their own,
        compiled at their sizes (``padding.separate_labels``): names are labels, only dataflow ties sizes."""
        try:
            return self._input_shapes, infer_dims(feed, self._input_shapes)
        except DimensionMismatchError:
            laid_out = (*self._config.left_padded_dims, *(dim for _, dim in self._config.generated_masks))
            shapes = separate_labels(feed, self._input_shapes, keep=laid_out)
            if shapes is None:
                raise
            return dict(shapes), infer_dims(feed, shapes)

    def compiled_sizes(self, actual: Mapping[str, int], branches: Mapping[str, bool]) -> dict[str, int]:
        """The compiled size of every planned dimension this call pads. A dimension whose verdict is
        exact is limited only by the model's own limit; a padded one past its plan is refused naming the
        option that raises it. Verdicts depend on the graph alone (``runtime.padding``), so the same
        call gets the same answer whatever ran before."""
        wanted = {}
        for dim, size in actual.items():
            if dim not in self.plan.sizes or is_batch_dim(dim):
                continue
            if self._decisions.is_exact(dim, actual, branches):
                self.plan.check_exact(dim, size, self._carriers.get(dim))
            else:
                wanted[dim] = self.plan.choose(dim, size, self._carriers.get(dim))
        return wanted

    def _micro_batch(self, samples: int) -> int:
        per_step = self._config.device_iterations * self._config.replicas
        batch_dim = next(dim for dim in self.plan.sizes if is_batch_dim(dim))
        wanted = min(-(-samples // per_step), self.plan.largest(batch_dim))
        return self.plan.choose(batch_dim, wanted, self._carriers.get(batch_dim))

    def _run_batched(
        self,
        feed: dict[str, np.ndarray],
        samples: int | None,
        micro: int | None,
        branches: Mapping[str, bool],
        actual: Mapping[str, int],
        batch_paddable: bool,
    ) -> dict[str, np.ndarray]:
        config = self._config
        if samples is None:  # nothing batched: every input goes whole to one micro-batch
            samples, micro = 1, 1
            input_axes: dict[str, int | None] = dict.fromkeys(feed)
        else:
            input_axes = {name: self._batch_axes.get(name) for name in feed}
        assert micro is not None
        plan = plan_steps(samples, micro, config.device_iterations, config.replicas)
        if not batch_paddable and plan.padding:
            raise ValueError(
                f"this graph mixes the samples of a batch, so a call of {samples} samples cannot be filled "
                f"up to whole device steps of {plan.samples_per_step}; call it with a multiple of "
                f"device_iterations x replication_factor samples"
            )
        shapes = {}
        for name, array in feed.items():
            shape = list(array.shape)
            if input_axes[name] is not None:
                shape[input_axes[name]] = micro  # type: ignore[index]
            shapes[name] = tuple(shape)
        self.check_limit(shapes, branches)
        step_outputs = [
            self._table.run_step(shapes, branches, step)
            for step in split_feed(feed, plan, batch_axes=input_axes)
        ]
        if plan.steps == 1 and plan.samples_per_step == 1:
            return {name: array[0, 0] for name, array in step_outputs[0].items()}
        batched = any(axis is not None for axis in input_axes.values())
        output_axes = self._decisions.output_batch_axes(actual, branches) if batched else {}
        return merge_outputs(
            step_outputs, plan, batch_axes={name: output_axes.get(name) for name in step_outputs[0]}
        )

    def check_limit(self, shapes: Mapping[str, tuple[int, ...]], branches: Mapping[str, bool]) -> None:
        """``ExecutableLimitError`` when these shapes need a new executable and ``max_executables`` are
        compiled already, naming why calls compile so many."""
        cap = self._config.max_executables
        if cap is None or self._table.has(shapes, branches) or self._table.count < cap:
            return
        why = "; ".join(
            f"{dim} is compiled at the size it comes in because {verdict.removeprefix(EXACT_PREFIX)}"
            for dim, verdict in self._decisions.verdicts().items()
            if verdict.startswith(EXACT_PREFIX)
        )
        raise ExecutableLimitError(
            f"this call needs a new executable for input shapes {dict(shapes)}, but the session has compiled "
            f"{self._table.count} and max_executables={cap}: "
            f"{why or 'every compiled size of the bucket plan has been used'}. Raise max_executables, or "
            "give sizes the calls fit (sequence_lengths=..., batch_size=...)"
        )

    # -- what the runtime feeds besides the caller's inputs ----------------------------------------

    def _placeholder_past(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """optimum's merged decoder without its cache gets placeholder (often empty) past tensors that the
        branch compiled for the call never reads; give them one position so every shape is consistent."""
        others = {name: array for name, array in feed.items() if name not in self._past_inputs}
        known = infer_dims(others, self._input_shapes)
        for name in self._past_inputs:
            if name in feed:
                shape = [
                    (1 if is_past_dim(dim) else known.get(dim, dim)) if isinstance(dim, str) else dim
                    for dim in self._input_shapes[name]
                ]
                others[name] = np.zeros(shape, dtype=feed[name].dtype)
        return others

    # -- trim_padding ------------------------------------------------------------------------------

    def _row_lengths(self, feed: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """Real lengths of right-padded rows of an encoder call, or None when trimming does not apply."""
        if self._trim_mask is None or self._trim_mask not in feed:
            return None
        mask = np.asarray(feed[self._trim_mask]) != 0
        if mask.ndim != 2 or mask.shape[0] == 0:
            return None
        lengths = mask.sum(axis=1)
        right_padded = (mask == (np.arange(mask.shape[1])[None, :] < lengths[:, None])).all()
        return lengths if right_padded and lengths.min() > 0 else None

    def _run_regrouped(
        self, feed: Mapping[str, np.ndarray], output_names: Sequence[str], lengths: np.ndarray
    ) -> list[np.ndarray]:
        """Rows that fall in one sequence bucket run together, cut to the longest of them."""
        mask_name = self._trim_mask
        assert mask_name is not None
        sequence_dim = str(self._input_shapes[mask_name][1])
        full_length = np.asarray(feed[mask_name]).shape[1]
        groups: dict[int, list[int]] = {}
        for row, length in enumerate(lengths):
            bucket = (
                self.plan.choose(sequence_dim, int(length), mask_name)
                if sequence_dim in self.plan.sizes
                else int(length)
            )
            groups.setdefault(bucket, []).append(row)
        actual = infer_dims(feed, self._input_shapes)
        sequence_axes = self._decisions.output_axes(sequence_dim, actual, {})
        if not sequence_axes:  # padding this sequence is not proven invisible: trimming it is not either
            return self._run_exact(feed, output_names, (self._input_shapes, actual))
        parts = []
        for rows in groups.values():
            width = int(lengths[rows].max())
            sub_feed = {}
            for name, array in feed.items():
                shape = self._input_shapes.get(name, ())
                part = np.asarray(array)
                if self._batch_axes.get(name) == 0:
                    part = part[rows]
                for axis, dim in enumerate(shape):
                    if dim == sequence_dim:
                        part = np.take(part, np.arange(width), axis=axis)
                sub_feed[name] = part
            # cut rows must still meet what the served graph needs of a feed, checked before any group runs
            check_token_counts(self._config.token_counts, sub_feed)
            parts.append((rows, width, sub_feed))
        results: list[np.ndarray | None] = [None] * len(output_names)
        for rows, width, sub_feed in parts:
            for index, (name, output) in enumerate(
                zip(output_names, self._run_exact(sub_feed, output_names), strict=True)
            ):
                axis = sequence_axes.get(name)
                if results[index] is None:
                    full = list(output.shape)
                    full[0] = len(lengths)
                    if axis is not None:
                        full[axis] = full_length
                    results[index] = np.zeros(full, dtype=output.dtype)
                selector: list[Any] = [slice(None)] * output.ndim
                selector[0] = rows
                if axis is not None:
                    selector[axis] = slice(0, width)
                results[index][tuple(selector)] = output  # type: ignore[index]
        masked = np.asarray(feed[mask_name]) == 0
        for name, result in zip(output_names, results, strict=True):
            axis = sequence_axes.get(name)
            if result is not None and axis == 1:
                result[masked] = 0  # one rule for every masked position, whichever group it ran in
        return results  # type: ignore[return-value]

    def compiled_shapes(
        self, fixed_dims: Mapping[str, int] | None = None
    ) -> list[tuple[dict[str, tuple[int, ...]], dict[str, bool]]]:
        """Every static signature ``(input shapes, branches)`` a call can compile: each combination of
        bucket sizes, merged-decoder branch and micro-batch (a call whose sizes equal buckets needs no
        padding, so its shapes are the symbolic shapes evaluated there). Dimensions no bucket plans, or
        compiled at exact sizes, take their size from ``fixed_dims`` (a size given for a bucketed dimension
        selects the bucket holding it); ``ValueError`` names those missing.
        For ahead-of-time compiles (``runtime.precompile``)."""
        import itertools

        from optimum_ipu_backend.runtime.dim_expressions import DimExpression

        symbols: set[str] = set()
        for shape in self._input_shapes.values():
            for dim in shape:
                if isinstance(dim, str):
                    symbols |= DimExpression.parse(dim).symbols
        given = dict(fixed_dims or {})
        branch_names = sorted(self._table.branch_inputs)
        branch_sets = [dict.fromkeys(branch_names, flag) for flag in (True, False)] if branch_names else [{}]
        signatures: dict[tuple, tuple[dict[str, tuple[int, ...]], dict[str, bool]]] = {}
        for branches in branch_sets:
            unsized = symbols - set(self.plan.sizes) - set(given)
            padded = (
                []
                if unsized
                else [d for d in self.plan.sizes if not self._decisions.is_exact(d, given, branches)]
            )
            # a size given for a padded dimension means "calls of that size": its bucket is what compiles
            fixed = {
                dim: self.plan.choose(dim, size) if dim in padded else size for dim, size in given.items()
            }
            planned = [d for d in padded if d not in fixed]
            missing = sorted(symbols - set(planned) - set(fixed))
            if missing:
                raise ValueError(
                    f"dimension(s) {', '.join(missing)} have no compiled sizes (they are compiled at the "
                    "size they come in); give each one a size to compile for"
                )
            uncached = bool(branches) and not all(branches.values())
            for sizes in itertools.product(*(self.plan.sizes[dim] for dim in planned)):
                values = {**fixed, **dict(zip(planned, sizes, strict=True))}
                if uncached:  # placeholder past of one position (``_placeholder_past``)
                    values.update({dim: 1 for dim in values if is_past_dim(dim)})
                shapes = self.shapes_at(values, branches)
                key = (tuple(sorted(shapes.items())), tuple(sorted(branches.items())))
                signatures.setdefault(key, (shapes, dict(branches)))
        return list(signatures.values())
