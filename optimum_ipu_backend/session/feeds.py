"""Validation of one call's feed, before anything reaches the runtime.

Every input must be present and known, of the graph's dtype or one that casts to it safely, of the
declared rank and fixed dimensions, and not empty; and an input that indexes a table on the device
must stay inside that table (``session.index_check``). Each failure is an ``InvalidFeedError`` (a
``ValueError``) that names the input. What the checks derive from the graph is computed once, when the
session is created. Attention masks are the runtime's business: a mask the padding proof's assumptions
do not hold for (values other than 0 and 1, a row that hides everything) is served without padding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from optimum_ipu_backend.compiler.analysis.index_ranges import IndexRanges
from optimum_ipu_backend.errors import InvalidFeedError
from optimum_ipu_backend.runtime.roles import InputRole, input_role, is_past_dim
from optimum_ipu_backend.session.index_check import IndexRangeCheck
from optimum_ipu_backend.session.node_arg import NodeArg


def _may_be_empty(input_name: str, dim: int | str | None) -> bool:
    """Key/value caches may be empty: the first step of generation feeds an empty past, and a merged
    decoder's first step feeds empty placeholders (on every axis) that the branch it runs never reads."""
    return input_role(input_name) is InputRole.PAST or (isinstance(dim, str) and is_past_dim(dim))


class FeedValidator:
    """Checks and normalizes feeds for one graph's inputs."""

    def __init__(
        self, inputs: Sequence[NodeArg], index_ranges: IndexRanges, initializer_defaults: Sequence[str] = ()
    ) -> None:
        self._inputs = {arg.name: arg for arg in inputs}
        self._initializer_defaults = frozenset(initializer_defaults)
        self._index_check = IndexRangeCheck(index_ranges)

    @property
    def index_checked_inputs(self) -> tuple[str, ...]:
        """The inputs whose values are range-checked because they index a table on the device."""
        return self._index_check.inputs

    def __call__(self, input_feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The feed as arrays of the graph's dtypes; ``InvalidFeedError`` naming the input otherwise."""
        if not isinstance(input_feed, Mapping):
            raise InvalidFeedError(
                f"the feed must be a dict of input name to array, got {type(input_feed).__name__}"
            )
        self._check_names(input_feed)
        feed = {name: self._array(name, arg, input_feed[name]) for name, arg in self._inputs.items()}
        self._index_check(feed)
        return feed

    def _check_names(self, input_feed: Mapping[str, Any]) -> None:
        overridden = sorted(name for name in input_feed if name in self._initializer_defaults)
        if overridden:
            raise InvalidFeedError(
                f"the feed overrides {overridden}: graph inputs with an initializer as their default value. "
                "The ipu provider compiles that default into the executable as a constant, so a call cannot "
                "replace it; remove it from the feed, or re-export the model with it as a graph input that "
                "has no initializer"
            )
        unknown = sorted(map(str, set(input_feed) - set(self._inputs)))
        missing = [name for name in self._inputs if name not in input_feed]
        if unknown or missing:
            parts = [f"missing {missing}" if missing else "", f"unknown {unknown}" if unknown else ""]
            raise InvalidFeedError(
                "the feed does not match the model's inputs: "
                + "; ".join(part for part in parts if part)
                + f". The model's inputs are {list(self._inputs)}"
            )

    @staticmethod
    def _array(name: str, arg: NodeArg, value: Any) -> np.ndarray:
        array = np.asarray(value)
        expected = arg.dtype
        if array.dtype != expected:
            if not np.can_cast(array.dtype, expected, casting="safe"):
                raise InvalidFeedError(
                    f"input {name!r} has dtype {array.dtype}, which cannot be cast safely to the model's "
                    f"{arg.type}; convert it before calling (e.g. array.astype(np.{expected}))"
                )
            array = array.astype(expected)
        if array.ndim != len(arg.shape):
            raise InvalidFeedError(
                f"input {name!r} has rank {array.ndim} (shape {list(array.shape)}) but the model expects "
                f"rank {len(arg.shape)} {arg.shape}"
            )
        for axis, (dim, size) in enumerate(zip(arg.shape, array.shape, strict=True)):
            if isinstance(dim, int) and dim != size:
                raise InvalidFeedError(
                    f"input {name!r} has size {size} on axis {axis} but the model fixes it to {dim} "
                    f"(expected shape {arg.shape})"
                )
            if size == 0 and not _may_be_empty(name, dim):
                label = f" ({dim})" if isinstance(dim, str) else ""
                raise InvalidFeedError(
                    f"input {name!r} is empty: size 0 on axis {axis}{label}, shape {list(array.shape)}. "
                    "An IPU executable has no zero-sized shapes; call with at least one element on every "
                    "axis (only key/value caches may be empty)"
                )
        return array
