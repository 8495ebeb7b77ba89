"""The optimum-onnx globals we replace, and the checks that keep a plugin provider from ever running on
the CPU in silence.

optimum-onnx resolves these names from module globals at call time, so replacing the globals is
enough (how optimum-onnx creates sessions, read from its source). Which module gets which patch is
listed once, in the bootstrap's ``PATCHED_GLOBALS``:

* ``validate_provider_availability`` (utils and its imported copy in base): accept plugin names and
  ``"auto"``.
* ``InferenceSession`` in each modeling module: dispatch plugin providers to their session factory
  and resolve ``"auto"`` (``integration/auto.py``).
* ``base.IOBinding``: plugin sessions have no C ``_sess``; they hand out their own binding.
* ``base.ORTSessionMixin.to`` and ``base.ORTParentMixin.to``: move a plugin model to a new onnxruntime
  session, refuse devices no provider serves (``integration/model_moves.py``).
* ``ORTModelForCausalLM.generate`` and ``ORTModelForConditionalGeneration.generate``: on a plugin model,
  name the generation mode optimum-onnx cannot serve on any provider (``integration/generation_modes.py``).

The patches fail closed. Validation accepts a plugin provider only when the module that asked is one
whose ``InferenceSession`` is patched; onnxruntime's own ``InferenceSession`` refuses any plugin
provider that reaches it (it would drop the name and run on the CPU with a printed line). So a
validated plugin provider can only end in the plugin's session, and every other path is an error that
names the module it came from.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

from optimum_ipu_backend._bootstrap import PATCHED_GLOBALS
from optimum_ipu_backend.errors import IntegrationError, ProviderPluginError
from optimum_ipu_backend.integration import AUTO

# Discovery (entry points, dataclasses) is imported on the first plugin lookup, not when optimum-onnx
# loads: these patches run inside `import optimum.onnxruntime`, whose cost we must not add to.

# The optimum-onnx versions whose internals these patches were checked against.
SUPPORTED_OPTIMUM_ONNX = ">=0.1,<0.2"

UTILS = "optimum.onnxruntime.utils"
SESSION_MODULES = tuple(name for name, names in PATCHED_GLOBALS.items() if "InferenceSession" in names)

_WRAPPED = "__optimum_provider_plugin_original__"
_logger = logging.getLogger(__name__)

# module name -> names that were expected but missing when the module loaded
_missing: dict[str, tuple[str, ...]] = {}
_version_checked = False


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


def _is_plugin_name(name: str) -> bool:
    return name == AUTO or (not _is_native(name) and _registry().lookup(name) is not None)


def optimum_onnx_version() -> str:
    try:
        from importlib.metadata import version

        return version("optimum-onnx")
    except Exception:
        return "unknown"


def optimum_onnx_supported() -> bool | None:
    """Whether the installed optimum-onnx is in the range the patches were checked against (None: unknown)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(optimum_onnx_version()) in SpecifierSet(SUPPORTED_OPTIMUM_ONNX)
    except InvalidVersion:
        return None


def _check_version_once() -> None:
    global _version_checked
    if _version_checked:
        return
    _version_checked = True
    if optimum_onnx_supported() is not True:
        _logger.warning(
            "optimum-onnx %s is outside the range %s that optimum-ipu-backend's patches were checked "
            "against. The patches still refuse to run a provider plugin when optimum-onnx's internals "
            "differ from what they expect; report what you see.",
            optimum_onnx_version(),
            SUPPORTED_OPTIMUM_ONNX,
        )


def _is_wrapper(obj: Any) -> bool:
    return hasattr(obj, _WRAPPED)


def _wrap(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    setattr(wrapper, _WRAPPED, original)
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__qualname__ = getattr(original, "__qualname__", wrapper.__qualname__)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _lookup(module: ModuleType, name: str) -> Any:
    """The global ``name`` of ``module``, or the method ``Class.method``; None when missing."""
    owner_name, _, attr = name.rpartition(".")
    owner = getattr(module, owner_name, None) if owner_name else module
    return getattr(owner, attr, None)


def _replace(module: ModuleType, name: str, value: Any) -> None:
    owner_name, _, attr = name.rpartition(".")
    setattr(getattr(module, owner_name) if owner_name else module, attr, value)


def patch_module(module: ModuleType) -> None:
    """Patch one optimum-onnx module in place. Idempotent; records missing names instead of raising."""
    name = module.__name__
    expected = PATCHED_GLOBALS.get(name)
    if expected is None:
        return
    _check_version_once()
    _guard_onnxruntime()
    missing = tuple(attr for attr in expected if _lookup(module, attr) is None)
    if missing:
        _missing[name] = missing
        _logger.warning(
            "optimum-ipu-backend cannot patch %s (optimum-onnx %s): missing %s. Provider plugins will "
            "refuse to run rather than fall back to the CPU; supported optimum-onnx versions: %s.",
            name,
            optimum_onnx_version(),
            ", ".join(missing),
            SUPPORTED_OPTIMUM_ONNX,
        )
        return
    _missing.pop(name, None)
    for attr in expected:
        current = _lookup(module, attr)
        if not _is_wrapper(current):
            _replace(module, attr, _WRAPPERS[attr](current))


def patch_report() -> dict[str, str]:
    """For diagnostics: each target module and whether it is patched, missing names, or not loaded."""
    report = {}
    for name, expected in PATCHED_GLOBALS.items():
        module = sys.modules.get(name)
        if name in _missing:
            report[name] = "missing " + ", ".join(_missing[name])
        elif module is None:
            report[name] = "not imported yet"
        elif all(_is_wrapper(_lookup(module, attr)) for attr in expected):
            report[name] = "patched: " + ", ".join(expected)
        else:
            report[name] = "not patched"
    return report


def _integration_failure(detail: str) -> IntegrationError:
    return IntegrationError(
        f"{detail}. optimum-ipu-backend's patches were checked against optimum-onnx "
        f"{SUPPORTED_OPTIMUM_ONNX} (installed: {optimum_onnx_version()}). Refusing to continue rather than "
        "let onnxruntime run the model on the CPU in silence; install a supported optimum-onnx or report "
        "the incompatibility."
    )


def _caller_outside(frame: FrameType | None, skipped: tuple[str, ...]) -> tuple[str, FrameType | None]:
    """The module of the first frame, from ``frame`` outwards, that is none of ``skipped``."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "<unknown module>")
        if name not in skipped:
            return name, frame
        frame = frame.f_back
    return "<unknown module>", None


def _check_dispatch_ready(provider: str) -> None:
    """Raise unless the module asking for ``provider`` creates its session through a patched
    ``InferenceSession``; the error names that module."""
    base = "optimum.onnxruntime.base"
    if base in _missing:
        raise _integration_failure(
            f"provider {provider!r} needs {base}.{', '.join(_missing[base])}, which is missing"
        )
    base_module = sys.modules.get(base)
    if base_module is not None and not _is_wrapper(getattr(base_module, "IOBinding", None)):
        raise _integration_failure(f"provider {provider!r}: {base}.IOBinding is not patched")
    caller, frame = _caller_outside(sys._getframe(2), (UTILS, __name__))
    if caller in _missing:
        raise _integration_failure(
            f"provider {provider!r} requested from {caller}, which has no InferenceSession to patch"
        )
    if caller not in SESSION_MODULES:
        raise _integration_failure(
            f"provider {provider!r} was requested from module {caller}, which optimum-ipu-backend does not "
            f"patch (it routes sessions created by {', '.join(SESSION_MODULES)})"
        )
    if frame is not None and not _is_wrapper(frame.f_globals.get("InferenceSession")):
        raise _integration_failure(
            f"provider {provider!r} requested from {caller}, whose InferenceSession is not patched"
        )


def _make_validate(original: Callable[[str], Any]) -> Callable[[str], Any]:
    def validate_provider_availability(provider: str) -> Any:
        if _is_native(provider):
            return original(provider)
        if provider == AUTO:
            _check_dispatch_ready(provider)
            from optimum_ipu_backend.integration.auto import chosen_provider

            chosen_provider()  # a bad OPTIMUM_PROVIDER_PREFERENCE or no usable provider fails here
            return None
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


def _create_auto_session(
    original: Callable[..., Any],
    path_or_bytes: Any,
    sess_options: Any,
    providers: list[Any],
    provider_options: Any,
    kwargs: dict[str, Any],
) -> Any:
    from optimum_ipu_backend.integration import auto

    if len(providers) > 1:
        raise ProviderPluginError(
            f"provider 'auto' must be the only entry of providers={providers!r}: it already ends at "
            "CPUExecutionProvider, and OPTIMUM_PROVIDER_PREFERENCE orders or restricts its candidates"
        )
    if isinstance(providers[0], (tuple, list)) and len(providers[0]) > 1:
        provider_options = [providers[0][1]]
    choice = auto.chosen_provider()
    name = choice.chosen.name
    options = [auto.options_for(choice, provider_options)]
    registration = None if _is_native(name) else _registry().lookup(name)
    if registration is not None:
        session = registration.create_session(
            path_or_bytes, sess_options=sess_options, providers=[name], provider_options=options, **kwargs
        )
    else:
        session = original(
            path_or_bytes, sess_options=sess_options, providers=[name], provider_options=options, **kwargs
        )
    return auto.annotate(session, choice)


def _make_session_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    def InferenceSession(  # noqa: N802 - it replaces onnxruntime.InferenceSession by name
        path_or_bytes: Any,
        sess_options: Any = None,
        providers: Any = None,
        provider_options: Any = None,
        **kwargs: Any,
    ) -> Any:
        if providers and _provider_name(providers[0]) == AUTO:
            return _create_auto_session(
                original, path_or_bytes, sess_options, list(providers), provider_options, kwargs
            )
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


def _make_to(move: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper of optimum-onnx's ``to`` method that hands the call to ``integration.model_moves.<move>``."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def to(self: Any, *args: Any, **kwargs: Any) -> Any:
            from optimum_ipu_backend.integration import model_moves

            return getattr(model_moves, move)(self, original, args, kwargs)

        return _wrap(original, to)

    return make


def _make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper of ``generate`` that hands the call to ``integration.generation_modes.generate``."""

    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        from optimum_ipu_backend.integration import generation_modes

        return generation_modes.generate(self, original, args, kwargs)

    return _wrap(original, generate)


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "validate_provider_availability": _make_validate,
    "InferenceSession": _make_session_factory,
    "IOBinding": _make_io_binding,
    "ORTSessionMixin.to": _make_to("move_session"),
    "ORTParentMixin.to": _make_to("move_parts"),
    "ORTModelForCausalLM.generate": _make_generate,
    "ORTModelForConditionalGeneration.generate": _make_generate,
}


def _guard_onnxruntime() -> None:
    """Make onnxruntime's own ``InferenceSession`` refuse plugin provider names.

    Given a name it does not know, onnxruntime prints a line and runs the model on the CPU. With this
    guard, a module that validated a plugin provider but creates its session some other way (a new
    optimum-onnx helper, user code) gets an error naming it instead.
    """
    from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession as OrtSession

    original_init = OrtSession.__init__
    if _is_wrapper(original_init):
        return

    def __init__(  # noqa: N807 - replaces the method by name
        self: Any,
        path_or_bytes: Any,
        sess_options: Any = None,
        providers: Any = None,
        provider_options: Any = None,
        **kwargs: Any,
    ) -> None:
        for entry in providers or ():
            name = _provider_name(entry)
            if _is_plugin_name(name):
                caller, _ = _caller_outside(sys._getframe(1), (__name__,))
                raise _integration_failure(
                    f"module {caller} created an onnxruntime.InferenceSession with provider {name!r}, "
                    "which onnxruntime does not know and would replace with the CPU; create the session "
                    "through optimum-onnx's ORTModel classes (whose InferenceSession is patched) instead"
                )
        original_init(
            self,
            path_or_bytes,
            sess_options=sess_options,
            providers=providers,
            provider_options=provider_options,
            **kwargs,
        )

    OrtSession.__init__ = _wrap(original_init, __init__)
