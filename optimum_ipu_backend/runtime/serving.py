"""Serving dynamic callers from a few compiled shapes.

Per call: infer every dimension from the feed, pad the dimensions a mask (or causality) hides to the
smallest compiled size that fits, cut the batch into device steps of ``micro_batch x device_iterations
x replicas`` laid out as PopART takes them, run each step, and slice every output back along its
dynamic axes. Dimensions no mask covers (image sizes, audio frames, a decoder's past without a
self-attention mask) are compiled at the size they come in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from optimum_ipu_backend.runtime.boundary import to_host_dtype
from optimum_ipu_backend.runtime.buckets import BucketPlan, is_batch_dim
from optimum_ipu_backend.runtime.device_steps import from_device_layout, plan_steps, to_device_layout
from optimum_ipu_backend.runtime.executables import ExecutableTable
from optimum_ipu_backend.runtime.padding import (
    DimExpression,
    SymbolicShape,
    infer_dims,
    inputs_for_dims,
    pad_feed,
    slice_outputs,
)

BATCH_DIM = "batch_size"
# A decoder's own sequence: positions after the real ones are hidden from them by causality.
CAUSAL_DIMS = ("decoder_sequence_length",)


def _symbols(shape: SymbolicShape) -> set[str]:
    names: set[str] = set()
    for dim in shape:
        if isinstance(dim, str):
            try:
                names |= DimExpression.parse(dim).symbols
            except ValueError:
                continue
    return names


def is_attention_mask(input_name: str) -> bool:
    """Whether an input hides positions from attention: padding relies on it along the dims it spans."""
    return input_name.endswith("attention_mask")


def bucketable_dims(input_shapes: Mapping[str, SymbolicShape], extra_masked: Sequence[str] = ()) -> list[str]:
    """Dimensions whose padding the graph hides: batch, any dimension an attention mask spans, a
    decoder's causal sequence, and dimensions the caller knows to be masked (``extra_masked``)."""
    all_dims: list[str] = []
    masked: set[str] = set(extra_masked)
    for name, shape in input_shapes.items():
        symbols = _symbols(shape)
        all_dims.extend(s for s in sorted(symbols) if s not in all_dims)
        if is_attention_mask(name):
            masked |= symbols
    chosen = [d for d in all_dims if is_batch_dim(d) or d in masked or d in CAUSAL_DIMS]
    # A sequence next to a past that cannot be padded is the one-token step of generation: padding it
    # would only compute (and return) extra tokens.
    return [d for d in chosen if not (f"past_{d}" in all_dims and f"past_{d}" not in chosen)]


@dataclass(frozen=True)
class ServingConfig:
    plan: BucketPlan
    pad_token_id: int | None = None
    max_position_id: int | None = None
    device_iterations: int = 1
    replicas: int = 1
    left_padded_dims: tuple[str, ...] = ()
    # inputs the runtime itself adds (e.g. the past-padding mask): name -> dimension it masks
    generated_masks: tuple[tuple[str, str], ...] = ()
    # Opt-in: group rows by real length and skip the padding they share. Outputs at masked positions
    # are then zeros instead of what the model computes for padding tokens.
    trim_padding: bool = False


def _batch_axis(shape: SymbolicShape) -> int | None:
    for axis, dim in enumerate(shape):
        if dim == BATCH_DIM:
            return axis
    return None


class StaticShapeRunner:
    """Runs a feed of any supported size on fixed-shape executables and returns exact results."""

    def __init__(
        self,
        table: ExecutableTable,
        input_shapes: Mapping[str, SymbolicShape],
        output_shapes: Mapping[str, SymbolicShape],
        output_dtypes: Mapping[str, np.dtype],
        config: ServingConfig,
    ) -> None:
        self._table = table
        self._input_shapes = dict(input_shapes)
        self._output_shapes = dict(output_shapes)
        self._output_dtypes = dict(output_dtypes)
        self._config = config
        self._carriers = inputs_for_dims(self._input_shapes)
        self._batch_axes = {name: _batch_axis(shape) for name, shape in self._input_shapes.items()}
        self._output_batch_axes = {name: _batch_axis(shape) for name, shape in self._output_shapes.items()}
        input_dims = set().union(*(_symbols(shape) for shape in self._input_shapes.values()))
        output_dims = set().union(*(_symbols(shape) for shape in self._output_shapes.values()))
        self._output_only_past_dims = sorted(d for d in output_dims - input_dims if d.startswith("past_"))
        # trim_padding applies to encoders whose mask is [batch, sequence] and that take no past
        self._trimmable = tuple(self._input_shapes.get("attention_mask", ())) == (
            BATCH_DIM,
            "sequence_length",
        ) and (not any(dim.startswith("past_") for dim in input_dims))

    @property
    def plan(self) -> BucketPlan:
        return self._config.plan

    @property
    def cache_description(self) -> str:
        return self._table.cache_description

    def statistics(self) -> list[dict[str, object]]:
        """Each compiled executable with its shapes, origin, load time and the calls it served."""
        return self._table.statistics()

    def _placeholder_past(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """optimum's merged decoder without its cache gets placeholder (often empty) past tensors that the
        branch compiled for the call never reads; give them one position so every shape is consistent."""
        others = {name: array for name, array in feed.items() if not name.startswith("past_key_values")}
        known = infer_dims(others, self._input_shapes)
        for name in feed:
            if name.startswith("past_key_values"):
                shape = [
                    1
                    if isinstance(dim, str) and dim.startswith("past_")
                    else known.get(dim, dim)
                    if isinstance(dim, str)
                    else dim
                    for dim in self._input_shapes[name]
                ]
                others[name] = np.zeros(shape, dtype=feed[name].dtype)
        return others

    def _with_generated_masks(self, feed: dict[str, np.ndarray], actual: Mapping[str, int]) -> None:
        for mask_name, dim in self._config.generated_masks:
            batch = actual.get(BATCH_DIM, 1)
            feed[mask_name] = np.ones((batch, actual[dim]), dtype=np.int64)

    def run(self, feed: Mapping[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        lengths = self._row_lengths(feed) if self._config.trim_padding else None
        if lengths is not None:
            return self._run_regrouped(feed, output_names, lengths)
        return self._run_exact(feed, output_names)

    def _row_lengths(self, feed: Mapping[str, np.ndarray]) -> np.ndarray | None:
        """Real lengths of right-padded rows of an encoder call, or None when trimming does not apply."""
        if not self._trimmable or "attention_mask" not in feed:
            return None
        mask = np.asarray(feed["attention_mask"]) != 0
        lengths = mask.sum(axis=1)
        right_padded = (mask == (np.arange(mask.shape[1])[None, :] < lengths[:, None])).all()
        return lengths if right_padded and lengths.min() > 0 else None

    def _has_sequence_axis(self, output_name: str) -> bool:
        shape = self._output_shapes[output_name]
        return len(shape) > 1 and shape[1] == "sequence_length"

    def _run_regrouped(
        self, feed: Mapping[str, np.ndarray], output_names: Sequence[str], lengths: np.ndarray
    ) -> list[np.ndarray]:
        """Rows that fall in one sequence bucket run together, cut to the longest of them."""
        groups: dict[int, list[int]] = {}
        for row, length in enumerate(lengths):
            groups.setdefault(self.plan.choose("sequence_length", int(length), "input_ids"), []).append(row)
        results: list[np.ndarray | None] = [None] * len(output_names)
        for rows in groups.values():
            width = int(lengths[rows].max())
            sub_feed = {}
            for name, array in feed.items():
                shape = self._input_shapes.get(name, ())
                part = np.asarray(array)[rows] if shape and shape[0] == BATCH_DIM else np.asarray(array)
                if len(shape) > 1 and shape[1] == "sequence_length":
                    part = part[:, :width]
                sub_feed[name] = part
            for index, (name, output) in enumerate(
                zip(output_names, self._run_exact(sub_feed, output_names), strict=True)
            ):
                if results[index] is None:
                    full = list(output.shape)
                    full[0] = len(lengths)
                    if self._has_sequence_axis(name):
                        full[1] = feed["attention_mask"].shape[1]
                    results[index] = np.zeros(full, dtype=output.dtype)
                target = results[index]
                if self._has_sequence_axis(name):
                    target[rows, :width] = output
                else:
                    target[rows] = output
        masked = np.asarray(feed["attention_mask"]) == 0
        for name, result in zip(output_names, results, strict=True):
            if result is not None and self._has_sequence_axis(name):
                result[masked] = 0  # one rule for every masked position, whichever group it ran in
        return results  # type: ignore[return-value]

    def _run_exact(self, feed: Mapping[str, np.ndarray], output_names: Sequence[str]) -> list[np.ndarray]:
        config = self._config
        branches = {name: bool(np.asarray(feed[name]).reshape(-1)[0]) for name in self._table.branch_inputs}
        feed = {name: array for name, array in feed.items() if name not in branches}
        # a merged decoder called without its cache (its first step)
        uncached = bool(branches) and not all(branches.values())
        if uncached:
            feed = self._placeholder_past(feed)
        actual = infer_dims(feed, self._input_shapes)
        self._with_generated_masks(feed, actual)
        # Non-batch dimensions are padded for the whole call; the batch is cut into device steps below.
        targets = self.plan.padded_dims(
            {dim: size for dim, size in actual.items() if not is_batch_dim(dim)}, self._carriers
        )
        padded = pad_feed(
            feed,
            self._input_shapes,
            targets,
            pad_token_id=config.pad_token_id,
            actual_dims=actual,
            left_padded_dims=config.left_padded_dims,
            max_position_id=config.max_position_id,
        )
        outputs = self._run_batched(padded.feed, actual.get(BATCH_DIM), branches)
        # Batch is already back to its real size; cut the other padded dimensions.
        padded_dims = {
            **padded.padded_dims,
            **({BATCH_DIM: actual[BATCH_DIM]} if BATCH_DIM in actual else {}),
        }
        # A decoder without a cache still names its present outputs "past_... + ..."; that past is empty.
        empty = dict.fromkeys(self._output_only_past_dims, 0)
        if uncached:
            empty.update({dim: 0 for dim in actual if dim.startswith("past_")})
        # Empty placeholders (a merged decoder's unused cache outputs) have nothing to cut.
        placeholders = {name: array for name, array in outputs.items() if array.size == 0}
        sliced = placeholders | slice_outputs(
            {name: array for name, array in outputs.items() if name not in placeholders},
            self._output_shapes,
            {**actual, **empty},
            {**padded_dims, **empty},
            left_padded_dims=config.left_padded_dims,
        )
        return [
            to_host_dtype(np.ascontiguousarray(sliced[name]), self._output_dtypes[name])
            for name in output_names
        ]

    def _run_batched(
        self, feed: dict[str, np.ndarray], samples: int | None, branches: Mapping[str, bool]
    ) -> dict[str, np.ndarray]:
        config = self._config
        per_step = config.device_iterations * config.replicas
        if samples is None:  # nothing batched: one micro-batch
            shapes = {name: tuple(array.shape) for name, array in feed.items()}
            step_feed = {name: array[None, None] for name, array in feed.items()}
            outputs = self._table.run_step(shapes, branches, step_feed)
            return {name: array[0, 0] for name, array in outputs.items()}
        wanted = min(-(-samples // per_step), self.plan.largest(BATCH_DIM))
        micro = self.plan.choose(BATCH_DIM, wanted, self._carriers.get(BATCH_DIM))
        steps = plan_steps(samples, micro, config.device_iterations, config.replicas)
        shapes = {}
        for name, array in feed.items():
            axis = self._batch_axes.get(name)
            shape = list(array.shape)
            if axis is not None:
                shape[axis] = micro
            shapes[name] = tuple(shape)
        merged: dict[str, list[np.ndarray]] = {}
        for step in range(steps.steps):
            step_feed = {}
            for name, array in feed.items():
                axis = self._batch_axes.get(name)
                if axis is None:
                    step_feed[name] = np.broadcast_to(
                        array, (config.device_iterations, config.replicas, *array.shape)
                    )
                else:
                    step_feed[name] = to_device_layout(array, steps, step, batch_axis=axis)
            outputs = self._table.run_step(shapes, branches, step_feed)
            for name, array in outputs.items():
                axis = self._output_batch_axes.get(name)
                if axis is None or array.shape[2 + axis] != micro:
                    # unbatched, or a placeholder (a merged decoder's empty cross-attention cache)
                    merged.setdefault(name, [array[0, 0]])
                else:
                    merged.setdefault(name, []).append(
                        from_device_layout(array, steps, step, batch_axis=axis)
                    )
        result = {}
        for name, parts in merged.items():
            axis = self._output_batch_axes.get(name)
            result[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
        return result
