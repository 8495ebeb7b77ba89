"""Progress for the steps that can take more than a second (legalize, compile, cache fill).

tqdm's ``delay`` keeps fast steps silent; bars go to stderr only when it is a terminal, and
``OPTIMUM_IPU_PROGRESS=0`` (or the provider option ``progress=0``) turns them off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PROGRESS_ENV = "OPTIMUM_IPU_PROGRESS"
DELAY_SECONDS = 1.0


def progress_enabled(option: bool | None = None) -> bool:
    if option is not None:
        return option
    if os.environ.get(PROGRESS_ENV, "").strip() == "0":
        return False
    return sys.stderr.isatty()


@contextmanager
def step_progress(description: str, total: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """Yields ``advance(label)``; a bar appears only if the work outlasts ``DELAY_SECONDS``."""
    if not enabled:
        yield lambda label: None
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=description, delay=DELAY_SECONDS, leave=False, file=sys.stderr) as bar:

        def advance(label: str) -> None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

        yield advance
