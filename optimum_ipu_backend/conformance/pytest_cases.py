"""The conformance cases as one parametrized test; ``pytest_plugin`` supplies the cases and gathers results.

``optimum-ipu conformance`` collects this file; ``conformance/test_conformance.py`` imports the test, so
``pytest conformance/ --provider NAME`` runs the very same cases.
"""

from __future__ import annotations

from typing import Any

import pytest

from optimum_ipu_backend.conformance.pytest_plugin import run_case
from optimum_ipu_backend.conformance.runner import PlannedCase


def test_conformance(
    request: pytest.FixtureRequest, conformance_case: PlannedCase, conformance_zoo: Any
) -> None:
    run_case(request, conformance_case, conformance_zoo)
