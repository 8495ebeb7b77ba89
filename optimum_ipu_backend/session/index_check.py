"""Per call: the inputs that index a table on the device hold only values inside that table.

An IPU reads whatever lies at an out-of-range index and returns a wrong answer where onnxruntime on a
CPU raises, so such feeds are refused on the host. Which inputs and which bounds comes from the
graph's cached description (``compiler.analysis.index_ranges``, once per graph); per call this is a
minimum and a maximum per checked input, microseconds against a device step.
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
        super().__init__(
            f"input {input_name!r} holds {value} at position {list(position)}, but it indexes the "
            f"{bound.size} entries of {bound.table!r} ({bound.op_type} {bound.node!r}{via}), so its values "
            f"must lie in [{bound.low}, {bound.high}]. An IPU does not check indices on the device and "
            "would return a wrong result, so the call is refused; check that the inputs come from this "
            "model's tokenizer or processor (e.g. its vocabulary size)"
        )


class IndexRangeCheck:
    """Checks a validated feed against the index bounds of its graph."""

    def __init__(self, ranges: IndexRanges) -> None:
        by_input: dict[str, list[IndexBound]] = {}
        for bound in ranges.bounds:
            by_input.setdefault(bound.input, []).append(bound)
        # (input, smallest allowed, largest allowed, its bounds): the intersection is checked per call,
        # the bounds only name the table once a value is outside it.
        self._checks = tuple(
            (name, max(b.low for b in bounds), min(b.high for b in bounds), tuple(bounds))
            for name, bounds in by_input.items()
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
        return tuple(name for name, *_ in self._checks)

    def __call__(self, feed: Mapping[str, np.ndarray]) -> None:
        """Raise ``IndexOutOfRangeError`` for the first value outside its table."""
        for name, low, high, bounds in self._checks:
            array = feed.get(name)
            if array is None or array.size == 0:
                continue
            smallest, largest = int(array.min()), int(array.max())
            if smallest < low or largest > high:
                raise _out_of_range(name, array, smallest if smallest < low else largest, bounds)


def _out_of_range(
    name: str, array: np.ndarray, value: int, bounds: tuple[IndexBound, ...]
) -> IndexOutOfRangeError:
    bound = next(b for b in bounds if not b.low <= value <= b.high)
    position = tuple(int(i) for i in np.argwhere(array == value)[0])
    return IndexOutOfRangeError(name, value, position, bound)
