"""Pad a feed up to compiled (bucket) sizes and cut the outputs back, with numpy only.

Shapes are described the way the exported ONNX graph declares them: per input or output a tuple of
ints (fixed), ``None`` (unknown) or ``dim_param`` strings. Those strings are dimension names
(``"batch_size"``) or small arithmetic expressions over them (``"past_sequence_length + sequence_length"``,
``"batch_size * num_heads"``, ``"1"``), which ``DimExpression`` parses without ``eval``.

Layout of a padded axis. An axis whose expression is a sum of dimension names and constants is a
concatenation of segments, one per term, in the order written: the attention mask of a decoder with a
cache (``past_sequence_length + sequence_length``) holds the past positions, then the new ones, and the
graph's ``present`` outputs are laid out the same way. Each segment is padded on its own (on the right,
or on the left for the dimensions in ``left_padded_dims``), so every real position keeps its place
relative to the others inside its segment, and ``slice_outputs`` takes the real part of each segment
back out. An axis with any other expression is padded and sliced as one block at its end.

Fill values. ``input_ids`` / ``decoder_input_ids`` get the pad token; attention masks, ``token_type_ids``
and everything else get 0 (key/value caches included: their padding is hidden by the mask); ``position_ids``
continue (last + 1, last + 2, ...) so the position-embedding lookup stays in range. Padded batch rows
repeat the real rows (all-masked rows can turn into NaN in some attention implementations); they are
dropped again by ``slice_outputs``.

Padding does not change the real part of any output as long as the graph hides padded positions
through an attention mask (or causality, for positions after the real ones). Dimensions no mask covers
(audio frames, image sizes, the past of a decoder that takes no self-attention mask) must not be padded.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

SymbolicDim = str | int | None
SymbolicShape = Sequence[SymbolicDim]

# Marker fill for inputs whose padding continues the sequence of real values (position ids).
CONTINUE = "continue"


class DimExpressionError(ValueError):
    """A ``dim_param`` string is not an expression of names, integers, ``+``, ``-``, ``*`` and parentheses."""


class DimensionMismatchError(ValueError):
    """Arrays disagree with each other or with their declared symbolic shapes."""


# ----------------------------------------------------------------------------------------------------------
# Dimension expressions
# ----------------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_.]*)|(?P<op>[-+*()]))")

# A polynomial: monomial (sorted tuple of names, repeated for powers) -> integer coefficient.
_Polynomial = dict[tuple[str, ...], int]


def _poly_add(left: _Polynomial, right: _Polynomial, sign: int = 1) -> _Polynomial:
    result = dict(left)
    for monomial, coefficient in right.items():
        result[monomial] = result.get(monomial, 0) + sign * coefficient
    return {monomial: coefficient for monomial, coefficient in result.items() if coefficient}


def _poly_mul(left: _Polynomial, right: _Polynomial) -> _Polynomial:
    result: _Polynomial = {}
    for (m1, c1), (m2, c2) in itertools.product(left.items(), right.items()):
        monomial = tuple(sorted(m1 + m2))
        result[monomial] = result.get(monomial, 0) + c1 * c2
    return {monomial: coefficient for monomial, coefficient in result.items() if coefficient}


class _Parser:
    """Recursive descent over ``expr := term (('+'|'-') term)*``, ``term := factor ('*' factor)*``,
    ``factor := INT | NAME | '(' expr ')' | '-' factor``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str]] = []
        position = 0
        stripped = text.rstrip()
        while position < len(stripped):
            match = _TOKEN.match(stripped, position)
            if match is None:
                raise DimExpressionError(f"cannot parse dimension {text!r} at {stripped[position:]!r}")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.index = 0

    def parse(self) -> tuple[_Polynomial, list[_Polynomial]]:
        """The whole expression and its top-level additive terms in written order (signs folded in)."""
        if not self.tokens:
            raise DimExpressionError(f"empty dimension expression {self.text!r}")
        terms = [self._term()]
        while self._peek() in ("+", "-"):
            sign = 1 if self._next() == "+" else -1
            terms.append(_poly_mul({(): sign}, self._term()))
        if self.index != len(self.tokens):
            raise DimExpressionError(f"unexpected {self.tokens[self.index][1]!r} in dimension {self.text!r}")
        total: _Polynomial = {}
        for term in terms:
            total = _poly_add(total, term)
        return total, terms

    def _peek(self) -> str | None:
        return self.tokens[self.index][1] if self.index < len(self.tokens) else None

    def _next(self) -> str:
        if self.index >= len(self.tokens):
            raise DimExpressionError(f"dimension {self.text!r} ends too early")
        value = self.tokens[self.index][1]
        self.index += 1
        return value

    def _expr(self) -> _Polynomial:
        result = self._term()
        while self._peek() in ("+", "-"):
            sign = 1 if self._next() == "+" else -1
            result = _poly_add(result, self._term(), sign)
        return result

    def _term(self) -> _Polynomial:
        result = self._factor()
        while self._peek() == "*":
            self._next()
            result = _poly_mul(result, self._factor())
        return result

    def _factor(self) -> _Polynomial:
        if self.index >= len(self.tokens):
            raise DimExpressionError(f"dimension {self.text!r} ends too early")
        kind, value = self.tokens[self.index]
        self.index += 1
        if kind == "int":
            return {(): int(value)} if int(value) else {}
        if kind == "name":
            return {(value,): 1}
        if value == "(":
            inner = self._expr()
            if self._next() != ")":
                raise DimExpressionError(f"unbalanced parentheses in dimension {self.text!r}")
            return inner
        if value == "-":
            return _poly_mul({(): -1}, self._factor())
        raise DimExpressionError(f"unexpected {value!r} in dimension {self.text!r}")


@dataclass(frozen=True)
class DimExpression:
    """A parsed ``dim_param``: evaluate it with dimension sizes, solve it for one unknown, or split it
    into concatenated segments."""

    text: str
    polynomial: tuple[tuple[tuple[str, ...], int], ...]
    # Top-level terms in written order, each a single name (coefficient 1) or a constant; None when the
    # expression is anything else and therefore has no segment layout.
    segments: tuple[str | int, ...] | None

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def parse(text: str) -> DimExpression:
        total, terms = _Parser(text).parse()
        segments: list[str | int] | None = []
        for term in terms:
            if not term:
                continue  # a literal 0
            if len(term) == 1 and () in term and term[()] > 0:
                segments.append(term[()])
            elif len(term) == 1 and next(iter(term.values())) == 1 and len(next(iter(term))) == 1:
                segments.append(next(iter(term))[0])
            else:
                segments = None
                break
        return DimExpression(
            text, tuple(sorted(total.items())), None if segments is None else tuple(segments)
        )

    @property
    def symbols(self) -> frozenset[str]:
        return frozenset(name for monomial, _ in self.polynomial for name in monomial)

    @property
    def is_single_name(self) -> bool:
        return self.segments is not None and len(self.segments) == 1 and isinstance(self.segments[0], str)

    def evaluate(self, sizes: Mapping[str, int]) -> int:
        """The value with ``sizes``; ``KeyError`` naming the first missing dimension."""
        total = 0
        for monomial, coefficient in self.polynomial:
            value = coefficient
            for name in monomial:
                if name not in sizes:
                    raise KeyError(name)
                value *= sizes[name]
            total += value
        return total

    def solve_for(self, unknown: str, value: int, sizes: Mapping[str, int]) -> int | None:
        """The size of ``unknown`` that makes the expression equal ``value`` given the other ``sizes``,
        or None when the expression is not linear in it or the answer is not a non-negative integer."""
        if any(monomial.count(unknown) > 1 for monomial, _ in self.polynomial):
            return None
        base = self.evaluate({**sizes, unknown: 0})
        slope = self.evaluate({**sizes, unknown: 1}) - base
        if slope == 0 or (value - base) % slope:
            return None
        solution = (value - base) // slope
        return solution if solution >= 0 else None


def _expression(dim: SymbolicDim) -> DimExpression | None:
    """The parsed dimension, or None for fixed and unknown ones; a ``dim_param`` outside the grammar
    (``floor(n / 2)``) counts as unknown, so such an axis is never padded or sliced."""
    if not isinstance(dim, str):
        return None
    try:
        return DimExpression.parse(dim)
    except DimExpressionError:
        return None


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
            elif (expression := _expression(dim)) is not None:
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


def inputs_for_dims(input_shapes: Mapping[str, SymbolicShape]) -> dict[str, str]:
    """For each dimension name, the first input whose declared shape carries it alone on an axis
    (for error messages such as ``BucketPlan.choose``'s)."""
    carriers: dict[str, str] = {}
    for name, shape in input_shapes.items():
        for dim in shape:
            expression = _expression(dim)
            if expression is not None and expression.is_single_name:
                carriers.setdefault(str(expression.segments[0]), name)  # type: ignore[index]
    return carriers


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
        expression = _expression(dim)
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


def default_fill_value(input_name: str, pad_token_id: int | None) -> int | str:
    """What padding of ``input_name`` holds: the pad token for token ids, ``CONTINUE`` for position ids,
    0 for masks, token types, key/value caches and everything else.

    Without a ``pad_token_id`` token ids are padded with 0: any id in the vocabulary gives the same real
    outputs, because the attention mask hides the padded positions, and 0 is always in the vocabulary.
    """
    if input_name.endswith("input_ids"):
        return 0 if pad_token_id is None else int(pad_token_id)
    if "position_ids" in input_name:
        return CONTINUE
    return 0


def _is_batch_name(dim: str) -> bool:
    return dim == "batch_size" or dim.endswith("_batch_size")


@dataclass(frozen=True)
class PaddedFeed:
    """A feed padded to compiled sizes, with what is needed to cut outputs back."""

    feed: dict[str, np.ndarray]
    actual_dims: dict[str, int]
    padded_dims: dict[str, int]
    left_padded_dims: frozenset[str] = field(default_factory=frozenset)

    def slice_outputs(
        self, outputs: Mapping[str, np.ndarray], output_shapes: Mapping[str, SymbolicShape]
    ) -> dict[str, np.ndarray]:
        """``slice_outputs`` with this feed's sizes."""
        return slice_outputs(
            outputs, output_shapes, self.actual_dims, self.padded_dims, left_padded_dims=self.left_padded_dims
        )


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
    input_shapes)``. ``fill_values`` overrides ``default_fill_value`` per input name (a number, or
    ``CONTINUE``). Dimensions in ``left_padded_dims`` are padded before their real part instead of after it.
    ``max_position_id`` caps continued position ids so the embedding lookup stays in range. Padded rows of
    batch dimensions repeat the real rows cyclically (``batch_fill="repeat"``) or hold the inputs' fill
    values (``"zeros"``). Inputs without a declared shape pass through unchanged.

    Returns a ``PaddedFeed`` whose ``slice_outputs`` cuts the graph's outputs back.
    """
    if batch_fill not in ("repeat", "zeros"):
        raise ValueError(f"batch_fill must be 'repeat' or 'zeros', got {batch_fill!r}")
    actual = dict(infer_dims(feed, input_shapes) if actual_dims is None else actual_dims)
    _check_padded_sizes(actual, padded_dims)
    padded = {dim: int(padded_dims.get(dim, size)) for dim, size in actual.items()}
    left = frozenset(left_padded_dims)
    fills = fill_values or {}

    def pad(name: str, array: np.ndarray, shape: SymbolicShape) -> np.ndarray:
        fill = fills.get(name, default_fill_value(name, pad_token_id))
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
        expression = _expression(dim)
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
        if (
            expression is not None
            and expression.is_single_name
            and _is_batch_name(str(expression.segments[0]))
        ):
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
# Slicing outputs back
# ----------------------------------------------------------------------------------------------------------


def slice_outputs(
    outputs: Mapping[str, np.ndarray],
    output_shapes: Mapping[str, SymbolicShape],
    actual_dims: Mapping[str, int],
    padded_dims: Mapping[str, int] | None = None,
    *,
    left_padded_dims: Iterable[str] = (),
) -> dict[str, np.ndarray]:
    """Cut every output back to the real sizes along its dynamic axes.

    ``output_shapes`` maps output names to their symbolic shapes; ``actual_dims`` are the caller's sizes
    and ``padded_dims`` the sizes the graph ran with (dimensions missing from it were not padded). Axes
    whose expression is a sum of names keep the real part of each segment (so a ``present`` cache of
    ``past_sequence_length + sequence_length`` comes back as real past followed by real new positions);
    other expressions keep their leading block. Without ``padded_dims``, an axis with a single dimension
    name takes the padded size from the array itself; composite axes then raise ``ValueError``.
    Fixed and unknown axes, and axes with names ``actual_dims`` lacks, are left as they are. Outputs
    without a declared shape pass through. Plain leading slices are returned as views.

    Raises ``DimensionMismatchError`` when an output's axis does not have the padded size its expression
    gives, which means the outputs do not belong to this padding.
    """
    cut = functools.partial(
        _slice_output, actual_dims=actual_dims, padded_dims=padded_dims, left=frozenset(left_padded_dims)
    )
    return _map_declared(outputs, output_shapes, cut)


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


def _slice_output(
    name: str,
    array: np.ndarray,
    shape: SymbolicShape,
    *,
    actual_dims: Mapping[str, int],
    padded_dims: Mapping[str, int] | None,
    left: frozenset[str],
) -> np.ndarray:
    """One output cut back to its real sizes, as ``slice_outputs`` describes."""
    if len(shape) != array.ndim:
        raise DimensionMismatchError(
            f"output {name!r} has rank {array.ndim} (shape {array.shape}) but the graph declares "
            f"{len(shape)} dimensions {tuple(shape)}"
        )
    result = array
    for axis, dim in enumerate(shape):
        expression = _expression(dim)
        if expression is None or not expression.symbols <= actual_dims.keys():
            continue
        length = array.shape[axis]
        if padded_dims is None:
            if not expression.is_single_name:
                raise ValueError(
                    f"output {name!r} axis {axis} is {expression.text!r}: slicing it needs padded_dims"
                )
            dim_name = str(expression.segments[0])  # type: ignore[index]
            segments = [_Segment(actual_dims[dim_name], length, dim_name in left)]
        else:
            segments = _axis_segments(expression, actual_dims, padded_dims, left) or []
        if sum(s.padded for s in segments) != length:
            raise DimensionMismatchError(
                f"output {name!r} has size {length} on axis {axis}, but {expression.text!r} is "
                f"{sum(s.padded for s in segments)} with the padded sizes"
            )
        result = _take_real(result, axis, segments)
    return result


def _take_real(array: np.ndarray, axis: int, segments: Sequence[_Segment]) -> np.ndarray:
    if all(s.actual == s.padded for s in segments):
        return array
    if len(segments) == 1:
        segment = segments[0]
        index = [slice(None)] * array.ndim
        index[axis] = slice(segment.real_offset, segment.real_offset + segment.actual)
        return array[tuple(index)]
    pieces = []
    start = 0
    for segment in segments:
        first = start + segment.real_offset
        pieces.append(np.arange(first, first + segment.actual))
        start += segment.padded
    return np.take(array, np.concatenate(pieces), axis=axis)
