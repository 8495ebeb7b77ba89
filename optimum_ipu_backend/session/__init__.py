"""The ipu provider's session factory: what the patched ``InferenceSession`` calls."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from optimum_ipu_backend.compiler.errors import LegalizationError
from optimum_ipu_backend.engines.base import EngineUnavailableError
from optimum_ipu_backend.engines.worker import DeviceFaultError
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session.inference_session import PROVIDER_NAME, IPUInferenceSession

__all__ = ["IPUInferenceSession", "PROVIDER_NAME", "create_session"]


def _split_providers(
    providers: Sequence[Any] | None, provider_options: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None
) -> list[tuple[str, dict[str, Any]]]:
    """Pair each provider with its options, accepting every form onnxruntime accepts."""
    providers = list(providers or [PROVIDER_NAME])
    if isinstance(provider_options, Mapping):
        provider_options = [provider_options] + [{}] * (len(providers) - 1)
    provider_options = list(provider_options or [{}] * len(providers))
    if len(provider_options) != len(providers):
        raise ValueError(
            f"{len(provider_options)} provider_options given for {len(providers)} providers; "
            "pass one dict per provider"
        )
    pairs = []
    for entry, options in zip(providers, provider_options, strict=True):
        if isinstance(entry, (tuple, list)):
            name, options = entry[0], {**(entry[1] if len(entry) > 1 else {}), **(options or {})}
        else:
            name = entry
        pairs.append((str(name), dict(options or {})))
    return pairs


def create_session(
    path_or_bytes: str | os.PathLike | bytes,
    sess_options: Any = None,
    providers: Sequence[Any] | None = None,
    provider_options: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Create an IPU session; if the IPU path cannot take this device or graph and the user listed
    other providers after ipu, warn with the reason and create a plain onnxruntime session on those."""
    pairs = _split_providers(providers, provider_options)
    model_dir = None if isinstance(path_or_bytes, (bytes, bytearray)) else Path(path_or_bytes).parent
    options = IPUProviderOptions.parse(pairs[0][1], model_dir)
    fallbacks = pairs[1:]
    try:
        return IPUInferenceSession(path_or_bytes, sess_options, options)
    # Device and engine failures (and, with compile="eager", compile failures) at creation.
    except (EngineUnavailableError, DeviceFaultError, LegalizationError) as exc:
        if not fallbacks:
            raise
        names = [name for name, _ in fallbacks]
        warnings.warn(
            f"IPUExecutionProvider cannot take this model: {exc}\nFalling back to {names}, which you listed "
            "after it in providers=. Remove them from the list to make this an error instead.",
            RuntimeWarning,
            stacklevel=3,
        )
        import onnxruntime as ort

        return ort.InferenceSession(
            path_or_bytes,
            sess_options=sess_options,
            providers=names,
            provider_options=[opts for _, opts in fallbacks],
            **kwargs,
        )
