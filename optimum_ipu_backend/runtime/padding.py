"""Pad a feed up to compiled (bucket) sizes, with numpy only.

Shapes are described the way the exported ONNX graph declares them: per input a tuple of ints
(fixed), ``None`` (unknown) or ``dim_param`` strings (``runtime.dim_expressions``).

Layout of a padded axis. An axis whose expression is a sum of dimension names and constants is a
concatenation of segments, one per term, in the order written: the attention mask of a decoder with a
cache (``past_sequence_length + sequence_length``) holds the past positions, then the new ones. Each
segment is padded on its own (on the right, or on the left for the dimensions in ``left_padded_dims``),
so every real position keeps its place relative to the others inside its segment. An axis with any
other expression is padded as one block at its end. ``axis_maps`` describes this layout to the padding
proof, which decides whether the padding may be used at all and where the real elements of the outputs
are.

Fill values come from the roles table (``runtime.roles.fill_value``): token ids get the pad token, positions
continue (last + 1, last + 2, ...) so a position-embedding lookup stays in range, everything else 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from optimum_ipu_backend.errors import InvalidFeedError
from optimum_ipu_backend.runtime.dim_expressions import DimExpression, SymbolicDim, parse_dim
from optimum_ipu_backend.runtime.roles import CONTINUE, fill_value, is_batch_dim

SymbolicShape = Sequence[SymbolicDim]

__all__ = [
    "CONTINUE",
    "DimExpression",
    "DimensionMismatchError",
    "SymbolicShape",
    "axis_maps",
    "evaluate_shape",
    "infer_dims",
    "inputs_for_dims",
    "pad_feed",
    "separate_labels",
]


class DimensionMismatchError(InvalidFeedError):
    """Arrays disagree with each other or with their declared symbolic shapes."""


# ----------------------------------------------------------------------------------------------------------
# Dimension sizes of a feed
# ----------------------------------------------------------------------------------------------------------


def infer_dims(feed: Mapping[str, np.ndarray], input_shapes: Mapping[str, SymbolicShape]) -> dict[str, int]:
    """The size of every dimension name that ``feed`` determines, solved from all inputs together.

    Composite axes are solved once enough of their names are known (``past_sequence_length +
    sequence_length`` gives the past length once ``sequence_length`` is known from ``input_ids``).
    Raises ``DimensionMismatchError`` when arrays disagree with each other, a fixed dimension, or the rank
    of their declared shape. Inputs of ``feed`` without a declared shape are not considered.
    """
    equations: list[tuple[DimExpression, int, str, int]] = []
    for name, array in feed.items():
        shape = input_shapes.get(name)
        if shape is None:
            continue
        if len(shape) != array.ndim:
            raise DimensionMismatchError(
                f"input {name!r} has rank {array.ndim} (shape {array.shape}) but the graph declares "
                f"{len(shape)} dimensions {tuple(shape)}"
            )
        for axis, (dim, size) in enumerate(zip(shape, array.shape, strict=True)):
            if isinstance(dim, int) and not isinstance(dim, bool):
                if dim != size:
                    raise DimensionMismatchError(
                        f"input {name!r} has size {size} on axis {axis} but the graph fixes it to {dim}"
                    )
            elif (expression := parse_dim(dim)) is not None:
                equations.append((expression, int(size), name, axis))

    known: dict[str, int] = {}
    source: dict[str, str] = {}
    pending = equations
    while pending:
        unsolved = []
        for expression, size, name, axis in pending:
            unknown = expression.symbols - known.keys()
            if not unknown:
                if expression.evaluate(known) != size:
                    sizes = ", ".join(
                        f"{s}={known[s]} (from {source[s]})" for s in sorted(expression.symbols)
                    )
                    raise DimensionMismatchError(
                        f"input {name!r} has size {size} on axis {axis}, but its dimension "
                        f"{expression.text!r} is {expression.evaluate(known)} with {sizes}"
                    )
            elif len(unknown) == 1:
                (symbol,) = unknown
                solution = expression.solve_for(symbol, size, known)
                if solution is None:
                    raise DimensionMismatchError(
                        f"input {name!r} has size {size} on axis {axis}, which no {symbol} satisfies in "
                        f"{expression.text!r} with {dict(sorted(known.items()))}"
                    )
                known[symbol] = solution
                source[symbol] = f"{name!r} axis {axis}"
            else:
                unsolved.append((expression, size, name, axis))
        if len(unsolved) == len(pending):
            break  # the rest has two or more unknowns each; those dimensions stay undetermined
        pending = unsolved
    return known


def separate_labels(
    feed: Mapping[str, np.ndarray],
    input_shapes: Mapping[str, SymbolicShape],
    keep: Iterable[str] = (),
) -> dict[str, tuple[SymbolicDim, ...]] | None:
    """The inputs' shapes for one call whose arrays disagree on the size of a shared dimension name.

    A ``dim_param`` is a label the exporter chose, not a constraint: onnxruntime accepts inputs that share
    a label at different sizes, and only the graph's dataflow can require them to agree (then the graph
    fails to run, as it does on the CPU). Each axis that carries such a label alone gets a name of its
    own (``<label>.<input index>.<axis>``), which no bucket plans, so it is compiled at the size it comes
    in. None when the disagreement cannot be separated so: a label that also appears inside a composite
    expression, a batch dimension, one of ``keep`` (dimensions the runtime lays out itself), or no
    disagreement among single-name axes at all."""
    sizes: dict[str, set[int]] = {}
    composite: set[str] = set()
    for name, array in feed.items():
        shape = input_shapes.get(name)
        if shape is None or len(shape) != np.ndim(array):
            continue
        for dim, size in zip(shape, np.shape(array), strict=True):
            expression = parse_dim(dim)
            if expression is None:
                continue
            if expression.is_single_name:
                sizes.setdefault(str(expression.segments[0]), set()).add(int(size))  # type: ignore[index]
            else:
                composite |= expression.symbols
    disagreeing = {label for label, seen in sizes.items() if len(seen) > 1}
    if not disagreeing or disagreeing & (composite | set(keep)) or any(map(is_batch_dim, disagreeing)):
        return None
    separated: dict[str, tuple[SymbolicDim, ...]] = {}
    for index, (name, shape) in enumerate(input_shapes.items()):
        renamed: list[SymbolicDim] = []
        for axis, dim in enumerate(shape):
            expression = parse_dim(dim)
            if expression is not None and expression.is_single_name and expression.symbols <= disagreeing:
                renamed.append(f"{next(iter(expression.symbols))}.{index}.{axis}")
            else:
                renamed.append(dim)
        separated[name] = tuple(renamed)
    return separated


def inputs_for_dims(input_shapes: Mapping[str, SymbolicShape]) -> dict[str, str]:
    """For each dimension name, the first input whose declared shape carries it alone on an axis
    (for error messages such as ``BucketPlan.choose``'s)."""
    carriers: dict[str, str] = {}
    for name, shape in input_shapes.items():
        for dim in shape:
            expression = parse_dim(dim)
            if expression is not None and expression.is_single_name:
                carriers.setdefault(str(expression.segments[0]), name)  # type: ignore[index]
    return carriers


def evaluate_shape(shape: SymbolicShape, dims: Mapping[str, int]) -> tuple[int, ...]:
    """The concrete shape of a declared ``shape`` at dimension sizes ``dims``."""
    result = []
    for dim in shape:
        parsed = parse_dim(dim)
        if parsed is not None:
            result.append(parsed.evaluate(dims))
        elif isinstance(dim, int):
            result.append(dim)
        else:
            raise DimensionMismatchError(f"dimension {dim!r} has no size at {dict(dims)}")
    return tuple(result)


# ----------------------------------------------------------------------------------------------------------
# Axis layouts
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    actual: int
    padded: int
    left: bool  # padding goes before the real part

    @property
    def real_offset(self) -> int:
        return self.padded - self.actual if self.left else 0


def _axis_segments(
    expression: DimExpression,
    actual_dims: Mapping[str, int],
    padded_dims: Mapping[str, int],
    left_padded_dims: frozenset[str],
) -> list[_Segment] | None:
    """The segments of one axis, or None when the axis cannot be laid out (undetermined names)."""
    if not expression.symbols <= actual_dims.keys():
        return None
    if expression.segments is not None:
        segments = []
        for term in expression.segments:
            if isinstance(term, int):
                segments.append(_Segment(term, term, False))
            else:
                actual = actual_dims[term]
                padded = padded_dims.get(term, actual)
                segments.append(_Segment(actual, padded, term in left_padded_dims))
        return segments
    padded_sizes = {**actual_dims, **padded_dims}
    return [_Segment(expression.evaluate(actual_dims), expression.evaluate(padded_sizes), False)]


def axis_maps(
    shape: SymbolicShape,
    actual_dims: Mapping[str, int],
    padded_dims: Mapping[str, int],
    left_padded_dims: Iterable[str] = (),
) -> tuple[np.ndarray | None, ...]:
    """Per axis of an input declared ``shape``, where ``pad_feed`` puts each real element: an array with
    one entry per padded position holding the caller's position it carries, or -1 for padding; None
    for an axis that is not padded. This is the layout the padding proof reasons about."""
    left = frozenset(left_padded_dims)
    maps: list[np.ndarray | None] = []
    for dim in shape:
        expression = parse_dim(dim)
        segments = None if expression is None else _axis_segments(expression, actual_dims, padded_dims, left)
        if segments is None or all(s.actual == s.padded for s in segments):
            maps.append(None)
            continue
        parts = []
        real_start = 0
        for segment in segments:
            part = np.full(segment.padded, -1, dtype=np.int64)
            offset = segment.real_offset
            part[offset : offset + segment.actual] = np.arange(real_start, real_start + segment.actual)
            parts.append(part)
            real_start += segment.actual
        maps.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    return tuple(maps)


def _check_padded_sizes(actual_dims: Mapping[str, int], padded_dims: Mapping[str, int]) -> None:
    for dim, padded in padded_dims.items():
        if dim in actual_dims and padded < actual_dims[dim]:
            raise ValueError(f"cannot pad {dim} from {actual_dims[dim]} down to {padded}")


# ----------------------------------------------------------------------------------------------------------
# Padding
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaddedFeed:
    """A feed padded to compiled sizes, with the sizes it was padded from and to."""

    feed: dict[str, np.ndarray]
    actual_dims: dict[str, int]
    padded_dims: dict[str, int]
    left_padded_dims: frozenset[str] = field(default_factory=frozenset)


def pad_feed(
    feed: Mapping[str, np.ndarray],
    input_shapes: Mapping[str, SymbolicShape],
    padded_dims: Mapping[str, int],
    *,
    pad_token_id: int | None = None,
    actual_dims: Mapping[str, int] | None = None,
    fill_values: Mapping[str, int | float | str] | None = None,
    left_padded_dims: Iterable[str] = (),
    max_position_id: int | None = None,
    batch_fill: Literal["repeat", "zeros"] = "repeat",
) -> PaddedFeed:
    """Pad every input of ``feed`` so each dimension name reaches its size in ``padded_dims``.

    ``input_shapes`` maps input names to their symbolic shapes (ONNX ``dim_param`` strings, ints, None).
    ``padded_dims`` holds the target size per dimension name (typically ``BucketPlan.padded_dims``);
    dimensions missing from it keep their size. ``actual_dims`` defaults to ``infer_dims(feed,
    input_shapes)``. ``fill_values`` overrides ``roles.fill_value`` per input name (a number, or
    ``CONTINUE``). Dimensions in ``left_padded_dims`` are padded before their real part instead of after it.
    ``max_position_id`` caps continued position ids so the embedding lookup stays in range. Padded rows of
    batch dimensions repeat the real rows cyclically (``batch_fill="repeat"``) or hold the inputs' fill
    values (``"zeros"``). Inputs without a declared shape pass through unchanged.

    Returns a ``PaddedFeed``.
    """
    if batch_fill not in ("repeat", "zeros"):
        raise ValueError(f"batch_fill must be 'repeat' or 'zeros', got {batch_fill!r}")
    actual = dict(infer_dims(feed, input_shapes) if actual_dims is None else actual_dims)
    _check_padded_sizes(actual, padded_dims)
    padded = {dim: int(padded_dims.get(dim, size)) for dim, size in actual.items()}
    left = frozenset(left_padded_dims)
    fills = fill_values or {}

    def pad(name: str, array: np.ndarray, shape: SymbolicShape) -> np.ndarray:
        fill = fills.get(name, fill_value(name, pad_token_id))
        return _pad_array(
            name, np.asarray(array), shape, actual, padded, left, fill, batch_fill, max_position_id
        )

    return PaddedFeed(_map_declared(feed, input_shapes, pad), actual, padded, left)


def _pad_array(
    name: str,
    array: np.ndarray,
    shape: SymbolicShape,
    actual: Mapping[str, int],
    padded: Mapping[str, int],
    left: frozenset[str],
    fill: int | float | str,
    batch_fill: str,
    max_position_id: int | None,
) -> np.ndarray:
    layouts: list[list[_Segment]] = []
    batch_axes = []
    for axis, dim in enumerate(shape):
        expression = parse_dim(dim)
        size = array.shape[axis]
        segments = None if expression is None else _axis_segments(expression, actual, padded, left)
        if segments is None:
            segments = [_Segment(size, size, False)]
        elif sum(s.actual for s in segments) != size:
            text = expression.text if expression is not None else dim
            raise DimensionMismatchError(
                f"input {name!r} has size {size} on axis {axis}, but {text!r} "
                f"is {sum(s.actual for s in segments)} with {dict(sorted(actual.items()))}"
            )
        if expression is not None and expression.is_single_name and is_batch_dim(str(expression.segments[0])):
            batch_axes.append(axis)
        layouts.append(segments)

    if all(s.actual == s.padded for segments in layouts for s in segments):
        return array
    constant = 0 if fill == CONTINUE else fill
    out = np.full(tuple(sum(s.padded for s in segments) for segments in layouts), constant, dtype=array.dtype)
    _copy_real_blocks(array, out, layouts)

    if fill == CONTINUE:
        # Continue inside real rows only: padded rows are copies of real rows or hold the plain fill.
        real_rows = out[
            tuple(slice(0, layouts[a][0].actual) if a in batch_axes else slice(None) for a in range(out.ndim))
        ]
        for axis, segments in enumerate(layouts):
            if axis not in batch_axes:
                _continue_along(real_rows, axis, segments, max_position_id)
    if batch_fill == "repeat":
        for axis in batch_axes:
            (segment,) = layouts[axis]
            if 0 < segment.actual < segment.padded:
                rows = np.arange(segment.padded - segment.actual) % segment.actual
                target = [slice(None)] * out.ndim
                target[axis] = slice(segment.actual, segment.padded)
                out[tuple(target)] = np.take(out, rows, axis=axis)
    return out


def _copy_real_blocks(array: np.ndarray, out: np.ndarray, layouts: Sequence[Sequence[_Segment]]) -> None:
    """Copy every block of real values of ``array`` to its place in ``out``."""
    per_axis = []
    for segments in layouts:
        pieces = []
        source_start = target_start = 0
        for segment in segments:
            if segment.actual:
                start = target_start + segment.real_offset
                pieces.append(
                    (
                        slice(source_start, source_start + segment.actual),
                        slice(start, start + segment.actual),
                    )
                )
            source_start += segment.actual
            target_start += segment.padded
        per_axis.append(pieces)
    for combination in itertools.product(*per_axis):
        source = tuple(piece[0] for piece in combination)
        target = tuple(piece[1] for piece in combination)
        out[target] = array[source]


def _continue_along(
    out: np.ndarray, axis: int, segments: Sequence[_Segment], max_position_id: int | None
) -> None:
    """Fill the padding after the real part of each segment with the last real value + 1, + 2, ...,
    capped at ``max_position_id``; real values are never changed."""
    moved = np.moveaxis(out, axis, -1)  # a view: writes land in ``out``
    start = 0
    previous_last: np.ndarray | None = None
    for segment in segments:
        real_end = start + segment.real_offset + segment.actual
        pad_count = segment.padded - segment.actual
        if pad_count and not segment.left:
            if segment.actual:
                last = moved[..., real_end - 1]
            elif previous_last is not None:
                last = previous_last
            else:
                last = np.full(moved.shape[:-1], -1, dtype=out.dtype)
            steps = np.arange(1, pad_count + 1, dtype=out.dtype)
            continued = last[..., None] + steps
            if max_position_id is not None:
                continued = np.minimum(continued, max_position_id)
            moved[..., real_end : real_end + pad_count] = continued
        if segment.padded:
            previous_last = moved[..., start + segment.padded - 1].copy()
        start += segment.padded


def _map_declared(
    arrays: Mapping[str, np.ndarray],
    shapes: Mapping[str, SymbolicShape],
    transform: Callable[[str, np.ndarray, SymbolicShape], np.ndarray],
) -> dict[str, np.ndarray]:
    """``transform(name, array, shape)`` for every array with a declared shape; the others pass through."""
    result: dict[str, np.ndarray] = {}
    for name, array in arrays.items():
        shape = shapes.get(name)
        result[name] = array if shape is None else transform(name, array, shape)
    return result
