"""The four optimum-onnx names we replace, and the checks that keep a plugin from ever running on
the CPU in silence.

optimum-onnx resolves these names from module globals at call time, so replacing the globals is
enough (reference: optimum-onnx-integration.md §2, §6):

* ``utils.validate_provider_availability`` and its imported copy in ``base``: accept plugin names.
* ``InferenceSession`` in each modeling module: dispatch plugin providers to their session factory.
* ``base.IOBinding``: plugin sessions have no C ``_sess``; they hand out their own binding.

If a validation is patched but the module about to create the session is not, onnxruntime would get
``providers=["IPUExecutionProvider"]`` and fall back to the CPU with only a printed line. The
validate patch therefore refuses a plugin provider unless the calling module's dispatch is in place.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from optimum_ipu_backend.integration.errors import IntegrationError, ProviderPluginError

# Discovery (entry points, dataclasses) is imported on the first plugin lookup, not when optimum-onnx
# loads: these patches run inside `import optimum.onnxruntime`, whose cost we must not add to.


def _registry():
    from optimum_ipu_backend.integration.discovery import get_registry

    return get_registry()


def _provider_name(entry: Any) -> str:
    """The name in an ORT ``providers`` entry: a string or a ``(name, options)`` tuple."""
    if isinstance(entry, (tuple, list)) and entry:
        return str(entry[0])
    return str(entry)


def _is_native(name: str) -> bool:
    """onnxruntime's own providers never go through the plugin registry."""
    import onnxruntime  # already imported by optimum-onnx

    return name in onnxruntime.get_available_providers()


SUPPORTED_OPTIMUM_ONNX = ">=0.1,<0.2"

UTILS = "optimum.onnxruntime.utils"
BASE = "optimum.onnxruntime.base"
SESSION_MODULES = (
    "optimum.onnxruntime.modeling",
    "optimum.onnxruntime.modeling_decoder",
    "optimum.onnxruntime.modeling_seq2seq",
    "optimum.onnxruntime.modeling_diffusion",
)
EXPECTED_NAMES: dict[str, tuple[str, ...]] = {
    UTILS: ("validate_provider_availability", "prepare_providers_and_provider_options"),
    BASE: ("validate_provider_availability", "IOBinding"),
    **{name: ("InferenceSession",) for name in SESSION_MODULES},
}

_WRAPPED = "__optimum_provider_plugin_original__"
_logger = logging.getLogger(__name__)

# module name -> names that were expected but missing when the module loaded
_missing: dict[str, tuple[str, ...]] = {}


def _optimum_onnx_version() -> str:
    try:
        from importlib.metadata import version

        return version("optimum-onnx")
    except Exception:
        return "unknown"


def _is_wrapper(obj: Any) -> bool:
    return hasattr(obj, _WRAPPED)


def _wrap(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    setattr(wrapper, _WRAPPED, original)
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__qualname__ = getattr(original, "__qualname__", wrapper.__qualname__)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def patch_module(module: ModuleType) -> None:
    """Patch one optimum-onnx module in place. Idempotent; records missing names instead of raising."""
    name = module.__name__
    expected = EXPECTED_NAMES.get(name)
    if expected is None:
        return
    missing = tuple(attr for attr in expected if not hasattr(module, attr))
    if missing:
        _missing[name] = missing
        _logger.warning(
            "optimum-ipu-backend cannot patch %s (optimum-onnx %s): missing %s. Provider plugins will "
            "refuse to run rather than fall back to the CPU; supported optimum-onnx versions: %s.",
            name,
            _optimum_onnx_version(),
            ", ".join(missing),
            SUPPORTED_OPTIMUM_ONNX,
        )
        return
    _missing.pop(name, None)
    if name in (UTILS, BASE) and not _is_wrapper(module.validate_provider_availability):
        module.validate_provider_availability = _make_validate(module.validate_provider_availability)
    if name == BASE and not _is_wrapper(module.IOBinding):
        module.IOBinding = _make_io_binding(module.IOBinding)
    if name in SESSION_MODULES and not _is_wrapper(module.InferenceSession):
        module.InferenceSession = _make_session_factory(module.InferenceSession)


def patch_report() -> dict[str, str]:
    """For diagnostics: each target module and whether it is patched, missing names, or not loaded."""
    report = {}
    for name, expected in EXPECTED_NAMES.items():
        module = sys.modules.get(name)
        if name in _missing:
            report[name] = "missing " + ", ".join(_missing[name])
        elif module is None:
            report[name] = "not imported yet"
        else:
            patched = all(
                _is_wrapper(getattr(module, attr))
                for attr in expected
                if attr in ("validate_provider_availability", "IOBinding", "InferenceSession")
            )
            report[name] = "patched" if patched else "not patched"
    return report


def _integration_failure(detail: str) -> IntegrationError:
    return IntegrationError(
        f"{detail}. optimum-ipu-backend supports optimum-onnx {SUPPORTED_OPTIMUM_ONNX} (installed: "
        f"{_optimum_onnx_version()}). Refusing to continue rather than let onnxruntime run the model on "
        "the CPU in silence; install a supported optimum-onnx or report the incompatibility."
    )


def _check_dispatch_ready(provider: str) -> None:
    """Raise unless the module that is about to create a session will dispatch to the plugin."""
    if BASE in _missing:
        raise _integration_failure(
            f"provider {provider!r} needs optimum.onnxruntime.base."
            f"{', '.join(_missing[BASE])}, which is missing"
        )
    base = sys.modules.get(BASE)
    if base is not None and not _is_wrapper(getattr(base, "IOBinding", None)):
        raise _integration_failure(
            f"provider {provider!r}: optimum.onnxruntime.base.IOBinding is not patched"
        )
    frame = sys._getframe(2)
    while frame is not None:
        caller = frame.f_globals.get("__name__")
        if caller in SESSION_MODULES:
            if caller in _missing:
                raise _integration_failure(
                    f"provider {provider!r} requested from {caller}, which has no InferenceSession to patch"
                )
            if not _is_wrapper(frame.f_globals.get("InferenceSession")):
                raise _integration_failure(
                    f"provider {provider!r} requested from {caller}, whose InferenceSession is not patched"
                )
            return
        frame = frame.f_back


def _make_validate(original: Callable[[str], Any]) -> Callable[[str], Any]:
    def validate_provider_availability(provider: str) -> Any:
        if _is_native(provider):
            return original(provider)
        registry = _registry()
        if registry.lookup(provider) is not None:
            _check_dispatch_ready(provider)
            return None
        try:
            return original(provider)
        except ValueError as exc:
            broken = registry.broken()
            if not broken:
                raise
            hints = "; ".join(b.message() for b in broken)
            raise ValueError(f"{exc} Note: some provider plugins failed to load: {hints}") from exc

    return _wrap(original, validate_provider_availability)


def _make_session_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    def InferenceSession(  # noqa: N802 - it replaces onnxruntime.InferenceSession by name
        path_or_bytes: Any,
        sess_options: Any = None,
        providers: Any = None,
        provider_options: Any = None,
        **kwargs: Any,
    ) -> Any:
        if providers and not all(_is_native(_provider_name(entry)) for entry in providers):
            registry = _registry()
            first = registry.lookup(_provider_name(providers[0]))
            if first is not None:
                return first.create_session(
                    path_or_bytes,
                    sess_options=sess_options,
                    providers=list(providers),
                    provider_options=provider_options,
                    **kwargs,
                )
            for entry in providers[1:]:
                later = registry.lookup(_provider_name(entry))
                if later is not None:
                    # onnxruntime would drop the unknown name and run everything on the first provider.
                    raise ProviderPluginError(
                        f"provider {later.name!r} must come first in providers={list(providers)!r}: "
                        "a plugin provider takes the whole graph, and the providers listed after it are "
                        "the fallbacks"
                    )
        return original(
            path_or_bytes,
            sess_options=sess_options,
            providers=providers,
            provider_options=provider_options,
            **kwargs,
        )

    return _wrap(original, InferenceSession)


def _make_io_binding(original: Callable[..., Any]) -> Callable[..., Any]:
    def IOBinding(session: Any) -> Any:  # noqa: N802 - replaces onnxruntime.IOBinding by name
        if getattr(session, "is_provider_plugin_session", False):
            return session.io_binding()
        return original(session)

    return _wrap(original, IOBinding)
