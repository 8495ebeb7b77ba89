"""The conformance cases; ``conftest.py`` plans them from ``--provider`` and the other options."""

from optimum_ipu_backend.conformance.pytest_cases import test_conformance  # noqa: F401
