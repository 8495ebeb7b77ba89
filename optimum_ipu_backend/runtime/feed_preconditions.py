"""What a rewrite of the served graph needs of each call's feed, checked before the call runs.

``compiler.graph_rewrites.eos_selection`` serves a classification head's end-of-sentence selection
densely. The dense form equals the export only where every row holds the same number, at least one, of
end-of-sentence tokens, which is what the PyTorch head checks and the export lost; elsewhere the export
mixes rows up. A call that breaks the condition is refused here, naming the input, the counts and the fix,
so no call ever returns a result the export would not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from optimum_ipu_backend.errors import InvalidFeedError

if TYPE_CHECKING:
    from optimum_ipu_backend.compiler.graph_rewrites.eos_selection import SameTokenCount

_SHOWN_ROWS = 16


class TokenCountError(InvalidFeedError):
    """The rows of a call hold different numbers of the end-of-sentence token a classification head
    reads (or none): the model's own head refuses such a batch."""


def check_token_counts(checks: Sequence[SameTokenCount], feed: Mapping[str, np.ndarray]) -> None:
    """Raise ``InvalidFeedError`` unless ``feed`` meets every check (missing inputs are the feed
    validation's to report)."""
    for check in checks:
        if check.input not in feed:
            continue
        tokens = np.asarray(feed[check.input])
        for other, axis, own_axis in check.same_sizes:
            if other not in feed or tokens.ndim <= own_axis:
                continue
            shape = np.shape(feed[other])
            if len(shape) > axis and shape[axis] != tokens.shape[own_axis]:
                raise InvalidFeedError(
                    f"input {other!r} has {shape[axis]} elements along axis {axis} and {check.input!r} has "
                    f"{tokens.shape[own_axis]} along axis {own_axis}; the model declares them one dimension "
                    f"and reads its end-of-sentence tokens from {check.input!r} on that understanding. Give "
                    f"them the same size (the model's tokenizer does)"
                )
        if tokens.ndim != 2 or tokens.shape[0] == 0:
            continue
        counts = np.count_nonzero(tokens == check.token_id, axis=1)
        if counts.min() >= 1 and counts.min() == counts.max():
            continue
        shown = ", ".join(str(int(c)) for c in counts[:_SHOWN_ROWS])
        if len(counts) > _SHOWN_ROWS:
            shown += f", ... ({len(counts)} rows)"
        raise TokenCountError(
            f"input {check.input!r}: its rows hold [{shown}] tokens of id {check.token_id}, the "
            "end-of-sentence token this model's classification head reads at the last one of each row. "
            "Every row must hold the same number of them, at least one, as the PyTorch model requires "
            "(BartForSequenceClassification and MBartForSequenceClassification raise 'All examples must "
            "have the same number of <eos> tokens.'). Fix: end every row's text with the same number of "
            "end-of-sentence tokens, as the model's tokenizer does when it adds the special tokens (do not "
            f"add or strip them by hand, and do not batch texts holding the id {check.token_id} in their "
            "body with texts that do not)"
        )
