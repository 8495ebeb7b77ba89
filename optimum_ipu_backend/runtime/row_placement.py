"""Where sequences go in packed rows: the placement rule packed serving runs (``runtime.packing``) and the
serving plan prices (``runtime.serving_plan``), in one place, importing neither."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where one sequence went: ``row`` of the step, first token ``start``, slot ``segment`` in its row."""

    row: int
    start: int
    segment: int


def first_fit_decreasing(lengths: Sequence[int], tokens: int, segments: int | None) -> list[Placement] | None:
    """Each sequence placed in the first row with room for it (longest first); None when one is longer
    than a row."""
    if any(length > tokens for length in lengths):
        return None
    used: list[int] = []  # tokens used per row
    count: list[int] = []  # sequences per row
    placements: dict[int, Placement] = {}
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        row = next(
            (
                r
                for r in range(len(used))
                if used[r] + length <= tokens and (segments is None or count[r] < segments)
            ),
            len(used),
        )
        if row == len(used):
            used.append(0)
            count.append(0)
        placements[index] = Placement(row, used[row], count[row])
        used[row] += length
        count[row] += 1
    return [placements[i] for i in range(len(lengths))]
