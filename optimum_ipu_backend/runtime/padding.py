"""Padding one call: which dimensions it pads, the padded feed, and its outputs cut back to their real
elements. Which dimensions are padded is decided by the padding proof (``compiler.padding``), never by
input or axis names.

Shapes are described the way the exported ONNX graph declares them: per input a tuple of ints
(fixed), ``None`` (unknown) or ``dim_param`` strings (``runtime.dim_expressions``).

Layout of a padded axis. An axis whose expression is a sum of dimension names and constants is a
concatenation of segments, one per term, in the order written: the attention mask of a decoder with a
cache (``past_sequence_length + sequence_length``) holds the past positions, then the new ones. Each
segment is padded on its own (on the right, or on the left for the dimensions in ``left_padded_dims``),
so every real position keeps its place relative to the others inside its segment. An axis with any
other expression is padded as one block at its end. ``axis_maps`` describes this layout to the padding
proof, which says whether the padding may be used at all and where the real elements of the outputs
are (``output_cuts``, ``cut_output``).

Fill values come from the roles table (``runtime.roles.fill_value``): token ids get the pad token, positions
continue (last + 1, last + 2, ...) so a position-embedding lookup stays in range, everything else 0.

Same call, same outcome. Whether a call is served or refused, and what it returns, is a function of the
graph, the session's options and the call alone, never of what earlier calls or the cache stored:

* A dimension's *verdict* (padded, or compiled at exact sizes and why) is the proof of padding that
  dimension alone at fixed canonical sizes (``BucketPlan.canonical_sizes``: its two smallest compiled
  sizes, every other planned dimension at its smallest, unplanned ones at the call's size). A call pads
  only dimensions whose verdict is padded, and only as far as the proof at its own sizes allows; a
  dimension past its plan is refused (``InputTooLargeError`` naming the option) when its verdict is
  padded and served at its exact size otherwise. The batch is filled up with repeated samples only when
  its verdict is padded and the call's own proof keeps it, and outputs are merged along the batch axes
  its canonical proof finds.
* Proofs are cached in memory and, with the executable cache, on disk (``cache_files.PROOFS_DIR``),
  keyed by the graph's content and the exact sizes they were made at; a stored proof is the proof that
  would be made again, so the cache only saves time. Verdicts are a report (``compiled_executables()``,
  ``optimum-ipu check``, the message of ``ExecutableLimitError``); no stored verdict is read back.

When every symbolic input dimension has compiled sizes, the verdicts are found when the session is
created, and each dimension compiled at exact sizes is reported once at WARNING with the node that
forces it and what it costs on an IPU; otherwise at the first call that needs the verdict.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from optimum_ipu_backend.compiler.padding import (
    PROOF_FORMAT,
    PaddedInput,
    PaddingAnalyzer,
    PaddingProof,
    inverse,
    real_positions,
)
from optimum_ipu_backend.errors import InvalidFeedError
from optimum_ipu_backend.runtime.cache_files import read_record, write_record
from optimum_ipu_backend.runtime.dim_expressions import DimExpression, SymbolicDim, dim_name, parse_dim
from optimum_ipu_backend.runtime.roles import CONTINUE, InputRole, fill_value, input_role, is_batch_dim

_logger = logging.getLogger(__name__)

SymbolicShape = Sequence[SymbolicDim]


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
        separated[name] = tuple(
            f"{label}.{index}.{axis}" if (label := dim_name(dim)) in disagreeing else dim
            for axis, dim in enumerate(shape)
        )
    return separated


def inputs_for_dims(input_shapes: Mapping[str, SymbolicShape]) -> dict[str, str]:
    """For each dimension name, the first input whose declared shape carries it alone on an axis
    (for error messages such as ``BucketPlan.choose``'s)."""
    carriers: dict[str, str] = {}
    for name, shape in input_shapes.items():
        for dim in shape:
            if (label := dim_name(dim)) is not None:
                carriers.setdefault(label, name)
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


# ----------------------------------------------------------------------------------------------------------
# Padding
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PaddedFeed:
    """A feed padded to compiled sizes, with the sizes it was padded from and to."""

    feed: dict[str, np.ndarray]
    actual_dims: dict[str, int]
    padded_dims: dict[str, int]


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
    for dim, size in padded_dims.items():
        if dim in actual and size < actual[dim]:
            raise ValueError(f"cannot pad {dim} from {actual[dim]} down to {size}")
    padded = {dim: int(padded_dims.get(dim, size)) for dim, size in actual.items()}
    left = frozenset(left_padded_dims)
    fills = fill_values or {}
    result = {}
    for name, array in feed.items():
        shape = input_shapes.get(name)
        if shape is not None:
            fill = fills.get(name, fill_value(name, pad_token_id))
            array = _pad_array(
                name, np.asarray(array), shape, actual, padded, left, fill, batch_fill, max_position_id
            )
        result[name] = array
    return PaddedFeed(result, actual, padded)


def generated_mask(
    shape: SymbolicShape,
    actual_dims: Mapping[str, int],
    padded_dims: Mapping[str, int],
    left_padded_dims: Iterable[str] = (),
) -> np.ndarray:
    """A mask the runtime makes itself (the past padding mask, the audio frame mask) at ``padded_dims``:
    1 at every real position, 0 at every padded one, laid out as ``pad_feed`` lays out the inputs. The
    one definition of its values, for the call and for the proof."""
    dims = {**actual_dims, **padded_dims}
    mask = np.zeros(evaluate_shape(shape, dims), np.int64)
    mask[real_positions(axis_maps(shape, actual_dims, dims, left_padded_dims), mask.shape)] = 1
    return mask


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
        if (label := dim_name(dim)) is not None and is_batch_dim(label):
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


# ----------------------------------------------------------------------------------------------------------
# Cutting
# ----------------------------------------------------------------------------------------------------------


def output_cuts(
    output_maps: Mapping[str, Sequence[np.ndarray | None]],
    skip_axes: Mapping[str, int | None] | None = None,
) -> dict[str, tuple[tuple[int, np.ndarray | slice], ...]]:
    """Per output, the (axis, indices) that keep the real elements the proof located (``skip_axes``: an
    axis per output left alone, the batch when device steps already dropped padded samples)."""
    skip_axes = skip_axes or {}
    cuts = {}
    for name, maps in output_maps.items():
        steps = []
        for axis, axis_map in enumerate(maps):
            if axis_map is None or axis == skip_axes.get(name):
                continue
            index = inverse(axis_map, int((axis_map >= 0).sum()))
            if len(index) and np.array_equal(index, np.arange(index[0], index[0] + len(index))):
                steps.append((axis, slice(int(index[0]), int(index[0]) + len(index))))
            else:
                steps.append((axis, index))
        cuts[name] = tuple(steps)
    return cuts


def cut_output(array: np.ndarray, steps: Sequence[tuple[int, np.ndarray | slice]]) -> np.ndarray:
    """An output with only its real elements (views where the real elements are contiguous)."""
    for axis, index in steps:
        if isinstance(index, slice):
            array = array[(slice(None),) * axis + (index,)]
        else:
            array = np.take(array, index, axis=axis)
    return array


# ----------------------------------------------------------------------------------------------------------
# Which dimensions a call pads
# ----------------------------------------------------------------------------------------------------------


#: A dimension's verdict once it has been tried: padded (proven) or compiled exactly, with the reason.
PADDED = "padded (proven)"
#: The prefix of every verdict of a dimension compiled at the size it comes in.
EXACT_PREFIX = "exact sizes: "


@dataclass(frozen=True)
class CallPadding:
    """How one call runs: the size every dimension is run at, and how to cut the outputs back."""

    dims: dict[str, int]
    #: Per output, the (axis, indices) that keep its real elements, batch axes excluded.
    cuts: dict[str, tuple[tuple[int, np.ndarray | slice], ...]] = field(default_factory=dict)
    #: Whether the batch may be filled up by repeating samples.
    batch_paddable: bool = True
    #: Per output and axis, where each real element is (every axis, the batch included); see the proof.
    output_maps: dict[str, tuple[np.ndarray | None, ...]] = field(default_factory=dict)


def _symbols(shapes: Mapping[str, SymbolicShape]) -> set[str]:
    found: set[str] = set()
    for shape in shapes.values():
        for dim in shape:
            parsed = parse_dim(dim)
            if parsed is not None:
                found |= parsed.symbols
    return found


class PaddingDecisions:
    """Proofs and verdicts for one served graph."""

    def __init__(
        self,
        load_model: Callable[[], Any],
        input_shapes: Mapping[str, SymbolicShape],
        fills: Mapping[str, Any],
        *,
        left_padded_dims: Sequence[str] = (),
        generated_masks: Sequence[tuple[str, str]] = (),
        store: Path | None = None,
        canonical_sizes: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """``canonical_sizes``: per planned dimension, the (real, padded) sizes its verdict is proven at
        (``BucketPlan.canonical_sizes``); a dimension without them is never padded. None (tools that
        prove single calls): no verdicts, each call's own proof decides, and the batch's axes are proven
        at the call's sizes."""
        self._load_model = load_model
        # What the runtime feeds, as the proof needs it described.
        self._shapes = dict(input_shapes)
        self._described_padded = functools.partial(
            padded_inputs,
            fills=dict(fills),
            left_padded_dims=tuple(left_padded_dims),
            generated_masks=tuple(generated_masks),
        )
        self._store = store
        self._per_call = canonical_sizes is None
        self._canonical = dict(canonical_sizes or {})
        self._symbols = _symbols(self._shapes)
        self._carriers = inputs_for_dims(self._shapes)
        self._analyzer_instance: PaddingAnalyzer | None = None
        self._proofs: dict[tuple, PaddingProof] = {}
        self._verdicts: dict[str, str] = {}
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    # -- what users see ----------------------------------------------------------------------------

    def verdicts(self) -> dict[str, str]:
        """Per dimension tried so far: ``"padded (proven)"`` or ``"exact sizes: <why>"``."""
        return dict(sorted(self._verdicts.items()))

    def is_exact(
        self, dim: str, actual: Mapping[str, int] | None = None, branches: Mapping[str, bool] | None = None
    ) -> bool:
        """Whether ``dim`` is compiled at the sizes it comes in (its verdict, see the module docstring).
        ``actual`` gives the sizes of dimensions without compiled sizes, when the graph has any."""
        return self.verdict(dim, actual or {}, branches or {}) != PADDED

    def verdict(self, dim: str, actual: Mapping[str, int], branches: Mapping[str, bool]) -> str:
        """``dim``'s verdict: the proof of padding it alone at its canonical sizes (cached by key)."""
        if self._per_call:
            return PADDED  # no verdicts: the call's own proof decides
        if dim not in self._canonical:
            return f"{EXACT_PREFIX}it has no compiled sizes"
        point = self._canonical_point(dim, actual)
        if point is None:  # an unplanned dimension's size is unknown: not padded, and nothing to report
            return f"{EXACT_PREFIX}the sizes of its proof are unknown"
        with self._lock:
            proof = self._proof(*point, branches)
        verdict = PADDED if proof.exact else f"{EXACT_PREFIX}{proof.problems[0]}"
        self._record(dim, verdict)
        return verdict

    def settle(self, branches: Mapping[str, bool] | None = None, dims: Iterable[str] | None = None) -> bool:
        """Find the verdicts of ``dims`` (every planned dimension by default) now, when every symbolic
        input dimension has canonical sizes; False (and nothing proven) otherwise."""
        if not self._symbols <= self._canonical.keys():
            return False
        for dim in self._canonical if dims is None else dims:
            if dim in self._symbols:
                self.verdict(dim, {}, branches or {})
        return True

    def _canonical_point(self, dim: str, actual: Mapping[str, int]) -> tuple[dict, dict] | None:
        """The (real, padded) sizes of ``dim``'s verdict: ``dim`` (every batch dimension with a batch)
        padded over its canonical sizes, the other planned dimensions at their smallest canonical size,
        the unplanned ones at the call's size."""
        real: dict[str, int] = {}
        for symbol in sorted(self._symbols):
            if symbol in self._canonical:
                real[symbol] = self._canonical[symbol][0]
            elif symbol in actual:
                real[symbol] = int(actual[symbol])
            else:
                return None
        moved = [d for d in real if is_batch_dim(d) and d in self._canonical] if is_batch_dim(dim) else [dim]
        padded = {**real, **{d: self._canonical[d][1] for d in moved}}
        return real, padded

    def _record(self, dim: str, verdict: str) -> None:
        if self._verdicts.get(dim, PADDED) != PADDED:
            return  # a verdict of exact (under any branch) is what the report keeps
        self._verdicts[dim] = verdict
        if verdict != PADDED and dim not in self._warned:
            self._warned.add(dim)
            _logger.warning(self._exact_warning(dim, verdict.removeprefix(EXACT_PREFIX)))

    def _exact_warning(self, dim: str, why: str) -> str:
        carrier = self._carriers.get(dim)
        where = f"{dim!r}"
        if carrier is not None:
            axis = next(a for a, d in enumerate(self._shapes[carrier]) if dim_name(d) == dim)
            where = f"input {carrier!r} axis {axis} ({dim})"
        if is_batch_dim(dim):
            advice = "Call with a few fixed numbers of samples (split or group calls yourself)"
            unit = "number of samples"
        else:
            audio = carrier is not None and input_role(carrier) is InputRole.AUDIO
            advice = "Cut or pad the inputs to a few fixed lengths yourself" + (
                ", as the transformers ASR pipeline's chunk_length_s does for audio" if audio else ""
            )
            unit = "length"
        return (
            f"{where} is compiled at the exact size each call brings, because {why}. On an IPU every "
            f"distinct {unit} compiles its own executable, which takes minutes, so calls of many different "
            f"sizes keep compiling. {advice}, and cap how many executables a session compiles with "
            "provider_options={'max_executables': N}."
        )

    # -- per call ------------------------------------------------------------------------------------

    def decide(
        self,
        actual: Mapping[str, int],
        wanted: Mapping[str, int],
        feed: Mapping[str, np.ndarray],
        branches: Mapping[str, bool],
        shapes: Mapping[str, SymbolicShape] | None = None,
    ) -> CallPadding:
        """The padding this call may use. ``wanted`` holds the compiled size per dimension (batch: the
        micro-batch) and ``actual`` the caller's sizes (batch: the real samples of the fullest
        micro-batch that has padding). ``shapes``: the inputs' shapes for this call when they differ
        from the graph's (labels that disagree in the feed, separated by ``padding.separate_labels``)."""
        with self._lock:
            exact = {dim for dim in wanted if self.is_exact(dim, actual, branches)}
            batch_ok = not any(is_batch_dim(dim) for dim in exact)
            wanted = {dim: size for dim, size in wanted.items() if dim not in exact}
            padded = {dim for dim, size in wanted.items() if size != actual.get(dim, size)}
            if not padded:
                return CallPadding({**actual, **wanted}, batch_paddable=batch_ok)
            proof = self._proof(actual, wanted, branches, shapes)
            if not proof.exact:
                wanted = self._narrowed(actual, wanted, branches, shapes)
                proof = self._proof(actual, wanted, branches, shapes)
            if proof.exact and not proof.holds_for(feed):
                # The caller's masks could mask a whole row: run this call without padding positions.
                wanted = {dim: size for dim, size in wanted.items() if is_batch_dim(dim)}
                proof = self._proof(actual, wanted, branches, shapes)
            if not proof.exact:
                wanted = {}
                proof = None
            batch_axes = self._output_batch_axes(actual, branches) if any(map(is_batch_dim, wanted)) else {}
        dims = {**actual, **wanted}
        # a batch this call needed filled up but whose padding its proof did not keep runs unfilled
        batch_paddable = batch_ok and all(dim in wanted for dim in padded if is_batch_dim(dim))
        if proof is None:
            return CallPadding(dims, {}, batch_paddable)
        return CallPadding(
            dims, output_cuts(proof.output_maps, batch_axes), batch_paddable, proof.output_maps
        )

    def output_batch_axes(
        self, actual: Mapping[str, int], branches: Mapping[str, bool]
    ) -> dict[str, int | None]:
        """Which axis of each output carries the batch (None: none), found by dataflow: by the batch's
        canonical proof."""
        with self._lock:
            return self._output_batch_axes(actual, branches)

    def output_axes(
        self, dim: str, actual: Mapping[str, int], branches: Mapping[str, bool]
    ) -> dict[str, int | None]:
        """Which axis of each output carries ``dim``, found by dataflow: the axes that a proof with ``dim``
        padded by one position at the call's sizes finds padded. Empty when that padding cannot be
        proven."""
        with self._lock:
            return _padded_axes(self._proof(actual, {**actual, dim: actual[dim] + 1}, branches))

    # -- proofs ----------------------------------------------------------------------------------------

    def _narrowed(
        self,
        actual: Mapping[str, int],
        wanted: Mapping[str, int],
        branches: Mapping[str, bool],
        shapes: Mapping[str, SymbolicShape] | None,
    ) -> dict[str, int]:
        """The padded dimensions that this call can pad on their own, each tried alone at its sizes."""
        kept = {}
        for dim, size in wanted.items():
            if size == actual.get(dim, size):
                kept[dim] = size
                continue
            alone = {d: (s if d == dim else actual.get(d, s)) for d, s in wanted.items()}
            proof = self._proof(actual, alone, branches, shapes)
            if proof.exact:
                kept[dim] = size
            else:
                _logger.info("%s runs at the size it comes in for this call: %s", dim, proof.problems[0])
                if self._per_call:  # the only verdicts there are: what single calls found (a report)
                    self._verdicts.setdefault(dim, f"{EXACT_PREFIX}{proof.problems[0]}")
        return kept

    def _output_batch_axes(
        self, actual: Mapping[str, int], branches: Mapping[str, bool]
    ) -> dict[str, int | None]:
        if self._per_call:
            batch_dims = [dim for dim in actual if is_batch_dim(dim)]
            one = {**actual, **dict.fromkeys(batch_dims, 1)}
            two = {**actual, **dict.fromkeys(batch_dims, 2)}
            return _padded_axes(self._proof(one, two, branches)) if batch_dims else {}
        batch_dims = sorted(dim for dim in self._canonical if is_batch_dim(dim) and dim in self._symbols)
        if not batch_dims:
            return {}
        point = self._canonical_point(batch_dims[0], actual)
        if point is None:
            return {}
        return _padded_axes(self._proof(*point, branches))

    def _proof(
        self,
        actual: Mapping[str, int],
        padded: Mapping[str, int],
        branches: Mapping[str, bool],
        shapes: Mapping[str, SymbolicShape] | None = None,
    ) -> PaddingProof:
        dims = {**actual, **padded}
        key: tuple = (_branch_key(branches), tuple(sorted(actual.items())), tuple(sorted(dims.items())))
        if shapes is not None and dict(shapes) != self._shapes:
            key += (tuple(sorted((name, tuple(map(str, shape))) for name, shape in shapes.items())),)
        proof = self._proofs.get(key)
        if proof is not None:
            return proof
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        path = None if self._store is None else self._store / f"{name}.json"
        stored = None if path is None else read_record(path, PROOF_FORMAT, "padding proof")
        # a stored proof that does not parse is made again
        with contextlib.suppress(KeyError, TypeError, ValueError):
            proof = None if stored is None else PaddingProof.from_json(stored)
        if proof is None:
            shapes = self._shapes if shapes is None else shapes
            inputs = self._described_padded(shapes, actual=actual, padded=dims, branches=branches)
            proof = self._analyzer().prove(inputs)
            if path is not None:
                write_record(path, PROOF_FORMAT, proof.to_json(), "padding proof")
        self._proofs[key] = proof
        return proof

    def _analyzer(self) -> PaddingAnalyzer:
        if self._analyzer_instance is None:
            # Branch inputs are fed as constants, so one analyzer serves every branch.
            self._analyzer_instance = PaddingAnalyzer(self._load_model())
        return self._analyzer_instance


def padded_inputs(
    input_shapes: Mapping[str, SymbolicShape],
    fills: Mapping[str, Any],
    actual: Mapping[str, int],
    padded: Mapping[str, int],
    *,
    left_padded_dims: Sequence[str] = (),
    generated_masks: Sequence[tuple[str, str]] = (),
    branches: Mapping[str, bool] | None = None,
) -> dict[str, Any]:
    """Every graph input of a call padded from ``actual`` to ``padded`` sizes, described the way
    ``pad_feed`` pads it, for ``PaddingAnalyzer.prove``."""
    dims = {**actual, **padded}
    generated = dict(generated_masks)
    inputs = {}
    for name, shape in input_shapes.items():
        real_shape = evaluate_shape(shape, actual)
        padded_shape = evaluate_shape(shape, dims)
        maps = axis_maps(shape, actual, dims, left_padded_dims)
        repeated = tuple(a for a, d in enumerate(shape) if isinstance(d, str) and is_batch_dim(d))
        fill = fills.get(name, 0)
        values = None
        if name in generated:  # made by the runtime itself: the proof gets its values
            values = (generated_mask(shape, actual, dims, left_padded_dims), np.ones(real_shape, np.int64))
        inputs[name] = PaddedInput(
            padded_shape, real_shape, maps, None if fill == CONTINUE else fill, repeated, values
        )
    for name, value in (branches or {}).items():
        constant = np.array(bool(value))
        inputs[name] = PaddedInput((), (), (), 0, (), (constant, constant))
    return inputs


def _padded_axes(proof: PaddingProof) -> dict[str, int | None]:
    """Per output, the first axis a proof found padded (None: none); empty when the proof failed."""
    if not proof.exact:
        return {}
    return {
        name: next((axis for axis, axis_map in enumerate(maps) if axis_map is not None), None)
        for name, maps in proof.output_maps.items()
    }


def _branch_key(branches: Mapping[str, bool]) -> tuple:
    return tuple(sorted((name, bool(value)) for name, value in branches.items()))
