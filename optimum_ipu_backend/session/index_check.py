"""Per call: the inputs that index a table on the device hold only values inside that table.

An IPU reads whatever lies at an out-of-range index and returns a wrong answer where onnxruntime on a
CPU raises, so such feeds are refused on the host. Which inputs and which bounds comes from the
graph's cached description (``compiler.analysis.index_ranges``, once per graph); per call this is a
minimum and a maximum per checked input (per column of its last axis where the bounds differ by column, as
a GatherND's index tuples do), microseconds against a device step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from optimum_ipu_backend.compiler.analysis.index_ranges import IndexBound, IndexRanges
from optimum_ipu_backend.errors import InvalidFeedError

_logger = logging.getLogger(__name__)


class IndexOutOfRangeError(InvalidFeedError):
    """An input holds a value that would index outside a table on the device."""

    def __init__(self, input_name: str, value: int, position: tuple[int, ...], bound: IndexBound) -> None:
        self.input_name = input_name
        self.value = value
        self.position = position
        self.bound = bound
        via = f" after {bound.path}" if bound.path else ""
        which = (
            "its values" if bound.column is None else f"the values in column {bound.column} of its last axis"
        )
        super().__init__(
            f"input {input_name!r} holds {value} at position {list(position)}, but it indexes the "
            f"{bound.size} entries of {bound.table!r} ({bound.op_type} {bound.node!r}{via}), so {which} "
            f"must lie in [{bound.low}, {bound.high}]. An IPU does not check indices on the device and "
            "would return a wrong result, so the call is refused; check that the inputs come from this "
            "model's tokenizer or processor (e.g. its vocabulary size)"
        )


class IndexRangeCheck:
    """Checks a validated feed against the index bounds of its graph."""

    def __init__(self, ranges: IndexRanges) -> None:
        by_values: dict[tuple[str, int | None], list[IndexBound]] = {}
        for bound in ranges.bounds:
            by_values.setdefault((bound.input, bound.column), []).append(bound)
        # (input, column, smallest allowed, largest allowed, its bounds): the intersection is checked per
        # call, the bounds only name the table once a value is outside it.
        self._checks = tuple(
            (name, column, max(b.low for b in bounds), min(b.high for b in bounds), tuple(bounds))
            for (name, column), bounds in by_values.items()
        )
        for entry in ranges.unchecked:
            _logger.info(
                "input %r reaches the indices of %s %r, but %s: its relation to the index is not provable, "
                "so it is not checked per call",
                entry.input,
                entry.op_type,
                entry.node,
                entry.reason,
            )

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for name, *_ in self._checks))

    def __call__(self, feed: Mapping[str, np.ndarray]) -> None:
        """Raise ``IndexOutOfRangeError`` for the first value outside its table."""
        for name, column, low, high, bounds in self._checks:
            array = feed.get(name)
            if array is None or array.size == 0:
                continue
            values = array if column is None else array[..., column]
            smallest, largest = int(values.min()), int(values.max())
            if smallest < low or largest > high:
                raise _out_of_range(name, values, column, smallest if smallest < low else largest, bounds)


def _out_of_range(
    name: str, values: np.ndarray, column: int | None, value: int, bounds: tuple[IndexBound, ...]
) -> IndexOutOfRangeError:
    bound = next(b for b in bounds if not b.low <= value <= b.high)
    position = tuple(int(i) for i in np.argwhere(values == value)[0])
    return IndexOutOfRangeError(name, value, position if column is None else (*position, column), bound)
