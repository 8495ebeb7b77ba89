"""Discovery of execution-provider plugins from the ``optimum.onnxruntime.providers`` entry points.

Modelled on JAX's ``jax_plugins`` and vLLM's platform plugins: an entry point yields a small
description (names, a probe, the *qualified name* of a session factory), discovery runs once and
lazily, and a plugin that fails to load is recorded with its error instead of breaking anything
else. The error is raised, with the distribution and entry point named, only when that provider is
asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from optimum_ipu_backend.engines.base import Availability
from optimum_ipu_backend.errors import ProviderPluginError

ENTRY_POINT_GROUP = "optimum.onnxruntime.providers"
PLUGINS_ENV = "OPTIMUM_PROVIDER_PLUGINS"

# Names onnxruntime itself owns; a plugin may not shadow them.
NATIVE_PROVIDER_PREFIXES = (
    "CPU",
    "CUDA",
    "Tensorrt",
    "ROCM",
    "MIGraphX",
    "OpenVINO",
    "DirectML",
    "Dml",
    "CoreML",
    "QNN",
    "VitisAI",
    "Azure",
    "DNNL",
    "NNAPI",
    "XNNPACK",
    "WebGPU",
    "Acl",
    "ArmNN",
    "CANN",
    "SNPE",
    "TVM",
    "Rknpu",
    "JS",
)

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProviderSpec:
    """What a plugin's entry point yields. Cheap to build: factories are named, not imported.

    ``session_factory`` is ``"module:qualname"`` of a callable with ``onnxruntime.InferenceSession``'s
    signature ``(path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs)``;
    ``providers[0]`` is this provider and any later entries are fallbacks the user listed.
    ``probe``, if given, is ``"module:qualname"`` of a no-argument callable returning an
    ``Availability``, a bool, a tuple ``(available, detail[, emulated])`` or a mapping with those
    keys; it must not compile or allocate devices. ``priority`` places the provider in
    ``provider="auto"``'s order (higher first; onnxruntime's own accelerators rank at 0, after plugins
    of equal priority; see ``integration/auto.py``). ``operator_table``, if given, is ``"module:qualname"``
    of the operators the provider's compiler takes (a collection of op types, ``domain::Op`` outside
    ai.onnx, or a no-argument callable returning one): the conformance suite runs the node cases of
    those operators only, and reports the rest as out of the table.
    """

    name: str
    session_factory: str
    aliases: tuple[str, ...] = ()
    probe: str | None = None
    description: str = ""
    priority: int = 0
    operator_table: str | None = None

    def all_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def resolve_qualname(qualname: str) -> Any:
    module_name, _, attr_path = qualname.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"expected 'module:qualname', got {qualname!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


_SPEC_FIELDS = tuple(item.name for item in dataclasses.fields(ProviderSpec))


def _coerce_spec(obj: Any) -> ProviderSpec:
    """Accept a ProviderSpec, a mapping with its fields, or a zero-argument callable returning either,
    so a vendor package need not import this one to register."""
    if callable(obj) and not isinstance(obj, ProviderSpec):
        obj = obj()
    if isinstance(obj, ProviderSpec):
        return obj
    if isinstance(obj, Mapping):
        fields = dict(obj)
    else:
        fields = {key: getattr(obj, key) for key in _SPEC_FIELDS if hasattr(obj, key)}
    if not isinstance(fields.get("name"), str) or not isinstance(fields.get("session_factory"), str):
        raise TypeError(
            "a provider entry point must yield a ProviderSpec or a mapping with string 'name' and "
            f"'session_factory' ('module:qualname'); got {type(obj).__name__}"
        )
    fields["aliases"] = tuple(fields.get("aliases") or ())
    priority = fields.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"a provider's 'priority' must be an int, got {priority!r}")
    return ProviderSpec(**fields)


def _coerce_availability(result: Any) -> Availability:
    if isinstance(result, Availability):
        return result
    if isinstance(result, Mapping):
        return Availability(
            bool(result.get("available")), str(result.get("detail", "")), bool(result.get("emulated", False))
        )
    if isinstance(result, tuple):
        return Availability(
            bool(result[0]),
            str(result[1]) if len(result) > 1 else "",
            bool(result[2]) if len(result) > 2 else False,
        )
    return Availability(bool(result))


@dataclass
class ProviderRegistration:
    """One loaded provider: its spec plus where it came from."""

    spec: ProviderSpec
    entry_point: str
    distribution: str
    version: str
    _factory: Callable[..., Any] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def probe(self) -> Availability:
        if self.spec.probe is None:
            return Availability(True, "the plugin declares no probe")
        try:
            result = resolve_qualname(self.spec.probe)()
        except Exception as exc:  # a probe failure is information, not a crash
            return Availability(False, f"probe {self.spec.probe} raised {type(exc).__name__}: {exc}")
        return _coerce_availability(result)

    def session_factory(self) -> Callable[..., Any]:
        if self._factory is None:
            try:
                self._factory = resolve_qualname(self.spec.session_factory)
            except Exception as exc:
                raise ProviderPluginError(
                    f"provider {self.spec.name!r} from distribution {self.distribution} "
                    f"(entry point {self.entry_point!r} in group {ENTRY_POINT_GROUP!r}) declares session "
                    f"factory {self.spec.session_factory!r}, which failed to import: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        return self._factory

    def create_session(self, *args: Any, **kwargs: Any) -> Any:
        return self.session_factory()(*args, **kwargs)


@dataclass
class BrokenProvider:
    """A plugin whose entry point failed to load or yielded something unusable."""

    entry_point: str
    value: str
    distribution: str
    version: str
    error: BaseException
    formatted: str

    def message(self) -> str:
        return (
            f"execution provider plugin {self.entry_point!r} from distribution {self.distribution} "
            f"{self.version} (entry point {self.entry_point} = {self.value} in group "
            f"{ENTRY_POINT_GROUP!r}) failed to load: {type(self.error).__name__}: {self.error}. "
            f"Fix or uninstall {self.distribution}, or leave it out with {PLUGINS_ENV}=<names to load>."
        )


def plugin_filter() -> frozenset[str] | None:
    """``None`` = load all; an empty set = load none; else the entry-point or distribution names."""
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None or raw.strip() == "":
        return None
    if raw.strip() == "0":
        return frozenset()
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def _is_native_name(name: str) -> bool:
    return name.endswith("ExecutionProvider") and name.startswith(NATIVE_PROVIDER_PREFIXES)


class ProviderRegistry:
    """All provider plugins of this environment, loaded once on first use."""

    def __init__(self, entry_points: Callable[[], Iterable[metadata.EntryPoint]] | None = None) -> None:
        self._entry_points = entry_points or (lambda: metadata.entry_points(group=ENTRY_POINT_GROUP))
        self._lock = threading.Lock()
        self._loaded = False
        self._by_name: dict[str, ProviderRegistration] = {}
        self._registrations: list[ProviderRegistration] = []
        self._broken: list[BrokenProvider] = []
        self._skipped: list[str] = []

    def _load(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            allowed = plugin_filter()
            seen: set[tuple[str, str]] = set()
            for ep in self._entry_points():
                if (ep.name, ep.value) in seen:  # the same distribution found twice on sys.path
                    continue
                seen.add((ep.name, ep.value))
                dist = getattr(ep, "dist", None)
                dist_name = dist.metadata["Name"] if dist is not None else "<unknown distribution>"
                dist_version = dist.version if dist is not None else "?"
                if allowed is not None and ep.name not in allowed and dist_name not in allowed:
                    self._skipped.append(ep.name)
                    continue
                try:
                    spec = _coerce_spec(ep.load())
                    self._check_names(spec)
                except Exception as exc:
                    broken = BrokenProvider(
                        ep.name, ep.value, dist_name, dist_version, exc, traceback.format_exc()
                    )
                    self._broken.append(broken)
                    # Logged once, here; the full error is raised again only if it is asked for.
                    _logger.warning("%s", broken.message())
                    continue
                registration = ProviderRegistration(spec, ep.name, dist_name, dist_version)
                self._registrations.append(registration)
                for name in spec.all_names():
                    self._by_name[name] = registration
            self._loaded = True

    def _check_names(self, spec: ProviderSpec) -> None:
        for name in spec.all_names():
            if _is_native_name(name):
                raise ValueError(f"provider name {name!r} belongs to onnxruntime and cannot be taken over")
            if name in self._by_name:
                other = self._by_name[name]
                raise ValueError(
                    f"provider name {name!r} is already registered by {other.distribution} "
                    f"(entry point {other.entry_point!r})"
                )

    def registrations(self) -> list[ProviderRegistration]:
        self._load()
        return list(self._registrations)

    def broken(self) -> list[BrokenProvider]:
        self._load()
        return list(self._broken)

    def skipped(self) -> list[str]:
        self._load()
        return list(self._skipped)

    def lookup(self, name: str) -> ProviderRegistration | None:
        """The registration serving ``name``; raises for a name that belongs to a broken plugin."""
        self._load()
        registration = self._by_name.get(name)
        if registration is not None:
            return registration
        for broken in self._broken:
            if name in (broken.entry_point, f"{broken.entry_point}ExecutionProvider") or (
                name.lower() == broken.entry_point.lower()
            ):
                raise ProviderPluginError(broken.message()) from broken.error
        return None


_registry: ProviderRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> ProviderRegistry:
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                _registry = ProviderRegistry()
    return _registry
