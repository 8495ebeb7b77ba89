"""The two tiers of the test matrices, in one definition each.

The README's test command (CI on two cores) runs each matrix on a representative share; the release check
(``make release-check``, i.e. ``OPTIMUM_IPU_FULL_MATRIX=1``; ``OPTIMUM_IPU_FULL_ENGINE_MATRIX=1``, its
first name, is accepted) runs every case of its full product. A matrix is a ``Matrix``: its full product,
the share CI runs, and the dimensions (class, architecture family, engine, option, ...) whose every value
the share must cover. tests/test_full_matrix.py fails when a share leaves a value of a dimension to the
release check alone, so moving a case there never leaves a behaviour unguarded by the default command.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

FULL = "1" in (os.environ.get("OPTIMUM_IPU_FULL_MATRIX"), os.environ.get("OPTIMUM_IPU_FULL_ENGINE_MATRIX"))

Case = TypeVar("Case", bound=Hashable)

#: Every matrix defined in this process, by name (tests/test_full_matrix.py imports the modules that
#: define them and checks each).
MATRICES: dict[str, Matrix] = {}


class Matrix(Generic[Case]):
    """A test matrix: ``product`` (every case, the release check) and ``share`` (what the README's command
    runs; a subset of ``product``). ``covers`` maps a dimension's name to the value (or the set of values)
    a case exercises in it; every value the product exercises must appear in the share. ``why`` says what
    makes the cases outside the share expensive, for docs/performance.md's list of release-only cases."""

    def __init__(
        self,
        name: str,
        product: Iterable[Case],
        share: Iterable[Case] | Callable[[Case], bool],
        covers: Mapping[str, Callable[[Case], Hashable | frozenset]],
        why: str,
    ) -> None:
        self.name = name
        self.product: tuple[Case, ...] = tuple(product)
        chosen = set(filter(share, self.product)) if callable(share) else set(share)
        unknown = chosen.difference(self.product)
        if unknown:
            raise ValueError(f"matrix {name!r}: share cases outside the product: {sorted(map(str, unknown))}")
        # in the product's order, so test ids and run order do not depend on how the share was written
        self.share: tuple[Case, ...] = tuple(case for case in self.product if case in chosen)
        self.covers = dict(covers)
        self.why = why
        MATRICES[name] = self

    @property
    def cases(self) -> tuple[Case, ...]:
        """What this run runs: the product in the release check, else the share."""
        return self.product if FULL else self.share

    @property
    def release_only(self) -> tuple[Case, ...]:
        """The cases only the release check runs."""
        return tuple(case for case in self.product if case not in self.share)

    def values(self, dimension: str, cases: Sequence[Case]) -> set:
        found: set = set()
        for case in cases:
            value = self.covers[dimension](case)
            found.update(value if isinstance(value, frozenset) else {value})
        return found

    def uncovered(self) -> dict[str, set]:
        """For each dimension, the values the product exercises and the share does not (empty when the
        share guards every behaviour the product does)."""
        missing = {
            dimension: self.values(dimension, self.product) - self.values(dimension, self.share)
            for dimension in self.covers
        }
        return {dimension: values for dimension, values in missing.items() if values}
