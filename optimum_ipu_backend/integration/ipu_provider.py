"""The entry-point target for ``ipu``: a description only. The session code is imported on first use."""

from __future__ import annotations

from optimum_ipu_backend.integration.discovery import ProviderSpec

IPU_PROVIDER = ProviderSpec(
    name="IPUExecutionProvider",
    aliases=("ipu",),
    session_factory="optimum_ipu_backend.session:create_session",
    probe="optimum_ipu_backend.engines.probe:provider_availability",
    description="Graphcore IPU through PopART/PopTorch, with a host emulator for machines without one",
)
