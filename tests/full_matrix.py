"""Whether this run is the release check, which runs every case of the test matrices CI runs a share of
(``OPTIMUM_IPU_FULL_MATRIX=1``; ``OPTIMUM_IPU_FULL_ENGINE_MATRIX=1``, its first name, is accepted)."""

from __future__ import annotations

import os

FULL = "1" in (os.environ.get("OPTIMUM_IPU_FULL_MATRIX"), os.environ.get("OPTIMUM_IPU_FULL_ENGINE_MATRIX"))
