"""The two kinds of value the padding proof tracks, and how padded coordinates map to real ones.

The proof runs the graph twice at once, abstractly: once at the padded sizes and once at the caller's
own (unpadded) sizes. A tensor whose value does not depend on user data (shapes, index arithmetic,
masks built from sizes, small constants) is computed exactly in both runs (``Concrete``). Every other
tensor is ``Data``: its values are unknown, but its shapes in both runs are known, and so is, per
element, whether the padded run holds there exactly what the unpadded run holds at the corresponding
element (``exact``), and a class saying what the value is (``classes``).

Which padded element corresponds to which unpadded one is said per axis by a *map*: an int array with
one entry per padded coordinate, holding the unpadded coordinate it stands for, or -1 where the padded
run has an element the unpadded run does not (padding). ``None`` is the identity (the axis is the same
in both runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from . import classes as C

AxisMap = np.ndarray | None


@dataclass(eq=False)
class Concrete:
    """A tensor computed exactly in both runs."""

    padded: np.ndarray
    unpadded: np.ndarray

    @property
    def size(self) -> int:
        return max(self.padded.size, self.unpadded.size)


@dataclass(eq=False)
class Data:
    """A tensor whose values depend on user data.

    ``exact`` and ``classes`` broadcast to ``shape`` (size 1 along axes where they do not vary);
    ``exact`` only means something at real elements (every axis map >= 0 there).
    """

    shape: tuple[int, ...]
    real_shape: tuple[int, ...]
    maps: tuple[AxisMap, ...]
    exact: np.ndarray
    classes: np.ndarray
    elem_type: int
    sources: frozenset[str] = frozenset()
    #: Why the first inexact element became inexact: "node 'name' (OpType): reason".
    blame: str | None = None

    def __post_init__(self) -> None:
        rank = len(self.shape)
        assert len(self.real_shape) == rank and len(self.maps) == rank, (self.shape, self.real_shape)
        self.exact = _uniform(_at_rank(np.asarray(self.exact, dtype=bool), rank))
        self.classes = _uniform(_at_rank(np.asarray(self.classes, dtype=np.int8), rank))

    @property
    def rank(self) -> int:
        return len(self.shape)

    def real_grid(self) -> np.ndarray:
        """Boolean grid (broadcastable to ``shape``): which elements exist in the unpadded run."""
        return real_grid(self.maps, self.shape)

    def is_exact(self) -> bool:
        return bool(np.all(self.exact | ~self.real_grid()))

    def inexact(self, blame: str) -> Data:
        """This tensor with no element exact (shapes and maps kept, for what is computed from them)."""
        return self.with_axes(
            self.shape,
            self.real_shape,
            self.maps,
            np.zeros((1,) * self.rank, bool),
            self.classes,
            blame=self.blame or blame,
        )

    def with_axes(
        self,
        shape: Sequence[int],
        real_shape: Sequence[int],
        maps: Sequence[AxisMap],
        exact: np.ndarray,
        classes: np.ndarray | np.int8,
        elem_type: int | None = None,
        blame: str | None = None,
    ) -> Data:
        """A tensor computed from this one alone: its sources, and its element type and blame unless
        given."""
        return Data(
            tuple(shape),
            tuple(real_shape),
            tuple(maps),
            exact,
            classes,
            self.elem_type if elem_type is None else elem_type,
            self.sources,
            self.blame if blame is None else blame,
        )


def _uniform(array: np.ndarray) -> np.ndarray:
    """Facts that do not vary at all are kept as one element: it keeps every later step small."""
    if array.size > 1:
        first = array.reshape(-1)[0]
        if np.all(array == first):
            return np.full((1,) * array.ndim, first, dtype=array.dtype)
    return array


def _at_rank(array: np.ndarray, rank: int) -> np.ndarray:
    if array.ndim < rank:
        return array.reshape((1,) * (rank - array.ndim) + array.shape)
    if array.ndim > rank:
        return array.reshape(array.shape[array.ndim - rank :])
    return array


def real_coordinates(axis_map: AxisMap, size: int) -> np.ndarray:
    """Which padded coordinates of one axis are real."""
    if axis_map is None:
        return np.ones(size, bool)
    return axis_map >= 0


def real_positions(maps: Sequence[AxisMap], shape: Sequence[int]) -> tuple[np.ndarray, ...]:
    """The open-mesh index (``np.ix_``) of the real elements of a padded tensor."""
    return np.ix_(
        *(
            np.arange(size) if m is None else np.nonzero(m >= 0)[0]
            for m, size in zip(maps, shape, strict=True)
        )
    )


def real_grid(maps: Sequence[AxisMap], shape: Sequence[int]) -> np.ndarray:
    grid = np.ones((1,) * len(shape), bool)
    for axis, axis_map in enumerate(maps):
        if axis_map is not None:
            view = [1] * len(shape)
            view[axis] = shape[axis]
            grid = grid & (axis_map >= 0).reshape(view)
    return grid


def complete(axis_map: AxisMap, real_size: int) -> bool:
    """Whether every unpadded coordinate appears exactly once among the padded ones."""
    if axis_map is None:
        return True
    real = axis_map[axis_map >= 0]
    return len(real) == real_size and bool(np.array_equal(np.sort(real), np.arange(real_size)))


def same_map(left: AxisMap, right: AxisMap) -> bool:
    if left is None or right is None:
        return left is None and right is None
    return left.shape == right.shape and bool(np.array_equal(left, right))


def agree(left: AxisMap, right: AxisMap) -> AxisMap:
    """The map of an elementwise result whose operands have these maps on one axis: a padded
    coordinate stands for an unpadded one only where both operands say the same."""
    if same_map(left, right):
        return left
    size = len(left) if left is not None else len(right)  # type: ignore[arg-type]
    a = np.arange(size) if left is None else left
    b = np.arange(size) if right is None else right
    return np.where(a == b, a, -1)


def expand_axis(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    """``array`` with ``axis`` made ``size`` long (it must be 1 or ``size`` already)."""
    if array.shape[axis] == size:
        return array
    target = list(array.shape)
    target[axis] = size
    return np.broadcast_to(array, target)


def inverse(axis_map: AxisMap, real_size: int) -> np.ndarray:
    """For each unpadded coordinate, the padded coordinate holding it (the map must be complete)."""
    if axis_map is None:
        return np.arange(real_size)
    result = np.full(real_size, -1, dtype=np.int64)
    real = np.nonzero(axis_map >= 0)[0]
    result[axis_map[real]] = real
    return result


def identity_or(axis_map: np.ndarray) -> AxisMap:
    """``None`` for a map that is the identity."""
    if axis_map is not None and bool(np.array_equal(axis_map, np.arange(len(axis_map)))):
        return None
    return axis_map


class Layouts:
    """Maps of axes the proof creates itself (``Range``, ``ConstantOfShape``, ``Expand``), found by size.

    The runtime's padding gives every padded input axis a map; an axis that appears later with the same
    pair of sizes (padded, unpadded) gets that map. Two different maps for one pair of sizes make the
    pair ambiguous; such an axis then gets the right-padded map, and wherever it meets an axis with a
    known map the two must agree, so a wrong choice can only make the proof fail, never pass wrongly.
    """

    def __init__(self) -> None:
        self._by_size: dict[tuple[int, int], np.ndarray | None] = {}

    def add(self, axis_map: np.ndarray, real_size: int) -> None:
        key = (len(axis_map), real_size)
        if key[0] == key[1] and bool(np.array_equal(axis_map, np.arange(key[0]))):
            return
        if key in self._by_size and (
            self._by_size[key] is None or not np.array_equal(self._by_size[key], axis_map)
        ):
            self._by_size[key] = None  # ambiguous
        else:
            self._by_size[key] = axis_map

    def lookup(self, padded: int, unpadded: int) -> AxisMap:
        if padded == unpadded:
            return None
        found = self._by_size.get((padded, unpadded))
        if found is not None:
            return found
        return np.where(np.arange(padded) < unpadded, np.arange(padded), -1)


def elem_type_of(array: np.ndarray) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(array.dtype)


def gather_unpadded(array: np.ndarray, maps: Sequence[AxisMap], shape: Sequence[int]) -> np.ndarray | None:
    """``array`` (unpadded) read at the unpadded coordinates of every padded element; None when the
    unpadded array is empty along an axis (then no element is real)."""
    if any(size == 0 for size in array.shape):
        return None
    index = []
    for axis, axis_map in enumerate(maps):
        if axis_map is not None:
            index.append(np.clip(axis_map, 0, array.shape[axis] - 1))
        elif array.shape[axis] == shape[axis]:
            index.append(np.arange(shape[axis]))
        else:  # a broadcast axis (size 1 in the unpadded run)
            index.append(np.zeros(shape[axis], dtype=np.int64))
    return array[np.ix_(*index)] if index else array


def to_data(value: Concrete, layouts: Layouts, hints: Sequence[AxisMap] | None = None) -> Data:
    """A concrete tensor seen as Data: maps from ``hints`` (the maps of the Data operand it meets) or
    else by size; exact where both runs agree at corresponding elements."""
    padded, unpadded = value.padded, value.unpadded
    rank = padded.ndim
    maps: list[AxisMap] = []
    for axis in range(rank):
        hint = hints[axis] if hints is not None and axis < len(hints) else None
        if hint is not None and len(hint) == padded.shape[axis]:
            maps.append(hint)
        elif padded.shape[axis] == unpadded.shape[axis] or padded.shape[axis] == 1:
            maps.append(None)
        else:
            maps.append(layouts.lookup(padded.shape[axis], unpadded.shape[axis]))
    if unpadded.ndim != rank:
        exact = np.zeros((1,) * rank, bool)
    else:
        mapped = gather_unpadded(unpadded, maps, padded.shape)
        if mapped is None:
            exact = np.ones((1,) * rank, bool)
        else:
            exact = (padded == mapped) | _both_nan(padded, mapped)
    return Data(
        tuple(padded.shape),
        tuple(unpadded.shape),
        tuple(maps),
        exact,
        C.classify(padded),
        elem_type_of(padded),
    )


def _both_nan(a: np.ndarray, b: np.ndarray) -> np.ndarray | bool:
    if np.issubdtype(a.dtype, np.floating):
        return np.isnan(a) & np.isnan(b)
    return False
